"""GET /metrics as the routers read it: the Gateway API Inference Extension's endpoint picker scrapes
Prometheus text, takes one series per name, and calls a server saturated from a KV usage of 0.8."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest
from conftest import LiveServer, MiB, offline_table
from prometheus_client.parser import text_string_to_metric_families
from tiny_models import write_model

from gmlx.capacity.budget import PROMPT_CACHE_SHARE
from gmlx.server.memory_governor import MemoryReading
from gmlx.server.metrics import ROUTER_SATURATION, kv_usage

VLLM = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")
KEY = {"Authorization": "Bearer scrape"}


def scrape(c: httpx.Client) -> dict[str, list]:
    """The picker's read: every family by name (a name twice would be a second family), its samples."""
    r = c.get("/metrics", headers=KEY)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families: dict[str, list] = {}
    for family in text_string_to_metric_families(r.text):
        assert family.name not in families, f"{family.name} appears twice"
        families[family.name] = family.samples
    return families


def picked(c: httpx.Client) -> dict[str, float]:
    """The three figures the picker reads by default, each from its one series."""
    families = scrape(c)
    out = {}
    for name in VLLM:
        [sample] = families[name]  # one series per name: the picker does not sum
        out[name.removeprefix("vllm:")] = sample.value
    assert 0 <= out["kv_cache_usage_perc"] <= 1
    return out


def test_the_picker_reads_one_series_per_name(tiny_models: dict[str, Path]) -> None:
    with LiveServer(tiny_models["llama"], api_key="scrape") as server, server.client() as c:
        assert c.get("/metrics").status_code == 401  # under the key, like every route but /health and /system
        families = scrape(c)
        for name in VLLM:
            [sample] = families[name]
            assert sample.labels == {"model_name": server.model_id}
        [info] = families["vllm:cache_config_info"]
        assert info.value == 1
        cache = server.engine.prompt_cache
        assert int(info.labels["block_size"]) == cache.block_tokens
        assert int(info.labels["num_gpu_blocks"]) > 0
        idle = picked(c)  # its KV usage follows the governor's reading of this machine's memory too
        assert idle["num_requests_waiting"] == idle["num_requests_running"] == 0
        # The same snapshot as /v1/metrics?format=prometheus, plus the vLLM series.
        own = c.get("/v1/metrics", params={"format": "prometheus"}, headers=KEY).text
        gmlx_names = {f.name for f in text_string_to_metric_families(own)}
        assert set(families) - gmlx_names == {*VLLM, "vllm:cache_config_info"}
        assert "gmlx_queue_wait_seconds" in gmlx_names
        assert "/metrics" in c.get("/openapi.json", headers=KEY).json()["paths"]


@contextmanager
def holding(server: LiveServer, prompt: str) -> Iterator[None]:
    """A streamed request that keeps its slot while open (EOS banned, tens of seconds of tokens); closed on exit."""
    eos = {str(t): -100 for t in server.engine.loaded.tokenizer.eos_token_ids}
    body = {"prompt": prompt, "max_tokens": 30_000, "stream": True, "logit_bias": eos, "temperature": 0}
    with server.client() as c, c.stream("POST", "/v1/completions", json=body) as s:
        lines = s.iter_lines()
        next(lines)  # its first chunk: it holds a slot and decodes
        yield


