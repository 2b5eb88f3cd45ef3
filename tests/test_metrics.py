"""/v1/metrics (JSON and Prometheus) and /system on a live server."""

from __future__ import annotations

import asyncio
import gc
import logging
import re
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import pytest
from conftest import LiveServer
from prometheus_client.parser import text_string_to_metric_families
from tiny_models import write_model

from gmlx import platform
from gmlx.engine.engine import Request
from gmlx.server import metrics
from gmlx.server.memory_governor import MemoryReading
from gmlx.server.metrics import snapshot

SECTIONS = [
    "concurrency",
    "queue",
    "connections",
    "governor",
    "memory",
    "capacity",
    "rates",
    "totals",
    "embeddings",
    "kv_cache",
    "prompt_cache",
    "requests",
    "resident_models",
    "latency",
]


def prometheus_values(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


Leaf = tuple[str, ...]


def numeric_leaves(node: Any, path: Leaf = ()) -> dict[Leaf, float | None]:
    """Every number and null under `node`, by its path of keys and list indices (bools and text left out)."""
    if isinstance(node, dict):
        return {k: v for key, child in node.items() for k, v in numeric_leaves(child, (*path, str(key))).items()}
    if isinstance(node, list):
        return {k: v for i, child in enumerate(node) for k, v in numeric_leaves(child, (*path, str(i))).items()}
    if node is None or (isinstance(node, (int, float)) and not isinstance(node, bool)):
        return {path: node}
    return {}


MIRRORED = (
    "concurrency",
    "queue",
    "connections",
    "governor",
    "memory",
    "rates",
    "resident_models",
    "capacity",
    "kv_cache",
)
ACTION_SAMPLES = {
    "count": "gmlx_governor_actions_total",
    "bytes_freed": "gmlx_governor_freed_bytes_total",
    "last_at": "gmlx_governor_action_last_timestamp_seconds",
}
CONFIG = "gmlx_config_info"  # configuration: one series, a label per value
RATES = {
    "decode_tok_s": "gmlx_rates_decode_tokens_per_second",
    "decode_streams": "gmlx_rates_decode_streams",
    "prefill_tok_s_recent": "gmlx_rates_prefill_recent_tokens_per_second",
    "decode_tok_s_recent": "gmlx_rates_decode_recent_tokens_per_second",
    "decode_tok_s_lifetime": "gmlx_rates_decode_lifetime_tokens_per_second",
    "speculative_accept_rate": "gmlx_rates_speculative_accept_ratio",
}
KV_CACHE = {"table_usage": "table_usage_ratio", "governor_fraction": "governor_ratio", "usage": "usage_ratio"}
# Null in the JSON, 0 in Prometheus: an action never taken, and no decode step in the rate's window.
ZERO_WHEN_NULL = {"last_at", "decode_tok_s"}

Target = tuple[str, tuple, str | None]  # a sample's name and labels, and the label holding the value (None: its value)


MODEL = {
    "loaded_at": "gmlx_model_loaded_timestamp_seconds",
    "last_used_at": "gmlx_model_last_used_timestamp_seconds",
    "decode_tok_s": "gmlx_model_decode_tokens_per_second",
}


def sample_of(path: Leaf, s: dict) -> Target:
    """The Prometheus sample a snapshot field is rendered as: the exporter's names, spelled out."""
    section, *rest = path
    match section, rest:
        case "queue", ["cap"]:  # the same as concurrency's
            return "gmlx_concurrency_queue_cap", (), None
        case "queue", ["eta_s"]:
            return "gmlx_queue_eta_seconds", (), None
        case "queue", ["rejections_by_reason", reason]:
            return "gmlx_queue_rejections_total", (("reason", reason),), None
        case "queue", ["timeouts"]:
            return "gmlx_queue_timeouts_total", (), None
        case "connections", ["cap"]:
            return CONFIG, (), "connections_cap"
        case "connections", ["open"]:
            return "gmlx_connections_open", (), None
        case "connections", [counter]:
            return f"gmlx_connections_{counter}_total", (), None
        case "governor", ["thresholds", "hysteresis"]:
            return CONFIG, (), "governor_hysteresis"
        case "governor", ["thresholds", band]:
            return CONFIG, (), f"governor_threshold_{band}"
        case "governor", ["interval_s"]:
            return CONFIG, (), "governor_interval_seconds"
        case "governor", ["fraction"]:
            return "gmlx_governor_used_ratio", (), None
        case "governor", ["actions", action, field]:
            return ACTION_SAMPLES[field], (("action", action),), None
        case "kv_cache", [("block_tokens" | "blocks") as key]:
            return CONFIG, (), f"prompt_cache_{key}"
        case "kv_cache", [key]:
            return f"gmlx_kv_cache_{KV_CACHE.get(key, key)}", (), None
        case (("concurrency" | "queue" | "governor" | "memory"), [key]):
            return f"gmlx_{section}_{key}", (), None
        case "rates", [key]:
            return RATES[key], (), None
        case "resident_models", [i, "capacity", *keys]:  # each model's table, by model
            return capacity_sample(keys, s["resident_models"][int(i)]["model"])
        case "resident_models", [i, ("decode_batch" | "context_length") as key]:
            return "gmlx_model_info", (("model", s["resident_models"][int(i)]["model"]),), key
        case "resident_models", [i, key]:
            return MODEL.get(key, f"gmlx_model_{key}"), (("model", s["resident_models"][int(i)]["model"]),), None
        case "capacity", keys:  # the preloaded model's table, the first resident model's
            return capacity_sample(keys, s["resident_models"][0]["model"])
    raise AssertionError(f"no Prometheus sample for {path}")


def capacity_sample(keys: list[str], model: str) -> Target:
    match keys:
        case ["widths", width]:
            return "gmlx_capacity_max_context_tokens", (("model", model), ("width", width)), None
        case ["depths", depth]:
            return "gmlx_capacity_max_width", (("depth", depth), ("model", model)), None
        case ["context_length"]:
            return "gmlx_capacity_context_length_tokens", (("model", model),), None
        case ["decode_batch"]:  # the model's own
            return "gmlx_model_info", (("model", model),), "decode_batch"
        case ["prefill_step"]:
            return CONFIG, (), "prefill_step"
        case ["kv_format", key]:
            return CONFIG, (), f"kv_{key}"
        case ["budget", "ceiling"]:
            return "gmlx_capacity_budget_ceiling_ratio", (("model", model),), None
        case ["warmup", key]:
            return f"gmlx_capacity_warmup_{key.replace('tok_s', 'tokens_per_second')}", (("model", model),), None
    return "gmlx_capacity_" + "_".join(keys), (("model", model),), None


def info_labels(text: str, name: str, selector: tuple) -> dict[str, str]:
    """The labels of the one `name` sample that carries the labels `selector`."""
    [labels] = [
        s.labels
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and set(selector) <= set(s.labels.items())
    ]
    return labels


def assert_prometheus_matches(s: dict, text: str) -> None:
    """Every numeric field of the mirrored sections is its sample, equal, or its label; a null one
    has no sample (an empty label), but for the few that read 0."""
    values = prometheus_values(text)
    leaves = numeric_leaves({k: s[k] for k in MIRRORED})
    assert len(leaves) > 40  # the walk found the sections' fields, not an empty snapshot
    for path, value in leaves.items():
        name, labels, label = sample_of(path, s)
        if path == ("queue", "rejections"):  # the total over the counter's reasons
            assert value == sum(v for (n, _), v in values.items() if n == "gmlx_queue_rejections_total")
        elif label is not None:
            assert info_labels(text, name, labels)[label] == ("" if value is None else str(value)), path
        elif value is None and path[-1] in ZERO_WHEN_NULL:
            assert values[(name, labels)] == 0, path
        elif value is None:
            assert (name, labels) not in values, path
        else:
            assert values[(name, labels)] == value, path


def test_snapshot_sections_and_prometheus_agree(live_server: LiveServer) -> None:
    live_server.wait_until(lambda: live_server.state.band is not None)  # the governor's first sample
    with live_server.client() as c:
        c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 6, "temperature": 0})
        snap = c.get("/v1/metrics").json()
        assert list(snap["server"]) == SECTIONS
        # Rendered from one snapshot: every field equals the sample it became.
        one = snapshot(live_server.state)
        text = live_server.state.histograms.render(one).decode()
        route = c.get("/v1/metrics", params={"format": "prometheus"})
    s = one["server"]
    assert route.headers["content-type"].startswith("text/plain")
    prometheus_values(route.text)  # the route's own text parses too
    assert_prometheus_matches(s, text)
    values = prometheus_values(text)
    assert s["concurrency"]["decode_batch"] == 4 and s["capacity"]["warmup"]["kv_bytes_measured"] > 0
    # Headroom is what the governor sees left: where MLX shares the host's memory (not CUDA's), the
    # whole resident size counts, not MLX's buffers alone.
    mem, budget = s["memory"], live_server.model.table().budget
    held = mlx = mem["active_bytes"] + mem["cache_bytes"]
    if platform.backend() != "cuda":
        assert mem["process_rss_bytes"] > mlx  # the interpreter, the libraries, the tokenizer
        held = mem["process_rss_bytes"]
    assert mem["headroom_bytes"] == budget.total_bytes - budget.reserve_bytes - held
    assert values[("gmlx_requests_finished_total", (("reason", "length"),))] == 1
    assert values[("gmlx_requests_finished_total", (("reason", "stop"),))] == 0  # every reason from the start
    assert values[("gmlx_generated_tokens_total", ())] == s["totals"]["generated_tokens"] == 6
    assert values[("gmlx_ttft_seconds_count", (("model", "tiny-llama"),))] == 1
    assert values[("gmlx_e2e_request_latency_seconds_count", (("model", "tiny-llama"),))] == 1
    assert values[("gmlx_queue_wait_seconds_count", (("model", "tiny-llama"),))] == 1
    assert len(s["requests"]) == 0
    assert all(v == 0 for (name, _), v in values.items() if name == "gmlx_requests")
    assert values[("gmlx_governor_band", (("band", s["governor"]["band"]),))] == 1


