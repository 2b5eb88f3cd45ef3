"""The admission gate: at most `width` requests run, at most `cap` wait, none waits forever.

It lives on the event loop (no locks): a request takes a slot at once when one is free,
nobody is waiting and `admission_allowed()` says yes, else queues in arrival order; a
finished request hands its slot straight to the oldest waiter. The memory governor sets
`admission_allowed` and calls `poke()` when its answer may have turned to yes.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter, deque
from collections.abc import Callable

from gmlx.server.errors import APIError

# Before any request has finished there is no drain rate to go on (the defaults of docs/ARCHITECTURE.md, "Contract").
RETRY_AFTER_FULL_S = 5
RETRY_AFTER_TIMEOUT_S = 10
RETRY_AFTER_MAX_S = 60


class AdmissionGate:
    def __init__(
        self,
        width: int,
        cap: int,
        timeout_s: float,
        drain: Callable[[], tuple[float | None, float | None]] = lambda: (None, None),
    ):
        """`drain` returns (mean generated tokens per request, aggregate decode tok/s), or Nones."""
        self.width, self.cap, self.timeout_s = width, cap, timeout_s
        self._drain = drain
        self.running = 0
        self._waiters: deque[tuple[asyncio.Future, int]] = deque()  # (granted when set, slots wanted)
        self.rejections = 0
        self.rejections_by_code: Counter[str] = Counter()
        self.last_reject_reason: str | None = None
        self.last_reject_at: float | None = None  # monotonic
        self.closed = False
        self.last_release = 0.0  # unix time slots were last given back (a request ended)
        self.admission_allowed: Callable[[], bool] = lambda: True

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def retry_after(self, fallback: int = RETRY_AFTER_FULL_S, waiting: int | None = None) -> int:
        """Seconds until `waiting` more requests finish (by default everyone queued and one more, the
        slot a request arriving now would take): waiting x mean tokens / decode rate."""
        mean, rate = self._drain()
        if not mean or not rate:
            return fallback
        ahead = self.waiting + 1 if waiting is None else waiting
        return min(RETRY_AFTER_MAX_S, max(1, math.ceil(ahead * mean / rate)))

    async def acquire(self, slots: int = 1) -> None:
        """Wait for `slots` slots together (a request's choices decode side by side; at most
        `width`); raises APIError 503 `queue_full` or `queue_timeout`. Cancelling the caller (a
        client gone) gives its place, or its slots, back."""
        assert 1 <= slots <= self.width
        if self.closed:
            raise self._shutting_down()
        if self.running + slots <= self.width and not self._waiters and self.admission_allowed():
            self.running += slots
            return
        if len(self._waiters) >= self.cap:
            raise self._reject("queue_full", "the admission queue is full", self.retry_after(RETRY_AFTER_FULL_S))
        slot = asyncio.get_running_loop().create_future()
        place = (slot, slots)
        self._waiters.append(place)
        try:
            await asyncio.wait_for(asyncio.shield(slot), self.timeout_s)
        except TimeoutError:
            if _granted(slot):  # handed its slots just as the time ran out: keep them
                return
            position = self._waiters.index(place) + 1  # its own turn: those ahead of it, then itself
            self._waiters.remove(place)
            message = f"waited {self.timeout_s:g} s for a slot"
            retry = self.retry_after(RETRY_AFTER_TIMEOUT_S, waiting=position)
            raise self._reject("queue_timeout", message, retry) from None
        except asyncio.CancelledError:
            if _granted(slot):
                self.release(slots)
            elif not slot.done():
                self._waiters.remove(place)
                slot.cancel()
            raise

    def close(self) -> None:
        """Shutting down: every waiter, and every request from now on, gets 503."""
        self.closed = True
        self.refuse_waiting(self._shutting_down())

    def refuse_waiting(self, error: APIError) -> None:
        """Every waiter gets `error` (its model failed to load, or the server shuts down)."""
        for slot, _ in self._waiters:
            if not slot.done():
                slot.set_exception(error)
        self._waiters.clear()

    def _shutting_down(self) -> APIError:
        return APIError(503, "the server is shutting down", "shutting_down", retry_after=RETRY_AFTER_FULL_S)

    def release(self, slots: int = 1) -> None:
        """Free slots: the oldest waiter takes them over if admission allows, else the running count drops."""
        self.running -= slots
        self.last_release = time.time()
        self.poke()

    def poke(self) -> None:
        """Grant free slots to the oldest waiters, in order, for as long as they fit and admission allows."""
        while self._waiters and self.running + self._waiters[0][1] <= self.width and self.admission_allowed():
            slot, slots = self._waiters.popleft()
            if not slot.done():
                self.running += slots
                slot.set_result(None)

    def _reject(self, code: str, message: str, retry_after: int) -> APIError:
        self.rejections += 1
        self.rejections_by_code[code] += 1
        self.last_reject_reason, self.last_reject_at = code, time.monotonic()
        return APIError(503, f"server busy: {message}; retry after {retry_after} s", code, retry_after=retry_after)


class Slot:
    """One request's slot, given back once: when the engine ends the request, or as soon as its
    client leaves. The second is safe because the engine runs commands in order: it drops the
    cancelled request before it takes the one the freed slot admits, which would otherwise wait
    a whole prefill step behind a request nobody reads."""

    def __init__(self, gate: AdmissionGate):
        self._gate: AdmissionGate | None = gate

    def release(self) -> None:
        if self._gate is not None:
            gate, self._gate = self._gate, None
            gate.release()


def _granted(slot: asyncio.Future) -> bool:
    return slot.done() and not slot.cancelled() and slot.exception() is None
