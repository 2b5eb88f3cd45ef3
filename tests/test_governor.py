"""The memory governor: band logic on recorded traces, and each band's action on a live server,
under a fake probe (exact sequencing) and under real memory in a server process of its own."""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil
import pytest
from conftest import LiveServer, ServeProcess
from tiny_models import write_model

from gmlx import platform
from gmlx.capacity.bands import Thresholds, band_for, bytes_to_release, next_band
from gmlx.server.memory_governor import STOP_MESSAGE, DeviceMemory, MemoryReading, in_use

T = Thresholds(yellow=0.80, orange=0.90, red=0.97, hysteresis=0.05)
CHAT = "/v1/chat/completions"


def replay(trace: list[float], t: Thresholds = T, start: str | None = None) -> list[str]:
    bands, band = [], start
    for fraction in trace:
        band = next_band(band, fraction, t)
        bands.append(band)
    return bands


def test_bands_rise_at_once_to_the_band_reached() -> None:
    assert replay([0.1, 0.79, 0.80, 0.89, 0.90, 0.96, 0.97, 1.2]) == [
        "green",
        "green",
        "yellow",
        "yellow",
        "orange",
        "orange",
        "red",
        "red",
    ]
    assert replay([0.5, 0.99]) == ["green", "red"]  # a spike skips the bands between
    assert replay([0.93]) == ["orange"]  # the first sample has no history


def test_no_flapping_around_a_threshold() -> None:
    wobble = [0.79, 0.81, 0.78, 0.80, 0.76, 0.805, 0.751, 0.749, 0.76, 0.79, 0.80]
    assert replay(wobble) == [
        "green",
        "yellow",
        "yellow",
        "yellow",
        "yellow",
        "yellow",
        "yellow",
        "green",
        "green",
        "green",
        "yellow",
    ]


def test_bands_fall_one_at_a_time_as_memory_is_released() -> None:
    # Red holds until below 0.92, then one band per sample even when everything is released.
    assert replay([0.99, 0.95, 0.921, 0.91, 0.10, 0.10, 0.10, 0.10]) == [
        "red",
        "red",
        "red",
        "orange",
        "yellow",
        "green",
        "green",
        "green",
    ]
    # Falling stops in the first band whose hold the fraction still meets.
    assert replay([0.98, 0.86, 0.86, 0.86]) == ["red", "orange", "orange", "orange"]
    assert replay([0.98, 0.84, 0.84, 0.84]) == ["red", "orange", "yellow", "yellow"]


def test_recorded_trace_with_hysteresis() -> None:
    # Streams start (memory climbs), one is stopped under red, the rest finish.
    trace = [0.55, 0.70, 0.82, 0.86, 0.91, 0.93, 0.975, 0.95, 0.90, 0.89, 0.84, 0.78, 0.74, 0.60]
    assert replay(trace) == [
        "green",
        "green",
        "yellow",
        "yellow",
        "orange",
        "orange",
        "red",
        "red",
        "orange",
        "orange",
        "yellow",
        "yellow",
        "green",
        "green",
    ]


def test_band_for_and_threshold_checks() -> None:
    assert [band_for(f, T) for f in (0.0, 0.8, 0.9, 0.97)] == ["green", "yellow", "orange", "red"]
    for bad in ({"yellow": 0.9, "orange": 0.8}, {"red": 1.5}, {"hysteresis": -0.1}, {"hysteresis": 0.9}):
        with pytest.raises(ValueError, match="governor"):
            Thresholds(**bad)


def test_in_use_takes_the_largest_reading() -> None:
    r = MemoryReading(active_bytes=600, cache_bytes=100, rss_bytes=800, available_bytes=900)
    assert in_use(r, 1000, host_memory=False) == 700  # device memory: MLX's figures only
    assert in_use(r, 1000, host_memory=True) == 800  # the process holds more than MLX reports
    assert in_use(MemoryReading(10, 0, 20, 50), 1000, host_memory=True) == 950  # others took the rest
    on_device = MemoryReading(600, 100, 800, 900, device_available_bytes=200)
    assert in_use(on_device, 1000, host_memory=False) == 800  # the device's own reading: others took some
    assert in_use(on_device, 1000, host_memory=True) == 800  # host memory: the device figure plays no part


def test_release_brings_use_back_to_where_the_band_ends() -> None:
    assert bytes_to_release(930, 1000, T) == 80  # orange is left below 0.90 - 0.05
    assert bytes_to_release(850, 1000, T) == 0 and bytes_to_release(100, 1000, T) == 0
    assert bytes_to_release(820, 1000, T, "yellow") == 70  # yellow is left below 0.80 - 0.05


