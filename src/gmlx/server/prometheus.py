"""Prometheus text for /v1/metrics?format=prometheus and /metrics, rendered by prometheus_client from
the JSON snapshot itself (so both answer the same at the same moment), plus latency histograms.

Names follow Prometheus' conventions, so `promtool check metrics` passes: base units as suffixes
(`_seconds`, `_bytes`, `_tokens`, `_tokens_per_second`, `_ratio` for 0-1 fractions), `_total` for
counts since start, configuration as the labels of one `gmlx_config_info` series. Every family is
declared from the first scrape; a labelled counter lists each label value it can take at 0. A null
field has no sample (its family stays declared), except the decode rates, which read 0 when nothing
decoded in their 10 s window, and the time of a governor action never taken, 0. Each resident
model's own figures, capacity table and latency histograms carry a `model` label; the sections that
sum over the models do not. /metrics adds the vLLM series routers scrape (the Gateway API Inference
Extension's endpoint picker, vLLM's production-stack router, llmtop), under vLLM's names."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from functools import partial
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.openmetrics import exposition as openmetrics

from gmlx.server.latency import WINDOW_S, Window

BANDS = ("green", "yellow", "orange", "red")
REJECT_REASONS = ("queue_full", "queue_timeout")  # AdmissionGate._reject's codes
FINISH_REASONS = ("stop", "length", "cancelled", "error")  # engine.Finished.finish_reason; error: a Failed
REQUEST_STATES = ("queued", "prefill", "decode")
MODEL_STATUSES = ("loading", "loaded")  # a resident model's (state.Status, less "unloaded")
_EOF = b"# EOF\n"  # OpenMetrics' last line: once, after the capacity table's text
_TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1, 2)
_QUEUE_BUCKETS = (0.005, 0.025, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

Row = tuple[list[str], Any]  # label values, and the value (None: no sample)

# Snapshot field -> series, per section: (field, name, HELP).
_CONCURRENCY = (  # every resident model's together
    ("decode_batch", "gmlx_concurrency_decode_batch", "Decode slots of the resident models together"),
    ("queue_cap", "gmlx_concurrency_queue_cap", "Queue places of the resident models together"),
    ("in_flight", "gmlx_concurrency_in_flight", "Decode slots held now (a request with n choices holds n)"),
    ("waiting", "gmlx_concurrency_waiting", "Requests waiting at the admission gate"),
)
_QUEUE = (
    ("waiting", "gmlx_queue_waiting", "Requests in the admission queue"),
    ("eta_s", "gmlx_queue_eta_seconds", "The Retry-After a request refused now would get: the queue's drain time"),
)
_MEMORY = (
    ("active_bytes", "gmlx_memory_active_bytes", "Bytes MLX's arrays hold now"),
    ("cache_bytes", "gmlx_memory_cache_bytes", "Bytes MLX's buffer cache holds for reuse"),
    ("peak_bytes", "gmlx_memory_peak_bytes", "MLX's high-water mark of active bytes since the start-up warm-up"),
    (
        "headroom_bytes",
        "gmlx_memory_headroom_bytes",
        "Usable budget left after MLX's active and cached bytes, or the resident size where larger (not on CUDA)",
    ),
    ("budget_bytes", "gmlx_memory_budget_bytes", "The memory budget the capacity table is built on"),
    ("process_rss_bytes", "gmlx_memory_process_rss_bytes", "Resident set size of this server's process"),
    ("kernels_scratch_bytes", "gmlx_memory_kernels_scratch_bytes", "CPU kernels' scratch outside MLX"),
    ("system_available_bytes", "gmlx_memory_system_available_bytes", "Memory the OS reports available"),
    ("system_total_bytes", "gmlx_memory_system_total_bytes", "The machine's memory"),
)
_KV_CACHE = (
    ("used_bytes", "gmlx_kv_cache_used_bytes", "KV bytes the running streams hold, by the capacity table's arithmetic"),
    ("budget_bytes", "gmlx_kv_cache_budget_bytes", "The capacity table's KV budget"),
    ("table_usage", "gmlx_kv_cache_table_usage_ratio", "KV bytes held over the KV budget"),
    ("governor_fraction", "gmlx_kv_cache_governor_ratio", "The governor's memory fraction, as KV usage reads it"),
    ("usage", "gmlx_kv_cache_usage_ratio", "KV-cache usage as routers read it (vllm:kv_cache_usage_perc)"),
)
_CONNECTION_COUNTS = (
    ("refused", "gmlx_connections_refused", "Connections refused at the cap"),
    ("evicted", "gmlx_connections_evicted", "Idle connections closed at the cap to admit a new one"),
    ("header_timeouts", "gmlx_connections_header_timeouts", "Connections closed for sending headers too slowly"),
    ("body_timeouts", "gmlx_connections_body_timeouts", "Requests refused for sending their body too slowly"),
)
_GOVERNOR = (
    ("fraction", "gmlx_governor_used_ratio", "The governor's last reading: used bytes over its limit"),
    ("used_bytes", "gmlx_governor_used_bytes", "Bytes in use at the governor's last reading"),
    ("limit_bytes", "gmlx_governor_limit_bytes", "The limit the governor's fraction is taken against"),
    ("host_bytes", "gmlx_governor_host_bytes", "Host memory outside MLX at the governor's last reading"),
)
_RATES = (  # per model
    ("decode_streams", "gmlx_rates_decode_streams", "Streams decoding now"),
    (
        "prefill_tok_s_recent",
        "gmlx_rates_prefill_recent_tokens_per_second",
        "Mean prefill rate of the recent finished requests, each on its own (absent before the first)",
    ),
    (
        "decode_tok_s_recent",
        "gmlx_rates_decode_recent_tokens_per_second",
        "Mean decode rate of the recent finished requests, each stream on its own (absent before the first)",
    ),
    (
        "decode_tok_s_lifetime",
        "gmlx_rates_decode_lifetime_tokens_per_second",
        "Mean decode rate per request over every finished request (absent before the first)",
    ),
    (
        "speculative_accept_rate",
        "gmlx_rates_speculative_accept_ratio",
        "Share of the drafter's proposed tokens the served model kept (absent without a drafter)",
    ),
)
_MODEL = (  # per resident model
    ("in_flight", "gmlx_model_in_flight", "Requests the model's engine holds now"),
    ("waiting", "gmlx_model_waiting", "Requests waiting at the model's admission gate"),
    (
        "weight_bytes",
        "gmlx_model_weight_bytes",
        "Bytes of the model's weights, its drafter's included (planned until loaded)",
    ),
    ("load_seconds", "gmlx_model_load_seconds", "How long the model took to load (absent while it loads)"),
    ("loaded_at", "gmlx_model_loaded_timestamp_seconds", "Unix time the model became ready (absent while it loads)"),
    ("last_used_at", "gmlx_model_last_used_timestamp_seconds", "Unix time a request last named the model"),
)
_PROMPT_CACHE_COUNTS = (
    ("misses", "gmlx_prompt_cache_misses", "Requests the prompt cache had nothing for"),
    ("reused_tokens", "gmlx_prompt_cache_reused_tokens", "Prompt tokens served from the prompt cache, not prefilled"),
    ("stored_bytes", "gmlx_prompt_cache_stored_bytes", "Bytes of KV stored into the prompt cache"),
    ("evicted_bytes", "gmlx_prompt_cache_evicted_bytes", "Bytes of KV evicted from the prompt cache (LRU or governor)"),
)
_PROMPT_CACHE_GAUGES = (
    ("bytes", "gmlx_prompt_cache_bytes", "Bytes the prompt cache holds now"),
    ("max_bytes", "gmlx_prompt_cache_max_bytes", "The prompt cache's bound"),
    ("entries", "gmlx_prompt_cache_entries", "Entries in the prompt cache"),
)
_BUDGET = {  # the capacity table's budget, bytes unless named
    "total_bytes": "The memory budget",
    "weight_bytes": "Bytes of the resident weights",
    "reserve_bytes": "Bytes held back for the OS and the runtime",
    "prefill_bytes": "Bytes one prefill chunk needs",
    "batch_bytes": "Bytes the decode batch needs beyond its KV",
    "prompt_cache_bytes": "The prompt cache's share",
    "host_bytes": "Host memory outside MLX",
    "kv_bytes": "What is left for the KV of the running streams",
    "ceiling": "The share of the machine's memory the budget may take",
    "other_models_bytes": "Bytes of the other resident models' weights, off this model's budget",
}
_WARMUP = (  # measured once at start
    ("tokens", "gmlx_capacity_warmup_tokens", "Prompt tokens of the start-up warm-up"),
    ("kv_bytes_predicted", "gmlx_capacity_warmup_kv_bytes_predicted", "KV bytes the table predicts for the warm-up"),
    ("kv_bytes_measured", "gmlx_capacity_warmup_kv_bytes_measured", "KV bytes the warm-up allocated"),
    ("kv_bytes_per_token_predicted", "gmlx_capacity_warmup_kv_bytes_per_token_predicted", "Predicted KV bytes a token"),
    ("kv_bytes_per_token_measured", "gmlx_capacity_warmup_kv_bytes_per_token_measured", "Measured KV bytes a token"),
    (
        "prefill_tok_s_measured",
        "gmlx_capacity_warmup_prefill_tokens_per_second_measured",
        "The warm-up's prefill rate",
    ),
    ("decode_tok_s_measured", "gmlx_capacity_warmup_decode_tokens_per_second_measured", "The warm-up's decode rate"),
    ("prefill_peak_bytes_measured", "gmlx_capacity_warmup_prefill_peak_bytes_measured", "The warm-up prefill's peak"),
    (
        "prefill_bytes_per_token_predicted",
        "gmlx_capacity_warmup_prefill_bytes_per_token_predicted",
        "What a prefill chunk's token adds to its memory, derived",
    ),
    (
        "prefill_bytes_per_token_measured",
        "gmlx_capacity_warmup_prefill_bytes_per_token_measured",
        "What a prefill chunk's token adds to its memory, measured at the warm-up",
    ),
    (
        "prefill_scratch_bytes_per_token_measured",
        "gmlx_capacity_warmup_prefill_scratch_bytes_per_token_measured",
        "What a prefill chunk's token holds in the CPU kernels' scratch, measured at the warm-up",
    ),
    (
        "prefill_bytes_predicted_per_chunk",
        "gmlx_capacity_warmup_prefill_bytes_predicted_per_chunk",
        "What the table predicts for one full prefill chunk",
    ),
)


def _family(kind: type[Metric], name: str, what: str, labels: list[str], rows: Iterable[Row]) -> Metric:
    """A gauge or counter family with a sample for each row whose value is not null."""
    family = kind(name, what, labels=labels)
    for values, value in rows:
        if value is not None:
            family.add_metric(values, value)
    return family


def _gauge(name: str, what: str, value: Any) -> Metric:
    return _family(GaugeMetricFamily, name, what, [], [([], value)])


def _counter(name: str, what: str, value: Any) -> Metric:
    return _family(CounterMetricFamily, name, what, [], [([], value)])


def _fields(section: dict, table: tuple[tuple[str, str, str], ...]) -> Iterator[Metric]:
    for key, name, what in table:
        yield _gauge(name, what, section.get(key))


def _label(value: Any) -> str:
    """A configuration value as a label: null as empty, a flag as true/false."""
    if value is None:
        return ""
    return str(value).lower() if isinstance(value, bool) else str(value)


class _Snapshot:
    """A collector over whatever snapshot it was last given."""

    def __init__(self) -> None:
        self.snap: dict[str, Any] = {}
        self.router: str | None = None  # /metrics: add the vLLM series, with this model_name

    def collect(self) -> Iterator[Metric]:
        s = self.snap.get("server", {})
        if self.router is not None:
            yield from _vllm(s, self.router)
        yield _config(s)
        yield from _fields(s.get("concurrency") or {}, _CONCURRENCY)
        yield from _queue(s.get("queue") or {})
        yield from _connections(s.get("connections") or {})
        yield from _fields(s.get("memory") or {}, _MEMORY)
        yield from _fields(s.get("kv_cache") or {}, _KV_CACHE)
        yield from _governor(s.get("governor") or {})
        yield from _rates(s.get("rates") or {})
        yield from _totals(s.get("totals") or {})
        yield from _embeddings(s.get("embeddings") or {})
        yield _requests(s)
        yield from _prompt_cache(s.get("prompt_cache") or {})
        yield from _models(s.get("resident_models") or [])


def _config(s: dict) -> Metric:
    """One series whose labels are the server's configuration; its value is 1."""
    gov, kv = s.get("governor") or {}, s.get("kv_cache") or {}
    thresholds = gov.get("thresholds") or {}
    cap = s.get("capacity") or {}
    kv_format = cap.get("kv_format") or {}
    labels = {
        "connections_cap": (s.get("connections") or {}).get("cap"),
        "governor_enabled": gov.get("enabled"),
        "governor_interval_seconds": gov.get("interval_s"),
        **{f"governor_threshold_{band}": thresholds.get(band) for band in BANDS[1:]},
        "governor_hysteresis": thresholds.get("hysteresis"),
        "prompt_cache_enabled": (s.get("prompt_cache") or {}).get("enabled"),
        "prompt_cache_block_tokens": kv.get("block_tokens"),
        "prompt_cache_blocks": kv.get("blocks"),
        "prefill_step": cap.get("prefill_step"),
        "kv_format": kv_format.get("describe"),
        **{f"kv_{k}": kv_format.get(k) for k in ("bits", "group_size", "value_bits", "tail_tokens", "float_bytes")},
        "kv_element_bytes": kv_format.get("element_bytes"),
    }
    info = InfoMetricFamily("gmlx_config", "The server's configuration, as labels (empty: not known yet or unset)")
    info.add_metric([], {k: _label(v) for k, v in labels.items()})
    return info


