"""Latency of the poll routes (/v1/metrics, /health?ready=1, /system) while 8 streams decode.

    python bench/bench_poll.py                    # starts `gmlx serve` on the default model
    python bench/bench_poll.py --url http://127.0.0.1:8080 --streams 8 --polls 200

Prints one JSON object: median and p99 per route, idle (the peer, same run) and under load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

import httpx

from bench_serve import PROMPTS, one_stream, wait_ready

ROUTES = ("/v1/metrics", "/health?ready=1", "/system")


async def poll(client: httpx.AsyncClient, n: int) -> dict[str, dict[str, float]]:
    out = {}
    for route in ROUTES:
        times = []
        for _ in range(n):
            t = time.perf_counter()
            await client.get(route)
            times.append((time.perf_counter() - t) * 1000)
        times.sort()
        out[route] = {"median_ms": round(statistics.median(times), 2),
                      "p99_ms": round(times[min(len(times) - 1, int(0.99 * len(times)))], 2)}
    return out


async def run(url: str, streams: int, polls: int, max_tokens: int) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        idle = await poll(client, polls)
        load = [asyncio.create_task(one_stream(client, PROMPTS[i % len(PROMPTS)], max_tokens)) for i in range(streams)]
        while (await client.get("/v1/metrics")).json()["server"]["rates"]["decode_streams"] < streams:
            await asyncio.sleep(0.05)
        busy = await poll(client, polls)
        await asyncio.gather(*load)
    return {"idle": idle, "while_decoding": busy}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url")
    ap.add_argument("--model")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--polls", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--port", type=int, default=8096)
    args = ap.parse_args()
    server, url = None, args.url
    if url is None:
        url = f"http://127.0.0.1:{args.port}"
        cmd = [sys.executable, "-m", "gmlx", "serve", "--port", str(args.port), "--log-level", "warning",
               "--decode-batch", str(args.streams)] + ([args.model] if args.model else [])
        server = subprocess.Popen(cmd, env={**os.environ, "GMLX_API_KEY": ""})
    try:
        wait_ready(url)
        result = asyncio.run(run(url, args.streams, args.polls, args.max_tokens))
    finally:
        if server:
            server.terminate()
            server.wait(30)
    print(json.dumps({"url": url, "streams": args.streams, **result}, indent=2))


if __name__ == "__main__":
    main()
