"""Speculative decoding: a drafter proposes, the served model verifies, and the output is the
served model's own greedy output token for token."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models.cache import (
    BatchKVCache,
    KVCache,
    RotatingKVCache,
    make_prompt_cache,
)
from mlx_lm.sample_utils import greedy_sampler
from tiny_models import write_model

from gmlx.cli.common import EXIT_BAD_MODEL
from gmlx.engine.drafting import (
    IncompatibleDrafter,
    check_drafter,
    check_drafter_files,
)
from gmlx.engine.sampling import SamplingParams, make_sampler
from gmlx.engine.speculative import (
    SpeculativeCounters,
    SpeculativeStream,
    can_speculate,
)
from gmlx.gguf.header import read_header
from gmlx.models.loader import LoadedModel, load
from gmlx.settings import resolve_settings

PROMPT = "hello world the capital of France is"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Untied tiny models: a separate random LM head keeps greedy output from repeating one token
    (a tied tiny model mostly echoes), so agreement token for token means something."""
    root = tmp_path_factory.mktemp("spec")
    return {
        "llama": write_model(root / "served-llama.gguf", "llama", tied=False, seed=0),
        "llama_draft": write_model(root / "draft-llama.gguf", "llama", tied=False, seed=7),
        "gemma3": write_model(root / "served-gemma3.gguf", "gemma3", tied=False, seed=0),  # window 64
        "qwen3": write_model(root / "served-qwen3.gguf", "qwen3", tied=False, seed=0),
        "qwen2": write_model(root / "other-vocab-qwen2.gguf", "qwen2", tied=False, seed=0),
    }


@pytest.fixture(scope="module")
def models(files: dict[str, Path]) -> dict[str, LoadedModel]:
    return {name: load(path, "float") for name, path in files.items()}


def plain_greedy(model, prompt: list[int], n: int) -> list[int]:
    """mlx_lm's own single-stream greedy generation: the reference."""
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n, sampler=greedy_sampler)]


def stream_for(model, draft, prompt: list[int], **kw) -> SpeculativeStream:
    cache = make_prompt_cache(model)
    model(mx.array(prompt[:-1])[None], cache=cache)
    mx.eval([c.state for c in cache])
    return SpeculativeStream(model, draft, cache, prompt[:-1], prompt[-1:], **kw)


def run(stream: SpeculativeStream, n: int) -> list[int]:
    out: list[int] = []
    while len(out) < n:
        got = stream.round(n - len(out))
        assert len(got) in range(1, stream.num_draft + 2)
        out += got
    assert len(out) == n
    return out


@pytest.mark.parametrize("arch,num_draft", [("llama", 1), ("llama", 3), ("llama", 6), ("qwen3", 3), ("gemma3", 4)])
def test_self_drafter_is_plain_greedy(models: dict[str, LoadedModel], arch: str, num_draft: int) -> None:
    m = models[arch]
    prompt = m.tokenizer.encode(PROMPT)
    n = 40  # gemma3: 40 + the prompt stays below its 64-token window
    ref = plain_greedy(m.model, prompt, n)
    assert len(set(ref)) > 5  # not a degenerate repeat
    s = stream_for(m.model, m.model, prompt, num_draft=num_draft)
    assert run(s, n) == ref
    assert s.accept_rate is not None and s.accept_rate >= 0.9
    assert s.rounds < n  # more than one token per forward pass of the served model


def test_random_drafter_same_output_low_accept(models: dict[str, LoadedModel]) -> None:
    m, d = models["llama"], models["llama_draft"]
    prompt = m.tokenizer.encode(PROMPT)
    ref = plain_greedy(m.model, prompt, 60)
    s = stream_for(m.model, d.model, prompt, num_draft=3)
    assert run(s, 60) == ref
    assert s.accept_rate is not None and s.accept_rate < 0.3
    c = s.counters.to_json()
    assert c["drafted"] == s.drafted > 0 and c["accepted"] == s.accepted and c["emitted"] == 60
    assert c["batched"] is False and set(c) == {"rounds", "drafted", "accepted", "emitted", "accept_rate", "batched"}


