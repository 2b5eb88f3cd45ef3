"""The governor's bands come down once the load is gone, and the plan keeps to what the governor
allows: releases under yellow on a live server (under a fake probe for exact sequencing, then
under real memory), and the plan's `ok` against the band reached, on the default model in a
server process of its own."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from conftest import LiveServer, ServeProcess
from tiny_models import write_model

import gmlx.server.memory_governor as governor_module
from gmlx.capacity.bands import Thresholds
from gmlx.server.memory_governor import MemoryReading

CHAT = "/v1/chat/completions"
MiB = 2**20


def test_yellow_releases_spare_running_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake probe reads yellow while the prompt cache holds anything. With a stream running,
    each release returns MLX's cache and the heap alone; once nothing runs, the first release
    does the same, and the next, the band still yellow, drops the cold entry: then green."""
    monkeypatch.setattr(governor_module, "RELEASE_EVERY_S", 0.05)
    server = LiveServer(write_model(tmp_path / "long.gguf", "llama", context=8192), governor_interval_s=0.02)
    state, engine, cache = server.state, server.engine, server.engine.prompt_cache
    pressure = {"on": False}
    asked: list[tuple[int, int]] = []  # (prompt-cache bytes a release asked for, requests in flight)
    release = engine.release_memory

    def spy(evict_bytes: int, done) -> None:
        asked.append((evict_bytes, engine.in_flight))
        release(evict_bytes, done)

    def fake_probe() -> MemoryReading:
        budget = state.default.table().budget
        limit = budget.total_bytes - budget.reserve_bytes
        used = int(0.85 * limit) if pressure["on"] and cache.bytes else limit // 2
        return MemoryReading(active_bytes=used, cache_bytes=0, rss_bytes=0, available_bytes=limit)

    engine.release_memory = spy  # type: ignore[method-assign]
    state.governor.probe = fake_probe
    with server, server.client() as c:
        eos = {str(t): -100 for t in server.engine.loaded.tokenizer.eos_token_ids}  # it runs until cancelled
        long = {
            "messages": [{"role": "user", "content": "long"}],
            "max_tokens": 8000,
            "stream": True,
            "logit_bias": eos,
        }
        kept = {"messages": [{"role": "user", "content": "kept"}], "max_tokens": 4}
        assert c.post(CHAT, json=kept).status_code == 200
        assert cache.bytes > 0

        def read() -> None:
            with server.client() as r:
                r.post(CHAT, json=long)

        reader = threading.Thread(target=read)
        reader.start()
        server.wait_until(lambda: engine.decoding == 1)
        pressure["on"] = True
        server.wait_until(lambda: state.band == "yellow" and sum(1 for _, n in asked if n) >= 2)
        running = [evict for evict, in_flight in asked if in_flight]
        engine.cancel_all()
        reader.join(30)
        server.wait_until(lambda: state.band == "green", timeout=10)
        snap = state.governor.snapshot()
    assert running == [0] * len(running), running
    idle = [evict for evict, in_flight in asked if in_flight == 0]
    assert idle[0] == 0 and idle[-1] > 0, idle  # MLX's cache and the heap first, then the entry
    assert snap["actions"]["evict_prompt_cache"]["count"] == 1 and cache.bytes == 0
    assert snap["actions"]["hold_admission"]["count"] == 0