def memory_for_kv(path: Path, tokens: int, decode_batch: int) -> int:
    """A --memory whose table leaves room for about `tokens` tokens of KV (as conftest's small_memory_model)."""
    probe = offline_table(path, 10**12, decode_batch)
    b = probe.budget
    return int(
        (b.weight_bytes + b.prefill_bytes + 512 * MiB + tokens * probe.stream_bytes(256) // 256)
        / (1 - 1 / PROMPT_CACHE_SHARE)
        / 0.999
    )


def test_waiting_running_and_kv_usage_move_with_load(tmp_path: Path) -> None:
    """Two streams hold both slots, one waits, a fourth is refused: the picker sees 2 running and 1
    waiting, KV usage rising with each stream, then all back to 0; the queue wait is observed once
    per request that passed the gate."""
    path = write_model(tmp_path / "long.gguf", "llama", context=32768)
    memory = memory_for_kv(path, 64_000, 2)  # each stream is a share the picker sees, never the whole
    with LiveServer(path, memory=memory, governor=False, decode_batch=2, queue_size=1) as server, server.client() as c:
        idle = picked(c)
        assert idle == {"num_requests_waiting": 0, "num_requests_running": 0, "kv_cache_usage_perc": 0}
        answers: list[httpx.Response] = []
        with ExitStack() as stack:
            stack.enter_context(holding(server, "the sea " * 100))
            one = picked(c)
            stack.enter_context(holding(server, "the sky " * 100))
            two = picked(c)
            waiter = threading.Thread(
                target=lambda: answers.append(
                    server.client().post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
                )
            )
            waiter.start()
            server.wait_until(lambda: server.model.gate.waiting == 1)
            time.sleep(0.2)
            refused = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            queued = picked(c)
        waiter.join(30)
        server.wait_until(lambda: server.engine.in_flight == 0 and server.model.gate.running == 0)
        after = picked(c)
        families = scrape(c)
    assert refused.status_code == 503 and answers[0].status_code == 200
    assert one["num_requests_running"] == 1 and two["num_requests_running"] == 2
    assert queued["num_requests_running"] == 2 and queued["num_requests_waiting"] == 1
    assert 0 < one["kv_cache_usage_perc"] < two["kv_cache_usage_perc"] <= queued["kv_cache_usage_perc"] <= 1
    assert after == idle
    wait = {s.name: s.value for s in families["gmlx_queue_wait_seconds"] if s.labels.get("model") == server.model_id}
    assert wait["gmlx_queue_wait_seconds_count"] == 3  # two holders and the waiter; not the refused one
    assert wait["gmlx_queue_wait_seconds_sum"] >= 0.2  # the waiter's time in the queue


def test_usage_reads_saturated_before_the_band_reaches_orange(live_server: LiveServer) -> None:
    """The governor's fraction is scaled so that yellow's threshold reads the picker's saturation: the
    picker sheds at yellow, a band before the server itself holds admission at orange."""
    state, governor = live_server.state, live_server.state.governor
    pressure = {"fraction": 0.5}

    def probe() -> MemoryReading:
        budget = live_server.model.table().budget
        limit = budget.total_bytes - budget.reserve_bytes
        return MemoryReading(int(pressure["fraction"] * limit), 0, 0, limit)

    governor.probe = probe
    seen = {}
    with live_server.client() as c:
        for fraction, band in ((0.5, "green"), (0.82, "yellow"), (0.93, "orange")):
            pressure["fraction"] = fraction
            live_server.wait_until(lambda b=band: state.band == b)
            seen[band] = picked(c)["kv_cache_usage_perc"]
        ready = c.get("/health", params={"ready": 1})
    assert seen["green"] == pytest.approx(0.5 * ROUTER_SATURATION / 0.8, abs=1e-3)
    assert ROUTER_SATURATION <= seen["yellow"] < 1
    assert seen["orange"] == 1 and ready.status_code == 503 and ready.json()["reason"] == "pressure"


def test_kv_usage_folds_the_table_and_the_governor() -> None:
    assert kv_usage(0.3, 0.2, "green", 0.8) == 0.3  # the table's share when it is the larger
    assert kv_usage(0.1, 0.8, "yellow", 0.8) == 0.8  # yellow's threshold reads the picker's saturation
    assert kv_usage(0.1, 0.6, "green", 0.75) == 0.64  # another yellow threshold scales the same way
    assert kv_usage(1.4, None, None, 0.8) == 1  # slots overcommitted past the table: clamped to 1
    assert kv_usage(0.0, 0.91, "orange", 0.8) == kv_usage(0.0, 0.5, "red", 0.8) == 1
    assert kv_usage(None, None, None, 0.8, ready=False) == 1  # loading: nothing to send it