def _queue(queue: dict) -> Iterator[Metric]:
    yield from _fields(queue, _QUEUE)
    by_reason = queue.get("rejections_by_reason")
    yield _family(
        CounterMetricFamily,
        "gmlx_queue_rejections",
        "Requests turned away at the admission gate, by reason",
        ["reason"],
        [
            ([r], None if by_reason is None else by_reason.get(r, 0))
            for r in sorted({*REJECT_REASONS, *(by_reason or {})})
        ],
    )
    yield _counter("gmlx_queue_timeouts", "Requests that waited in the queue past the timeout", queue.get("timeouts"))


def _connections(conns: dict) -> Iterator[Metric]:
    yield _gauge("gmlx_connections_open", "Client connections open now", conns.get("open"))
    for key, name, what in _CONNECTION_COUNTS:
        yield _counter(name, what, conns.get(key))


def _governor(gov: dict) -> Iterator[Metric]:
    yield _family(
        GaugeMetricFamily,
        "gmlx_governor_band",
        "1 for the memory governor's current band, 0 for the others (all 0 until its first reading or when disabled)",
        ["band"],
        [([b], float(gov.get("band") == b)) for b in BANDS],
    )
    yield from _fields(gov, _GOVERNOR)
    actions = (gov.get("actions") or {}).items()
    yield _family(
        CounterMetricFamily,
        "gmlx_governor_actions",
        "Times the governor took each action",
        ["action"],
        [([n], a["count"]) for n, a in actions],
    )
    yield _family(
        CounterMetricFamily,
        "gmlx_governor_freed_bytes",
        "Bytes each releasing action freed",
        ["action"],
        [([n], a.get("bytes_freed")) for n, a in actions],
    )
    yield _family(
        GaugeMetricFamily,
        "gmlx_governor_action_last_timestamp_seconds",
        "Unix time each action was last taken; 0 until it is first taken",
        ["action"],
        [([n], a["last_at"] or 0) for n, a in actions],
    )