class FakeNVML:
    """The part of pynvml the governor uses: two devices, this process on the second."""

    def __init__(self, pids: list[list[int]]) -> None:
        self.pids = pids

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return len(self.pids)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list:
        return [type("Process", (), {"pid": pid}) for pid in self.pids[h]]

    def nvmlDeviceGetMemoryInfo(self, h: int) -> object:
        return type("Memory", (), {"total": 1000 * (h + 1), "used": 300})


def test_device_memory_through_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import sys

    monkeypatch.setattr(platform, "backend", lambda: "cpu")
    monkeypatch.setitem(sys.modules, "pynvml", FakeNVML([[os.getpid()]]))
    assert DeviceMemory().available_bytes() is None  # off CUDA, NVML is not even asked
    monkeypatch.setattr(platform, "backend", lambda: "cuda")
    assert DeviceMemory().available_bytes() == 700
    monkeypatch.setitem(sys.modules, "pynvml", FakeNVML([[1], [os.getpid(), 2]]))
    assert DeviceMemory().available_bytes() == 1700  # the device this process runs on
    monkeypatch.setitem(sys.modules, "pynvml", FakeNVML([[1], [2]]))
    assert DeviceMemory().available_bytes() is None  # which one is ours cannot be told
    monkeypatch.setitem(sys.modules, "pynvml", None)  # no nvidia-ml-py: skipped, not an error
    assert DeviceMemory().available_bytes() is None


def test_settings_and_disabled_governor(tiny_models: dict[str, Path]) -> None:
    from gmlx.settings import SettingsError, resolve_settings

    s = resolve_settings({}, env={"GMLX_GOVERNOR": "0", "GMLX_GOVERNOR_ORANGE": "0.85"})
    assert (s.governor, s.governor_yellow, s.governor_orange, s.governor_red, s.governor_interval_s) == (
        False,
        0.80,
        0.85,
        0.97,
        0.25,
    )
    with pytest.raises(SettingsError, match="governor_red"):
        resolve_settings({}, env={"GMLX_GOVERNOR_RED": "1.5"})
    with LiveServer(tiny_models["llama"], governor=False) as server:
        snap = server.state.governor.snapshot()
        assert snap["enabled"] is False and snap["band"] is None and snap["fraction"] is None
        assert server.state.band is None


def test_sampling_real_memory(tiny_models: dict[str, Path]) -> None:
    with LiveServer(tiny_models["llama"], governor_interval_s=0.02) as server:
        server.wait_until(lambda: server.state.governor.snapshot()["fraction"] is not None)
        snap = server.state.governor.snapshot()
        table = server.model.table()
    assert snap["enabled"] is True and snap["band"] == "green"
    assert snap["limit_bytes"] == table.budget.total_bytes - table.budget.reserve_bytes
    assert 0 < snap["used_bytes"] < snap["limit_bytes"]
    assert snap["thresholds"] == {"yellow": 0.8, "orange": 0.9, "red": 0.97, "hysteresis": 0.05}
    assert set(snap["actions"]) == {
        "single_admission",
        "hold_admission",
        "evict_prompt_cache",
        "clear_cache",
        "stop_stream",
        "unload_model",
    }
    assert snap["actions"]["evict_prompt_cache"] == {"count": 0, "last_at": None, "bytes_freed": 0}


def test_orange_evicts_the_coldest_prompt_cache_entries(tiny_models: dict[str, Path]) -> None:
    """With no hysteresis, a fake reading one byte into orange asks for one byte back: the prompt
    cache drops its least recently used entry alone, and MLX's cache is released, although the
    reading shows no MLX cache at all."""
    server = LiveServer(tiny_models["llama"], governor_interval_s=0.02, governor_hysteresis=0.0)
    state, cache = server.state, server.engine.prompt_cache
    pressure = {"on": False}

    def fake_probe() -> MemoryReading:
        budget = state.default.table().budget
        limit = budget.total_bytes - budget.reserve_bytes
        used = int(0.90 * limit) + 1 if pressure["on"] and not cache.stats.evicted_bytes else limit // 2
        return MemoryReading(active_bytes=used, cache_bytes=0, rss_bytes=0, available_bytes=limit)

    state.governor.probe = fake_probe
    cold = {"messages": [{"role": "user", "content": "the coldest entry"}], "max_tokens": 4, "temperature": 0}
    warm = {"messages": [{"role": "user", "content": "a recent one"}], "max_tokens": 4, "temperature": 0}
    with server, server.client() as c:
        for body in (warm, cold, warm):  # the second `warm` makes `cold` the least recently used
            assert c.post(CHAT, json=body).status_code == 200
        before = cache.snapshot()
        assert before["entries"] == 2 and c.post("/v1/estimate", json=cold).json()["cache_tier"] == "exact"
        pressure["on"] = True
        server.wait_until(lambda: state.governor.snapshot()["actions"]["clear_cache"]["count"] >= 1)
        actions = state.governor.snapshot()["actions"]
        after = cache.snapshot()
        assert c.post("/v1/estimate", json=cold).json()["cache_tier"] == "miss"
        assert c.post("/v1/estimate", json=warm).json()["cache_tier"] == "exact"
    evict = actions["evict_prompt_cache"]
    assert evict["count"] == 1 and evict["last_at"] and after["entries"] == 1
    assert evict["bytes_freed"] == after["evicted_bytes"] == before["bytes"] - after["bytes"] > 0
    assert actions["clear_cache"]["bytes_freed"] > 0


