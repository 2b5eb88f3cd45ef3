"""The one metrics snapshot (docs/ARCHITECTURE.md, decision 6): built here section by section; a section
whose probe raises reports null fields and the rest still answers. Prometheus text is rendered
from the same snapshot, so the two never disagree."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import psutil

from gmlx import kernels, platform
from gmlx.capacity.memory import kv_bytes_after_prefill, kv_bytes_per_token, warmup_per_token
from gmlx.engine.engine import drafting_refused
from gmlx.server.admission import RETRY_AFTER_FULL_S, AdmissionGate
from gmlx.server.state import ModelState, ServerState

log = logging.getLogger("gmlx.metrics")

Probe = Callable[[ServerState], Any]
ROUTER_SATURATION = 0.8  # where the Gateway API Inference Extension's picker calls a server saturated


def _gates(s: ServerState) -> list[AdmissionGate]:
    return [m.gate for m in s.models.values()]


def _offering(s: ServerState) -> list[ModelState]:
    """The models whose slots the server offers: the resident ones, or while none is, the preloaded
    one, which the next request loads (a ratio over a capacity of 0 would read as no server at all)."""
    return s.resident() or [s.default]


def _concurrency(s: ServerState) -> dict:
    """Every model's together (each model's own are in resident_models)."""
    offering, gates = _offering(s), _gates(s)
    return {
        "decode_batch": sum(m.gate.width for m in offering),
        "queue_cap": sum(m.gate.cap for m in offering),
        "in_flight": sum(g.running for g in gates),
        "waiting": sum(g.waiting for g in gates),
    }


def _queue(s: ServerState) -> dict:
    gates = _gates(s)
    by_reason: Counter[str] = sum((g.rejections_by_code for g in gates), Counter())
    last = max(gates, key=lambda g: g.last_reject_at or 0.0)
    return {
        "waiting": sum(g.waiting for g in gates),
        "cap": sum(m.gate.cap for m in _offering(s)),
        "eta_s": max(
            (g.retry_after(RETRY_AFTER_FULL_S) for g in gates if g.waiting), default=s.default.gate.retry_after()
        ),
        "rejections": sum(g.rejections for g in gates),
        "timeouts": by_reason.get("queue_timeout", 0),
        "rejections_by_reason": dict(by_reason),
        "last_reject_reason": last.last_reject_reason,
    }


def _connections(s: ServerState) -> dict:
    return s.connections.to_json()


def _governor(s: ServerState) -> dict:
    return s.governor.snapshot() if s.governor is not None else {"band": None, "enabled": False}


_PROCESS = psutil.Process()  # this server's process: looked up once, read at every snapshot


def _memory(s: ServerState) -> dict:
    active, cache = mx.get_active_memory(), mx.get_cache_memory()
    table = s.budget_table()
    usable = table.budget.total_bytes - table.budget.reserve_bytes if table else None
    vm = psutil.virtual_memory()
    rss = _PROCESS.memory_info().rss
    # Where MLX's buffers share the host's memory, what the process holds beside them counts too,
    # as the governor counts it: the whole resident size when it is the larger.
    held = active + cache if platform.backend() == "cuda" else max(active + cache, rss)
    return {
        "active_bytes": active,
        "cache_bytes": cache,
        "peak_bytes": mx.get_peak_memory(),  # MLX's high-water mark since the start-up warm-up
        "headroom_bytes": usable - held if usable is not None else None,
        "budget_bytes": table.budget.total_bytes if table else None,
        "process_rss_bytes": rss,
        # What the CPU kernels keep outside MLX's buffers; freed once the prompts are prefilled.
        "kernels_scratch_bytes": kernels.scratch_bytes() if kernels.available() else None,
        "system_available_bytes": vm.available,
        "system_total_bytes": vm.total,
    }


def _model_capacity(m: ModelState) -> dict | None:
    table, engine, out = m.table(), m.engine, m.table_json()
    if table is None or engine is None or out is None:
        return None
    if (measured := engine.measured) is not None:
        # Below zero the measure failed (a tiny model's KV under what else MLX freed meanwhile): null.
        kv = measured.kv_bytes if measured.kv_bytes >= 0 else None
        out["warmup"] = {
            "tokens": measured.tokens,
            "kv_bytes_predicted": kv_bytes_after_prefill(table.geometry, measured.tokens, table.kv),
            "kv_bytes_measured": kv,
            **warmup_per_token(table.geometry, measured.tokens, kv, table.kv),
            "prefill_tok_s_measured": round(measured.prefill_tok_s, 1),
            "decode_tok_s_measured": round(measured.decode_tok_s, 2),
            # The warm-up prompt is short, so its peak sits well under one full chunk's prediction.
            "prefill_peak_bytes_measured": measured.prefill_peak_bytes,
            **(growth.to_json() if (growth := m.prefill_growth()) else {}),
            "prefill_bytes_predicted_per_chunk": table.budget.prefill_bytes,
        }
    return out


def _capacity(s: ServerState) -> dict | None:
    """The preloaded model's table, as the plan route answers without `model=` (each resident
    model's is in its resident_models entry)."""
    return _model_capacity(s.default)


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def _rates(s: ServerState) -> dict:
    """Rates now are summed over the models' engines; means over requests are the models' mean."""
    engines = s.engines()
    means = [e.stats.request_means() for e in engines]
    rates = [e.stats.decode_tok_s_recent() for e in engines]
    drafting = [e for e in engines if e.draft is not None]
    return {
        "decode_tok_s": _round(sum(r for r in rates if r is not None) if any(r is not None for r in rates) else None),
        "decode_streams": sum(e.decoding for e in engines),
        "prefill_tok_s_recent": _round(_mean([p for _, p in means])),
        "decode_tok_s_recent": _round(_mean([d for d, _ in means])),
        "decode_tok_s_lifetime": _round(_mean([e.stats.decode_tok_s_per_request_lifetime() for e in engines])),
        # The drafter's share of proposals the served model kept, over every finished request.
        "speculative_accept_rate": _round(_mean([e.stats.speculative.accept_rate for e in drafting]), 4)
        if drafting
        else None,
    }


