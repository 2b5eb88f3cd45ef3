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

HISTORY = 300  # samples kept for the sparklines: five minutes at the default interval
MAX_BACKOFF_S = 30.0


class Status(Enum):
    CONNECTING = "connecting"
    UP = "up"
    DOWN = "down"
    AUTH = "key needed"  # /v1/metrics answered 401


@dataclass
class History:
    decode: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY))
    prefill: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY))
    queue: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY))


class Poller:
    """One server. `poll()` never raises for what the network or the server does."""

    def __init__(self, url: str, api_key: str | None = None, interval: float = 1.0):
        self.url = url.rstrip("/")
        self.interval = interval
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=max(2.0, 2 * interval))
        self.status = Status.CONNECTING
        self.error: str | None = None
        self.failures = 0
        self.metrics: dict[str, Any] = {}  # the `server` object of /v1/metrics
        self.system: dict[str, Any] = {}
        self.ready: dict[str, Any] = {}
        self.history = History()
        self.polled_at: float | None = None  # monotonic time of the last poll that reached the server
        self._totals: tuple[float, float, float] | None = None  # (time, prompt tokens, generated tokens)

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
                "this server needs its API key: --url URL#KEY, a fleet file, "
                "or --api-key KEY (GMLX_API_KEY) for every server",
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
        self._totals = None

    def _sample(self, now: float) -> None:
        """Token rates from the growth of the totals between two polls; queue depth as it is."""
        totals = dict_of(self.metrics.get("totals"))
        prompt, generated = num(totals.get("prompt_tokens")), num(totals.get("generated_tokens"))
        if prompt is not None and generated is not None:
            if self._totals is not None and now > self._totals[0]:
                dt = now - self._totals[0]
                self.history.prefill.append(max(0.0, (prompt - self._totals[1]) / dt))
                self.history.decode.append(max(0.0, (generated - self._totals[2]) / dt))
            self._totals = (now, prompt, generated)
        waiting = num(dict_of(self.metrics.get("queue")).get("waiting"))
        if waiting is not None:
            self.history.queue.append(waiting)

    async def aclose(self) -> None:
        await self._http.aclose()


def _json(r: httpx.Response) -> dict[str, Any]:
    try:
        return dict_of(r.json())
    except ValueError:
        return {}
