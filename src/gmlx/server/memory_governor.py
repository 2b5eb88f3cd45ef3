"""The memory governor: samples memory a few times a second, publishes its band, and acts on it.

The limit is the capacity table's budget: total memory less the reserve. "In use" is the largest
of three readings, since each misses something the others see:
- MLX active + cache memory: weights, KV caches, working buffers, and freed buffers MLX keeps
  for reuse (they are only released by `mx.clear_cache`). On CUDA this is the device memory the
  budget counts, and the two host figures below are left out.
- the process's resident memory: adds the interpreter, tokenizer and libraries.
- the limit less the system's available memory: what other processes take counts against us too,
  as we can grow no further than what is available. On CUDA, the limit less the device's free
  memory, read through NVML where nvidia-ml-py and a driver are present.

Actions, each counted with the time of the last one (`snapshot()["actions"]`):
- `single_admission` (entering yellow): the gate admits one new stream at a time; the next is
  admitted only once every slot holder has reached decode.
- `hold_admission` (entering orange or red): the gate admits none; new requests wait in the queue.
- `evict_prompt_cache` and `clear_cache` (yellow, orange, red; at most once a second, and right
  after a stop): on the engine thread, the prompt cache drops its least recently used entries
  until it has freed what would bring use back under the point where the band falls one step
  (its threshold less the hysteresis; `bytes_to_release`), or it is empty; then MLX's buffer
  cache, which now holds those entries' buffers too, is returned to the system, and the heap's
  free pages with it where the C library can (glibc's `malloc_trim`: on Linux CPU, MLX's buffers
  come from malloc, and what they free stays resident otherwise). Under orange and red the
  entries go to bring use back to yellow; only the prompt cache is counted on to cover the
  excess, since MLX's cache refills as streams run. Under yellow, where running work must not
  suffer, only MLX's cache and the heap go while anything runs, and on the first release once
  nothing does; if the band is still yellow a second later with nothing running, the entries
  go to bring use back to green. So the bands come down once the load is gone, and admission
  opens again. Each is recorded when it freed something, with the bytes it freed (the second's
  include the first's).
- `stop_stream` (red): the newest running stream ends with an error that says why, one at a time:
  the next only once the last has ended and memory is still red.
- `unload_model` (orange or red for a second sample and more, with several models resident): the
  least recently used idle model is unloaded (`relieve`: server/residency.py), once the prompt
  caches have had their release.

Every resident model's engine and gate is governed alike: the band is the server's, as memory is.

Where the budget is host memory, the heap is also trimmed at most once a second in any band, so
that what ended streams freed does not stay resident, and each sample reads the process's memory
outside MLX (`host_bytes`: resident memory less MLX's), which the capacity table took off as the
warm-up measured it: the snapshot shows whether it has grown since.

It runs on its own thread. The only MLX calls made here are memory reads; the gate, which lives
on the event loop, is reached through `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import mlx.core as mx
import psutil

from gmlx import platform
from gmlx.capacity.bands import BANDS, Thresholds, bytes_to_release, next_band
from gmlx.engine.engine import Failed
from gmlx.heap import trim_heap

if TYPE_CHECKING:
    from gmlx.capacity.table import CapacityTable
    from gmlx.engine.engine import Engine
    from gmlx.server.admission import AdmissionGate
    from gmlx.settings import Settings

log = logging.getLogger("gmlx.governor")
ACTIONS = ("single_admission", "hold_admission", "evict_prompt_cache", "clear_cache", "stop_stream", "unload_model")
RELEASES = ("evict_prompt_cache", "clear_cache")  # the actions that report the bytes they freed
STOP_MESSAGE = (
    "stopped under memory pressure: the server's memory governor is red and this was the newest "
    "running request; retry later"
)
RELEASE_EVERY_S = 1.0  # above green, release memory at most this often (it takes effect within a step)
_ORANGE = BANDS.index("orange")
_process = psutil.Process()


@dataclass(frozen=True)
class MemoryReading:
    active_bytes: int  # MLX
    cache_bytes: int  # MLX
    rss_bytes: int  # this process
    available_bytes: int  # the system's
    device_available_bytes: int | None = None  # the CUDA device's free memory, from NVML; None unread


class DeviceMemory:
    """Free memory of the CUDA device this process runs on, through NVML. None off CUDA, and
    where NVML is absent (no nvidia-ml-py, no driver) or the device cannot be told apart from
    others; then the governor goes on MLX's figures alone. Found once; each read is one NVML call."""

    def __init__(self) -> None:
        self._nvml: Any = None
        self._handle: Any = None
        self._found = False

    def available_bytes(self) -> int | None:
        if not self._found:
            self._found = True
            self._nvml, self._handle = self._find()
        if self._handle is None:
            return None
        try:
            info = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
        except Exception as e:  # the driver went away: carry on without the figure
            log.warning("memory governor: NVML stopped answering (%s); device memory is no longer read", e)
            self._handle = None
            return None
        return int(info.total) - int(info.used)

    @staticmethod
    def _find() -> tuple[Any, Any]:
        if platform.backend() != "cuda":
            return None, None
        try:
            import pynvml

            pynvml.nvmlInit()
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            if len(handles) > 1:  # the one whose compute processes list ours (not in a PID namespace)
                handles = [
                    h
                    for h in handles
                    if any(p.pid == os.getpid() for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h))
                ]
        except Exception as e:  # no library or no driver: not an error, the figure is just not read
            log.info("memory governor: no NVML device memory (%s)", e)
            return None, None
        if len(handles) != 1:
            log.info("memory governor: cannot tell this process's CUDA device through NVML")
            return None, None
        return pynvml, handles[0]