def test_release_then_plain_greedy_continues(models: dict[str, LoadedModel]) -> None:
    m, d = models["llama"], models["llama_draft"]
    prompt = m.tokenizer.encode(PROMPT)
    ref = plain_greedy(m.model, prompt, 50)
    s = stream_for(m.model, d.model, prompt, num_draft=4)
    out = run(s, 21)
    cache, history, pending = s.release()
    assert history == prompt + out[:-1] and pending == out[-1:]
    assert all(c.offset == len(history) for c in cache)  # the served cache holds exactly history
    with pytest.raises(RuntimeError):
        s.round(1)
    # Continue one token at a time on the returned cache, as a single stream would.
    while len(out) < 50:
        logits = m.model(mx.array(pending)[None], cache=cache)[:, -1, :]
        pending = [int(logits.argmax(-1).item())]
        out += pending
    assert out == ref


@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # gemma3: sliding caches out of a BatchRotatingKVCache
def test_round_trip_through_the_batch_generator(models: dict[str, LoadedModel], arch: str) -> None:
    """The engine's path: decode in the batch, take the stream out (remove with its cache), run
    it speculatively, hand it back (insert with cache and tokens), finish in the batch."""
    m = models[arch]
    prompt = m.tokenizer.encode(PROMPT)
    total = 45
    ref = plain_greedy(m.model, prompt, total)
    gen = BatchGenerator(m.model, stop_tokens=[], completion_batch_size=4, prefill_batch_size=4)
    [uid] = gen.insert([prompt], [total])
    out: list[int] = []
    while len(out) < 7:
        _, responses = gen.next()
        out += [r.token for r in responses]
    [(cache, tokens)] = gen.remove([uid], return_prompt_caches=True).values()
    assert list(tokens) == prompt + out  # the newest emitted token is in the cache
    s = SpeculativeStream.from_batch(m.model, m.model, cache, tokens, num_draft=3)
    while len(out) < 30:
        out += s.round(30 - len(out))
    cache, history, pending = s.release()
    [uid] = gen.insert([pending], [total - len(out)], caches=[cache], all_tokens=[history])
    while len(out) < total:
        _, responses = gen.next()
        out += [r.token for r in responses]
    gen.close()
    assert out == ref and s.accept_rate == 1.0


def test_drafter_cache_carries_over_to_the_next_lane(models: dict[str, LoadedModel]) -> None:
    m, d = models["llama"], models["llama_draft"]
    prompt = m.tokenizer.encode(PROMPT)
    ref = plain_greedy(m.model, prompt, 40)
    s = stream_for(m.model, d.model, prompt, num_draft=3)
    out = run(s, 10)
    cache, history, pending = s.release()
    assert s.draft_state is not None and s.draft_state[1] <= len(history)
    for _ in range(6):  # decoded "in the batch", without the drafter
        logits = m.model(mx.array(pending)[None], cache=cache)[:, -1, :]
        history, pending = history + pending, [int(logits.argmax(-1).item())]
        out += pending
    again = SpeculativeStream(m.model, d.model, cache, history, pending, num_draft=3, draft_state=s.draft_state)
    out += run(again, 40 - len(out))
    assert out == ref


def test_sliding_window_stops_speculating_and_stays_exact(models: dict[str, LoadedModel]) -> None:
    m = models["gemma3"]  # sliding window 64
    prompt = m.tokenizer.encode(PROMPT)
    ref = plain_greedy(m.model, prompt, 90)
    s = stream_for(m.model, m.model, prompt, num_draft=3)
    out: list[int] = []
    while s.reason() is None:
        out += s.round(90 - len(out))
    assert "64-token sliding window" in (s.reason() or "")
    assert s.length <= 64 and s.headroom() == 0
    drafted = s.drafted
    while len(out) < 90:  # rounds past the window draft nothing: plain steps, still exact
        out += s.round(90 - len(out))
    assert out == ref and s.drafted == drafted
    cache, _, _ = s.release()
    assert "past its 64-token window" in (can_speculate(cache) or "")


