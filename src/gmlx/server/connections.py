"""Connection guards: a cap on open connections, a deadline for each request's headers, the file
descriptor limit raised, and uvicorn's own refusals in the OpenAI error shape.

uvicorn closes idle keep-alive connections but has no deadline for a request that arrives slowly:
a client that trickles one header line at a time holds its socket for good, and a few thousand of
them exhaust the process's file descriptors, after which nothing, not even /health, connects. The
cap keeps connections well below that limit, so the model files, logs and /proc reads the server
needs still open; the header deadline frees what a slow client holds. The body's own deadline is
the app's (`http.read_json`), since only the route knows it is waiting for one.

The guard subclasses uvicorn's h11 protocol and relies on its `cycle` (None until a request's
headers are parsed, a new object for each request), `connections` (the server's set of open
connections), `transport`, `conn` and `send_400_response`; checked against uvicorn 0.54
(`tests/test_connections.py` fails if they change).
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
from dataclasses import dataclass
from typing import Any

from gmlx import upstream

log = logging.getLogger("gmlx.server")
FD_RESERVE = 64  # descriptors kept free of connections: model files, logs, /proc reads, the listener
RETRY_AFTER_CONNECTIONS_S = 1
LINGER_S = 0.5
MAX_LINGERING = 256  # descriptors a flood of refusals may hold for LINGER_S
FRESH_GRACE_S = 0.25  # a new connection's time to send its first bytes before it may be evicted


@dataclass
class ConnectionStats:
    """What the guard did, for /v1/metrics; written on the event loop only."""

    cap: int
    open: int = 0
    refused: int = 0  # at the cap with no idle connection to give way
    evicted: int = 0  # idle connections closed at the cap for a new one
    header_timeouts: int = 0
    body_timeouts: int = 0

    def to_json(self) -> dict[str, int]:
        return {
            "open": self.open,
            "cap": self.cap,
            "refused": self.refused,
            "evicted": self.evicted,
            "header_timeouts": self.header_timeouts,
            "body_timeouts": self.body_timeouts,
        }


def raise_fd_limit() -> int:
    """Raise the soft limit on open files to the hard one (a process may, unprivileged); returns
    the soft limit in force. macOS refuses an unlimited value, so it is capped there."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
    if want > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            log.info("cannot raise the open-file limit above %d", soft)
    return soft


def connection_cap(setting: int, fd_limit: int) -> int:
    """The connections admitted: the setting, but never so many that the process runs out of files."""
    return max(1, min(setting, fd_limit - FD_RESERVE))


