"""The CPU `gmlx top --interval 1` takes, against an idle server (the peer, same run) and against a busy one.

    python bench/bench_top.py                     # starts `gmlx serve` on the default model
    python bench/bench_top.py --url http://127.0.0.1:8080 --streams 6 --seconds 30

`gmlx top` runs in a pseudo-terminal of 160x45 (Textual draws as it would in a real one; what it
writes is read and dropped). After a settling time, for its start-up imports, the top process's
CPU seconds (user + system, from psutil) are taken over `--seconds`, once with the server idle and
once while `--streams` requests decode without a break, and its RSS at the end. Writes
bench/results/top-<model>.json (and prints it) with the machine (the CPU model as lscpu names it).
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil

from bench_poll import machine, write_result
from bench_serve import PROMPTS, one_stream, wait_ready

RESULTS = Path(__file__).parent / "results"
SETTLE_S = 5.0


def start_top(url: str, interval: float, size: tuple[int, int] = (160, 45)) -> subprocess.Popen:
    """`gmlx top` on a pseudo-terminal whose output a thread drains, so the app never blocks on it."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", size[1], size[0], 0, 0))
    cmd = [sys.executable, "-m", "gmlx", "top", "--url", url, "--interval", str(interval)]
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": str(size[0]), "LINES": str(size[1])}
    proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True)
    os.close(slave)

    def drain() -> None:
        try:
            while os.read(master, 65536):
                pass
        except OSError:  # the terminal closed with the process
            pass

    threading.Thread(target=drain, daemon=True).start()
    return proc


def cpu_seconds(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def measure(proc: psutil.Process, seconds: float) -> dict:
    start, wall = cpu_seconds(proc), time.monotonic()
    time.sleep(seconds)
    used, span = cpu_seconds(proc) - start, time.monotonic() - wall
    return {"cpu_seconds": round(used, 3), "wall_seconds": round(span, 2), "core_pct": round(100 * used / span, 2)}


async def keep_busy(url: str, streams: int, max_tokens: int, stop: asyncio.Event) -> int:
    """`streams` requests at a time, each replaced as it ends, until `stop`; how many finished."""
    done = 0

    async def lane(client: httpx.AsyncClient, i: int) -> None:
        nonlocal done
        while not stop.is_set():
            await one_stream(client, PROMPTS[(i + done) % len(PROMPTS)], max_tokens)
            done += 1

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await asyncio.gather(*(lane(client, i) for i in range(streams)))
    return done


def busy_while(url: str, streams: int, max_tokens: int, work: Callable[[], dict]) -> tuple[dict, int]:
    """Run `work()` (blocking) in a thread while the load runs on this thread's event loop."""

    async def main() -> tuple[dict, int]:
        stop = asyncio.Event()
        load = asyncio.create_task(keep_busy(url, streams, max_tokens, stop))
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            while (await client.get("/v1/metrics")).json()["server"]["rates"]["decode_streams"] < streams:
                await asyncio.sleep(0.1)
        result = await asyncio.to_thread(work)
        stop.set()
        return result, await load

    return asyncio.run(main())


def lscpu_model() -> str | None:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", help="a running server without a key (else one is started here)")
    ap.add_argument("--model", help="GGUF for the server this script starts (default model when omitted)")
    ap.add_argument("--streams", type=int, default=6)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--port", type=int, default=8097)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    at_start = {**machine(), "lscpu_model_name": lscpu_model()}
    server, url = None, args.url
    if url is None:
        url = f"http://127.0.0.1:{args.port}"
        cmd = [sys.executable, "-m", "gmlx", "serve", "--port", str(args.port), "--log-level", "warning"]
        cmd += ["--decode-batch", str(args.streams)] + ([args.model] if args.model else [])
        server = subprocess.Popen(cmd)
    top = None
    try:
        wait_ready(url)
        system = httpx.get(f"{url}/system", timeout=10).json()
        top = start_top(url, args.interval)
        ps = psutil.Process(top.pid)
        time.sleep(SETTLE_S)
        idle = measure(ps, args.seconds)
        busy, finished = busy_while(url, args.streams, args.max_tokens, lambda: measure(ps, args.seconds))
        if top.poll() is not None:
            raise SystemExit(f"gmlx top exited early ({top.returncode})")
        rss = ps.memory_info().rss
    finally:
        if top is not None:
            top.terminate()
            top.wait(10)
        if server:
            server.terminate()
            server.wait(30)
    out = {
        "model": system["model"],
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "url": url,
        "compute_type": system.get("compute_type"),
        "interval_s": args.interval,
        "streams": args.streams,
        "terminal": "160x45",
        "idle": idle,
        "busy": busy,
        "busy_over_idle": round(busy["cpu_seconds"] / idle["cpu_seconds"], 2) if idle["cpu_seconds"] else None,
        "requests_finished_while_busy": finished,
        "top_rss_bytes": rss,
        "machine": at_start,
    }
    write_result(out, args.out, f"top-{out['model']}.json")


if __name__ == "__main__":
    main()
