"""logprobs for chat (`logprobs`, `top_logprobs`) and completions (`logprobs` N), streamed or not:
the model's own log-softmax, in OpenAI's shapes, and what the official client reads."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import LiveServer, needs_kernels
from openai import OpenAI

from gmlx import kernels
from gmlx.engine.logprobs import top_k
from gmlx.gguf.header import read_header
from gmlx.gguf.tokenizer import load_tokenizer
from gmlx.gguf.vocab import token_bytes

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def server(tiny_models: dict[str, Path]) -> Iterator[LiveServer]:
    with LiveServer(tiny_models["llama"]) as s:
        yield s


def chat(s: LiveServer, **kw: object) -> dict:
    body = {"messages": [{"role": "user", "content": "Hello there"}], "temperature": 0, "max_tokens": 8, **kw}
    with s.client() as c:
        r = c.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_chat_top_logprobs_are_sorted_at_most_0_with_the_greedy_token_first(server: LiveServer) -> None:
    out = chat(server, logprobs=True, top_logprobs=5)
    choice = out["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == out["usage"]["completion_tokens"] - (choice["finish_reason"] == "stop")
    for entry in content:
        top = entry["top_logprobs"]
        assert len(top) == 5 and [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        assert all(t["logprob"] <= 0 for t in top)
        assert (top[0]["token"], top[0]["logprob"]) == (entry["token"], entry["logprob"])  # greedy: the best
        assert bytes(entry["bytes"]).decode("utf-8", errors="replace") == entry["token"]
    assert b"".join(bytes(e["bytes"]) for e in content).decode() == choice["message"]["content"]


def test_logprobs_off_by_default_and_without_alternatives_at_0(server: LiveServer) -> None:
    assert chat(server)["choices"][0]["logprobs"] is None
    content = chat(server, logprobs=True)["choices"][0]["logprobs"]["content"]
    assert content and all(e["top_logprobs"] == [] for e in content)


def test_the_first_token_logprobs_are_the_models_log_softmax(server: LiveServer) -> None:
    prompt = [1, 15, 27, 33, 8]
    with server.client() as c:
        out = c.post(
            "/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 5}
        ).json()
    lp = out["choices"][0]["logprobs"]
    logits = server.engine.loaded.model(mx.array([prompt]))[0, -1].astype(mx.float32)
    expected = (logits - mx.logsumexp(logits)).tolist()
    vocab = server.model.token_bytes()
    by_text: dict[str, float] = {}  # tokens of the same text: the likelier, as the shape shows
    for i, v in enumerate(expected):
        text = vocab[i].decode("utf-8", errors="replace")
        by_text[text] = max(v, by_text.get(text, -math.inf))
    assert math.isclose(lp["token_logprobs"][0], max(expected), abs_tol=1e-3)
    for text, value in lp["top_logprobs"][0].items():
        assert math.isclose(value, by_text[text], abs_tol=1e-3), text


def test_completions_logprobs_lists_line_up_with_the_text(server: LiveServer) -> None:
    with server.client() as c:
        out = c.post(
            "/v1/completions", json={"prompt": "The sea", "max_tokens": 8, "temperature": 0, "logprobs": 3}
        ).json()
    choice = out["choices"][0]
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(len(lp["tokens"]))]
    # Greedy: each chosen token is its position's best, shown under its own text (at most 3
    # alternatives: two of the same text show as one).
    for token, top, value in zip(lp["tokens"], lp["top_logprobs"], lp["token_logprobs"], strict=True):
        assert top[token] == value == max(top.values())
        assert len(top) <= 3


@pytest.mark.parametrize("chat_api", [True, False])
def test_streamed_logprobs_reassemble_to_the_whole_answer(server: LiveServer, chat_api: bool) -> None:
    body = {
        "max_tokens": 10,
        "temperature": 0,
        **(
            {"messages": [{"role": "user", "content": "Count"}], "logprobs": True, "top_logprobs": 2}
            if chat_api
            else {"prompt": "Count", "logprobs": 2}
        ),
    }
    route = CHAT if chat_api else "/v1/completions"
    with server.client() as c:
        whole = c.post(route, json=body).json()["choices"][0]["logprobs"]
        with c.stream("POST", route, json={**body, "stream": True}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    parts = [ch["logprobs"] for e in events for ch in e["choices"] if ch.get("logprobs")]
    if chat_api:
        assert same([x for part in parts for x in part["content"]], whole["content"])
    else:
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert same([x for part in parts for x in part[key]], whole[key]), key


def same(a: object, b: object) -> bool:
    """Equal, floats to 1e-4: the second request finds the prompt cached and prefills only its last
    token, whose logits then come from a 1-row forward; a row's rounding moves with the rows beside it."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, abs_tol=1e-4)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize(
    "body",
    [
        {"logprobs": True, "top_logprobs": 21},
        {"top_logprobs": 2},
        {"logprobs": True, "top_logprobs": -1},
        {"logprobs": 3},
    ],
)
def test_bad_logprobs_are_a_400(server: LiveServer, body: dict) -> None:
    with server.client() as c:
        r = c.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}], **body})
        assert r.status_code == 400 and r.json()["error"]["param"] in ("logprobs", "top_logprobs"), r.text
        r = c.post("/v1/completions", json={"prompt": "hi", "logprobs": 21})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
        assert c.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).status_code == 200


