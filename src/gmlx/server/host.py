"""The host under /system → host: CPU use per core and this process's resident memory, what a console
shows where there is no GPU telemetry. Cheap enough to poll: psutil's counters are read without
blocking, and CPU use is measured between two readings."""

from __future__ import annotations

import threading
import time

import psutil

MIN_SPAN_S = 0.5  # two pollers a moment apart share a reading instead of measuring a few ms each

_PROCESS = psutil.Process()
_lock = threading.Lock()
_last: tuple[float, list[float] | None, float | None] = (0.0, None, None)  # (when, per core %, process %)


def _prime() -> None:
    """psutil measures CPU use from the previous call: the first reading after import has a span."""
    global _last
    psutil.cpu_percent(percpu=True)
    _PROCESS.cpu_percent()
    _last = (time.monotonic(), None, None)


_prime()


def telemetry() -> dict:
    """`cpu_pct_per_core`: each logical CPU's use in % since the previous reading (null until one has
    passed); `process_cpu_pct`: this server's use, 100 per core it keeps busy; `process_rss_bytes`."""
    global _last
    with _lock:
        now = time.monotonic()
        if now - _last[0] >= MIN_SPAN_S:
            _last = (now, psutil.cpu_percent(percpu=True), _PROCESS.cpu_percent())
        _, cores, process = _last
    return {
        "cpu_pct_per_core": cores,
        "process_cpu_pct": process,
        "process_rss_bytes": _PROCESS.memory_info().rss,
    }
