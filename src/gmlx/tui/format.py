"""Numbers for people: 1.2 GiB, 41.3 tok/s, 3 m 12 s. Anything that is not a number prints as a dash."""

from __future__ import annotations

from typing import Any

DASH = "-"


def num(x: Any) -> float | None:
    """`x` when it is a real number (not a bool); None for anything a server might send instead."""
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def dict_of(x: Any) -> dict:
    return x if isinstance(x, dict) else {}


def list_of(x: Any) -> list:
    return x if isinstance(x, list) else []


def text(x: Any) -> str:
    return DASH if x is None or x == "" else str(x)


def size(x: Any) -> str:
    n = num(x)
    if n is None:
        return DASH
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def rate(x: Any) -> str:
    n = num(x)
    return DASH if n is None else f"{n:.1f} tok/s"


def count(x: Any) -> str:
    """Token counts: 812, 12.4 K, 1.5 M."""
    n = num(x)
    if n is None:
        return DASH
    if abs(n) < 10_000:
        return f"{n:.0f}"
    return f"{n / 1000:.1f} K" if abs(n) < 1_000_000 else f"{n / 1_000_000:.1f} M"


def tokens(x: Any) -> str:
    """Exact token counts with separators: 32,768."""
    n = num(x)
    return DASH if n is None else f"{n:,.0f}"


def duration(x: Any) -> str:
    """0.42 s, 12.5 s, 3 m 12 s, 2 h 05 m."""
    s = num(x)
    if s is None:
        return DASH
    if s < 1:
        return f"{s:.2f} s"
    if s < 60:
        return f"{s:.1f} s"
    m, sec = divmod(int(s), 60)
    if m < 60:
        return f"{m} m {sec:02d} s"
    h, m = divmod(m, 60)
    return f"{h} h {m:02d} m"


def percent(x: Any) -> str:
    """A fraction (0.8) as 80 %."""
    n = num(x)
    return DASH if n is None else f"{n * 100:.0f} %"


def latency(x: Any) -> str:
    """Latencies: 4.2 ms, 85 ms, then as durations (1.7 s)."""
    s = num(x)
    if s is None or s >= 1:
        return duration(s)
    return f"{s * 1000:.1f} ms" if s < 0.01 else f"{s * 1000:.0f} ms"


def short_duration(x: Any) -> str:
    """A table cell's duration: 0.80s, 11.4s, 3m20s, 2h05m."""
    return duration(x).replace(" s", "s").replace(" m ", "m").replace(" h ", "h").replace(" m", "m")


def short_size(x: Any) -> str:
    """A table cell's size: 288M, 1.2G."""
    n = num(x)
    if n is None:
        return DASH
    for unit in ("B", "K", "M", "G", "T"):
        if abs(n) < 1000 or unit == "T":
            return f"{n:.0f}{unit}" if unit == "B" or abs(n) >= 10 else f"{n:.1f}{unit}"
        n /= 1024
    raise AssertionError("unreachable")