def test_each_band_acts_on_a_live_server(tmp_path: Path) -> None:
    """A fake probe reports `base + per_stream x requests in flight` of the budget in use, so the
    test moves the band, and a stopped stream releases its share as real memory would."""
    model = write_model(tmp_path / "long.gguf", "llama", context=8192)
    server = LiveServer(model, decode_batch=4, governor_interval_s=0.02, queue_timeout=30)
    state, engine, gate, governor = server.state, server.engine, server.model.gate, server.state.governor
    pressure = {"base": 0.85, "per_stream": 0.0}  # yellow

    def fake_probe() -> MemoryReading:
        budget = state.default.table().budget
        limit = budget.total_bytes - budget.reserve_bytes
        used = int((pressure["base"] + pressure["per_stream"] * engine.in_flight) * limit)
        return MemoryReading(active_bytes=used - 2**20, cache_bytes=2**20, rss_bytes=0, available_bytes=limit)

    governor.probe = fake_probe
    streams: list[list[dict]] = [[] for _ in range(3)]

    def stream(i: int) -> None:  # reads to the end (some tokens have no text, so no event may come for long)
        with (
            server.client() as c,
            c.stream(
                "POST",
                CHAT,
                json={
                    "messages": [{"role": "user", "content": f"stream {i}"}],
                    "max_tokens": 8000,
                    "temperature": 0,
                    "stream": True,
                },
            ) as r,
        ):
            streams[i] = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]

    with server:
        server.wait_until(lambda: state.band == "yellow")

        # Yellow: three arrive together, and each is admitted only once the last one decodes.
        seen = {"fresh": 0, "waiting": 0}
        watching = threading.Event()

        class Queue(deque):  # records the longest the queue got: a wait can be too short to sample
            def append(self, slot: object) -> None:
                super().append(slot)
                seen["waiting"] = max(seen["waiting"], len(self))

        gate._waiters = Queue(gate._waiters)

        def watch() -> None:
            while not watching.is_set():
                running = gate.running  # read first: decoding only grows while nothing ends
                seen["fresh"] = max(seen["fresh"], running - engine.decoding)

        watcher = threading.Thread(target=watch)
        watcher.start()
        # The three overlap however fast this machine prefills: the engine's first step waits until
        # one of them queues (a loaded CI machine once admitted each before the next arrived).
        step = engine._step

        def held(gen):
            deadline = time.monotonic() + 10
            while gate.waiting == 0 and time.monotonic() < deadline:
                time.sleep(0.001)
            engine._step = step
            return step(gen)

        engine._step = held
        readers = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
        for t in readers:
            t.start()
        server.wait_until(lambda: engine.decoding == 3)
        watching.set()
        watcher.join()
        assert seen["fresh"] == 1 and seen["waiting"] >= 1
        order = sorted(engine.requests(), key=lambda r: r.submitted_at)

        # Orange: nothing is admitted, the newcomer waits, and readiness says why.
        pressure["base"] = 0.93
        server.wait_until(lambda: state.band == "orange")
        queued: list[httpx.Response] = []

        def late() -> None:
            with server.client() as c:
                queued.append(c.post(CHAT, json={"messages": [{"role": "user", "content": "late"}], "max_tokens": 4}))

        waiter = threading.Thread(target=late)
        waiter.start()
        server.wait_until(lambda: gate.waiting == 1)
        with server.client() as c:
            r = c.get("/health", params={"ready": 1})
        assert r.status_code == 503 and r.json()["reason"] == "pressure"
        assert gate.running == 3 and gate.waiting == 1
        server.wait_until(lambda: governor.snapshot()["actions"]["clear_cache"]["count"] >= 1)

        # Red: the newest stream is stopped with its error; its memory going drops the band to orange.
        pressure.update(base=0.77, per_stream=0.07)  # 3 in flight: 0.98 (red); 2: 0.91 (orange)
        server.wait_until(lambda: engine.in_flight == 2)
        server.wait_until(lambda: state.band == "orange")
        assert {r.id for r in engine.requests()} == {order[0].id, order[1].id}
        snap = governor.snapshot()
        assert snap["actions"]["stop_stream"]["count"] == 1 and snap["actions"]["stop_stream"]["last_at"]
        assert gate.waiting == 1  # orange still holds the newcomer

        # Release: the band falls one step at a time to green and the newcomer runs.
        pressure.update(base=0.3, per_stream=0.0)
        waiter.join(30)
        assert queued[0].status_code == 200, queued[0].text
        server.wait_until(lambda: state.band == "green")
        engine.cancel_all()  # ends the two long streams that are left
        for t in readers:
            t.join(30)
        server.wait_until(lambda: engine.in_flight == 0 and gate.running == 0)
        snap = governor.snapshot()

    ends = sorted(s[-1]["error"]["message"] for s in streams)
    assert ends == [STOP_MESSAGE, "the server is shutting down", "the server is shutting down"]
    actions = snap["actions"]
    assert actions["single_admission"]["count"] == 2  # at start, and on the way down
    assert actions["hold_admission"]["count"] == 1
    assert actions["clear_cache"]["count"] >= 2  # under orange, and right after the stop


