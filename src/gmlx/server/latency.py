"""Latency percentiles over a sliding window, for `server.latency` in /v1/metrics (what `gmlx top`
shows). Fed the same observations as the Prometheus histograms. Memory stays bounded at any rate:
the window is kept as SLOT_S-second slots of log-spaced buckets, so a quantile is a bucket's
geometric middle, within GROWTH's half-step (1%) of the exact value."""

from __future__ import annotations

import math
import threading
import time
from collections import Counter, deque

WINDOW_S = 300
SLOT_S = 5  # the window moves in steps of this many seconds
GROWTH = 1.02  # each bucket's upper bound over its lower one
_ZERO = -(10**6)  # the bucket of a zero (or clock-skewed negative) duration
QUANTILES = {"p50": 0.5, "p95": 0.95, "p99": 0.99}


def _bucket(seconds: float) -> int:
    return _ZERO if seconds <= 0 else math.floor(math.log(seconds, GROWTH))


def _value(bucket: int) -> float:
    return 0.0 if bucket == _ZERO else round(GROWTH ** (bucket + 0.5), 6)


class Window:
    """One series' observations of the last WINDOW_S seconds. Observed on any thread (the engine's
    for the inter-token gaps), read on the event loop: one lock."""

    def __init__(self) -> None:
        self._slots: deque[tuple[int, Counter[int]]] = deque()
        self._lock = threading.Lock()

    def observe(self, seconds: float, now: float | None = None) -> None:
        slot = int((time.monotonic() if now is None else now) // SLOT_S)
        with self._lock:
            if not self._slots or self._slots[-1][0] != slot:
                self._slots.append((slot, Counter()))
                while self._slots[0][0] <= slot - WINDOW_S // SLOT_S:
                    self._slots.popleft()
            self._slots[-1][1][_bucket(seconds)] += 1

    def summary(self, now: float | None = None) -> dict[str, int | float | None]:
        """{"count", "p50", "p95", "p99"} over the window (nearest rank); the quantiles are null when count is 0."""
        oldest = int((time.monotonic() if now is None else now) // SLOT_S) - WINDOW_S // SLOT_S + 1
        merged: Counter[int] = Counter()
        with self._lock:
            for slot, counts in self._slots:
                if slot >= oldest:
                    merged.update(counts)
        count = sum(merged.values())
        out: dict[str, int | float | None] = {"count": count, **dict.fromkeys(QUANTILES)}
        if count:
            ranked = sorted(merged.items())
            for name, q in QUANTILES.items():
                rank, seen = max(1, math.ceil(q * count)), 0
                for bucket, n in ranked:
                    seen += n
                    if seen >= rank:
                        out[name] = _value(bucket)
                        break
        return out
