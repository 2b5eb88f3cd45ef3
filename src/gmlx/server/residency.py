"""Which models are resident: loaded on demand under one memory budget, unloaded when idle.

Loading is a capacity decision made before any weight is read (docs/ARCHITECTURE.md, "Many
models"): a model loads when its weights, its reserve and one stream of a useful depth fit beside
the resident ones (its header's table, built against their weights: `Deployment.planned_table`)
and `max_resident` allows one more; otherwise the least recently used resident models with
nothing in flight or queued are unloaded first, as many as it takes; otherwise the request gets
503 `model_unavailable`. A model loads on its own engine thread; requests for it wait meanwhile in
its own queue (its gate admits nobody until it is ready). Idle models are unloaded after
`keep_alive` seconds, and by the memory governor under orange (`relieve`).

Everything here runs on the event loop, but for an engine's stop, which joins its thread.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from gmlx.deployment import Deployment
from gmlx.engine.engine import Engine
from gmlx.gguf.header import GGUFError
from gmlx.heap import trim_heap
from gmlx.server.admission import RETRY_AFTER_MAX_S
from gmlx.server.errors import APIError
from gmlx.server.state import LOADING_RETRY_AFTER_S, ModelState, ServerState
from gmlx.server.system import models_dir_files

log = logging.getLogger("gmlx.residency")
USEFUL_DEPTH = 2048  # a model that cannot hold one stream of this many tokens (or its window) is not loaded
_KEEP_ALIVE_POLL_S = 1.0
_UNLOAD_TIMEOUT_S = 30.0  # an idle engine stops within one command; this only bounds a stuck one

Build = Callable[[Deployment, int], Engine]


class Residency:
    def __init__(self, state: ServerState, build: Build, admits: Callable[[ModelState], bool] = lambda m: True):
        """`build(deployment, others_bytes)` makes a model's engine; `admits(model)` is the memory
        governor's say on admitting one more of its requests."""
        self._state, self._build, self._admits = state, build, admits
        self._lock = asyncio.Lock()  # one residency change at a time: each decision sees the last one's result
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop the gates live on, once started
        for m in state.models.values():
            self.register(m)

    def register(self, m: ModelState) -> None:
        m.gate.admission_allowed = lambda: m.ready and self._admits(m)

    def discover(self, model_id: str) -> ModelState | None:
        """A file added to the models directory since start, by its id (the listing, so a name
        cannot reach outside the directory)."""
        s = self._state.settings
        path = models_dir_files(s.models_dir).get(model_id)
        taken = {m.deployment.path.resolve() for m in self._state.models.values()}
        if path is None or path.resolve() in taken:
            return None
        m = self._state.models[model_id] = ModelState(
            Deployment(model_id, path, s, "models_dir"), self._state.histograms
        )
        self.register(m)
        return m

    # --- deciding ----------------------------------------------------------------------------

    def others_bytes(self, m: ModelState, leaving: Sequence[ModelState] = ()) -> int:
        """The weights resident beside `m`, but those of `leaving`."""
        return sum(r.weight_bytes() for r in self._state.resident() if r is not m and r not in leaving)

    def room_for(self, m: ModelState) -> tuple[bool, list[ModelState]]:
        """Whether `m` may load, and the idle models that would be unloaded first, oldest use first."""
        resident = [r for r in self._state.resident() if r is not m]
        idle = sorted((r for r in resident if r.status == "loaded" and r.idle), key=lambda r: r.busy_at())
        cap = self._state.settings.max_resident
        leaving: list[ModelState] = []
        while not (
            (cap is None or len(resident) - len(leaving) < cap) and self._fits(m, self.others_bytes(m, leaving))
        ):
            if not idle:
                return False, leaving
            leaving.append(idle.pop(0))
        return True, leaving

    def outlook(self, m: ModelState) -> tuple[str | None, list[ModelState]]:
        """For `m`, not resident: why a request for it would be refused now (None: it would load),
        and the idle models its load would unload first."""
        if _failed_before(m):
            return f"it failed to load: {m.load_error}", []
        ok, leaving = self.room_for(m)
        return (None, leaving) if ok else ("no room for it beside the busy models", [])

    @staticmethod
    def _fits(m: ModelState, others: int) -> bool:
        table, _ = m.deployment.planned_table(others)
        return table.max_context_at_width(1) >= min(USEFUL_DEPTH, table.context_length)

    # --- acting --------------------------------------------------------------------------------

    def prepare(self) -> None:
        """The preloaded model's engine, built but not started (a test may wrap its loader)."""
        self._attach(self._state.default)

    def preload(self) -> None:
        """Start loading the preloaded model (at start, before the server answers)."""
        engine = self._state.default.engine
        assert engine is not None, "prepare() first"
        engine.start()

    async def ensure(self, m: ModelState) -> None:
        """`m` resident or loading; 503 `model_unavailable` when it cannot be, and why."""
        m.last_used = time.time()
        if m.engine is not None:
            return
        async with self._lock:
            if m.engine is not None:  # loaded by a request that held the lock before this one
                return
            if _failed_before(m):
                raise _failed(m)
            try:  # its header: what the decision reads, before any weight
                ok, leaving = self.room_for(m)
            except (GGUFError, OSError) as e:
                log.error("cannot serve %s: %s", m.model_id, e)
                m.load_error, m.failed_file = _private(m, str(e)), _file_version(m)
                raise _failed(m) from None
            if not ok:
                busy = [r.model_id for r in self._state.resident() if r is not m and r not in leaving]
                why = "it does not fit in memory" + (f" beside {', '.join(busy)}, which are busy" if busy else "")
                if self._state.settings.max_resident is not None and not leaving:
                    why += f" (at most {self._state.settings.max_resident} resident)"
                raise _unavailable(m, why, retry_after=m.gate.retry_after(LOADING_RETRY_AFTER_S))
            for r in leaving:
                log.info(
                    "unloading %s (idle since %.0f s) to make room for %s",
                    r.model_id,
                    time.time() - r.busy_at(),
                    m.model_id,
                )
                if not await self._unload_if_idle(r, locked=True):  # a request took it up meanwhile
                    raise _unavailable(m, f"{r.model_id}, whose room it needs, is busy", LOADING_RETRY_AFTER_S)
            self._start(m)

    @asynccontextmanager
    async def pinned(self, m: ModelState) -> AsyncIterator[None]:
        """`m` resident (or loading), and kept so while the caller readies its request for the
        gate (tokenizing, queueing): once a slot is held, the gate's count keeps it."""
        await self.ensure(m)
        m.pins += 1  # no await since ensure: nothing can unload it in between
        try:
            yield
        finally:
            m.pins -= 1

    async def unload(self, m: ModelState) -> None:
        """POST /v1/models/{id}/unload: 404 if not loaded, 409 if anything is in flight or queued."""
        async with self._lock:
            if m.engine is None:
                raise APIError(404, f"model {m.model_id!r} is not loaded", "model_not_loaded")
            if not m.idle or m.status == "loading":
                raise APIError(
                    409,
                    f"model {m.model_id!r} has requests in flight or queued, or is loading: unload it once idle",
                    "model_busy",
                )
            await self._unload(m)

    def relieve(self) -> bool:
        """The governor's last resort under orange, after the prompt caches (on its thread): unload
        the least recently used idle model, unless it is the only one resident (it is what serves).
        True when one will be."""
        resident = self._state.resident()
        idle = sorted((r for r in resident if r.status == "loaded" and r.idle), key=lambda r: r.busy_at())
        if not idle or len(resident) < 2 or self._loop is None:
            return False
        log.warning("memory governor: orange; unloading the idle model %s", idle[0].model_id)
        self._loop.call_soon_threadsafe(self._spawn, self._unload_if_idle(idle[0]))
        return True

    def start(self) -> None:
        """On the loop at start: watch the preloaded model's load, and keep-alive when set."""
        self._loop = asyncio.get_running_loop()
        for m in self._state.resident():
            assert m.engine is not None
            self._spawn(self._watch(m, m.engine))
        if self._state.settings.keep_alive is not None:
            self._spawn(self._keep_alive(self._state.settings.keep_alive))

    def stop(self, timeout: float) -> None:
        for task in self._tasks:
            task.cancel()
        for engine in self._state.engines():
            engine.stop(timeout)

    def _attach(self, m: ModelState) -> Engine:
        others = self.others_bytes(m)
        engine = self._build(m.deployment, others)
        m.attach(engine, others)
        return engine

    def _start(self, m: ModelState) -> None:
        engine = self._attach(m)
        log.info("loading %s from %s", m.model_id, m.deployment.path)
        engine.start()
        self._spawn(self._watch(m, engine))

    async def _watch(self, m: ModelState, engine: Engine) -> None:
        """Once `engine` is ready: its queue opens, or, if it failed, its waiters learn why."""
        await asyncio.to_thread(engine.ready.wait)
        if m.engine is not engine:
            return
        if engine.load_error is not None or engine.loaded is None:
            log.error("cannot serve %s: %s", m.model_id, engine.load_error)
            m.load_error, m.failed_file = _private(m, engine.load_error or "unknown error"), _file_version(m)
            m.detach()
            m.gate.refuse_waiting(_failed(m))
            return
        m.loaded_at = time.time()
        m.gate.poke()

    async def _unload_if_idle(self, m: ModelState, locked: bool = False) -> bool:
        """Unload `m` if it is still loaded and idle now (the decision may be an await old)."""
        if not locked:
            async with self._lock:
                return await self._unload_if_idle(m, locked=True)
        if m.engine is None or m.status != "loaded" or not m.idle:
            return False
        await self._unload(m)
        return True

    async def _unload(self, m: ModelState) -> None:
        engine = m.detach()
        if engine is not None:
            await asyncio.to_thread(_release, engine)
            log.info("unloaded %s", m.model_id)

    async def _keep_alive(self, seconds: float) -> None:
        while True:
            await asyncio.sleep(min(_KEEP_ALIVE_POLL_S, seconds))
            now = time.time()
            for m in self._state.resident():
                if m.status == "loaded" and m.idle and now - m.busy_at() >= seconds:
                    log.info("unloading %s: idle for %.0f s (keep-alive %g s)", m.model_id, now - m.busy_at(), seconds)
                    await self._unload_if_idle(m)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _release(engine: Engine) -> None:
    """Stop an engine and give its memory back: its thread ends, the last references to its
    arrays go, and MLX's buffer cache and the heap return the pages (gmlx/heap.py)."""
    import mlx.core as mx

    engine.stop(_UNLOAD_TIMEOUT_S)
    engine.loaded = engine.draft = None
    gc.collect()
    mx.clear_cache()
    trim_heap()


def _failed_before(m: ModelState) -> bool:
    """Its last load failed on the file as it is now: not tried again until the file changes."""
    return m.load_error is not None and m.failed_file == _file_version(m)


def _file_version(m: ModelState) -> tuple[int, int] | None:
    try:
        st = m.deployment.path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


def _private(m: ModelState, error: str) -> str:
    """An error as a client may read it: the file's name, not where it lives (the log has the path)."""
    path = m.deployment.path
    return error.replace(str(path.resolve()), path.name).replace(str(path), path.name)


def _unavailable(m: ModelState, why: str, retry_after: int) -> APIError:
    return APIError(
        503, f"model {m.model_id!r} cannot be loaded now: {why}", "model_unavailable", retry_after=retry_after
    )


def _failed(m: ModelState) -> APIError:
    """A model whose file failed to load: not tried again until the file changes, which a retry
    cannot know of, so it is told to come back late (503s carry Retry-After)."""
    return _unavailable(m, f"it failed to load: {m.load_error}", RETRY_AFTER_MAX_S)