def _decode_rate(value: Any, known: bool) -> Any:
    """A rate over the last 10 s of decode steps: null (fewer than two steps, idle) reads 0 here,
    unless the probe failed (`known` false)."""
    return 0 if value is None and known else value


def _rates(rates: dict) -> Iterator[Metric]:
    """Server-wide: summed over the models' engines, or their mean (each model's own are gmlx_model_*)."""
    yield _gauge(
        "gmlx_rates_decode_tokens_per_second",
        "Tokens decoded per second over the last 10 s, every stream of every model (0 when nothing decoded)",
        _decode_rate(rates.get("decode_tok_s"), rates.get("decode_streams") is not None),
    )
    yield from _fields(rates, _RATES)


def _totals(totals: dict) -> Iterator[Metric]:
    """Since start, over every model."""
    finished = totals.get("requests_finished")
    yield _family(
        CounterMetricFamily,
        "gmlx_requests_finished",
        "Engine requests (choices) finished, by finish reason",
        ["reason"],
        [([r], None if finished is None else finished.get(r, 0)) for r in sorted({*FINISH_REASONS, *(finished or {})})],
    )
    yield _counter("gmlx_prompt_tokens", "Prompt tokens prefilled", totals.get("prompt_tokens"))
    yield _counter("gmlx_generated_tokens", "Tokens generated", totals.get("generated_tokens"))


