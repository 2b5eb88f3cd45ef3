"""Prometheus text for /v1/metrics?format=prometheus and /metrics, rendered by prometheus_client from
the JSON snapshot itself (so both answer the same at the same moment), plus latency histograms.
Every numeric field of the concurrency, queue, connections, memory, governor, capacity, kv_cache,
rates and resident_models sections becomes a sample; counts since start are counters (`_total`).
/metrics adds the vLLM series that routers scrape (the Gateway API Inference Extension's endpoint
picker, vLLM's production-stack router, llmtop): one series per name, as they read it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

BANDS = ("green", "yellow", "orange", "red")
_TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1, 2)
_QUEUE_BUCKETS = (0.005, 0.025, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _Snapshot:
    """A collector over whatever snapshot it was last given."""

    def __init__(self) -> None:
        self.snap: dict[str, Any] = {}
        self.router = False  # /metrics: add the vLLM series

    def collect(self) -> Iterator[Metric]:
        s = self.snap.get("server", {})
        models = s.get("resident_models") or []
        model = models[0]["model"] if models else ""
        if self.router:
            yield from _vllm(s, model)
        for section in ("concurrency", "queue", "memory", "kv_cache"):
            yield from _gauges(f"gmlx_{section}", s.get(section) or {}, skip=("rejections", "timeouts"))
        queue = s.get("queue") or {}
        rejected = CounterMetricFamily("gmlx_queue_rejections", "Requests turned away at the gate", labels=["reason"])
        for reason, n in (queue.get("rejections_by_reason") or {}).items():
            rejected.add_metric([reason], n)
        yield rejected
        if queue.get("timeouts") is not None:
            yield CounterMetricFamily(
                "gmlx_queue_timeouts", "Requests that waited in the queue past the timeout", value=queue["timeouts"]
            )
        conns = s.get("connections") or {}
        yield from _gauges("gmlx_connections", {k: conns.get(k) for k in ("open", "cap")})
        for key, what in (
            ("refused", "Connections refused at the cap"),
            ("evicted", "Idle connections closed at the cap to admit a new one"),
            ("header_timeouts", "Connections closed for sending headers too slowly"),
            ("body_timeouts", "Requests refused for sending their body too slowly"),
        ):
            if conns.get(key) is not None:
                yield CounterMetricFamily(f"gmlx_connections_{key}", what, value=conns[key])
        yield from _governor(s.get("governor") or {})
        yield from _gauges("gmlx_rates", s.get("rates") or {}, labels={"model": model})
        yield GaugeMetricFamily("gmlx_requests", "Requests queued or running", value=len(s.get("requests") or []))
        totals = s.get("totals") or {}
        finished = CounterMetricFamily("gmlx_requests_finished", "Requests finished", labels=["model", "reason"])
        for reason, n in (totals.get("requests_finished") or {}).items():
            finished.add_metric([model, reason], n)
        yield finished
        for name in ("prompt_tokens", "generated_tokens"):
            if totals.get(name) is not None:
                c = CounterMetricFamily(f"gmlx_{name}", f"{name.replace('_', ' ').capitalize()}", labels=["model"])
                c.add_metric([model], totals[name])
                yield c
        yield from _prompt_cache(s.get("prompt_cache") or {}, model)
        for m in models:
            for key in ("in_flight", "weight_bytes", "decode_batch", "context_length"):
                g = GaugeMetricFamily(
                    f"gmlx_model_{key}",
                    f"Resident model {key.replace('_', ' ')}",
                    labels=["model", "kind", "weight_mode"],
                )
                g.add_metric([m["model"], m["kind"], m["weight_mode"]], m[key])
                yield g


def _gauges(
    prefix: str, section: dict, skip: tuple[str, ...] = (), labels: dict[str, str] | None = None
) -> Iterator[Metric]:
    """One gauge per numeric field; null fields are left out rather than reported as 0."""
    labels = labels or {}
    for key, value in section.items():
        if key in skip or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        g = GaugeMetricFamily(f"{prefix}_{key}", f"{prefix.removeprefix('gmlx_')} {key}", labels=list(labels))
        g.add_metric(list(labels.values()), value)
        yield g


def _vllm(s: dict, model: str) -> Iterator[Metric]:
    """The series a router reads by vLLM's names, with their meaning (docs/ARCHITECTURE.md, "Behind a
    router"): waiting counts queued requests only; running, the slots held (a request with n choices
    holds n, as vLLM counts sequences); KV usage is kv_cache.usage."""
    conc, kv = s.get("concurrency") or {}, s.get("kv_cache") or {}
    for name, what, value in (
        ("num_requests_waiting", "Requests waiting in the admission queue", conc.get("waiting")),
        ("num_requests_running", "Requests holding a decode slot", conc.get("in_flight")),
        (
            "kv_cache_usage_perc",
            "KV-cache usage, 0-1: the capacity table's share, the governor's band",
            kv.get("usage"),
        ),
    ):
        if value is not None:
            g = GaugeMetricFamily(f"vllm:{name}", what, labels=["model_name"])
            g.add_metric([model], value)
            yield g
    if kv.get("blocks") is not None:
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "The prompt cache's block size and block count",
            labels=["block_size", "num_gpu_blocks"],
        )
        info.add_metric([str(kv["block_tokens"]), str(kv["blocks"])], 1.0)
        yield info


def _prompt_cache(pc: dict, model: str) -> Iterator[Metric]:
    if not pc.get("enabled"):
        return
    hits = CounterMetricFamily(
        "gmlx_prompt_cache_hits", "Requests whose prefix the prompt cache held, by tier", labels=["model", "tier"]
    )
    for tier, n in (pc.get("hits_by_tier") or {}).items():
        hits.add_metric([model, tier], n)
    yield hits
    for key, what in (
        ("misses", "Requests the prompt cache had nothing for"),
        ("reused_tokens", "Prompt tokens served from the prompt cache instead of prefilled"),
        ("stored_bytes", "Bytes of KV stored into the prompt cache"),
        ("evicted_bytes", "Bytes of KV evicted from the prompt cache (LRU or governor)"),
    ):
        if pc.get(key) is not None:
            c = CounterMetricFamily(f"gmlx_prompt_cache_{key}", what, labels=["model"])
            c.add_metric([model], pc[key])
            yield c
    for key, what in (
        ("bytes", "Bytes the prompt cache holds now"),
        ("max_bytes", "The prompt cache's bound"),
        ("entries", "Entries in the prompt cache"),
    ):
        if pc.get(key) is not None:
            g = GaugeMetricFamily(f"gmlx_prompt_cache_{key}", what, labels=["model"])
            g.add_metric([model], pc[key])
            yield g


def _governor(gov: dict) -> Iterator[Metric]:
    band = GaugeMetricFamily("gmlx_governor_band", "1 for the memory governor's current band", labels=["band"])
    for name in BANDS:
        band.add_metric([name], 1.0 if gov.get("band") == name else 0.0)
    yield band
    yield GaugeMetricFamily("gmlx_governor_enabled", "1 when the governor runs", value=float(bool(gov.get("enabled"))))
    yield from _gauges("gmlx_governor", gov)  # fraction, used and limit bytes, sampling interval
    thresholds = dict(gov.get("thresholds") or {})
    if "hysteresis" in thresholds:
        yield GaugeMetricFamily(
            "gmlx_governor_hysteresis",
            "How far below its threshold a band falls back",
            value=thresholds.pop("hysteresis"),
        )
    threshold = GaugeMetricFamily(
        "gmlx_governor_threshold", "Fraction of the budget at which a band starts", labels=["band"]
    )
    for name, value in thresholds.items():
        threshold.add_metric([name], value)
    yield threshold
    actions = gov.get("actions") or {}
    count = CounterMetricFamily("gmlx_governor_actions", "Times the governor took each action", labels=["action"])
    freed = CounterMetricFamily("gmlx_governor_freed_bytes", "Bytes each releasing action freed", labels=["action"])
    last = GaugeMetricFamily(
        "gmlx_governor_action_last_at_seconds", "Unix time each action was last taken", labels=["action"]
    )
    for name, a in actions.items():
        count.add_metric([name], a["count"])
        if "bytes_freed" in a:
            freed.add_metric([name], a["bytes_freed"])
        if a["last_at"] is not None:
            last.add_metric([name], a["last_at"])
    yield from (count, freed, last)


def _capacity(cap: dict | None) -> Iterator[Metric]:
    """The table by width and depth as labelled series; every other number under its own path."""
    if not cap:
        return
    ctx = GaugeMetricFamily("gmlx_capacity_max_ctx", "Max context per stream at a width", labels=["width"])
    for width, tokens in cap["widths"].items():
        ctx.add_metric([width], tokens)
    yield ctx
    wid = GaugeMetricFamily("gmlx_capacity_max_width", "Max streams at a depth", labels=["depth"])
    for depth, streams in cap["depths"].items():
        wid.add_metric([depth], streams)
    yield wid
    yield from _gauges("gmlx_capacity", cap)  # decode_batch, context_length
    for key, part in cap.items():
        if isinstance(part, dict) and key not in ("widths", "depths"):  # budget, kv_format, warmup
            yield from _gauges(f"gmlx_capacity_{key}", part)


class _Capacity:
    """A collector over the capacity section it was last given."""

    def __init__(self) -> None:
        self.cap: dict | None = None

    def collect(self) -> Iterator[Metric]:
        yield from _capacity(self.cap)


class Histograms:
    """Latency histograms, and the registry the text is rendered from. TTFT is observed as each
    request finishes; inter-token latency at every gap between two tokens of a stream (the
    engine's `on_token_gap`, on its thread: prometheus_client's histograms take a lock)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._snapshot = _Snapshot()
        self.registry.register(self._snapshot)
        # The capacity table's 40-odd samples change only with the table: rendered once per table.
        self._capacity = _Capacity()
        self._capacity_registry = CollectorRegistry(auto_describe=False)
        self._capacity_registry.register(self._capacity)
        self._capacity_text = b""
        self.ttft = Histogram(
            "gmlx_ttft_seconds",
            "Time to first token, from the request's arrival (queue wait included)",
            registry=self.registry,
            buckets=_TTFT_BUCKETS,
        )
        self.itl = Histogram(
            "gmlx_inter_token_latency_seconds",
            "Time between two tokens of a stream",
            registry=self.registry,
            buckets=_ITL_BUCKETS,
        )
        self.queue_wait = Histogram(
            "gmlx_queue_wait_seconds",
            "Time a request waited at the admission gate",
            registry=self.registry,
            buckets=_QUEUE_BUCKETS,
        )

    def observe_ttft(self, ttft_s: float | None) -> None:
        if ttft_s is not None:
            self.ttft.observe(ttft_s)

    def observe_gap(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def observe_queue_wait(self, seconds: float) -> None:
        """Once per request that passed the gate (one refused or gone while queued is not counted)."""
        self.queue_wait.observe(seconds)

    def render(self, snap: dict, router: bool = False) -> bytes:
        """The text for `snap`; with `router`, the vLLM series too (/metrics). On the event loop only."""
        self._snapshot.snap, self._snapshot.router = snap, router
        capacity = snap.get("server", {}).get("capacity")
        if capacity != self._capacity.cap:
            self._capacity.cap = capacity
            self._capacity_text = generate_latest(self._capacity_registry)
        return generate_latest(self.registry) + self._capacity_text
