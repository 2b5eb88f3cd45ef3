"""The one metrics snapshot (docs/ARCHITECTURE.md, decision 6): built here section by section; a section
whose probe raises reports null fields and the rest still answers. Prometheus text is rendered
from the same snapshot, so the two never disagree."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import psutil

from gmlx.capacity.memory import kv_bytes_after_prefill, kv_bytes_per_token, warmup_per_token
from gmlx.capacity.table import CapacityTable
from gmlx.engine.engine import drafting_refused
from gmlx.server.admission import RETRY_AFTER_FULL_S
from gmlx.server.state import ServerState

log = logging.getLogger("gmlx.metrics")

Probe = Callable[[ServerState], Any]
ROUTER_SATURATION = 0.8  # where the Gateway API Inference Extension's picker calls a server saturated


def _concurrency(s: ServerState) -> dict:
    return {
        "decode_batch": s.gate.width,
        "queue_cap": s.gate.cap,
        "in_flight": s.gate.running,
        "waiting": s.gate.waiting,
    }


def _queue(s: ServerState) -> dict:
    g = s.gate
    return {
        "waiting": g.waiting,
        "cap": g.cap,
        "eta_s": g.retry_after(RETRY_AFTER_FULL_S),
        "rejections": g.rejections,
        "timeouts": g.rejections_by_code.get("queue_timeout", 0),
        "rejections_by_reason": dict(g.rejections_by_code),
        "last_reject_reason": g.last_reject_reason,
    }


def _connections(s: ServerState) -> dict:
    return s.connections.to_json()


def _governor(s: ServerState) -> dict:
    return s.governor.snapshot() if s.governor is not None else {"band": None, "enabled": False}


_PROCESS = psutil.Process()  # this server's process: looked up once, read at every snapshot


def _memory(s: ServerState) -> dict:
    active, cache = mx.get_active_memory(), mx.get_cache_memory()
    table = s.table()
    usable = table.budget.total_bytes - table.budget.reserve_bytes if table else None
    vm = psutil.virtual_memory()
    return {
        "active_bytes": active,
        "cache_bytes": cache,
        "peak_bytes": mx.get_peak_memory(),  # MLX's high-water mark since the start-up warm-up
        "headroom_bytes": usable - active - cache if usable is not None else None,
        "budget_bytes": table.budget.total_bytes if table else None,
        "process_rss_bytes": _PROCESS.memory_info().rss,
        "system_available_bytes": vm.available,
        "system_total_bytes": vm.total,
    }


_table_json: tuple[CapacityTable, dict] | None = None  # the last table and its JSON (a table never changes)


def _capacity(s: ServerState) -> dict | None:
    global _table_json
    table, measured = s.table(), s.engine.measured
    if table is None:
        return None
    if _table_json is None or _table_json[0] is not table:  # its binary searches cost more than the rest
        _table_json = (table, table.to_json())
    out = dict(_table_json[1])  # the warm-up is added below; nothing changes the nested parts
    if measured is not None:
        out["warmup"] = {
            "tokens": measured.tokens,
            "kv_bytes_predicted": kv_bytes_after_prefill(table.geometry, measured.tokens, table.kv),
            "kv_bytes_measured": measured.kv_bytes,
            **warmup_per_token(table.geometry, measured.tokens, measured.kv_bytes, table.kv),
            "prefill_tok_s_measured": round(measured.prefill_tok_s, 1),
            "decode_tok_s_measured": round(measured.decode_tok_s, 2),
            # The warm-up prompt is short, so its peak sits well under one full chunk's prediction.
            "prefill_peak_bytes_measured": measured.prefill_peak_bytes,
            "prefill_bytes_predicted_per_chunk": table.budget.prefill_bytes,
        }
    return out


def _rates(s: ServerState) -> dict:
    st = s.engine.stats
    decode_recent, prefill_recent = st.request_means()
    return {
        "decode_tok_s": _round(st.decode_tok_s_recent()),
        "decode_streams": s.engine.decoding,
        "prefill_tok_s_recent": _round(prefill_recent),
        "decode_tok_s_recent": _round(decode_recent),
        "decode_tok_s_lifetime": _round(st.decode_tok_s_per_request_lifetime()),
        # The drafter's share of proposals the served model kept, over every finished request.
        "speculative_accept_rate": None if s.engine.draft is None else _round(st.speculative.accept_rate, 4),
    }


def _totals(s: ServerState) -> dict:
    st = s.engine.stats
    return {
        "requests_finished": dict(st.finish_reasons),
        "prompt_tokens": st.prefill_tokens,
        "generated_tokens": st.decode_tokens,
    }


def _requests(s: ServerState) -> list[dict]:
    now = time.monotonic()
    rows = [
        {
            "id": q.id,
            "uid": None,
            "model": s.model_id,
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
        }
        for q in list(s.queued.values())
    ]
    for r in s.engine.requests():
        rows.append(
            {
                "id": r.id,
                "uid": r.uid,
                "model": s.model_id,
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
            }
        )
    return rows


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
    """KV bytes the running streams hold (the table's arithmetic, at each one's prompt plus what it
    generated) against the table's KV budget; the prompt cache's bound is already off that budget."""
    table, cache = s.table(), s.engine.prompt_cache
    used = budget = table_usage = blocks = None
    if table is not None:
        used = sum(table.stream_bytes(len(r.prompt_ids) + r.generated) for r in s.engine.requests())
        budget = table.budget.kv_bytes
        table_usage = round(used / budget, 4) if budget else 1.0
        if cache is not None and cache.enabled:
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
    cache = s.engine.prompt_cache
    return cache.snapshot() if cache is not None else {"enabled": False}


def _resident_models(s: ServerState) -> list[dict]:
    loaded = s.engine.loaded
    if loaded is None:
        return []
    return [
        {
            "model": s.model_id,
            "kind": "chat",
            "in_flight": s.engine.in_flight,
            "decode_batch": s.gate.width,
            "weight_mode": loaded.mode,
            "weight_bytes": loaded.report.resident_bytes,
            "context_length": loaded.context_length,
        }
    ]


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
