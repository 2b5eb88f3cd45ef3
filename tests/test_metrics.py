"""/v1/metrics (JSON and Prometheus) and /system on a live server."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import httpx
import pytest
from conftest import LiveServer
from prometheus_client.parser import text_string_to_metric_families
from tiny_models import write_model

from gmlx.server import metrics
from gmlx.server.metrics import snapshot

SECTIONS = ["concurrency", "queue", "governor", "memory", "capacity", "rates", "totals", "prompt_cache", "requests", "resident_models"]


def prometheus_values(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_snapshot_sections_and_prometheus_agree(live_server: LiveServer) -> None:
    with live_server.client() as c:
        c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 6, "temperature": 0})
        snap = c.get("/v1/metrics").json()
        assert list(snap["server"]) == SECTIONS
        # Rendered from one snapshot: every gauge equals the JSON field it came from.
        one = snapshot(live_server.state)
        values = prometheus_values(live_server.state.histograms.render(one).decode())
        text = c.get("/v1/metrics", params={"format": "prometheus"})
    s = one["server"]
    assert text.headers["content-type"].startswith("text/plain")
    prometheus_values(text.text)  # the route's own text parses too
    assert values[("gmlx_concurrency_decode_batch", ())] == s["concurrency"]["decode_batch"] == 4
    assert values[("gmlx_memory_active_bytes", ())] == s["memory"]["active_bytes"]
    assert values[("gmlx_capacity_max_ctx", (("width", "1"),))] == s["capacity"]["widths"]["1"]
    assert values[("gmlx_requests_finished_total", (("model", "tiny-llama"), ("reason", "length")))] == 1
    assert values[("gmlx_generated_tokens_total", (("model", "tiny-llama"),))] == s["totals"]["generated_tokens"] == 6
    assert values[("gmlx_rates_decode_tok_s_lifetime", (("model", "tiny-llama"),))] == s["rates"]["decode_tok_s_lifetime"]
    assert values[("gmlx_ttft_seconds_count", ())] == 1
    assert values[("gmlx_requests", ())] == len(s["requests"]) == 0
    assert s["capacity"]["warmup"]["kv_bytes_measured"] > 0


def test_a_failing_probe_nulls_its_section_only(live_server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(_: object) -> dict:
        raise RuntimeError("probe down")

    monkeypatch.setitem(metrics.SECTIONS, "memory", (broken, metrics.SECTIONS["memory"][1]))
    with live_server.client() as c:
        s = c.get("/v1/metrics").json()["server"]
        assert s["memory"]["active_bytes"] is None and s["memory"]["cache_bytes"] is None
        assert s["concurrency"]["decode_batch"] == 4
        assert c.get("/v1/metrics", params={"format": "prometheus"}).status_code == 200


def test_fields_follow_what_they_measure(tmp_path: Path) -> None:
    """Two snapshots, idle and under load: every live figure moved."""
    # A context long enough that the first request is still decoding when the busy snapshot is
    # taken (the tiny model decodes about 1,000 tokens a second here).
    model = write_model(tmp_path / "long.gguf", "llama", context=2048)
    with LiveServer(model, decode_batch=1, queue_size=1, queue_timeout=0.3) as server:
        idle = snapshot(server.state)["server"]
        busy: dict = {}

        async def load() -> None:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as ac:
                body = {"prompt": "x", "max_tokens": 1500, "temperature": 0}
                first = asyncio.create_task(ac.post("/v1/completions", json=body))
                while server.engine.decoding < 1:
                    await asyncio.sleep(0.005)
                queued = asyncio.create_task(ac.post("/v1/completions", json=body))
                while server.state.gate.waiting < 1:
                    await asyncio.sleep(0.005)
                full = await ac.post("/v1/completions", json=body)  # rejected: queue full
                assert full.status_code == 503
                await asyncio.sleep(0.05)
                busy.update(snapshot(server.state)["server"])
                await first
                assert (await queued).status_code in (200, 503)

        asyncio.run(load())
        after = snapshot(server.state)["server"]
    assert (idle["concurrency"]["in_flight"], busy["concurrency"]["in_flight"]) == (0, 1)
    assert (idle["concurrency"]["waiting"], busy["concurrency"]["waiting"]) == (0, 1)
    assert busy["queue"]["waiting"] == 1 and busy["queue"]["rejections"] > idle["queue"]["rejections"]
    assert busy["queue"]["last_reject_reason"] == "queue_full"
    assert [r["state"] for r in busy["requests"]] == ["queued", "decode"]  # queued rows first
    running = busy["requests"][1]
    assert running["generated"] > 0 and running["ttft_s"] is not None and running["elapsed_s"] > 0
    assert busy["memory"]["active_bytes"] != idle["memory"]["active_bytes"]
    assert idle["rates"]["decode_tok_s"] is None and busy["rates"]["decode_tok_s"] > 0
    assert busy["rates"]["decode_streams"] == 1
    assert after["totals"]["generated_tokens"] > busy["totals"]["generated_tokens"] > 0
    assert after["rates"]["decode_tok_s_lifetime"] is not None and after["rates"]["prefill_tok_s_recent"] is not None


def test_system_is_open_and_has_no_content(tiny_models: dict[str, Path]) -> None:
    with LiveServer(tiny_models["llama"], api_key="k") as server, server.client() as c:
        assert c.get("/v1/metrics").status_code == 401
        assert c.get("/v1/metrics", headers={"Authorization": "Bearer k"}).status_code == 200
        info = c.get("/system").json()
    assert info["state"] == "ready" and info["model"] == "tiny-llama" and info["version"]
    assert info["gpu"] is None  # no NVIDIA driver on these machines: expected, not an error
    assert info["compute_type"].startswith("cpu/float32") and info["activity"] == {"active": 0, "waiting": 0}


def test_poll_routes_answer_while_the_engine_is_busy(tiny_models: dict[str, Path]) -> None:
    with LiveServer(tiny_models["llama"], decode_batch=2) as server:
        stop = threading.Event()

        def hog() -> None:
            with server.client() as c:
                while not stop.is_set():
                    c.post("/v1/completions", json={"prompt": "x", "max_tokens": 50, "temperature": 0})

        threads = [threading.Thread(target=hog) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            with server.client() as c:
                for _ in range(20):
                    for route in ("/v1/metrics", "/health?ready=1", "/system"):
                        assert c.get(route).status_code in (200, 503)
        finally:
            stop.set()
            for t in threads:
                t.join(30)