def _totals(s: ServerState) -> dict:
    """Since start, over every model: a model's counts outlive its unloading (ModelState.stats)."""
    finished: Counter[str] = Counter()
    for m in s.models.values():
        finished.update(m.stats.finish_reasons)
    return {
        "requests_finished": dict(finished),
        "prompt_tokens": sum(m.stats.prefill_tokens for m in s.models.values()),
        "generated_tokens": sum(m.stats.decode_tokens for m in s.models.values()),
    }


def _embedding_rows(s: ServerState, now: float) -> list[dict]:
    """Embeddings requests, in the generation rows' shape: they decode nothing, and a running one
    holds one input's cache at a time, counted at its longest input."""
    rows = []
    for m in s.models.values():
        table = m.table() if m.engine is not None else None
        for e in list(m.embeddings.values()):
            depth = e.cache_tokens
            rows.append(
                {
                    "id": e.id,
                    "kind": "embedding",
                    "uid": None,
                    "model": m.model_id,
                    "state": e.state,
                    "prompt_tokens": e.tokens,
                    "inputs": e.inputs,
                    "generated": 0,
                    "max_tokens": None,
                    "elapsed_s": round(now - e.arrived_at, 2),
                    "queued_s": round((e.started_at or now) - e.arrived_at, 2),
                    "ttft_s": None,
                    "decode_tok_s": None,
                    "cache": None,
                    "speculative": None,
                    "kv_bytes": table.stream_bytes(depth) if table is not None and depth else None,
                }
            )
    return rows