def _embeddings(e: dict) -> Iterator[Metric]:
    """Since start, over every model; those running or waiting are in gmlx_requests too."""
    yield _counter("gmlx_embeddings_requests", "Embeddings requests answered", e.get("requests"))
    yield _counter("gmlx_embeddings_failed", "Embeddings requests the engine failed", e.get("failed"))
    yield _counter(
        "gmlx_embeddings_input_tokens", "Input tokens of the answered embeddings requests", e.get("input_tokens")
    )
    yield _gauge("gmlx_embeddings_running", "Embeddings requests the engines run now", e.get("running"))
    yield _gauge("gmlx_embeddings_waiting", "Embeddings requests waiting for a slot", e.get("waiting"))


def _requests(s: dict) -> Metric:
    """Rows of the snapshot's requests, by model and state; every resident model's states at 0 too."""
    counts = {(m["model"], state): 0 for m in s.get("resident_models") or [] for state in REQUEST_STATES}
    for row in s.get("requests") or []:
        key = (row["model"], row["state"])
        counts[key] = counts.get(key, 0) + 1
    return _family(
        GaugeMetricFamily,
        "gmlx_requests",
        "Requests queued or running, by model and state",
        ["model", "state"],
        [([m, st], n) for (m, st), n in counts.items()],
    )