def test_inter_token_latency_observes_every_gap(live_server: LiveServer) -> None:
    with live_server.client() as c:
        start = time.perf_counter()
        done = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 9, "temperature": 0}).json()
        elapsed = time.perf_counter() - start
        values = prometheus_values(c.get("/v1/metrics", params={"format": "prometheus"}).text)
    tokens = done["usage"]["completion_tokens"]
    assert tokens > 2
    model = (("model", "tiny-llama"),)
    assert values[("gmlx_inter_token_latency_seconds_count", model)] == tokens - 1  # one per gap, not per request
    assert 0 < values[("gmlx_inter_token_latency_seconds_sum", model)] < elapsed


def test_a_failing_probe_nulls_its_section_only(live_server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(_: object) -> dict:
        raise RuntimeError("probe down")

    monkeypatch.setitem(metrics.SECTIONS, "memory", (broken, metrics.SECTIONS["memory"][1]))
    with live_server.client() as c:
        s = c.get("/v1/metrics").json()["server"]
        assert s["memory"]["active_bytes"] is None and s["memory"]["cache_bytes"] is None
        assert s["concurrency"]["decode_batch"] == 4
        assert c.get("/v1/metrics", params={"format": "prometheus"}).status_code == 200


# Figures of configuration, of the machine, or measured once at start: they do not move with load.
FIXED = [
    ("concurrency", "decode_batch"),
    ("concurrency", "queue_cap"),
    ("queue", "cap"),
    ("connections", "cap"),
    ("governor", "thresholds"),
    ("governor", "interval_s"),
    ("governor", "limit_bytes"),
    ("memory", "budget_bytes"),
    ("memory", "system_total_bytes"),
    ("capacity",),  # the table from the budget, and the warm-up measured at start
    ("prompt_cache", "max_bytes"),
    ("prompt_cache", "block_tokens"),
    ("kv_cache", "budget_bytes"),
    ("kv_cache", "block_tokens"),
    ("kv_cache", "blocks"),
    ("resident_models", "0", "decode_batch"),
    ("resident_models", "0", "weight_bytes"),
    ("resident_models", "0", "context_length"),
    ("resident_models", "0", "capacity"),  # the model's table, as `capacity` above
    ("resident_models", "0", "load_seconds"),
    ("resident_models", "0", "loaded_at"),
    ("latency", "window_s"),
]
# Counts of what this load does not cause, each driven where named.
NOT_DRIVEN = [
    ("governor", "actions", "stop_stream"),  # red: test_governor's live test
    ("governor", "actions", "unload_model"),  # orange beside an idle model: test_residency
    ("prompt_cache", "hits_by_tier", "block"),
    ("prompt_cache", "hits_by_tier", "ckpt"),
    ("prompt_cache", "hits_by_tier", "anchor"),  # test_prompt_cache
    ("rates", "speculative_accept_rate"),  # null without a drafter: test_speculative_engine
    ("embeddings",),  # test_embeddings_metrics
    ("connections", "refused"),
    ("connections", "evicted"),
    ("connections", "header_timeouts"),
    ("connections", "body_timeouts"),
]  # slow and surplus clients: test_connections


def test_every_numeric_field_follows_what_it_measures(tmp_path: Path) -> None:
    """Snapshots idle, under load, after requests were served, and after the governor released
    memory: every numeric field but the fixed ones takes more than one value."""
    # A context long enough that the first request is still decoding when the busy snapshot is
    # taken (the tiny model decodes about 1,000 tokens a second here).
    model = write_model(tmp_path / "long.gguf", "llama", context=2048)
    server = LiveServer(model, decode_batch=1, queue_size=1, queue_timeout=0.3, governor_interval_s=0.02)
    state, governor = server.state, server.state.governor
    real_probe, pressure = governor.probe, {"fraction": None}

    def probe() -> MemoryReading:  # the real reading, or a made-up fraction of the budget
        if pressure["fraction"] is None:
            return real_probe()
        limit = state.default.table().budget.total_bytes - state.default.table().budget.reserve_bytes
        return MemoryReading(int(pressure["fraction"] * limit), 0, 0, limit)

    governor.probe = probe
    snaps: dict[str, dict] = {}
    # A prompt longer than the start-up warm-up's, so its prefill raises the memory peak.
    body = {"prompt": "the sea " * 60, "max_tokens": 1500, "temperature": 0}
    with server:
        # MLX's peak is the process's: earlier tests' arrays, freed since, may still hold it up.
        gc.collect()
        mx.reset_peak_memory()
        snaps["idle"] = snapshot(state)

        async def load() -> None:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as ac:
                first = asyncio.create_task(ac.post("/v1/completions", json=body))
                while server.engine.decoding < 1:
                    await asyncio.sleep(0.005)
                queued = asyncio.create_task(ac.post("/v1/completions", json=body))
                while server.model.gate.waiting < 1:
                    await asyncio.sleep(0.005)
                full = await ac.post("/v1/completions", json=body)  # rejected: queue full
                assert full.status_code == 503
                await asyncio.sleep(0.05)
                snaps["busy"] = snapshot(state)
                await asyncio.sleep(0.05)
                snaps["busy_later"] = snapshot(state)
                assert (await first).status_code == 200
                assert (await queued).status_code == 503  # waited past the queue's timeout
                again = await ac.post("/v1/completions", json={**body, "max_tokens": 4})  # a prompt cache hit
                assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

        asyncio.run(load())
        snaps["served"] = snapshot(state)
        pressure["fraction"] = 0.93  # orange: admission held, the prompt cache evicted, MLX's cache released
        server.wait_until(lambda: governor.snapshot()["actions"]["evict_prompt_cache"]["count"] >= 1)
        pressure["fraction"] = 0.3  # back to green, through yellow
        server.wait_until(lambda: state.band == "green")
        snaps["after"] = snapshot(state)
    for snap in snaps.values():  # and each is what Prometheus says at that moment
        assert_prometheus_matches(snap["server"], state.histograms.render(snap).decode())

    walks = {
        name: numeric_leaves({k: v for k, v in snap["server"].items() if k != "requests"})
        for name, snap in snaps.items()
    }
    paths = set().union(*walks.values())
    allowed = FIXED + NOT_DRIVEN
    unchanged = sorted(
        p
        for p in paths
        if not any(p[: len(a)] == a for a in allowed) and len({w.get(p, "absent") for w in walks.values()}) == 1
    )
    assert not unchanged, f"fields that never changed: {unchanged}"
    assert len(paths) > 80  # the walk saw the whole snapshot

    # Requests come and go, so their rows are compared to themselves: queued first, then running.
    busy, later = snaps["busy"]["server"]["requests"], snaps["busy_later"]["server"]["requests"]
    assert [r["state"] for r in busy] == [r["state"] for r in later] == ["queued", "decode"]
    assert busy[1]["generated"] < later[1]["generated"] and busy[1]["ttft_s"] is not None
    assert busy[0]["elapsed_s"] < later[0]["elapsed_s"] and busy[1]["elapsed_s"] < later[1]["elapsed_s"]
    assert snaps["busy"]["server"]["queue"]["last_reject_reason"] == "queue_full"
    assert snaps["after"]["server"]["queue"]["last_reject_reason"] == "queue_timeout"


def test_system_is_open_and_has_no_content(tiny_models: dict[str, Path]) -> None:
    with LiveServer(tiny_models["llama"], api_key="k") as server, server.client() as c:
        assert c.get("/v1/metrics").status_code == 401
        assert c.get("/v1/metrics", headers={"Authorization": "Bearer k"}).status_code == 200
        info = c.get("/system").json()
    assert info["state"] == "ready" and info["model"] == "tiny-llama" and info["version"]
    assert info["gpu"] is None  # no NVIDIA driver on these machines: expected, not an error
    assert info["compute_type"].startswith("cpu/float32") and info["activity"] == {"active": 0, "waiting": 0}


def test_poll_routes_never_wait_on_the_engine(live_server: LiveServer) -> None:
    """With the engine thread stuck in a request's callback, every poll route still answers at once."""
    stuck, release, returned = threading.Event(), threading.Event(), threading.Event()

    def hold(_: object) -> None:  # runs on the engine thread, which stays here until released
        stuck.set()
        release.wait(30)
        returned.set()

    live_server.engine.submit(Request("stuck", [1], 0, emit=hold))  # max_tokens 0: failed at once, in emit
    assert stuck.wait(10)
    try:
        with httpx.Client(base_url=live_server.url, timeout=0.5) as c:
            for route in ("/health", "/health?ready=1", "/v1/metrics", "/v1/metrics?format=prometheus", "/system"):
                start = time.perf_counter()
                assert c.get(route).status_code == 200, route
                assert time.perf_counter() - start < 0.5, route
        assert live_server.engine.alive and not returned.is_set()  # still stuck the whole time
    finally:
        release.set()


def test_ttft_and_elapsed_count_the_queue_wait(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A request that waited at the gate: its row's elapsed runs on from arrival (no jump back when
    it leaves the queue), its TTFT and log line include the wait and show it as queued; the
    engine's prefill rate leaves it out."""
    caplog.set_level(logging.INFO, logger="gmlx.server")
    wait = 0.6
    with LiveServer(write_model(tmp_path / "long.gguf", "llama", context=4096), decode_batch=1) as server:
        eos = {str(t): -100 for t in server.engine.loaded.tokenizer.eos_token_ids}
        holder = {"prompt": "hello", "max_tokens": 4000, "stream": True, "logit_bias": eos}
        answers: list[httpx.Response] = []
        with server.client() as c, c.stream("POST", "/v1/completions", json=holder) as s:
            lines = s.iter_lines()  # kept: a dropped iterator closes the stream
            next(lines)  # it holds the one slot
            waiter = threading.Thread(
                target=lambda: answers.append(
                    server.client().post("/v1/completions", json={"prompt": "hello world", "max_tokens": 2})
                )
            )
            waiter.start()
            server.wait_until(lambda: len(server.model.queued) == 1)
            time.sleep(wait)
            queued_row = next(r for r in snapshot(server.state)["server"]["requests"] if r["state"] == "queued")
            assert queued_row["elapsed_s"] >= wait and queued_row["queued_s"] >= wait
        waiter.join(30)  # the holder's client left: its slot went to the waiter
        assert answers[0].status_code == 200
        [line] = [
            r.getMessage() for r in caplog.records if r.getMessage().startswith(answers[0].json()["id"] + " prompt=")
        ]
        queued, ttft = (float(re.search(rf"{k}=([\d.]+)s", line)[1]) for k in ("queued", "ttft"))
        assert wait <= queued <= ttft, line
        [ttft_sum] = [
            x.value
            for x in server.state.histograms.ttft.collect()[0].samples
            if x.name.endswith("_sum") and x.labels["model"] == server.model_id
        ]
        assert ttft_sum >= queued  # Prometheus observes it from arrival too
        _, prefill_tok_s = server.engine.stats.recent_requests[-1]
        prompt_tokens = answers[0].json()["usage"]["prompt_tokens"]
        assert prefill_tok_s > 4 * prompt_tokens / queued  # the wait diluted no prefill rate
