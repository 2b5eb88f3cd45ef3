"""Polls one server's `/v1/metrics`, `/system` and `/health?ready=1` with async httpx, and keeps what
the dashboard draws: the last answers, whether the server is up, and a few minutes of rates."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import httpx

from gmlx.tui.format import dict_of, num

HISTORY_S = 300.0  # what the sparklines span: a fixed five minutes, whatever the interval
RATE_WINDOW_S = 10.0  # token rates are the counters' growth over this long (a prefill chunk lands at once)
MAX_BACKOFF_S = 30.0


class Status(Enum):
    CONNECTING = "connecting"
    UP = "up"
    DOWN = "down"
    AUTH = "key needed"  # /v1/metrics answered 401


@dataclass
class History:
    """(monotonic time, value) samples of the last HISTORY_S: aggregate token rates, and queue depth."""

    decode: deque[tuple[float, float]] = field(default_factory=deque)
    prefill: deque[tuple[float, float]] = field(default_factory=deque)
    queue: deque[tuple[float, float]] = field(default_factory=deque)

    def add(self, series: deque[tuple[float, float]], now: float, value: float) -> None:
        series.append((now, value))
        while series[0][0] < now - HISTORY_S:
            series.popleft()


def window(series: deque[tuple[float, float]], now: float, cells: int) -> list[float]:
    """The last HISTORY_S as `cells` values, oldest first: the largest sample in each slice of time,
    0 where none landed (before the first poll, or while the server was down), so the time axis
    stays fixed instead of stretching as history fills."""
    out = [0.0] * cells
    for t, v in series:
        i = int((t - (now - HISTORY_S)) / HISTORY_S * cells)
        if 0 <= i < cells:
            out[i] = max(out[i], v)
        elif i == cells:  # sampled at `now` exactly
            out[-1] = max(out[-1], v)
    return out


class Poller:
    """One server. `poll()` never raises for what the network or the server does."""

    def __init__(self, url: str, api_key: str | None = None, interval: float = 1.0):
        self.url = url.rstrip("/")
        self.interval = interval
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._keyed = bool(api_key)
        self._http = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=max(2.0, 2 * interval))
        self.status = Status.CONNECTING
        self.error: str | None = None
        self.failures = 0
        self.metrics: dict[str, Any] = {}  # the `server` object of /v1/metrics
        self.system: dict[str, Any] = {}
        self.ready: dict[str, Any] = {}
        self.history = History()
        self.polled_at: float | None = None  # monotonic time of the last poll that reached the server
        # (time, prompt tokens, generated tokens) of the polls in the last RATE_WINDOW_S, and one before
        self._totals: deque[tuple[float, float, float]] = deque()

    @property
    def delay(self) -> float:
        """Seconds to the next poll: the interval, doubled per failure in a row up to MAX_BACKOFF_S."""
        return min(self.interval * 2 ** min(self.failures, 16), max(MAX_BACKOFF_S, self.interval))

    async def poll(self) -> None:
        try:
            system, metrics, ready = await asyncio.gather(
                self._http.get("/system"), self._http.get("/v1/metrics"), self._http.get("/health?ready=1")
            )
        except httpx.HTTPError as e:
            return self._fail(Status.DOWN, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
        self.system = _json(system) if system.is_success else {}
        self.ready = _json(ready)
        if metrics.status_code == 401:
            self.metrics = {}
            return self._fail(
                Status.AUTH,
                ("this server refused the API key given" if self._keyed else "this server needs its API key")
                + ": --url URL#KEY, a fleet file, or --api-key KEY (GMLX_API_KEY) for every server",
            )
        if not metrics.is_success:
            message = dict_of(dict_of(_json(metrics)).get("error")).get("message")
            return self._fail(
                Status.DOWN, f"HTTP {metrics.status_code} from /v1/metrics" + (f": {message}" if message else "")
            )
        self.metrics = dict_of(_json(metrics).get("server"))
        self.status, self.error, self.failures = Status.UP, None, 0
        self.polled_at = time.monotonic()
        self._sample(self.polled_at)

    def _fail(self, status: Status, error: str) -> None:
        self.status, self.error = status, error
        self.failures += 1
        self._totals.clear()

    def _sample(self, now: float) -> None:
        """Aggregate token rates: the growth of the server's totals over the last RATE_WINDOW_S (the
        engine adds a prefill chunk's tokens when the chunk ends, so a shorter span would show bursts).
        Queue depth as it is."""
        totals = dict_of(self.metrics.get("totals"))
        prompt, generated = num(totals.get("prompt_tokens")), num(totals.get("generated_tokens"))
        if prompt is not None and generated is not None:
            if self._totals and (prompt < self._totals[-1][1] or generated < self._totals[-1][2]):
                self._totals.clear()  # the server restarted between two polls
            self._totals.append((now, prompt, generated))
            while len(self._totals) > 2 and self._totals[1][0] <= now - RATE_WINDOW_S:
                self._totals.popleft()
            t0, p0, g0 = self._totals[0]
            if now - t0 >= min(RATE_WINDOW_S, 10 * self.interval):  # a shorter span shows a chunk as a burst
                self.history.add(self.history.prefill, now, (prompt - p0) / (now - t0))
                self.history.add(self.history.decode, now, (generated - g0) / (now - t0))
        waiting = num(dict_of(self.metrics.get("queue")).get("waiting"))
        if waiting is not None:
            self.history.add(self.history.queue, now, waiting)

    def latest(self, series: deque[tuple[float, float]]) -> float | None:
        """What the last poll measured; None where it measured nothing: the server is down, or a
        fresh rate window still fills after a restart or an outage (an older sample is not "now")."""
        if self.status is not Status.UP or not series or series[-1][0] != self.polled_at:
            return None
        return series[-1][1]

    async def aclose(self) -> None:
        await self._http.aclose()


def _json(r: httpx.Response) -> dict[str, Any]:
    try:
        return dict_of(r.json())
    except ValueError:
        return {}
