"""Latency as `gmlx top` reads it (`server.latency` in /v1/metrics: count and p50/p95/p99 over the
last 300 s) and as Prometheus does (histograms labelled by model), fed by the same observations."""

from __future__ import annotations

import math

import pytest
from conftest import LiveServer
from prometheus_client.parser import text_string_to_metric_families

from gmlx.server.latency import SLOT_S, WINDOW_S, Window
from gmlx.server.prometheus import Histograms


def exact(values: list[float], q: float) -> float:
    """The nearest-rank quantile."""
    return sorted(values)[max(1, math.ceil(q * len(values))) - 1]


def test_the_window_gives_percentiles_within_a_percent() -> None:
    window, now = Window(), 1000.0
    values = [0.001 * 1.37**i for i in range(40)] + [0.25] * 60  # 1 ms to about 200 s, and a mode
    for i, v in enumerate(values):
        window.observe(v, now + i * 0.01)
    summary = window.summary(now + 1)
    assert summary["count"] == len(values)
    for name, q in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99)):
        assert summary[name] == pytest.approx(exact(values, q), rel=0.01), name


def test_the_window_forgets_what_is_older_than_300_s() -> None:
    window, now = Window(), 5000.0
    assert window.summary(now) == {"count": 0, "p50": None, "p95": None, "p99": None}
    window.observe(10.0, now)
    window.observe(0.0, now + 1)  # a zero duration is kept as 0, not lost to the log scale
    assert window.summary(now + WINDOW_S - SLOT_S)["count"] == 2
    later = now + WINDOW_S + SLOT_S
    window.observe(0.5, later)
    recent = window.summary(later)
    assert recent["count"] == 1 and all(recent[p] == pytest.approx(0.5, rel=0.01) for p in ("p50", "p95", "p99"))
    assert window.summary(later + 2 * WINDOW_S) == {"count": 0, "p50": None, "p95": None, "p99": None}
    for i in range(100_000):  # a day of observations, one a second
        window.observe(0.01 * (1 + i % 1000), later + i)
    assert WINDOW_S - SLOT_S <= window.summary(later + 100_000)["count"] <= WINDOW_S
    assert len(window._slots) <= WINDOW_S // SLOT_S + 1  # memory: the window's slots, not the day


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def test_histograms_are_labelled_by_model_and_feed_the_window() -> None:
    h = Histograms()
    for seconds in (0.1, 0.2, 0.3):
        h.observe_ttft("a", seconds)
        h.observe_e2e("a", 10 * seconds)
        h.observe_gap("b", seconds / 100)
    h.observe_queue_wait("b", 1.5)
    h.observe_ttft("b", None)  # a choice that ended before its first token
    snap = {"server": {"resident_models": [{"model": m, "kind": "chat"} for m in ("a", "b", "idle")]}}
    values = samples(h.render(snap).decode())
    count = {
        (name, model): values[(f"{name}_count", (("model", model),))]
        for name in (
            "gmlx_ttft_seconds",
            "gmlx_e2e_request_latency_seconds",
            "gmlx_inter_token_latency_seconds",
            "gmlx_queue_wait_seconds",
        )
        for model in ("a", "b", "idle")
    }
    assert count[("gmlx_ttft_seconds", "a")] == 3 and count[("gmlx_ttft_seconds", "b")] == 0
    assert count[("gmlx_e2e_request_latency_seconds", "a")] == 3
    assert count[("gmlx_inter_token_latency_seconds", "b")] == 3 and count[("gmlx_queue_wait_seconds", "b")] == 1
    assert all(n == 0 for (_, model), n in count.items() if model == "idle")  # declared at 0 before any request
    assert values[("gmlx_e2e_request_latency_seconds_sum", (("model", "a"),))] == pytest.approx(6.0)
    latency = h.latency()
    assert latency["window_s"] == WINDOW_S
    ttft = latency["ttft_seconds"]
    assert ttft["count"] == 3 and ttft["p50"] == pytest.approx(0.2, rel=0.01)
    assert ttft["p95"] == ttft["p99"] == pytest.approx(0.3, rel=0.01)
    assert latency["e2e_seconds"]["p50"] == pytest.approx(2.0, rel=0.01)
    assert latency["inter_token_seconds"]["count"] == 3 and latency["queue_wait_seconds"]["count"] == 1


def test_the_snapshot_reports_a_served_request(live_server: LiveServer) -> None:
    with live_server.client() as c:
        assert c.get("/v1/metrics").json()["server"]["latency"]["ttft_seconds"] == {
            "count": 0,
            "p50": None,
            "p95": None,
            "p99": None,
        }
        done = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 6, "temperature": 0}).json()
        latency = c.get("/v1/metrics").json()["server"]["latency"]
    assert latency["window_s"] == 300
    assert latency["ttft_seconds"]["count"] == latency["queue_wait_seconds"]["count"] == 1
    assert latency["inter_token_seconds"]["count"] == done["usage"]["completion_tokens"] - 1
    ttft = latency["ttft_seconds"]
    assert 0 < ttft["p50"] == ttft["p95"] == ttft["p99"] < 10