def test_stop_token_ends_the_round(models: dict[str, LoadedModel]) -> None:
    m = models["llama"]
    prompt = m.tokenizer.encode(PROMPT)
    ref = plain_greedy(m.model, prompt, 30)
    stop = ref[5]
    first = ref.index(stop)
    s = stream_for(m.model, m.model, prompt, num_draft=6)
    out: list[int] = []
    while not out or out[-1] != stop:
        out += s.round(30 - len(out), stop_tokens={stop})
    assert out == ref[: first + 1]
    assert s.history == prompt + out[:-1] and s.pending == [stop]
    assert all(c.offset == len(s.history) for c in s.cache)


def test_several_pending_tokens(models: dict[str, LoadedModel]) -> None:
    """A stream may start with part of the prompt still to feed: it goes in with the first verify."""
    m, d = models["qwen3"], models["qwen3"]
    prompt = m.tokenizer.encode(PROMPT)
    ref = plain_greedy(m.model, prompt, 20)
    cache = make_prompt_cache(m.model)
    m.model(mx.array(prompt[:4])[None], cache=cache)
    s = SpeculativeStream(m.model, d.model, cache, prompt[:4], prompt[4:], num_draft=3, prefill_step=5)
    assert run(s, 20) == ref and s.accept_rate == 1.0


def test_max_new_is_respected_and_sampled_decoding_runs(models: dict[str, LoadedModel]) -> None:
    m = models["llama"]
    prompt = m.tokenizer.encode(PROMPT)
    s = stream_for(m.model, m.model, prompt, num_draft=5)
    assert s.round(1) == plain_greedy(m.model, prompt, 1) and s.drafted == 0  # one token: no drafting
    assert s.round(0) == []
    sampled = stream_for(
        m.model, m.model, prompt, num_draft=3, sampler=make_sampler(SamplingParams(temperature=0.8, seed=3))
    )
    out = run(sampled, 20)
    assert all(0 <= t < m.geometry.vocab_size for t in out) and sampled.rounds > 0