def _prompt_cache(pc: dict) -> Iterator[Metric]:
    """The preloaded model's prompt cache, as the JSON's section. Declared whether or not it is on
    (gmlx_config_info's prompt_cache_enabled); samples only when on."""
    on = bool(pc.get("enabled"))
    tiers = (pc.get("hits_by_tier") or {}).items() if on else ()
    yield _family(
        CounterMetricFamily,
        "gmlx_prompt_cache_hits",
        "Requests whose prefix the prompt cache held, by tier",
        ["tier"],
        [([tier], n) for tier, n in tiers],
    )
    for key, name, what in _PROMPT_CACHE_COUNTS:
        yield _counter(name, what, pc.get(key) if on else None)
    for key, name, what in _PROMPT_CACHE_GAUGES:
        yield _gauge(name, what, pc.get(key) if on else None)


def _models(models: list[dict]) -> Iterator[Metric]:
    """Each resident model's own figures, by `model`."""
    info = InfoMetricFamily(
        "gmlx_model", "Each resident model: its kind, weights, decode batch and context window (empty: loading)"
    )
    for m in models:
        info.add_metric(
            [], {k: _label(m.get(k)) for k in ("model", "kind", "weight_mode", "decode_batch", "context_length")}
        )
    yield info
    yield _family(
        GaugeMetricFamily,
        "gmlx_model_status",
        "1 for each resident model's status, 0 for the other",
        ["model", "status"],
        [([m["model"], st], float(m.get("status") == st)) for m in models for st in MODEL_STATUSES],
    )
    for key, name, what in _MODEL:
        yield _family(GaugeMetricFamily, name, what, ["model"], [([m["model"]], m.get(key)) for m in models])
    yield _family(
        GaugeMetricFamily,
        "gmlx_model_decode_tokens_per_second",
        "Tokens the model decoded per second over the last 10 s, all its streams (0 when nothing decoded)",
        ["model"],
        [([m["model"]], _decode_rate(m.get("decode_tok_s"), True)) for m in models],
    )


