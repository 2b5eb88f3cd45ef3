"""presence/frequency/repetition penalties and logit_bias (gmlx.engine.processors): the functions on
small arrays, and a live server's greedy output against the definitions applied by hand."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import LiveServer
from mlx_lm.models.cache import make_prompt_cache

from gmlx.engine.processors import Decoding, add_bias, frequency_presence, repetition
from gmlx.models.loader import LoadedModel, load

COMPLETIONS = "/v1/completions"
PROMPT = [2, 300, 301, 302, 303]  # <bos> and four pieces of the tiny llama vocabulary
STEPS = 24


def ids(*tokens: int) -> mx.array:
    return mx.array(tokens, dtype=mx.int32)


def test_frequency_and_presence_follow_openai() -> None:
    logits = mx.array([[1.0, -2.0, 3.0, 0.5, 4.0]])
    out = frequency_presence(logits, ids(2, 2, 4), frequency=0.5, presence=1.0)
    # token 2 seen twice: 3 - 2 * 0.5 - 1; token 4 once: 4 - 0.5 - 1; the others untouched
    assert np.allclose(np.array(out), [[1.0, -2.0, 1.0, 0.5, 2.5]])
    assert np.allclose(
        np.array(frequency_presence(logits, ids(1, 1, 1), frequency=-1.0, presence=0.0)), [[1.0, 1.0, 3.0, 0.5, 4.0]]
    )  # negative: repeats encouraged


def test_repetition_follows_llama_cpp() -> None:
    logits = mx.array([[1.0, -2.0, 3.0, 0.0]])
    out = repetition(logits, ids(0, 1, 1, 3), penalty=2.0)
    assert np.allclose(np.array(out), [[0.5, -4.0, 3.0, 0.0]])  # once each, however often seen


def test_bias_adds() -> None:
    out = add_bias(mx.array([[1.0, 2.0, 3.0]]).astype(mx.bfloat16), ids(0, 2), mx.array([100.0, -100.0]))
    assert out.dtype == mx.bfloat16 and np.allclose(np.array(out.astype(mx.float32)), [[101.0, 2.0, -97.0]])


def test_penalties_see_only_the_generated_tokens() -> None:
    """The prompt is no part of frequency or presence: only tokens past it count."""
    [penalize] = Decoding(frequency_penalty=1.0, presence_penalty=0.5).processors(prompt_tokens=3)
    logits = mx.zeros((1, 4))
    assert np.allclose(np.array(penalize(ids(1, 1, 2), logits)), 0)  # the prompt alone
    assert np.allclose(np.array(penalize(ids(1, 1, 2, 2, 3, 2), logits)), [[0, 0, -2.5, -1.5]])
    [window] = Decoding(repetition_penalty=2.0, repeat_last_n=2).processors(prompt_tokens=3)
    assert np.allclose(np.array(window(ids(0, 1, 2), mx.ones((1, 4)))), [[1, 0.5, 0.5, 1]])
    assert Decoding().plain and Decoding(repetition_penalty=3.0, repeat_last_n=0).plain
    assert not Decoding(logit_bias=((1, 5.0),)).plain


@pytest.fixture(scope="module")
def tiny(tiny_models: dict[str, Path]) -> LoadedModel:
    return load(tiny_models["llama"], weights="float")


def by_hand(
    m: LoadedModel,
    steps: int = STEPS,
    frequency: float = 0.0,
    presence: float = 0.0,
    repeat: float = 1.0,
    last_n: int = 64,
    bias: dict[int, float] | None = None,
) -> list[int]:
    """Greedy decoding with each definition applied in numpy, token by token."""
    cache = make_prompt_cache(m.model)
    logits = m.model(mx.array([PROMPT]), cache=cache)[0, -1]
    out: list[int] = []
    for _ in range(steps):
        row = np.array(logits.astype(mx.float32), dtype=np.float64)
        for t, b in (bias or {}).items():
            row[t] += b
        for t in set((PROMPT + out)[-last_n:]):
            row[t] = row[t] / repeat if row[t] > 0 else row[t] * repeat
        for t, c in Counter(out).items():
            row[t] -= c * frequency + presence
        token = int(np.argmax(row))
        if token in m.tokenizer.eos_token_ids:
            break
        out.append(token)
        logits = m.model(mx.array([[token]]), cache=cache)[0, -1]
    return out


def text_of(m: LoadedModel, tokens: list[int]) -> str:
    """The text the server streams for these tokens (HF's decode renders invalid UTF-8 differently)."""
    detok = m.tokenizer.detokenizer
    detok.reset()
    for t in tokens:
        detok.add_token(t)
    detok.finalize()
    return detok.text


def served(server: LiveServer, **kw: object) -> dict:
    with server.client() as c:
        r = c.post(COMPLETIONS, json={"prompt": PROMPT, "max_tokens": STEPS, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


@pytest.fixture(scope="module")
def server(tiny_models: dict[str, Path]):
    with LiveServer(tiny_models["llama"]) as s:
        yield s


def test_greedy_output_is_repetitive_and_served_as_by_hand(server: LiveServer, tiny: LoadedModel) -> None:
    plain = by_hand(tiny)
    assert len(set(plain)) < len(plain) / 2  # a loop: what the penalties are for
    assert served(server)["text"] == text_of(tiny, plain)


@pytest.mark.parametrize(
    "kw",
    [
        {"frequency_penalty": 0.3},
        {"presence_penalty": 0.3},
        {"frequency_penalty": 2.0},
        {"presence_penalty": -2.0, "frequency_penalty": 1.0},
    ],
)
def test_frequency_and_presence_change_greedy_output_as_defined(
    server: LiveServer, tiny: LoadedModel, kw: dict
) -> None:
    expected = by_hand(tiny, frequency=kw.get("frequency_penalty", 0.0), presence=kw.get("presence_penalty", 0.0))
    assert expected != by_hand(tiny)
    assert served(server, **kw)["text"] == text_of(tiny, expected)


def test_repetition_penalty_changes_greedy_output_as_defined(server: LiveServer, tiny: LoadedModel) -> None:
    for kw in (
        {"repetition_penalty": 1.5},
        {"repetition_penalty": 1.5, "repeat_last_n": 4},
        {"repetition_penalty": 1.5, "repeat_last_n": -1},
        {"repetition_penalty": 1.5, "repeat_last_n": 2**32},  # past any context: the whole of it (was a 500)
        {"repetition_penalty": 1.5, "repeat_last_n": 2**64},
    ):
        last = kw.get("repeat_last_n", 64)
        last = -1 if last >= 2**31 else last
        expected = by_hand(tiny, repeat=1.5, last_n=len(PROMPT) + STEPS if last == -1 else last)
        assert expected != by_hand(tiny)
        assert served(server, **kw)["text"] == text_of(tiny, expected), kw


def test_logit_bias_forces_and_bans(server: LiveServer, tiny: LoadedModel) -> None:
    forced = tiny.tokenizer.encode("ing", add_special_tokens=False)
    assert len(forced) == 1
    choice = served(server, logit_bias={str(forced[0]): 100})
    assert choice["text"] == "ing" * STEPS and choice["finish_reason"] == "length"
    plain = by_hand(tiny)
    banned = {t: -100.0 for t in set(plain[:3])}
    expected = by_hand(tiny, bias=banned)
    assert not set(expected) & set(banned)
    assert served(server, logit_bias={str(t): b for t, b in banned.items()})["text"] == text_of(tiny, expected)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"logit_bias": {"99999": 1}}, "logit_bias"),
        ({"logit_bias": {"hello": 1}}, "logit_bias"),
        ({"logit_bias": {"9" * 5000: 1}}, "logit_bias"),  # past int()'s digit limit: was a 500
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"5": "1"}}, "logit_bias"),
        ({"logit_bias": [5]}, "logit_bias"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": 5e-324}, "repetition_penalty"),  # dividing by it made NaN logprobs (a 500)
        ({"repetition_penalty": 1e300}, "repetition_penalty"),
        ({"repeat_last_n": -2}, "repeat_last_n"),
    ],
)
def test_bad_penalties_are_400(server: LiveServer, body: dict, param: str) -> None:
    with server.client() as c:
        r = c.post(COMPLETIONS, json={"prompt": PROMPT, "max_tokens": 2, **body})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
        assert c.post(COMPLETIONS, json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200