def test_can_speculate_reasons() -> None:
    assert can_speculate([KVCache(), KVCache()]) is None
    assert "no KV cache" in can_speculate([])
    rotating = RotatingKVCache(max_size=8)
    rotating.update_and_fetch(mx.zeros((1, 1, 10, 4)), mx.zeros((1, 1, 10, 4)))
    assert "past its 8-token window" in can_speculate([KVCache(), rotating])
    assert "batch" in can_speculate([BatchKVCache([0])])
    fresh = RotatingKVCache(max_size=8)
    assert can_speculate([fresh]) is None
    assert "reach the 8-token sliding window" in can_speculate([fresh], tokens=6, num_draft=3)
    with pytest.raises(ValueError, match="past its 8-token window"):
        SpeculativeStream(None, None, [rotating], [1], [2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pending"):
        SpeculativeStream(None, None, [KVCache()], [1], [])  # type: ignore[arg-type]


def test_counters_json_and_lifetime_sum() -> None:
    life = SpeculativeCounters()
    assert life.accept_rate is None and life.to_json()["accept_rate"] is None
    life.add(SpeculativeCounters(rounds=2, drafted=6, accepted=3, emitted=5))
    life.add(SpeculativeCounters(rounds=1, drafted=2, accepted=2, emitted=3, batched=True))
    assert life.to_json() == {
        "rounds": 3,
        "drafted": 8,
        "accepted": 5,
        "emitted": 8,
        "accept_rate": 0.625,
        "batched": False,
    }


def test_tokenizer_check(models: dict[str, LoadedModel]) -> None:
    served, same_vocab, other = models["llama"], models["gemma3"], models["qwen2"]
    check_drafter(served.tokenizer, same_vocab.tokenizer, served.geometry, same_vocab.geometry)  # same vocabulary
    check_drafter(served.tokenizer, models["llama_draft"].tokenizer, served.geometry, models["llama_draft"].geometry)
    with pytest.raises(ValueError, match="cannot draft for .*vocabulary of"):
        check_drafter(served.tokenizer, other.tokenizer, served.geometry, other.geometry)

    class Renamed:  # same size, one piece renamed
        def __init__(self, tok, eos=None):
            self.tok, self.eos_token_ids = tok, eos if eos is not None else tok.eos_token_ids
            self.bos_token_id = tok.bos_token_id

        def get_vocab(self):
            return self.tok.get_vocab()

        def convert_ids_to_tokens(self, ids):
            return ["<renamed>" if i == 300 else p for i, p in zip(ids, self.tok.convert_ids_to_tokens(ids))]

    with pytest.raises(IncompatibleDrafter, match="token 300 is '<renamed>'"):
        check_drafter(served.tokenizer, Renamed(served.tokenizer), served.geometry, served.geometry)

    class OtherEos(Renamed):
        def convert_ids_to_tokens(self, ids):
            return self.tok.convert_ids_to_tokens(ids)

    with pytest.raises(IncompatibleDrafter, match="eos token ids"):
        check_drafter(served.tokenizer, OtherEos(served.tokenizer, eos={7}), served.geometry, served.geometry)


def test_file_check(files: dict[str, Path]) -> None:
    served = read_header(files["llama"])
    check_drafter_files(served, read_header(files["gemma3"]))
    with pytest.raises(IncompatibleDrafter, match="tokenizer 'gpt2' differs"):
        check_drafter_files(served, read_header(files["qwen2"]))
    renamed = read_header(files["llama_draft"])
    tokens = list(renamed.get("tokenizer.ggml.tokens"))
    tokens[42] = "<other>"
    renamed.metadata["tokenizer.ggml.tokens"] = tokens
    with pytest.raises(IncompatibleDrafter, match="token 42 is '<other>'"):
        check_drafter_files(served, renamed)
    other_eos = read_header(files["llama_draft"])
    other_eos.metadata["tokenizer.ggml.eos_token_id"] = 5
    with pytest.raises(IncompatibleDrafter, match="eos token id 5"):
        check_drafter_files(served, other_eos)


def test_the_engine_loads_and_checks_its_drafter(files: dict[str, Path]) -> None:
    from gmlx.deployment import Deployment
    from gmlx.server.build import build_engine

    for draft, ok in (("llama_draft", True), ("qwen2", False)):
        settings = resolve_settings({"weights": "float", "draft": str(files[draft])}, env={})
        engine = build_engine(Deployment("llama", files["llama"], settings))
        engine.start()
        assert engine.ready.wait(60)
        if ok:
            assert engine.load_error is None and engine.draft is not None and engine.draft.model_id == "draft-llama"
        else:  # on the loaded tokenizers too (serve checks the headers before it starts)
            assert engine.loaded is None and "cannot draft for" in (engine.load_error or "")
        engine.stop()


def test_settings_rows() -> None:
    s = resolve_settings({}, env={})
    assert s.draft is None and s.num_draft == 3
    s = resolve_settings({"num_draft": 5}, env={"GMLX_DRAFT": "d.gguf"})
    assert s.draft == "d.gguf" and s.sources["draft"] == "env GMLX_DRAFT" and s.num_draft == 5


def test_serve_refuses_an_incompatible_drafter(files: dict[str, Path]) -> None:
    env = {**os.environ, "GMLX_LOG_LEVEL": "warning"}
    r = subprocess.run(
        [sys.executable, "-m", "gmlx", "serve", str(files["llama"]), "--draft", str(files["qwen2"]), "--port", "0"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode == EXIT_BAD_MODEL, r.stderr
    assert "cannot draft for served-llama.gguf" in r.stderr and "tokenizer 'gpt2' differs" in r.stderr
    assert "serving" not in r.stderr  # refused before the server started


@pytest.mark.slow
def test_default_model_as_its_own_drafter(default_model: Path) -> None:
    # Float weights: MLX's own float32 kernels give the same logits (to ~3e-5) whether the
    # served model runs 1 or k+1 tokens per pass, so greedy output must match token for token.
    m = load(default_model, "float")
    prompt = m.tokenizer.encode("The capital of France is")
    ref = plain_greedy(m.model, prompt, 24)
    s = stream_for(m.model, m.model, prompt, num_draft=3)
    assert run(s, 24) == ref
    assert s.accept_rate is not None and s.accept_rate >= 0.9


@pytest.mark.slow
def test_default_model_as_its_own_drafter_gguf_mode(default_model: Path) -> None:
    m = load(default_model, "gguf")
    prompt = m.tokenizer.encode("The capital of France is")
    ref = plain_greedy(m.model, prompt, 24)
    assert run(stream_for(m.model, m.model, prompt, num_draft=3), 24) == ref
