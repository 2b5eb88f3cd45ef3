"""Graceful shutdown: stop admitting, let running streams finish for a while, then cancel them
through the engine, so every client gets a proper end (an error event, not a cut connection)."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket

import uvicorn

from gmlx.server.app import ServerState

log = logging.getLogger("gmlx.server")
_CANCEL_GRACE_S = 2.0  # time for cancelled streams to send their last event


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout: float):
        super().__init__(config)
        self.state, self.drain_timeout = state, drain_timeout

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await drain(self.state, self.drain_timeout)
        await super().shutdown(sockets)
        # uvicorn re-raises a captured signal once it has stopped, so the process would die of the
        # SIGTERM or SIGINT it just handled (exit -15, or 130); a drained shutdown is a clean exit, 0.
        self._captured_signals = [s for s in self._captured_signals if s not in (signal.SIGTERM, signal.SIGINT)]


async def drain(state: ServerState, timeout: float) -> None:
    state.gate.close()
    engine = state.engine
    if engine.in_flight:
        log.info("shutting down: waiting up to %g s for %d running request(s)", timeout, engine.in_flight)
    if not await _until_idle(state, timeout):
        log.warning("shutting down: cancelling %d request(s) still running", engine.in_flight)
        engine.cancel_all()
        await _until_idle(state, _CANCEL_GRACE_S)


async def _until_idle(state: ServerState, timeout: float) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while state.engine.in_flight or state.gate.running:
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(0.05)
    return True