def test_real_memory_comes_down_from_yellow(tmp_path: Path) -> None:
    """The real probe, on a live server whose yellow band starts 1.5 KV blocks above its idle use:
    one prompt of 3 blocks leaves its KV in the prompt cache, so the band stays yellow once it
    has ended. Nothing runs then, so the governor returns MLX's cache and trims the heap, then
    drops the entry, and the band is green within seconds (it stayed yellow for good when
    nothing was released below orange)."""
    # 2 layers x 8 KV heads x 2048 wide in float32: 256 KiB of KV a token, 64 MiB a 256-token block.
    model = write_model(tmp_path / "kv.gguf", "llama", context=4096, heads=8, kv_heads=8, head_dim=2048)
    block = 64 * MiB
    limit = psutil.Process().memory_info().rss + 16 * block  # this process's memory: the server runs in it
    if psutil.virtual_memory().available < limit + 2**30:  # the governor counts what others' processes take
        pytest.skip("too little free memory for a budget the system's available memory does not press")
    server = LiveServer(
        model,
        memory=limit,
        reserve_fraction=0,
        reserve_floor=0,
        governor_interval_s=0.05,
        prompt_cache_bytes=str(4 * block),
    )
    prompt = {
        "messages": [{"role": "user", "content": " ".join(f"w{i % 97}" for i in range(250))}],
        "max_tokens": 2,
        "temperature": 0,
    }  # about 750 tokens: 3 blocks
    governor = server.state.governor
    with server, server.client() as c:
        server.wait_until(lambda: governor.used_bytes is not None)
        idle = governor.used_bytes
        # Thresholds in blocks above idle: the prompt's prefill stays below orange.
        at = {band: (idle + n * block) / limit for band, n in {"yellow": 1.5, "orange": 9, "red": 11}.items()}
        governor.thresholds = Thresholds(**at, hysteresis=0.5 * block / limit)
        assert c.post(CHAT, json=prompt).status_code == 200
        ended, ended_at, bands = time.monotonic(), time.time(), []
        while not bands or bands[-1] != "green":
            assert time.monotonic() - ended < 10, f"still {bands[-1]} 10 s after the load: {bands}"
            bands.append(server.state.band)
            time.sleep(0.02)
        elapsed = time.monotonic() - ended
        actions = governor.snapshot()["actions"]
        ready = c.get("/health", params={"ready": 1}).status_code
    print(
        f"idle {idle / MiB:.0f} MiB: green {elapsed:.1f} s after the load, "
        f"bands {sorted(set(bands), key=bands.index)}; actions {actions}"
    )
    assert bands[0] == "yellow"  # the entry held it there once the request had ended
    assert actions["evict_prompt_cache"]["last_at"] > ended_at and actions["hold_admission"]["count"] == 0
    assert server.engine.prompt_cache.stats.evicted_bytes > 0 and ready == 200


def test_offline_table_assumes_the_host_memory_estimate(tiny_models: dict[str, Path]) -> None:
    """`gmlx plan` has no server to measure: it takes HOST_BYTES_ESTIMATE off, as a server with a
    governor would take what it measured; without a governor, nothing."""
    from gmlx.capacity.budget import HOST_BYTES_ESTIMATE
    from gmlx.capacity.table import header_table
    from gmlx.gguf.header import read_header
    from gmlx.settings import resolve_settings

    h = read_header(tiny_models["llama"])
    governed, _ = header_table(h, resolve_settings({}, env={}), mode="float", memory=8 * 2**30)
    plain, _ = header_table(h, resolve_settings({}, env={"GMLX_GOVERNOR": "0"}), mode="float", memory=8 * 2**30)
    on_cuda, _ = header_table(h, resolve_settings({}, env={}), mode="float", memory=8 * 2**30, host_memory=False)
    assert (governed.budget.host_bytes, governed.budget.ceiling) == (HOST_BYTES_ESTIMATE, 0.85)
    assert (plain.budget.host_bytes, plain.budget.ceiling) == (0, 1.0)
    assert governed.budget.prefill_bytes == plain.budget.prefill_bytes  # the arithmetic of MLX's own is the same
    assert on_cuda.budget.host_bytes == 0 and on_cuda.budget.ceiling == 0.85
    assert governed.budget.kv_bytes < on_cuda.budget.kv_bytes < plain.budget.kv_bytes


