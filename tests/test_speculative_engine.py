"""Speculative decoding in the engine: a request alone decodes with the drafter, hands its stream
back to the batch when another arrives, and every request's greedy text is the text it gets with
no drafter at all; the figures reach its metrics row, the rates and Prometheus."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from conftest import LiveServer
from tiny_models import write_model

from gmlx.capacity.kv_quant import KVQuantSettings, plan_kv_quant
from gmlx.engine.engine import Chunk, Engine, Event, Finished, Request
from gmlx.engine.kv_cache import make_cache_factory
from gmlx.engine.prompt_cache import PromptCache
from gmlx.engine.sampling import SamplingParams
from gmlx.gguf.header import read_header
from gmlx.models.loader import load

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    # Untied heads, so greedy text does not just echo one token and agreement means something.
    root = tmp_path_factory.mktemp("spec-engine")
    return {
        "served": write_model(root / "served.gguf", "llama", tied=False, seed=0, context=1024),
        "other": write_model(root / "other.gguf", "llama", tied=False, seed=7, context=1024),
    }


def engine(served: Path, draft: Path | None, kv: KVQuantSettings | None = None) -> Engine:
    plan = plan_kv_quant(kv, read_header(served).geometry) if kv else None
    e = Engine(
        lambda: load(served, "float"),
        "spec",
        decode_batch=4,
        prompt_cache=PromptCache(0),
        load_draft=(lambda _: load(draft, "float")) if draft else None,
        num_draft=3,
        make_cache=make_cache_factory(plan),
    )
    e.start()
    assert e.ready.wait(60) and e.loaded is not None
    return e


def submit(
    e: Engine, ids: list[int], max_tokens: int, rid: str
) -> tuple[Request, threading.Event, list[str], list[Event]]:
    done, text, end = threading.Event(), [], []

    def emit(ev: Event) -> None:
        if isinstance(ev, Chunk):
            text.append(ev.text)
        else:
            end.append(ev)
            done.set()

    req = Request(rid, ids, max_tokens, GREEDY, emit=emit)
    e.submit(req)
    return req, done, text, end


def run(e: Engine, ids: list[int], max_tokens: int = 40) -> tuple[str, Request]:
    req, done, text, end = submit(e, ids, max_tokens, f"r{len(ids)}")
    assert done.wait(120) and isinstance(end[0], Finished), end
    return "".join(text), req


PROMPTS = [[5 + (i * 7 + k) % 300 for i in range(20 + 9 * k)] for k in range(3)]


@pytest.fixture(scope="module")
def plain(files: dict[str, Path]) -> list[str]:
    e = engine(files["served"], None)
    try:
        return [run(e, p)[0] for p in PROMPTS]
    finally:
        e.stop()


@pytest.mark.parametrize(("drafter", "accept"), [("served", (0.9, 1.0)), ("other", (0.0, 0.5))])
def test_a_lone_request_drafts_and_keeps_its_text(
    files: dict[str, Path], plain: list[str], drafter: str, accept: tuple[float, float]
) -> None:
    e = engine(files["served"], files[drafter])
    try:
        rounds = 0
        for p, expected in zip(PROMPTS, plain):
            text, req = run(e, p)
            assert text == expected
            spec = req.speculative
            assert spec is not None and spec.rounds > 0 and not spec.batched
            assert accept[0] <= spec.accept_rate <= accept[1], spec
            rounds += spec.rounds
        assert e.stats.speculative.rounds == rounds  # the lifetime figures sum the requests'
    finally:
        e.stop()


def test_a_second_request_sends_the_stream_back_to_the_batch(files: dict[str, Path], plain: list[str]) -> None:
    e = engine(files["served"], files["served"])
    try:
        first = submit(e, PROMPTS[0], 40, "a")
        while first[0].speculative is None or first[0].speculative.rounds == 0:  # drafting alone by now
            assert not first[1].wait(0.01), "it finished before it drafted"
        second = submit(e, PROMPTS[1], 40, "b")
        for (_, done, text, end), expected in zip((first, second), plain):
            assert done.wait(120) and isinstance(end[0], Finished), end
            assert "".join(text) == expected  # handed over mid-stream, the text is the same
        assert first[0].speculative.batched
    finally:
        e.stop()


@pytest.mark.parametrize("scheme", ["uniform", "kvarn"])
def test_quantized_kv_drafts_too(files: dict[str, Path], scheme: str) -> None:
    """The lane trims quantized caches back as exactly as float ones: same text as no drafter."""
    kv = KVQuantSettings(bits=8, scheme=scheme)
    plain, drafted = engine(files["served"], None, kv), engine(files["served"], files["served"], kv)
    try:
        text, req = run(drafted, PROMPTS[1])
        assert text == run(plain, PROMPTS[1])[0] and req.speculative.accept_rate == 1.0
    finally:
        plain.stop()
        drafted.stop()


def test_rows_rates_and_prometheus_carry_the_figures(files: dict[str, Path]) -> None:
    with LiveServer(files["served"], draft=str(files["other"])) as server, server.client() as c:
        body = {"prompt": PROMPTS[2], "max_tokens": 40, "temperature": 0}
        assert c.post("/v1/completions", json=body).status_code == 200
        rates = c.get("/v1/metrics").json()["server"]["rates"]
        prom = c.get("/v1/metrics", params={"format": "prometheus"}).text
    rate = server.engine.stats.speculative.accept_rate
    assert rate is not None and rates["speculative_accept_rate"] == round(rate, 4)
    assert f"gmlx_rates_speculative_accept_ratio {round(rate, 4)}" in prom


def test_no_drafter_means_null_figures(tiny_models: dict[str, Path]) -> None:
    with LiveServer(tiny_models["llama"]) as server, server.client() as c:
        assert c.get("/v1/metrics").json()["server"]["rates"]["speculative_accept_rate"] is None