def test_the_openai_client_reads_them(server: LiveServer) -> None:
    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    r = client.chat.completions.create(
        model=server.model_id,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = r.choices[0].logprobs.content
    assert content and content[0].top_logprobs[0].token == content[0].token and content[0].logprob <= 0


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # a SentencePiece and a byte-level vocabulary
def test_token_bytes_join_to_the_texts_bytes(tiny_models: dict[str, Path], arch: str) -> None:
    header = read_header(tiny_models[arch])
    text = "naïve café, 東京 ok"
    ids = load_tokenizer(header).encode(text, add_special_tokens=False)
    joined = b"".join(token_bytes(header)[i] for i in ids)
    assert joined.decode().strip() == text


@pytest.mark.parametrize(("width", "k"), [(262_144, 5), (262_144, 20), (300_001, 3), (5_000, 7), (50, 50)])
def test_top_k_finds_each_rows_largest(width: int, k: int) -> None:
    """The blocked partition gives what a whole sort gives, ties and a ragged last block included."""
    rng = np.random.default_rng(width + k)
    x = rng.standard_normal((3, width)).astype(np.float32)
    x[1, :] = 0.0  # every entry tied
    x[2, -1] = 9.0  # the largest in the ragged last block
    ids, values = top_k(mx.array(x), k)
    ids, values = np.asarray(ids), np.asarray(values)
    assert np.array_equal(np.take_along_axis(x, ids, -1), values)
    assert all(len(set(row)) == k for row in ids.tolist())
    assert np.allclose(np.sort(values, -1), np.sort(x, -1)[:, -k:])


@needs_kernels
@pytest.mark.parametrize(("width", "k"), [(262_144, 5), (262_144, 20), (5_000, 0), (50, 50)])
def test_the_kernels_scores_are_the_log_softmax_and_its_best(width: int, k: int, isa: str) -> None:
    """score_rows' node: each row's token's log-probability, and its k best, best first (ties:
    the lower id), whether the row is peaked, flat, tied or masked."""
    rng = np.random.default_rng(width + k)
    x = rng.standard_normal((4, width)).astype(np.float32) * 3
    x[1, :] = 0.0  # every entry tied
    x[2, 3:] = -np.inf  # a grammar's mask: fewer finite entries than k
    tokens = np.array([7, 1, 2, width - 1])
    chosen, ids, values = kernels.extension().logprob_top(mx.array(x), mx.array(tokens), k)
    x64 = x.astype(np.float64)
    lse = np.log(np.exp(x64 - x64.max(-1, keepdims=True)).sum(-1)) + x64.max(-1)
    np.testing.assert_allclose(np.array(chosen), x64[np.arange(4), tokens] - lse, rtol=1e-5, atol=1e-5)
    order = [np.lexsort((np.arange(width), -x[r]))[:k].tolist() for r in range(4)]
    assert np.array(ids).tolist() == order
    want = np.take_along_axis(x64, np.array(order, dtype=np.int64).reshape(4, k), -1) - lse[:, None]
    np.testing.assert_allclose(np.array(values), want, rtol=1e-5, atol=1e-5)


def test_the_vocabulary_is_read_only_for_a_request_that_asks_for_logprobs(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reading every token's bytes from the header takes a third of a second on gemma3's
    vocabulary, on the event loop, where every stream waits: requests without logprobs never do."""
    import gmlx.server.state

    reads: list[int] = []
    monkeypatch.setattr(gmlx.server.state, "token_bytes", lambda h: (reads.append(1), token_bytes(h))[1])
    with LiveServer(tiny_models["llama"]) as s:
        chat(s)
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}
        with s.client() as c, c.stream("POST", CHAT, json=body) as r:
            assert r.status_code == 200 and "[DONE]" in r.read().decode()
        assert reads == []
        assert chat(s, logprobs=True)["choices"][0]["logprobs"]["content"]
        chat(s, logprobs=True)
        assert reads == [1]  # once per load