def _prompt(c: httpx.Client, salt: str, tokens: int) -> dict:
    """A chat body whose prompt is about `tokens` long (the chat template's tokens included)."""

    def body(words: int) -> dict:
        text = f"{salt} " + " ".join(f"w{j % 97}" for j in range(words))
        return {"messages": [{"role": "user", "content": text}], "max_tokens": 4, "temperature": 0}

    counted = c.post("/v1/estimate", json=body(tokens // 2)).json()["prompt_tokens"]
    words = tokens // 2 * tokens // counted
    while c.post("/v1/estimate", json=body(words)).json()["prompt_tokens"] > tokens:
        words -= 8
    return body(words)


def _memory_for(capacity: dict, model: Path, width: int, depth: int) -> int:
    """The smallest --memory (to a MiB) whose table, with this capacity section's measured
    figures, holds `width` streams of `depth` tokens."""
    from gmlx.capacity.budget import MemoryBudget, default_prompt_cache_bytes
    from gmlx.capacity.memory import KVFormat
    from gmlx.capacity.table import build_table
    from gmlx.gguf.header import read_header

    g, budget, kv = (
        read_header(model).geometry,
        capacity["budget"],
        KVFormat(float_bytes=capacity["kv_format"]["float_bytes"]),
    )

    def fits(memory: int) -> bool:
        b = MemoryBudget(
            memory,
            budget["weight_bytes"],
            budget["prefill_bytes"],
            prompt_cache_bytes=default_prompt_cache_bytes(memory),
            batch_bytes=budget["batch_bytes"],
            host_bytes=budget["host_bytes"],
            ceiling=budget["ceiling"],
        )
        table = build_table(g, b, width, kv, prefill_step=capacity["prefill_step"])
        return table.max_context_at_width(width) >= depth

    lo, hi = 0, 64 * 1024  # MiB: lo does not fit, hi does
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid * MiB) else (mid, hi)
    return hi * MiB


@pytest.mark.slow
def test_plan_ok_keeps_the_band_at_yellow(default_model: Path, tmp_path: Path) -> None:
    """The capacity table counts what the governor counts: on a --memory just big enough for 4
    streams of about 1024 tokens by the table (measured by a first server's warm-up), each width's
    deepest depth the plan says `ok` to (at most a few thousand tokens, to stay short) runs
    without the band ever passing yellow. (The table left the process's memory outside MLX
    out: 4 streams of 3,509 tokens it had said yes to went red; filled to orange itself, 4 streams
    of 1,024 tokens peaked at 0.80-0.87 of the limit here and reached orange on another machine.)"""
    flags = ("--weights", "auto", "--decode-batch", "4")  # the default model as `gmlx serve` loads it
    env = {"GMLX_GOVERNOR": "1", "GMLX_GOVERNOR_INTERVAL_S": "0.1"}
    with ServeProcess(default_model, tmp_path / "calibrate.log", *flags, "--memory", "8GiB", env=env) as s:
        capacity = httpx.get(f"{s.url}/v1/metrics", timeout=60).json()["server"]["capacity"]
    memory = _memory_for(capacity, default_model, 4, 1024)

    results: dict[int, dict] = {}
    with (
        ServeProcess(default_model, tmp_path / "serve.log", *flags, "--memory", str(memory), env=env) as s,
        httpx.Client(base_url=s.url, timeout=300) as c,
    ):

        def band() -> str:
            return c.get("/v1/metrics").json()["server"]["governor"]["band"]

        for width, most in ((1, 1024), (4, 3072)):
            deadline = time.monotonic() + 10
            while band() != "green":  # what the last run left is released first
                assert time.monotonic() < deadline, s.log()
                time.sleep(0.1)
            deepest = c.get("/v1/capacity/plan", params={"width": width, "depth": 1}).json()["max_context_at_width"]
            depth = min(deepest, most)
            plan = c.get("/v1/capacity/plan", params={"width": width, "depth": depth}).json()
            assert plan["ok"] is True and plan["admit_now"] is True, plan
            bodies = [_prompt(c, f"{width}.{i}", depth - 4) for i in range(width)]
            bands, done = [], threading.Event()

            def watch(bands: list[str], done: threading.Event) -> None:
                with httpx.Client(base_url=s.url, timeout=60) as w:
                    while not done.is_set():
                        bands.append(w.get("/v1/metrics").json()["server"]["governor"]["band"])
                        time.sleep(0.05)

            watcher = threading.Thread(target=watch, args=(bands, done))
            watcher.start()
            ends: list[str] = []

            def post(body: dict, ends: list[str]) -> None:
                r = c.post(CHAT, json=body).json()
                ends.append(r["error"]["code"] if "error" in r else r["choices"][0]["finish_reason"])

            posts = [threading.Thread(target=post, args=(b, ends)) for b in bodies]
            for t in posts:
                t.start()
            for t in posts:
                t.join(300)
            done.set()
            watcher.join(60)
            results[width] = {
                "depth": depth,
                "deepest": deepest,
                "bands": sorted(set(bands), key=bands.index),
                "ends": ends,
            }
        m = c.get("/v1/metrics").json()["server"]
    print(f"--memory {memory / MiB:.0f} MiB, budget {m['capacity']['budget']}: {results}")
    for width, r in results.items():
        assert set(r["bands"]) <= {"green", "yellow"}, (width, r)
        assert r["ends"] == ["length"] * width, (width, r)
    assert m["governor"]["actions"]["hold_admission"]["count"] == 0  # never orange, between samples too
