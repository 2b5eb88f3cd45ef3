"""POST /v1/embeddings with the official openai client: one L2-normalised vector per input, pooled
as llama.cpp pools a causal model (the GGUF's pooling_type, else the last token), equal to the
model's normed hidden state computed directly, deterministic, and different for different inputs."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import mlx.core as mx
import numpy as np
import openai
import pytest
from conftest import LiveServer, invoke_json
from mlx_lm.models.cache import make_prompt_cache
from tiny_models import write_model

from gmlx.engine.embeddings import embed, pooling_for
from gmlx.gguf.header import read_header
from gmlx.gguf.tokenizer import load_tokenizer
from gmlx.models.loader import load

TEXTS = ["the sea is calm tonight", "the cat sat on the mat", "the sea is calm tonight"]


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def server(request: pytest.FixtureRequest, tiny_models: dict[str, Path]) -> Iterator[LiveServer]:
    # A small prefill step, so a long input is embedded in several chunks through the cache.
    with LiveServer(tiny_models[request.param], prefill_step=16) as s:
        yield s


@pytest.fixture(scope="module")
def direct(server: LiveServer):
    """The same file loaded again on this thread (the server's arrays belong to its engine thread)."""
    return load(server.engine.loaded.header.path, "float")


def _client(server: LiveServer, prefix: str = "/v1") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + prefix, api_key="none", max_retries=0)


def _last_token_vector(loaded, ids: list[int]) -> np.ndarray:
    hidden = loaded.model.model(mx.array([ids]))[0, -1].astype(mx.float32)  # the whole input at once, no cache
    v = np.array(hidden)
    return v / np.linalg.norm(v)


def test_vectors_are_normalised_pooled_and_deterministic(server: LiveServer, direct) -> None:
    client = _client(server)
    res = client.embeddings.create(model=server.model_id, input=TEXTS)  # the client asks for base64 by default
    vectors = [np.array(d.embedding) for d in res.data]
    assert [d.index for d in res.data] == [0, 1, 2] and res.model == server.model_id
    n_embd = server.engine.loaded.geometry.n_embd
    assert all(v.shape == (n_embd,) and abs(np.linalg.norm(v) - 1) < 1e-5 for v in vectors)
    assert np.allclose(vectors[0], vectors[2], atol=1e-6)  # the same text, the same vector
    assert not np.allclose(vectors[0], vectors[1], atol=1e-2)  # different texts differ
    ids = [server.engine.loaded.tokenizer.encode(t) for t in TEXTS]
    assert res.usage.prompt_tokens == res.usage.total_tokens == sum(len(x) for x in ids)
    for v, x in zip(vectors, ids):
        assert np.allclose(v, _last_token_vector(direct, x), atol=1e-4)
    again = client.embeddings.create(model=server.model_id, input=TEXTS[0])
    assert np.allclose(again.data[0].embedding, vectors[0], atol=1e-6)


def test_token_ids_floats_and_the_bare_route(server: LiveServer) -> None:
    ids = server.engine.loaded.tokenizer.encode(TEXTS[1])
    client = _client(server)
    as_text = client.embeddings.create(model=server.model_id, input=TEXTS[1]).data[0].embedding
    as_ids = client.embeddings.create(model=server.model_id, input=ids).data[0].embedding
    batch = client.embeddings.create(model=server.model_id, input=[ids, ids[:3]]).data
    floats = client.embeddings.create(model=server.model_id, input=TEXTS[1], encoding_format="float").data[0].embedding
    bare = _client(server, prefix="").embeddings.create(model=server.model_id, input=TEXTS[1]).data[0].embedding
    assert np.allclose(as_ids, as_text, atol=1e-6) and np.allclose(batch[0].embedding, as_text, atol=1e-6)
    assert not np.allclose(batch[1].embedding, as_text, atol=1e-2)
    assert isinstance(floats, list) and np.allclose(floats, as_text, atol=1e-6)
    assert np.allclose(bare, as_text, atol=1e-6)


