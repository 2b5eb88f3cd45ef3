"""Latency of the poll routes (/v1/metrics, /health?ready=1, /system), idle and while 8 streams decode.

    python bench/bench_poll.py                    # starts `gmlx serve` on the default model
    python bench/bench_poll.py --url http://127.0.0.1:8080 --api-key KEY --streams 8 --polls 200

Writes bench/results/poll-<model>.json (and prints it): median and p99 per route, idle (the
peer, same run) and under load, with the machine and what the server says it runs on (/system).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from bench_serve import PROMPTS, one_stream, wait_ready

ROUTES = ("/v1/metrics", "/health?ready=1", "/system")
RESULTS = Path(__file__).parent / "results"


async def poll(client: httpx.AsyncClient, n: int) -> dict[str, dict[str, float]]:
    out = {}
    for route in ROUTES:
        times = []
        for _ in range(n):
            t = time.perf_counter()
            if (await client.get(route)).status_code == 401:  # 503 is an answer (ready=1 under load); 401 is not
                raise SystemExit("the server wants an API key: pass --api-key")
            times.append((time.perf_counter() - t) * 1000)
        times.sort()
        out[route] = {
            "median_ms": round(statistics.median(times), 2),
            "p99_ms": round(times[min(len(times) - 1, int(0.99 * len(times)))], 2),
        }
    return out


async def decode_streams(client: httpx.AsyncClient) -> int:
    return (await client.get("/v1/metrics")).json()["server"]["rates"]["decode_streams"]


async def run(url: str, api_key: str | None, streams: int, polls: int, max_tokens: int) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=url, timeout=600, headers=headers) as client:
        system = (await client.get("/system")).json()
        idle = await poll(client, polls)
        load = [asyncio.create_task(one_stream(client, PROMPTS[i % len(PROMPTS)], max_tokens)) for i in range(streams)]
        while await decode_streams(client) < streams:
            await asyncio.sleep(0.05)
        busy = await poll(client, polls)
        still = await decode_streams(client)  # below `streams`: some ended while polling (raise --max-tokens)
        await asyncio.gather(*load)
    return {"system": system, "idle": idle, "while_decoding": busy, "decode_streams_after_polls": still}


def machine() -> dict:
    cpu = (
        next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            None,
        )
        if Path("/proc/cpuinfo").exists()
        else None
    )
    return {
        "cpu": cpu or platform.processor(),
        "cores": os.cpu_count(),
        "memory_bytes": psutil.virtual_memory().total,
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "os": platform.platform(),
        "python": platform.python_version(),
    }


def write_result(out: dict, folder: Path, name: str) -> None:
    """The run's JSON into `folder`/`name`, and on stdout; where it went on stderr."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))
    print(f"wrote {path}", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", help="a running server (else one is started here)")
    ap.add_argument("--model", help="GGUF for the server this script starts (default model when omitted)")
    ap.add_argument(
        "--api-key",
        default=os.environ.get("GMLX_API_KEY") or None,
        help="the server's key (default: $GMLX_API_KEY); a server started here gets it too",
    )
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--polls", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--port", type=int, default=8096)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    at_start = machine()  # the load average before this script's server adds its own
    server, url = None, args.url
    if url is None:
        url = f"http://127.0.0.1:{args.port}"
        cmd = [
            sys.executable,
            "-m",
            "gmlx",
            "serve",
            "--port",
            str(args.port),
            "--log-level",
            "warning",
            "--decode-batch",
            str(args.streams),
        ] + ([args.model] if args.model else [])
        server = subprocess.Popen(cmd, env={**os.environ, "GMLX_API_KEY": args.api_key or ""})
    try:
        wait_ready(url)
        result = asyncio.run(run(url, args.api_key, args.streams, args.polls, args.max_tokens))
    finally:
        if server:
            server.terminate()
            server.wait(30)
    out = {
        "model": result["system"]["model"],
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "url": url,
        "streams": args.streams,
        "polls_per_route": args.polls,
        "max_tokens": args.max_tokens,
        "machine": at_start,
        **result,
    }
    write_result(out, args.out, f"poll-{out['model']}.json")


if __name__ == "__main__":
    main()
