"""Embeddings requests in /v1/metrics and its Prometheus text: a row of kind `embedding` from arrival
to answer (queued at the gate, then `prefill` with its cache counted in kv_cache), and the
`embeddings` section's counts; a failed embedding is counted and the engine goes on."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from conftest import LiveServer
from prometheus_client.parser import text_string_to_metric_families
from tiny_models import write_model

import gmlx.engine.engine as engine_module

INPUTS = ["the sea is calm tonight", "the cat sat on the mat and then it sat on the other mat"]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[LiveServer]:
    # A window long enough for a stream to hold the one slot for seconds.
    with LiveServer(write_model(tmp_path / "long.gguf", "llama", context=8192), decode_batch=1, queue_size=2) as s:
        yield s


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Embeddings wait on the engine thread until the event is set: a request is caught running."""
    go, real = threading.Event(), engine_module.embed

    def embed(*args, **kw):
        assert go.wait(30)
        return real(*args, **kw)

    monkeypatch.setattr(engine_module, "embed", embed)
    return go


def _metrics(c: httpx.Client) -> tuple[dict, dict[str, float]]:
    """The JSON snapshot, and the Prometheus samples by name and labels (one scrape after it)."""
    snap = c.get("/v1/metrics").json()["server"]
    text = c.get("/v1/metrics", params={"format": "prometheus"}).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[s.name + "".join(f",{k}={v}" for k, v in sorted(s.labels.items()))] = s.value
    return snap, samples


def _embedding_rows(snap: dict) -> list[dict]:
    return [r for r in snap["requests"] if r["kind"] == "embedding"]


def test_an_embedding_is_a_request_row_from_arrival_to_answer(server: LiveServer, held: threading.Event) -> None:
    tokenizer, model = server.engine.loaded.tokenizer, server.model_id
    ids = [tokenizer.encode(t) for t in INPUTS]
    no_eos = {str(t): -100 for t in tokenizer.eos_token_ids}
    holder = {"prompt": "x", "max_tokens": 8000, "stream": True, "logit_bias": no_eos}
    with server.client() as c, ThreadPoolExecutor(1) as pool:
        with c.stream("POST", "/v1/completions", json=holder) as s:
            lines = s.iter_lines()  # kept: a dropped iterator closes the stream
            next(lines)  # it holds the only slot until it is closed
            answer = pool.submit(server.client().post, "/v1/embeddings", json={"input": INPUTS})
            server.wait_until(lambda: server.model.gate.waiting == 1)
            snap, samples = _metrics(c)
        [row] = _embedding_rows(snap)
        assert row["state"] == "queued" and row["model"] == model and row["inputs"] == 2
        assert row["prompt_tokens"] == sum(len(x) for x in ids)  # tokenized before the queue
        assert row["kv_bytes"] is None and row["generated"] == 0
        assert [r["kind"] for r in snap["requests"]] == ["embedding", "generation"]  # queued rows first
        assert snap["embeddings"] == {"requests": 0, "failed": 0, "input_tokens": 0, "running": 0, "waiting": 1}
        assert samples["gmlx_embeddings_waiting"] == 1
        assert samples[f"gmlx_requests,model={model},state=queued"] == 1

        # The stream is gone: the embedding holds the slot, caught in the engine.
        server.wait_until(lambda: (r := _embedding_rows(_metrics(c)[0])) and r[0]["state"] == "prefill")
        snap, samples = _metrics(c)
        [row] = _embedding_rows(snap)
        expected = server.model.table().stream_bytes(max(len(x) for x in ids))  # its longest input's cache
        assert row["kv_bytes"] == expected > 0
        assert snap["kv_cache"]["used_bytes"] == expected  # nothing else runs
        assert snap["embeddings"]["running"] == 1 and snap["embeddings"]["waiting"] == 0
        assert samples["gmlx_embeddings_running"] == 1 and samples[f"gmlx_requests,model={model},state=prefill"] == 1

        held.set()
        res = answer.result(30)
        assert res.status_code == 200
        snap, samples = _metrics(c)
    tokens = res.json()["usage"]["prompt_tokens"]
    assert _embedding_rows(snap) == [] and snap["kv_cache"]["used_bytes"] == 0
    assert snap["embeddings"] == {"requests": 1, "failed": 0, "input_tokens": tokens, "running": 0, "waiting": 0}
    assert samples["gmlx_embeddings_requests_total"] == 1
    assert samples["gmlx_embeddings_input_tokens_total"] == tokens


def test_a_failed_embedding_is_counted_and_the_engine_goes_on(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = engine_module.embed

    def broken(*args, **kw):
        raise RuntimeError("no memory for it")

    monkeypatch.setattr(engine_module, "embed", broken)
    with server.client() as c:
        res = c.post("/v1/embeddings", json={"input": "hi"})
        assert res.status_code == 500 and res.json()["error"]["code"] == "embedding_failed"
        monkeypatch.setattr(engine_module, "embed", real)
        assert c.post("/v1/embeddings", json={"input": "hi"}).status_code == 200
        snap, samples = _metrics(c)
    assert snap["embeddings"]["failed"] == 1 and snap["embeddings"]["requests"] == 1
    assert samples["gmlx_embeddings_failed_total"] == 1 and _embedding_rows(snap) == []
    assert server.model.gate.running == 0  # the slot came back both times