def _sample(c: httpx.Client) -> dict:
    """One look, as a monitor takes it: the band and memory, the requests, and readiness."""
    m = c.get("/v1/metrics").json()["server"]
    ready = c.get("/health", params={"ready": 1})
    return {
        "t": time.monotonic(),
        "band": m["governor"]["band"],
        "used": m["governor"]["used_bytes"],
        "states": [r["state"] for r in m["requests"]],
        "in_flight": m["concurrency"]["in_flight"],
        "ready": ready.status_code,
        "reason": ready.json().get("reason"),
    }


def test_real_memory_moves_the_bands(tmp_path: Path) -> None:
    """The real probe, on a server process whose budget is 7 blocks of KV (448 MiB) above its idle
    use. One long prompt's prefill takes the band up through yellow (a request behind it waits
    though slots are free), orange (it still waits; readiness says `pressure`) and red, where that
    stream, the newest running, is stopped with its error; its memory going, the band falls back,
    the waiter is admitted and completes, and the band ends green (which needed the heap trimmed:
    on Linux the memory freed stayed resident, and the band yellow with nothing running)."""
    # 2 layers x 8 KV heads x 2048 wide in float32: 256 KiB of KV a token, 64 MiB a 256-token block.
    model = write_model(tmp_path / "kv.gguf", "llama", context=4096, heads=8, kv_heads=8, head_dim=2048)
    env = {
        "GMLX_GOVERNOR": "1",
        "GMLX_GOVERNOR_INTERVAL_S": "0.05",
        "GMLX_RESERVE_FRACTION": "0",
        "GMLX_RESERVE_FLOOR": "0",
        "GMLX_PROMPT_CACHE_BYTES": "0",
    }
    # Short prefill chunks: the big prompt's KV grows a little at a time, so each band lasts a while.
    flags = ("--decode-batch", "4", "--prefill-step", "64", "--queue-timeout", "300")
    big = {
        "messages": [{"role": "user", "content": " ".join(f"w{i % 97}" for i in range(600))}],
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
    }  # about 1750 tokens: 7 blocks
    late = {"messages": [{"role": "user", "content": "late"}], "max_tokens": 4, "temperature": 0}

    with ServeProcess(model, tmp_path / "calibrate.log", *flags, "--memory", "64GiB", env=env) as s:
        mem = httpx.get(f"{s.url}/v1/metrics", timeout=60).json()["server"]
        # In use as the governor counts it, less the share of a 64 GiB budget others' processes take.
        idle = max(mem["memory"]["process_rss_bytes"], mem["memory"]["active_bytes"] + mem["memory"]["cache_bytes"])
        block = int(256 * mem["capacity"]["warmup"]["kv_bytes_per_token_measured"])  # caches grow a block at a time
    limit = idle + 7 * block
    if psutil.virtual_memory().available < limit + 2**30:  # the governor counts what others' processes take
        pytest.skip("too little free memory for a budget the system's available memory does not press")
    # Thresholds in blocks above idle; the big prompt's KV is 7. Green returns below 0.75 blocks, so
    # not while the big prompt holds its first block, and it does once MLX's cache is all that is left.
    levels = {"yellow": 1.5, "orange": 4, "red": 6}
    env |= {f"GMLX_GOVERNOR_{band.upper()}": f"{(idle + n * block) / limit:.4f}" for band, n in levels.items()}
    env["GMLX_GOVERNOR_HYSTERESIS"] = f"{0.75 * block / limit:.4f}"

    trace: list[dict] = []
    ends: dict[str, dict] = {}
    done = threading.Event()

    def watch(url: str) -> None:
        with httpx.Client(base_url=url, timeout=60) as c:
            while not done.is_set():
                trace.append(_sample(c))
                time.sleep(0.01)

    def stream(url: str) -> None:
        with httpx.stream("POST", url + CHAT, json=big, timeout=300) as r:
            lines = [line for line in r.iter_lines() if line]
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        end = events[-1].get("error") or {"finish": events[-1]["choices"][0]["finish_reason"]}
        ends["big"] = {**end, "last": lines[-1]}  # a stream that ends properly ends with [DONE]

    def post(url: str) -> None:
        body = httpx.post(url + CHAT, json=late, timeout=300).json()
        ends["late"] = body.get("error") or {"finish": body["choices"][0]["finish_reason"]}

    def wait_for(what: str, predicate: Callable[[dict], bool]) -> None:
        deadline = time.monotonic() + 120
        while not (trace and predicate(trace[-1])):
            assert time.monotonic() < deadline, f"waiting for {what}; last seen {trace[-3:]}\n{s.log()}"
            time.sleep(0.01)

    started = time.monotonic()
    with ServeProcess(model, tmp_path / "serve.log", *flags, "--memory", str(limit), env=env) as s:
        watcher = threading.Thread(target=watch, args=(s.url,))
        watcher.start()
        clients = [threading.Thread(target=stream, args=(s.url,)), threading.Thread(target=post, args=(s.url,))]
        try:
            # the governor's first reading (used_bytes is null until it has one)
            wait_for("a first sample", lambda p: p["band"] == "green" and p["used"] is not None)
            at_start = trace[-1]["used"]
            clients[0].start()
            wait_for("yellow", lambda p: p["band"] != "green")
            clients[1].start()
            for t in clients:
                t.join(300)
            wait_for("green again", lambda p: p["band"] == "green" and p["ready"] == 200 and not p["states"])
        finally:
            done.set()
            watcher.join(60)
        actions = httpx.get(f"{s.url}/v1/metrics", timeout=60).json()["server"]["governor"]["actions"]

    bands = [b for i, b in enumerate(p["band"] for p in trace) if i == 0 or b != trace[i - 1]["band"]]
    print(
        f"{time.monotonic() - started:.1f} s: idle {idle >> 20} MiB (at start {at_start >> 20}), block {block >> 20} "
        f"MiB, limit {limit >> 20} MiB, peak {max(p['used'] or 0 for p in trace) >> 20} MiB, at the end "
        f"{trace[-1]['used'] >> 20} MiB; bands {bands}; ends {ends}; actions {actions}"
    )
    firsts = [bands.index(b) for b in ("yellow", "orange", "red")]
    assert firsts == sorted(firsts) and bands[-1] == "green", bands  # up one band after another, then back
    # Yellow: the late request waits, though slots are free, while the one ahead of it is in prefill.
    assert any(
        p["band"] == "yellow" and p["states"][:1] == ["queued"] and "prefill" in p["states"] and p["in_flight"] < 4
        for p in trace
    )
    # Orange (and red): it still waits, and readiness says why.
    assert any(p["band"] == "orange" and p["states"][:1] == ["queued"] for p in trace)
    assert any(p["reason"] == "pressure" and p["band"] in ("orange", "red") for p in trace)
    # Red: the newest running stream, the big one, is stopped with its error; nothing else is lost.
    # (the error a request not streamed gets as its 503, Retry-After in it)
    big = ends["big"]
    assert {k: big.get(k) for k in ("message", "type", "code", "param", "last")} == {
        "message": STOP_MESSAGE,
        "type": "service_unavailable",
        "code": "memory_pressure",
        "param": None,
        "last": "data: [DONE]",
    }
    assert big["retry_after"] >= 1
    assert ends["late"] == {"finish": "length"}
    assert actions["stop_stream"]["count"] == 1 and actions["single_admission"]["count"] >= 1
    assert actions["hold_admission"]["count"] >= 1 and actions["clear_cache"]["count"] >= 1