def test_a_long_input_runs_in_chunks_and_equals_the_whole(server: LiveServer, direct) -> None:
    ids = server.engine.loaded.tokenizer.encode("the sea and the cat " * 12)
    assert len(ids) > 3 * 16  # several prefill steps
    v = _client(server).embeddings.create(model=server.model_id, input=ids).data[0].embedding
    assert np.allclose(v, _last_token_vector(direct, ids), atol=1e-4)


def test_refusals(server: LiveServer) -> None:
    context = server.engine.loaded.context_length
    with server.client() as c:

        def error(body: dict, status: int = 400) -> dict:
            r = c.post("/v1/embeddings", json=body)
            assert r.status_code == status, r.text
            return r.json()["error"]

        assert error({"input": [1] * (context + 1)})["code"] == "context_length_exceeded"
        assert error({"input": []})["param"] == "input"
        assert 'not {"a": 1}' in error({"input": {"a": 1}})["message"]  # what it got, not "empty"
        assert error({"input": [[]]})["param"] == "input"
        assert error({"input": [True]})["param"] == "input"  # a bool is no token id
        assert error({"input": [10**9]})["param"] == "input"
        assert error({"input": "x", "dimensions": 8})["code"] == "unsupported_parameter"
        assert error({"input": "x", "encoding_format": "int8"})["param"] == "encoding_format"
        assert error({"input": "x", "model": "text-embedding-3-small"}, 404)["code"] == "model_not_found"
        assert c.post("/v1/embeddings", json={"input": "x", "user": "u1"}).status_code == 200


def test_pooling_follows_the_gguf_key(direct) -> None:
    def header(value: object) -> SimpleNamespace:
        return SimpleNamespace(arch_key=lambda key: value if key == "pooling_type" else None)

    assert [pooling_for(header(v)) for v in (None, 0, 1, 2, 3, 4)] == ["last", "last", "mean", "cls", "last", "last"]
    ids = [3, 9, 4, 12, 7, 5, 8]
    hidden = np.array(direct.model.model(mx.array([ids]))[0].astype(mx.float32))
    mean = hidden.mean(axis=0)
    for pooling, want in (("mean", mean), ("cls", hidden[0]), ("last", hidden[-1])):
        got = np.array(embed(direct, make_prompt_cache, ids, pooling, step=3))  # three chunks through the cache
        assert np.allclose(got, want / np.linalg.norm(want), atol=1e-4), pooling


def test_an_embedding_takes_an_admission_slot(tiny_models: dict[str, Path]) -> None:
    """Embeddings queue with generation: with the one slot held and no queue, a 503 queue_full."""
    with LiveServer(tiny_models["llama"], decode_batch=1, queue_size=0) as server, server.client() as c:
        no_eos = {str(t): -100 for t in server.engine.loaded.tokenizer.eos_token_ids}
        holder = {"prompt": "x", "max_tokens": 200, "stream": True, "logit_bias": no_eos}
        with c.stream("POST", "/v1/completions", json=holder) as s:
            lines = s.iter_lines()
            next(lines)  # it holds the slot
            busy = c.post("/v1/embeddings", json={"input": "hi"})
            assert busy.status_code == 503 and busy.json()["error"]["code"] == "queue_full"
            assert int(busy.headers["Retry-After"]) >= 1
        server.wait_until(lambda: server.model.gate.running == 0)
        assert c.post("/v1/embeddings", json={"input": "hi"}).status_code == 200


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """Each input the engine embeds is counted; while `gate` is clear, the engine waits in the first."""
    from gmlx.engine import engine as engine_module

    seen, real = SimpleNamespace(count=0, gate=threading.Event()), engine_module.embed

    def counted(*args, **kw):
        seen.count += 1
        assert seen.gate.wait(30)
        return real(*args, **kw)

    monkeypatch.setattr(engine_module, "embed", counted)
    return seen


def test_a_client_that_leaves_drops_its_remaining_inputs(tiny_models: dict[str, Path], calls) -> None:
    with LiveServer(tiny_models["llama"], decode_batch=1) as server:
        with httpx.Client(base_url=server.url, timeout=0.5) as c, pytest.raises(httpx.ReadTimeout):
            c.post("/v1/embeddings", json={"input": [f"input {i}" for i in range(6)]})
        server.wait_until(lambda: server.model.gate.running == 0)  # it saw the client go, and freed the slot
        calls.gate.set()
        with server.client() as c:
            answer = c.post("/v1/embeddings", json={"input": ["a", "b"]})
        assert answer.status_code == 200 and len(answer.json()["data"]) == 2
        assert calls.count == 1 + 2  # the first input was running when its client left; the other five never ran
        assert server.engine.alive