_device = DeviceMemory()


def read_memory() -> MemoryReading:
    return MemoryReading(
        mx.get_active_memory(),
        mx.get_cache_memory(),
        _process.memory_info().rss,
        platform.available_memory_bytes(),
        _device.available_bytes(),
    )


def in_use(reading: MemoryReading, limit: int, host_memory: bool) -> int:
    """Bytes in use against `limit` (see the module's docstring); host figures count only
    where the budget is host memory (CPU, and Metal's unified memory), the device's where not."""
    used = reading.active_bytes + reading.cache_bytes
    if host_memory:
        used = max(used, reading.rss_bytes, limit - reading.available_bytes)
    elif reading.device_available_bytes is not None:
        used = max(used, limit - reading.device_available_bytes)
    return used


@dataclass
class _Action:
    count: int = 0
    last_at: float | None = None  # unix time
    bytes_freed: int = 0  # reported for RELEASES only

    def to_json(self, name: str) -> dict[str, Any]:
        out: dict[str, Any] = {"count": self.count, "last_at": self.last_at}
        if name in RELEASES:
            out["bytes_freed"] = self.bytes_freed
        return out


class Governed(Protocol):
    """A model the governor watches: its engine (None while not resident) and its gate."""

    @property
    def engine(self) -> Engine | None: ...
    @property
    def gate(self) -> AdmissionGate: ...