def error_bytes(status: int, reason: str, message: str, code: str, retry_after: int | None = None) -> bytes:
    """A complete HTTP/1.1 response that closes the connection, its body in the OpenAI error shape,
    for refusals made before (or instead of) the app."""
    body = json.dumps(
        {
            "error": {
                "message": message,
                "type": "invalid_request_error" if status < 500 else "service_unavailable",
                "code": code,
                "param": None,
            }
        }
    ).encode()
    head = [
        f"HTTP/1.1 {status} {reason}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
    ]
    if retry_after is not None:
        head.append(f"retry-after: {retry_after}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def guarded_protocol(stats: ConnectionStats, header_timeout_s: float) -> type:
    """uvicorn's h11 protocol with the cap and the header deadline; pass it as `Config(http=...)`.

    At the cap, a new connection takes the place of a stalled one, which holds no work: one that
    sent part of a request's headers and no more yet, or sits idle between requests (the longest
    stalled goes first). So slow or idle clients cannot keep out one that sends its request at
    once. A connection from which nothing has been read yet is spared for FRESH_GRACE_S, so a
    newcomer gets to send its headers before the next may take its place. With none to give
    way, the new one is refused with a 503 that a load balancer retries elsewhere."""
    # Insertion-ordered, oldest first: connections with nothing read yet (-> when connected), and
    # stalled ones; together, every admitted connection that has no request's headers in.
    fresh: dict[GuardedProtocol, float] = {}
    stalled: dict[GuardedProtocol, None] = {}
    lingering = 0  # answers waiting for LINGER_S to pass

    def answer_and_close(transport: asyncio.BaseTransport, response: bytes) -> None:
        """Write a final `response`, stop writing, and drop the connection a moment later. Closing at
        once, with the client's request still unread, would reset the connection and lose the answer
        in the client's buffer; past MAX_LINGERING such answers at once, the moment is skipped."""
        nonlocal lingering
        assert isinstance(transport, asyncio.WriteTransport)
        transport.write(response)
        if lingering >= MAX_LINGERING or not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        lingering += 1

        def drop() -> None:
            nonlocal lingering
            lingering -= 1
            transport.abort()

        asyncio.get_running_loop().call_later(LINGER_S, drop)

    def give_way() -> None:
        if stalled:
            next(iter(stalled))._close("evicted")
        elif fresh and time.monotonic() - next(iter(fresh.values())) >= FRESH_GRACE_S:
            next(iter(fresh))._close("evicted")

    class GuardedProtocol(upstream.H11Protocol):
        _admitted = False  # counted in stats.open, from admission until closed
        _answered = False  # gmlx wrote its own final answer (400, 408): what still arrives is dropped
        _header_timer: asyncio.TimerHandle | None = None
        _waiting_cycle: Any = None  # the cycle that was current when this connection went idle

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            if stats.open >= stats.cap:
                give_way()
            if stats.open >= stats.cap:
                stats.refused += 1
                answer_and_close(
                    transport,
                    error_bytes(
                        503,
                        "Service Unavailable",
                        "too many open connections; retry shortly",
                        "too_many_connections",
                        RETRY_AFTER_CONNECTIONS_S,
                    ),
                )
                return
            self._admitted = True
            stats.open += 1
            super().connection_made(transport)
            self._waiting_cycle = None
            fresh[self] = time.monotonic()
            self._arm_header_deadline()

        def connection_lost(self, exc: Exception | None) -> None:
            if self.transport is None:  # refused: uvicorn's side never started
                return
            self._leave_idle()
            self._uncount()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self.transport is None or self._answered:  # refused, or answered and closing: read and drop
                return
            if self._header_timer is None and self in stalled:
                self._arm_header_deadline()  # the first bytes of the next request on a kept-alive connection
            super().data_received(data)
            if self.cycle is not self._waiting_cycle:  # a request's headers arrived: the app takes it from here
                self._leave_idle()
            elif fresh.pop(self, None) is not None:  # part of its headers only
                stalled[self] = None

        def on_response_complete(self) -> None:
            super().on_response_complete()  # keep-alive's idle timer runs until the next request's bytes
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self._waiting_cycle = self.cycle
                stalled[self] = None

        def send_400_response(self, msg: str) -> None:
            self._answered = True
            self._leave_idle()
            answer_and_close(
                self.transport, error_bytes(400, "Bad Request", f"invalid HTTP request: {msg}", "invalid_http")
            )

        def _leave_idle(self) -> None:
            fresh.pop(self, None)
            stalled.pop(self, None)
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _uncount(self) -> None:
            if self._admitted:
                self._admitted = False
                stats.open -= 1

        def _arm_header_deadline(self) -> None:
            self._header_timer = self.loop.call_later(header_timeout_s, self._close, "header_timeout")

        def _close(self, why: str) -> None:
            """Close an idle connection: its headers are late (a 408 says so), or a new one needs its place
            (uncounted at once, so that one is admitted now rather than when the close completes)."""
            self._leave_idle()
            if self.transport.is_closing():
                return
            if why == "header_timeout":
                stats.header_timeouts += 1
                self._answered = True
                answer_and_close(
                    self.transport,
                    error_bytes(
                        408,
                        "Request Timeout",
                        f"the request's headers did not arrive within {header_timeout_s:g} s",
                        "header_timeout",
                    ),
                )
            else:
                stats.evicted += 1
                self._uncount()
                self.transport.close()

    return GuardedProtocol


class RepeatFilter(logging.Filter):
    """Lets a message through at most once per `window_s` (keyed by logger and format string), then
    says how many were held back: one failing accept() loop must not write 30 MB of log in 10 s."""

    def __init__(self, window_s: float = 10.0):
        super().__init__()
        self.window_s = window_s
        self._seen: dict[tuple[str, Any], tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:  # only repeated warnings and errors flood
            return True
        if (decided := getattr(record, "gmlx_repeat_pass", None)) is not None:
            return decided  # the same record at a second handler
        record.gmlx_repeat_pass = passes = self._decide(record)
        return passes

    def _decide(self, record: logging.LogRecord) -> bool:
        key, now = (record.name, str(record.msg)), time.monotonic()
        last, held = self._seen.get(key, (None, 0))
        if last is not None and now - last < self.window_s:
            self._seen[key] = (last, held + 1)
            return False
        if held and last is not None:
            record.msg = f"{record.msg} [{held} more like this in the last {now - last:.1f} s]"
        self._seen[key] = (now, 0)
        if len(self._seen) > 1024:  # bounded: the oldest half goes
            for k in sorted(self._seen, key=lambda k: self._seen[k][0])[:512]:
                del self._seen[k]
        return True


def limit_log_repeats(*logger_names: str) -> None:
    """Install one RepeatFilter on every handler of the root logger and of the named ones."""
    repeat = RepeatFilter()
    for name in ("", *logger_names):
        for handler in logging.getLogger(name).handlers:
            handler.addFilter(repeat)