def test_streams_decode_between_an_embeddings_inputs(tmp_path: Path, calls) -> None:
    """An embedding of many inputs does not stall decoding for all of them: the engine steps the
    batch between each two inputs."""
    calls.gate.set()
    model = write_model(tmp_path / "long.gguf", "llama", context=8192)  # a stream that outlasts the embedding
    with LiveServer(model, decode_batch=2) as server, server.client() as c:
        no_eos = {str(t): -100 for t in server.engine.loaded.tokenizer.eos_token_ids}
        holder = {"prompt": "x", "max_tokens": 8000, "stream": True, "logit_bias": no_eos}
        with c.stream("POST", "/v1/completions", json=holder) as s:
            lines = s.iter_lines()
            next(lines)  # decoding
            [stream] = server.engine.requests()
            seen, real = [], calls.gate

            class Recording:  # the stream's tokens as each input starts
                def wait(self, timeout: float) -> bool:
                    seen.append(stream.generated)
                    return real.wait(timeout)

            calls.gate = Recording()
            answer = c.post("/v1/embeddings", json={"input": [f"input {i}" for i in range(8)]})
        assert answer.status_code == 200 and len(seen) == 8
        assert all(b > a for a, b in zip(seen, seen[1:])), seen


@pytest.mark.usefixtures("no_settings_env")
def test_the_estimate_of_an_embeddings_body(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """POST /v1/estimate with an embeddings body: the tokens the request will be charged, the memory
    its longest input takes (a prefill chunk and that input's cache), the window judged per input,
    and, for a model in the models directory, the same from its file, never loading it, as
    `gmlx estimate --body` answers offline."""
    folder = tmp_path / "models"
    folder.mkdir()
    other = write_model(folder / "other.gguf", "qwen3", context=4096, kv_heads=4)
    memory = 4 * 2**30
    with LiveServer(tiny_models["llama"], models_dir=str(folder), memory=memory) as server, server.client() as c:
        est = c.post("/v1/estimate", json={"input": TEXTS}).json()
        assert server.model.embedding_stats.requests == 0  # nothing ran
        real = c.post("/v1/embeddings", json={"input": TEXTS}).json()
        assert est["kind"] == "embedding" and est["inputs"] == 3 and est["resident"] is True
        assert est["prompt_tokens"] == real["usage"]["prompt_tokens"]
        longest = max(len(server.engine.loaded.tokenizer.encode(t)) for t in TEXTS)
        table = server.model.table()
        assert est["need_bytes"] == table.budget.prefill_bytes + table.stream_bytes(longest)
        assert est["fits_now"] is True and est["context_ok"] is True and est["est_ttft_s"] > 0
        window = server.engine.loaded.context_length
        long = c.post("/v1/estimate", json={"input": [[1] * (window + 1), "hi"]}).json()
        assert long["context_ok"] is False and long["context_limit"] == window  # the request itself is a 400:
        refused = c.post("/v1/embeddings", json={"input": [[1] * (window + 1), "hi"]})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
        bad = c.post("/v1/estimate", json={"input": []})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "input"
        off = c.post("/v1/estimate", json={"input": "hello world", "model": "other"}).json()
    assert off["resident"] is False and off["loadable"] is True and off["model"] == "other"
    assert off["prompt_tokens"] == len(load_tokenizer(read_header(other)).encode("hello world"))
    assert off["fits_now"] is None and off["est_ttft_s"] is None and off["context_limit"] == 4096
    assert server.state.models["other"].engine is None  # not loaded by the estimate
    (tmp_path / "body.json").write_text(json.dumps({"input": "hello world"}))
    offline = invoke_json("estimate", other, "--body", tmp_path / "body.json", "--weights", "float", "--memory", memory)
    for key in ("kind", "inputs", "prompt_tokens", "need_bytes", "context_ok", "context_limit", "resident"):
        assert offline["estimate"][key] == off[key], key