class Governor:
    """What it reads: `table()` (the budget: any resident model's, as they share memory; None
    while none is loaded), and each model's requests and gate counts (`models()`). What it
    changes: the band, through `publish_band`; admission, through `admits` (each gate asks it);
    on the engine threads, memory (`engine.release_memory`) and the newest stream under red
    (`engine.cancel`); and the idle models resident (`relieve`: True when it unloads one)."""

    def __init__(
        self,
        s: Settings,
        table: Callable[[], CapacityTable | None],
        models: Callable[[], list[Governed]],
        publish_band: Callable[[str], None],
        relieve: Callable[[], bool] | None = None,
        probe: Callable[[], MemoryReading] = read_memory,
    ):
        """`probe` reads memory; tests swap in a fake to drive the bands."""
        self._table, self._models, self._publish_band, self._relieve = table, models, publish_band, relieve
        self.probe = probe
        self.band: str | None = None  # None until the first sample
        self.enabled = s.governor
        self.thresholds = Thresholds(s.governor_yellow, s.governor_orange, s.governor_red, s.governor_hysteresis)
        self.interval_s = s.governor_interval_s
        self._host_memory = platform.backend() != "cuda"
        self.fraction: float | None = None
        self.used_bytes: int | None = None
        self.limit_bytes: int | None = None
        self.host_bytes: int | None = None  # the process's memory outside MLX; None where not counted
        self._actions = {name: _Action() for name in ACTIONS}
        self._lock = threading.Lock()  # the snapshot sees one sample's figures together
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._victim: str | None = None  # the stream last stopped, until it has ended
        self._last_release = float("-inf")
        self._idle_yellow = False  # the last release was in yellow with nothing running
        self._last_trim = float("-inf")
        self._last_error: str | None = None

    def start(self) -> None:
        """Start sampling; call on the event loop the gates live on. Does nothing when disabled."""
        if not self.enabled:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="gmlx-governor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(5)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "band": self.band if self.enabled else None,
                "enabled": self.enabled,
                "thresholds": self.thresholds.to_json(),
                "interval_s": self.interval_s,
                "fraction": None if self.fraction is None else round(self.fraction, 4),
                "used_bytes": self.used_bytes,
                "limit_bytes": self.limit_bytes,
                "host_bytes": self.host_bytes,
                "actions": {name: a.to_json(name) for name, a in self._actions.items()},
            }

    # --- on the event loop -----------------------------------------------------------------

    def admits(self, m: Governed) -> bool:
        """Whether `m`'s gate may admit one more request now (always, when disabled)."""
        band = self.band if self.enabled else None
        if band == "yellow":
            # Every slot holder has left prefill: one queued at the engine, in prefill, or between
            # the gate and the engine holds a slot without a decode row.
            return (m.engine.decoding if m.engine is not None else 0) >= m.gate.running
        return band not in ("orange", "red")

    def _engines(self) -> list[Engine]:
        return [e for m in self._models() if (e := m.engine) is not None]

    # --- on the governor's thread ----------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.wait(self.interval_s):
            try:
                self._sample()
                self._last_error = None
            except Exception as e:  # a failing probe must not end the sampling
                if str(e) != self._last_error:
                    log.exception("memory governor: sampling failed")
                self._last_error = str(e)

    def _sample(self) -> None:
        table = self._table()
        if table is None:  # still loading: no budget to measure against yet
            return
        limit = table.budget.total_bytes - table.budget.reserve_bytes
        reading = self.probe()
        used = in_use(reading, limit, self._host_memory)
        fraction = used / limit if limit > 0 else 1.0
        previous = self.band
        band = next_band(previous, fraction, self.thresholds)
        now = time.time()
        with self._lock:
            self.band = band
            self._publish_band(band)
            self.fraction, self.used_bytes, self.limit_bytes = fraction, used, limit
            if self._host_memory:
                self.host_bytes = max(0, reading.rss_bytes - reading.active_bytes - reading.cache_bytes)
            level, was = BANDS.index(band), -1 if previous is None else BANDS.index(previous)
            if band == "yellow" and previous != "yellow":
                self._record("single_admission", now)
            if level >= _ORANGE > was:
                self._record("hold_admission", now)
            stopped = band == "red" and self._stop_newest(now)
            if band != "yellow":
                self._idle_yellow = False
            if band != "green" and (stopped or now - self._last_release >= RELEASE_EVERY_S):
                # Queued after the stop, so it frees that stream's buffers too.
                evict = self._to_evict(band, used, limit)
                for engine in self._engines():
                    engine.release_memory(evict, self._released)
                if level >= _ORANGE and was >= _ORANGE and self._relieve is not None and self._relieve():
                    self._record("unload_model", now)  # still orange after a release: an idle model goes
                self._last_release = now
        if self._host_memory and now - self._last_trim >= RELEASE_EVERY_S:
            trim_heap()  # in any band: what ended streams freed would otherwise stay resident
            self._last_trim = now
        if band != previous:
            log.log(
                logging.WARNING if level >= _ORANGE else logging.INFO,
                "memory governor: %s -> %s (%.1f%% of %d MiB in use)",
                previous,
                band,
                100 * fraction,
                limit >> 20,
            )
        for m in self._models():
            if m.gate.waiting:  # the band, or a stream leaving prefill, may let a waiter in
                assert self._loop is not None
                self._loop.call_soon_threadsafe(m.gate.poke)

    def _to_evict(self, band: str, used: int, limit: int) -> int:
        """Prompt-cache bytes this release drops (see the module's docstring): under yellow, none
        until a release with nothing running has left it yellow; then what brings it to green."""
        if band != "yellow":
            return bytes_to_release(used, limit, self.thresholds)
        idle = not any(m.gate.running or (m.engine is not None and m.engine.in_flight) for m in self._models())
        evict, self._idle_yellow = idle and self._idle_yellow, idle
        return bytes_to_release(used, limit, self.thresholds, "yellow") if evict else 0

    def _stop_newest(self, now: float) -> bool:
        rows = [(engine, r) for engine in self._engines() for r in engine.requests()]
        if self._victim is not None and any(r.id == self._victim for _, r in rows):
            return False  # the last stop has not taken effect yet
        running = [(engine, r) for engine, r in rows if r.state in ("prefill", "decode")]
        if not running:
            self._victim = None
            return False
        engine, victim = max(running, key=lambda er: er[1].submitted_at)
        log.warning("memory governor: red, stopping the newest running request %s", victim.id)
        engine.cancel(victim.id, Failed(STOP_MESSAGE, "memory_pressure"))
        self._victim = victim.id
        self._record("stop_stream", now)
        return True

    def _record(self, name: str, now: float, freed: int = 0) -> None:
        action = self._actions[name]
        action.count += 1
        action.last_at = now
        action.bytes_freed += freed

    # --- on the engine thread ----------------------------------------------------------------

    def _released(self, evicted: int, released: int) -> None:
        now = time.time()
        with self._lock:
            if evicted:
                self._record("evict_prompt_cache", now, evicted)
            if released:
                self._record("clear_cache", now, released)
