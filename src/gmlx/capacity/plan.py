"""The plan answer: do W streams of D tokens fit in memory (ok), and can they start now (admit_now)?"""

from __future__ import annotations

from dataclasses import dataclass

from gmlx.capacity.table import CapacityTable

# Governor bands under which new work may start; orange and red hold it back.
_OPEN_BANDS = (None, "green", "yellow")


@dataclass(frozen=True)
class LiveState:
    decode_batch: int
    in_flight: int
    waiting: int
    band: str | None = None  # governor band: green, yellow, orange or red; None without a governor
    not_ready: str | None = None  # why the server takes no work at all now ("model loading", "shutting down")


def plan(
    table: CapacityTable | None, width: int, depth: int, live: LiveState, model: str, overcommit: bool = False
) -> dict:
    """The fields of GET /v1/capacity/plan; `reason` names the first failing check, else 'ok'."""
    if width < 1 or depth < 1:
        raise ValueError(f"{'width' if width < 1 else 'depth'} must be at least 1")
    max_context = table.max_context_at_width(width) if table else None
    max_width = table.max_width_at_depth(depth) if table else None
    too_wide = table is not None and width > table.decode_batch  # more streams than ever run together
    # Overcommit keeps the table's figures on show but stops them deciding anything.
    ok = None if max_context is None or overcommit else depth <= max_context and not too_wide
    slots = max(0, live.decode_batch - live.in_flight)
    free = min(slots, 1) if live.band == "yellow" else slots  # yellow lets one stream in at a time

    if live.not_ready:
        reason = live.not_ready
    elif ok is False and too_wide:
        reason = f"width {width} exceeds the decode batch {live.decode_batch}"
    elif ok is False:
        reason = f"depth {depth} exceeds max context {max_context} at width {width}"
    elif live.band not in _OPEN_BANDS:
        reason = f"governor {live.band}"
    elif live.waiting > 0:
        reason = f"{live.waiting} waiting for a slot"
    elif free < width:
        reason = f"{free} free slot(s) of {live.decode_batch}, need {width}"
    else:
        reason = "ok"
    return {
        "width": width,
        "depth": depth,
        "ok": ok,
        "max_context_at_width": max_context,
        "max_width_at_depth": max_width,
        "model": model,
        "band": live.band,
        "decode_batch": live.decode_batch,
        "in_flight": live.in_flight,
        "waiting": live.waiting,
        "slots": slots,
        "admit_now": reason == "ok",
        "reason": reason,
    }