def _vllm(s: dict, model: str) -> Iterator[Metric]:
    """The series a router reads by vLLM's names, with their meaning (docs/ARCHITECTURE.md, "Behind a
    router"): waiting counts queued requests only; running, the slots held (a request with n choices
    holds n, as vLLM counts sequences); KV usage is kv_cache.usage. promtool flags their ':' (it
    reserves it for recording rules), and only that: the names are vLLM's, routers read them so."""
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
        yield _family(GaugeMetricFamily, f"vllm:{name}", what, ["model_name"], [([model], value)])
    info = GaugeMetricFamily(
        "vllm:cache_config_info",
        "The prompt cache's block size and block count",
        labels=["block_size", "num_gpu_blocks"],
    )
    if kv.get("blocks") is not None:
        info.add_metric([str(kv["block_tokens"]), str(kv["blocks"])], 1.0)
    yield info


Tables = list[tuple[str, dict]]  # (model, its capacity table's JSON), each resident model with a table


def _capacity(tables: Tables) -> Iterator[Metric]:
    """Each model's table by width and depth, its budget and its start-up warm-up, by `model`; the
    configuration (decode batch, prefill step, KV format) is in gmlx_config_info."""

    def family(name: str, what: str, rows: Iterable[Row], extra: tuple[str, ...] = ()) -> Metric:
        return _family(GaugeMetricFamily, name, what, ["model", *extra], rows)

    yield family(
        "gmlx_capacity_max_context_tokens",
        "The longest context each stream can hold when this many streams run side by side",
        [([m, w], n) for m, cap in tables for w, n in cap["widths"].items()],
        ("width",),
    )
    yield family(
        "gmlx_capacity_max_width",
        "How many streams fit side by side at this context depth (tokens)",
        [([m, d], n) for m, cap in tables for d, n in cap["depths"].items()],
        ("depth",),
    )
    yield family(
        "gmlx_capacity_context_length_tokens",
        "The context window the table plans for",
        [([m], cap.get("context_length")) for m, cap in tables],
    )
    for key, what in _BUDGET.items():
        name = "gmlx_capacity_budget_ceiling_ratio" if key == "ceiling" else f"gmlx_capacity_budget_{key}"
        yield family(name, what, [([m], cap["budget"].get(key)) for m, cap in tables])
    for key, name, what in _WARMUP:
        yield family(name, what, [([m], (cap.get("warmup") or {}).get(key)) for m, cap in tables])


class _Capacity:
    """A collector over the tables it was last given."""

    def __init__(self) -> None:
        self.tables: Tables = []

    def collect(self) -> Iterator[Metric]:
        yield from _capacity(self.tables)


def _encoder(accept: str | None) -> tuple[Callable[[CollectorRegistry], bytes], str]:
    """OpenMetrics when the Accept header names it, else the classic text. Names are written as
    they are: prometheus_client's default OpenMetrics escaping turns the samples' ':' into '_'
    (but not their HELP's), and routers read vLLM's names exactly."""
    if any(part.split(";")[0].strip() == "application/openmetrics-text" for part in (accept or "").split(",")):
        return partial(openmetrics.generate_latest, escaping=openmetrics.ALLOWUTF8), openmetrics.CONTENT_TYPE_LATEST
    return generate_latest, CONTENT_TYPE_LATEST


def content_type(accept: str | None) -> str:
    """The media type `render` answers an Accept header with."""
    return _encoder(accept)[1]