def _requests(s: ServerState) -> list[dict]:
    """Queued rows first (waiting for a slot, generation then embeddings; then admitted but not yet
    begun), then what the engines run."""
    now = time.monotonic()
    embedding = _embedding_rows(s, now)
    rows = [
        {
            "id": q.id,
            "kind": "generation",
            "uid": None,
            "model": m.model_id,
            "state": "queued",
            "prompt_tokens": q.prompt_tokens,
            "generated": 0,
            "max_tokens": q.max_tokens,
            "elapsed_s": round(now - q.arrived_at, 2),
            "queued_s": round(q.queued_s(now), 2),
            "ttft_s": None,
            "decode_tok_s": None,
            "cache": None,
            "speculative": None,
            "kv_bytes": None,
        }
        for m in s.models.values()
        for q in list(m.queued.values())
    ]
    rows += [r for r in embedding if r["state"] == "queued"]
    for m in s.resident():
        engine, table = m.engine, m.table()
        for r in engine.requests() if engine is not None else []:
            rows.append(
                {
                    "id": r.id,
                    "kind": "generation",
                    "uid": r.uid,
                    "model": m.model_id,
                    "state": r.state,
                    "prompt_tokens": len(r.prompt_ids),
                    "generated": r.generated,
                    "max_tokens": r.max_tokens,
                    "elapsed_s": round(now - r.arrival, 2),
                    "queued_s": round(r.queued_s, 2),
                    "ttft_s": _round(r.ttft_s, 3),
                    "decode_tok_s": _round(r.decode_tok_s(now)),
                    "cache": r.cache.to_json() if r.cache else None,
                    # With a drafter: its figures, and why this request never drafts (None: it may).
                    "speculative": {**r.speculative.to_json(), "off": drafting_refused(r)} if r.speculative else None,
                    # Its KV cache as the table counts it (what it holds now, at its depth).
                    "kv_bytes": table.stream_bytes(len(r.prompt_ids) + r.generated) if table is not None else None,
                }
            )
    rows += [r for r in embedding if r["state"] != "queued"]
    # Queued rows first: also those an engine holds (their slots taken) but has not begun to prefill.
    return sorted(rows, key=lambda r: r["state"] != "queued")


def _embeddings(s: ServerState) -> dict:
    """Since start, over every model; and those queued or running now."""
    rows = [e for m in s.models.values() for e in list(m.embeddings.values())]
    stats = [m.embedding_stats for m in s.models.values()]
    return {
        "requests": sum(x.requests for x in stats),
        "failed": sum(x.failed for x in stats),
        "input_tokens": sum(x.input_tokens for x in stats),
        "running": sum(1 for e in rows if e.state == "prefill"),
        "waiting": sum(1 for e in rows if e.state == "queued"),
    }


def kv_usage(
    table_usage: float | None, governor_fraction: float | None, band: str | None, yellow: float, ready: bool = True
) -> float:
    """The 0-1 figure a router reads as KV-cache usage (vllm:kv_cache_usage_perc; a picker saturates
    at 0.8): the larger of the table's share and the governor's fraction scaled so that yellow's
    threshold reads 0.8, and 1 at orange or red or while loading (docs/ARCHITECTURE.md, "Behind a
    router"). The table's share anticipates: it counts a request's whole prompt once the engine has
    it, before prefill allocates it. The governor's share sees what the arithmetic misses."""
    if not ready or band in ("orange", "red"):
        return 1.0
    governed = 0.0 if governor_fraction is None else governor_fraction * ROUTER_SATURATION / yellow
    return round(min(1.0, max(table_usage or 0.0, governed)), 4)


