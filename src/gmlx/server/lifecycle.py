"""The uvicorn server: built with the connection limits, and shut down gracefully: stop admitting,
let running streams finish for a while (or not at all after a second signal), then cancel them
through the engine, so every client gets a proper end (an error event, not a cut connection)."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from types import FrameType

import uvicorn
from starlette.applications import Starlette

from gmlx import upstream
from gmlx.server.connections import connection_cap, guarded_protocol, limit_log_repeats, raise_fd_limit
from gmlx.server.state import ServerState

log = logging.getLogger("gmlx.server")
_CANCEL_GRACE_S = 2.0  # time for cancelled streams to send their last event
CONNECTION_CLOSE_S = 3  # after draining, what open connections get before uvicorn cuts them


def build_server(app: Starlette, port: int | None = None) -> DrainingServer:
    """The uvicorn server for `app` with the settings' connection limits (`port` overrides the
    settings', as tests ask for 0, a free one)."""
    state: ServerState = app.state.gmlx
    s = state.settings
    state.connections.cap = connection_cap(s.max_connections, raise_fd_limit())
    config = uvicorn.Config(
        app,
        host=s.host,
        port=s.port if port is None else port,
        log_level=s.log_level,
        access_log=False,
        timeout_graceful_shutdown=CONNECTION_CLOSE_S,
        http=guarded_protocol(state.connections, s.header_timeout),
        timeout_keep_alive=s.keep_alive_timeout,
    )  # type: ignore[arg-type]  # uvicorn takes a float
    limit_log_repeats("uvicorn", "uvicorn.error", "uvicorn.access")  # after uvicorn has set its loggers up
    return DrainingServer(config, state, s.shutdown_timeout)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout: float):
        super().__init__(config)
        self.state, self.drain_timeout = state, drain_timeout
        self.hurried = False  # a second signal: cancel running streams now rather than after the timeout

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and not self.hurried:
            log.warning("shutting down: second signal, cancelling running requests now")
            self.hurried = True
            return
        super().handle_exit(sig, frame)  # the first signal drains; a third is uvicorn's force quit

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await drain(self.state, self.drain_timeout, lambda: self.hurried)
        await super().shutdown(sockets)
        # uvicorn re-raises a captured signal once it has stopped, so the process would die of the
        # SIGTERM or SIGINT it just handled (exit -15, or 130); a drained shutdown is a clean exit, 0.
        upstream.forget_signals(self)


async def drain(state: ServerState, timeout: float, hurried: Callable[[], bool] = lambda: False) -> None:
    for m in state.models.values():
        m.gate.close()
    running = sum(e.in_flight for e in state.engines())
    if running:
        log.info("shutting down: waiting up to %g s for %d running request(s)", timeout, running)
    if not await _until_idle(state, timeout, hurried):
        log.warning("shutting down: cancelling %d request(s) still running", sum(e.in_flight for e in state.engines()))
        for engine in state.engines():
            engine.cancel_all()
        await _until_idle(state, _CANCEL_GRACE_S)


async def _until_idle(state: ServerState, timeout: float, stop_early: Callable[[], bool] = lambda: False) -> bool:
    """True once nothing runs; False when `timeout` passes or `stop_early()` says so first."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while any(e.in_flight for e in state.engines()) or any(m.gate.running for m in state.models.values()):
        if loop.time() >= deadline or stop_early():
            return False
        await asyncio.sleep(0.05)
    return True
