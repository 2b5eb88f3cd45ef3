"""Drive a gmlx server with N concurrent streams; report aggregate decode tok/s and TTFT per width.

    python bench/bench_serve.py                       # starts `gmlx serve` on the default model
    python bench/bench_serve.py --url http://127.0.0.1:8080 --widths 1 4 8 --max-tokens 128
    python bench/bench_serve.py --temperature 0.7 --top-p 0.9   # sampled, not greedy

Prints one JSON object. Each width's throughput is also given as a ratio to width 1 from the
same run (the peer), which is what holds on a shared, noisy machine.
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

PROMPTS = [
    "Write a long story about a lighthouse keeper and the sea.",
    "Explain in detail how tides work, step by step.",
    "Describe a busy harbour at dawn, in many sentences.",
    "Tell the history of sailing ships, century by century.",
]


async def one_stream(client: httpx.AsyncClient, prompt: str, max_tokens: int, sampling: dict | None = None) -> dict:
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(sampling or {}),
    }
    start = time.perf_counter()
    first = last = None
    usage = {}
    times = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            elif event["choices"] and event["choices"][0]["delta"].get("content"):
                last = time.perf_counter()
                first = first or last
                times.append(last)
    tokens = usage.get("completion_tokens", 0)
    return {
        "ttft_s": (first or start) - start,
        "tokens": tokens,
        "start": start,
        "first": first,
        "last": last,
        "times": times,
        "decode_tok_s": (tokens - 1) / (last - first) if first and last and last > first else None,
    }


async def run_width(url: str, width: int, max_tokens: int, sampling: dict | None = None) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await one_stream(client, "Hello", 4)  # warm-up: caches and kernels
        results = await asyncio.gather(
            *(one_stream(client, PROMPTS[i % len(PROMPTS)], max_tokens, sampling) for i in range(width))
        )
    starts = [r["first"] for r in results if r["first"]]
    ends = [r["last"] for r in results if r["last"]]
    tokens = sum(r["tokens"] for r in results)
    # Aggregate decode rate: tokens after each stream's first, over the span in which streams decode.
    span = max(ends) - min(starts) if starts and ends else 0
    ttfts = [r["ttft_s"] for r in results]
    # While every stream decodes (after the last first token, before the first stream ends): the
    # steady rate, without admission, prefill and the tail (content chunks, about one a token).
    lo, hi = (max(starts), min(ends)) if len(starts) == len(ends) == width else (0, 0)
    full = sum(1 for r in results for t in r["times"] if lo < t <= hi) / (hi - lo) if hi > lo else None
    return {
        "width": width,
        "generated_tokens": tokens,
        "aggregate_decode_tok_s": round((tokens - len(results)) / span, 1) if span > 0 else None,
        "full_width_tok_s": round(full, 1) if full else None,
        "per_stream_decode_tok_s": round(statistics.mean(r["decode_tok_s"] for r in results if r["decode_tok_s"]), 1),
        "ttft_mean_s": round(statistics.mean(ttfts), 3),
        "ttft_max_s": round(max(ttfts), 3),
    }


def wait_ready(url: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", params={"ready": 1}).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise SystemExit("the server did not become ready")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url")
    ap.add_argument("--model", help="GGUF for the server this script starts (default model when omitted)")
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--port", type=int, default=8099)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    args = ap.parse_args()
    sampling = {"temperature": args.temperature, "top_p": args.top_p}

    server = None
    url = args.url
    if url is None:
        url = f"http://127.0.0.1:{args.port}"
        cmd = [
            sys.executable,
            "-m",
            "gmlx",
            "serve",
            "--port",
            str(args.port),
            "--decode-batch",
            str(max(args.widths)),
            "--log-level",
            "warning",
        ] + ([args.model] if args.model else [])
        server = subprocess.Popen(cmd, env={**os.environ, "GMLX_API_KEY": ""})
    try:
        wait_ready(url)
        rows = [asyncio.run(run_width(url, w, args.max_tokens, sampling)) for w in args.widths]
    finally:
        if server:
            server.terminate()
            server.wait(30)
    base = rows[0]["aggregate_decode_tok_s"] or 0
    for row in rows:
        rate = row["aggregate_decode_tok_s"]
        row["vs_width_1"] = round(rate / base, 2) if rate and base else None
    print(json.dumps({"url": url, "max_tokens": args.max_tokens, "sampling": sampling, "results": rows}, indent=2))


if __name__ == "__main__":
    main()