class Histograms:
    """Latency histograms, and the registry the text is rendered from. TTFT and end-to-end latency
    are observed as each choice finishes; inter-token latency at every gap between two tokens of a
    stream (the engine's `on_token_gap`, on its thread: prometheus_client's histograms and the
    windows take a lock); queue wait once per request that passed the gate. Each is labelled by
    model, and also kept over the last WINDOW_S seconds for `server.latency`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._snapshot = _Snapshot()
        self.registry.register(self._snapshot)
        # The capacity tables' 40-odd samples each change only with the tables: rendered once per tables and format.
        self._capacity = _Capacity()
        self._capacity_registry = CollectorRegistry(auto_describe=False)
        self._capacity_registry.register(self._capacity)
        self._capacity_text: dict[str, bytes] = {}

        def histogram(name: str, what: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, what, ["model"], registry=self.registry, buckets=buckets)

        self.ttft = histogram(
            "gmlx_ttft_seconds", "Time to first token, from the request's arrival (queue wait included)", _TTFT_BUCKETS
        )
        self.itl = histogram("gmlx_inter_token_latency_seconds", "Time between two tokens of a stream", _ITL_BUCKETS)
        self.queue_wait = histogram(
            "gmlx_queue_wait_seconds", "Time a request waited at the admission gate", _QUEUE_BUCKETS
        )
        self.e2e = histogram(
            "gmlx_e2e_request_latency_seconds",
            "Time from a request's arrival to its end (queue wait included)",
            _E2E_BUCKETS,
        )
        self._series = {
            "ttft_seconds": (self.ttft, Window()),
            "inter_token_seconds": (self.itl, Window()),
            "e2e_seconds": (self.e2e, Window()),
            "queue_wait_seconds": (self.queue_wait, Window()),
        }

    def _observe(self, series: str, model: str, seconds: float) -> None:
        histogram, window = self._series[series]
        histogram.labels(model).observe(seconds)
        window.observe(seconds)

    def observe_ttft(self, model: str, seconds: float | None) -> None:
        """Once per finished choice; None (it ended before its first token) is not observed."""
        if seconds is not None:
            self._observe("ttft_seconds", model, seconds)

    def observe_gap(self, model: str, seconds: float) -> None:
        self._observe("inter_token_seconds", model, seconds)

    def observe_queue_wait(self, model: str, seconds: float) -> None:
        """Once per request that passed the gate (one refused or gone while queued is not counted)."""
        self._observe("queue_wait_seconds", model, seconds)

    def observe_e2e(self, model: str, seconds: float) -> None:
        """Once per finished choice, from the request's arrival to its end."""
        self._observe("e2e_seconds", model, seconds)

    def latency(self) -> dict[str, Any]:
        """`server.latency`: each series' count and p50/p95/p99 over the last WINDOW_S seconds, all models together."""
        return {"window_s": WINDOW_S, **{name: window.summary() for name, (_, window) in self._series.items()}}

    def render(self, snap: dict, router: str | None = None, accept: str | None = None) -> bytes:
        """The text for `snap` in the format `accept` asks for (content_type says which); with
        `router`, the vLLM series too, labelled model_name=router (/metrics). On the event loop only."""
        s = snap.get("server", {})
        self._snapshot.snap, self._snapshot.router = snap, router
        for m in s.get("resident_models") or []:  # each resident model's histograms, at 0 before its first request
            for histogram, _ in self._series.values():
                histogram.labels(m["model"])
        encode, media = _encoder(accept)
        tables = [(m["model"], m["capacity"]) for m in s.get("resident_models") or [] if m.get("capacity")]
        if tables != self._capacity.tables:
            self._capacity.tables, self._capacity_text = tables, {}
        if media not in self._capacity_text:
            self._capacity_text[media] = encode(self._capacity_registry).removesuffix(_EOF)
        text = encode(self.registry)
        return text.removesuffix(_EOF) + self._capacity_text[media] + (_EOF if text.endswith(_EOF) else b"")