def _kv_cache(s: ServerState) -> dict:
    """KV bytes the running streams hold (each model's table's arithmetic, at each stream's prompt
    plus what it generated, and each running embedding's at its longest input) against the smallest
    KV budget of the resident models' tables: memory is shared, and each table already leaves out the
    other models' weights. The prompt caches' bounds are off those budgets already. Blocks are the
    preloaded model's prompt cache's."""
    used = budget = table_usage = blocks = None
    tables = [(m, t) for m in s.resident() if (t := m.table()) is not None and m.engine is not None]
    if tables:
        used = sum(t.stream_bytes(len(r.prompt_ids) + r.generated) for m, t in tables for r in m.engine.requests())  # type: ignore[union-attr]
        used += sum(t.stream_bytes(n) for m, t in tables for e in list(m.embeddings.values()) if (n := e.cache_tokens))
        budget = min(t.budget.kv_bytes for _, t in tables)
        # six places: a small model's stream holds a few MB of a budget of tens of GB
        table_usage = round(used / budget, 6) if budget else 1.0
    cache = s.default.engine.prompt_cache if s.default.engine is not None else None
    table = s.default.table()
    if table is not None and cache is not None and cache.enabled:
        blocks = int(cache.max_bytes // (cache.block_tokens * kv_bytes_per_token(table.geometry, table.kv)))
    gov = s.governor.snapshot() if s.governor is not None and s.governor.enabled else {}
    yellow = (gov.get("thresholds") or {}).get("yellow", ROUTER_SATURATION)
    return {
        "used_bytes": used,
        "budget_bytes": budget,
        "table_usage": table_usage,
        "governor_fraction": gov.get("fraction"),
        "usage": kv_usage(table_usage, gov.get("fraction"), gov.get("band"), yellow, s.ready),
        "block_tokens": cache.block_tokens if blocks is not None else None,
        "blocks": blocks,
    }


def _prompt_cache(s: ServerState) -> dict:
    """The preloaded model's prompt cache (each model has its own; a reload starts its entries
    afresh, its counters go on). While it is not loaded: empty, its counters as they stand."""
    m = s.default
    if m.engine is not None:
        cache = m.engine.prompt_cache
        return cache.snapshot() if cache is not None else {"enabled": False}
    limit = m.settings.prompt_cache_limit(m.deployment.memory)
    if limit <= 0:
        return {"enabled": False}
    empty = {"max_bytes": limit, "bytes": 0, "entries": 0, "block_tokens": m.settings.prompt_cache_block}
    return {"enabled": True, **empty, "entries_by_kind": {}, **m.prompt_cache_stats.to_json()}


def _resident_models(s: ServerState) -> list[dict]:
    """Each model with an engine (loading or loaded), its own figures and capacity table."""
    out = []
    for m in s.resident():
        engine = m.engine
        assert engine is not None
        loaded = engine.loaded
        rate = engine.stats.decode_tok_s_recent()
        out.append(
            {
                "model": m.model_id,
                "kind": "chat",
                "status": m.status,
                "in_flight": engine.in_flight,
                "waiting": m.gate.waiting,
                "decode_batch": m.gate.width,
                "weight_mode": loaded.mode if loaded is not None else m.deployment.mode,
                "weight_bytes": m.weight_bytes(),
                "context_length": loaded.context_length if loaded is not None else None,
                "load_seconds": round(loaded.load_seconds, 2) if loaded is not None else None,
                "loaded_at": m.loaded_at,
                "last_used_at": m.last_used,
                "decode_tok_s": _round(rate),
                "capacity": _model_capacity(m),
            }
        )
    return out


# Section -> (probe, the fields it reports null when the probe fails).
SECTIONS: dict[str, tuple[Probe, tuple[str, ...]]] = {
    "concurrency": (_concurrency, ("decode_batch", "queue_cap", "in_flight", "waiting")),
    "queue": (
        _queue,
        ("waiting", "cap", "eta_s", "rejections", "timeouts", "rejections_by_reason", "last_reject_reason"),
    ),
    "connections": (_connections, ("open", "cap", "refused", "evicted", "header_timeouts", "body_timeouts")),
    "governor": (_governor, ("band", "enabled")),
    "memory": (
        _memory,
        (
            "active_bytes",
            "cache_bytes",
            "peak_bytes",
            "headroom_bytes",
            "budget_bytes",
            "process_rss_bytes",
            "system_available_bytes",
            "system_total_bytes",
        ),
    ),
    "capacity": (_capacity, ()),
    "rates": (
        _rates,
        (
            "decode_tok_s",
            "decode_streams",
            "prefill_tok_s_recent",
            "decode_tok_s_recent",
            "decode_tok_s_lifetime",
            "speculative_accept_rate",
        ),
    ),
    "totals": (_totals, ("requests_finished", "prompt_tokens", "generated_tokens")),
    "embeddings": (_embeddings, ("requests", "failed", "input_tokens", "running", "waiting")),
    "kv_cache": (
        _kv_cache,
        ("used_bytes", "budget_bytes", "table_usage", "governor_fraction", "usage", "block_tokens", "blocks"),
    ),
    "prompt_cache": (
        _prompt_cache,
        (
            "enabled",
            "max_bytes",
            "bytes",
            "entries",
            "hits",
            "misses",
            "hit_rate",
            "reused_tokens",
            "stored_bytes",
            "evicted_bytes",
        ),
    ),
    "requests": (_requests, ()),
    "resident_models": (_resident_models, ()),
    # Percentiles over the last 300 s of what the latency histograms observe (server/latency.py): `gmlx top`.
    "latency": (
        lambda s: s.histograms.latency(),
        ("window_s", "ttft_seconds", "inter_token_seconds", "e2e_seconds", "queue_wait_seconds"),
    ),
}


def snapshot(s: ServerState) -> dict:
    server: dict[str, Any] = {}
    for name, (probe, fields) in SECTIONS.items():
        try:
            server[name] = probe(s)
        except Exception:
            log.exception("metrics section %s failed; reporting nulls", name)
            server[name] = dict.fromkeys(fields) if fields else None
    return {"server": server}


def _round(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)
