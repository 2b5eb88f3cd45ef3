"""GET /metrics scraped as a router's endpoint picker does (every 50 ms), idle and while 8 streams
decode and a long prompt prefills; and how vllm:kv_cache_usage_perc moves beside the governor's band.

    python bench/bench_metrics_poll.py --quick          # starts `gmlx serve` on the default model
    python bench/bench_metrics_poll.py --memory 2GiB    # a small budget: the governor's band moves too
    python bench/bench_metrics_poll.py --url http://127.0.0.1:8080 --api-key KEY

The picker treats a server whose metrics are older than 2 s as saturated; the aim is a p99 under
50 ms. Writes bench/results/metrics-poll-<model>[-<memory>].json (and prints it): p99 and max per
phase, with the machine (CPU model) and a trace summary: the KV usage seen in each band, and whether
the picker would have read saturation (0.8) before the band reached orange.
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
from pathlib import Path

import httpx
from bench_poll import machine, write_result
from bench_serve import PROMPTS, one_stream, wait_ready
from prometheus_client.parser import text_string_to_metric_families

RESULTS = Path(__file__).parent / "results"
SCRAPE_INTERVAL_S = 0.05  # the endpoint picker's refresh interval
BANDS = ("green", "yellow", "orange", "red")
GMLX = {
    "gmlx_kv_cache_table_usage_ratio": "table_usage",
    "gmlx_governor_used_ratio": "governor_fraction",
}  # the trace's keys


def read(text: str) -> dict:
    """The figures a trace keeps from one scrape."""
    out: dict = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting"):
                out[s.name.removeprefix("vllm:")] = s.value
            elif s.name in GMLX:
                out[GMLX[s.name]] = s.value
            elif s.name == "gmlx_governor_band" and s.value == 1:
                out["band"] = s.labels["band"]
    return out


async def scrape(
    client: httpx.AsyncClient, seconds: float | None, until: asyncio.Event | None, tag: str, rows: list[dict]
) -> None:
    """Scrape every 50 ms, for `seconds` or until `until` is set; one row per scrape. Each scrape is
    followed by a GET /health, the server's floor: what any answer costs at that moment."""
    start = time.perf_counter()
    while (seconds is None or time.perf_counter() - start < seconds) and not (until and until.is_set()):
        t = time.perf_counter()
        r = await client.get("/metrics")
        if r.status_code == 401:
            raise SystemExit("the server wants an API key: pass --api-key")
        ms = (time.perf_counter() - t) * 1000
        h = time.perf_counter()
        await client.get("/health")
        floor_ms = (time.perf_counter() - h) * 1000
        rows.append(
            {
                "phase": tag,
                "t": round(t, 3),
                "ms": round(ms, 2),
                "health_ms": round(floor_ms, 2),
                "status": r.status_code,
                **read(r.text),
            }
        )
        await asyncio.sleep(max(0.0, SCRAPE_INTERVAL_S - (time.perf_counter() - t)))


def latency(rows: list[dict]) -> dict:
    if not rows:
        return {"scrapes": 0}
    out: dict = {"scrapes": len(rows), "non_200": sum(r["status"] != 200 for r in rows)}
    for key, name in (("ms", "metrics"), ("health_ms", "health")):
        ms = sorted(r[key] for r in rows)
        out[name] = {
            "median_ms": round(statistics.median(ms), 2),
            "p99_ms": ms[min(len(ms) - 1, int(0.99 * len(ms)))],
            "max_ms": ms[-1],
        }
    return out


def fold(rows: list[dict]) -> dict:
    """KV usage by band, and which came first: the picker's saturation (usage >= 0.8) or orange."""
    by_band = {}
    for band in BANDS:
        seen = [r for r in rows if r.get("band") == band]
        if seen:
            by_band[band] = {
                "samples": len(seen),
                "usage_min": min(r["kv_cache_usage_perc"] for r in seen),
                "usage_max": max(r["kv_cache_usage_perc"] for r in seen),
                "governor_fraction_max": max(r.get("governor_fraction", 0) for r in seen),
                "table_usage_max": max(r.get("table_usage", 0) for r in seen),
            }
    t0 = rows[0]["t"] if rows else 0
    first_saturated = next((round(r["t"] - t0, 2) for r in rows if r["kv_cache_usage_perc"] >= 0.8), None)
    first_orange = next((round(r["t"] - t0, 2) for r in rows if r.get("band") in ("orange", "red")), None)
    return {
        "by_band": by_band,
        "saturated_at_s": first_saturated,
        "orange_at_s": first_orange,
        "saturated_before_orange": None
        if first_orange is None
        else first_saturated is not None and first_saturated < first_orange,
    }


def long_prompt(words: int) -> str:
    return " ".join(f"{PROMPTS[i % len(PROMPTS)]} (part {i})" for i in range(words // 12))


async def run(url: str, api_key: str | None, streams: int, idle_s: float, max_tokens: int, prompt_words: int) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    rows: list[dict] = []
    async with httpx.AsyncClient(base_url=url, timeout=600, headers=headers) as client:
        system = (await client.get("/system")).json()
        await one_stream(client, "Hello", 4)  # warm-up
        await scrape(client, idle_s, None, "idle", rows)
        load = [asyncio.create_task(one_stream(client, PROMPTS[i % len(PROMPTS)], max_tokens)) for i in range(streams)]
        decoding = asyncio.Event()
        watcher = asyncio.create_task(scrape(client, None, decoding, "ramp", rows))
        while (
            not rows
            or rows[-1].get("num_requests_running", 0) < streams
            or (await client.get("/v1/metrics")).json()["server"]["rates"]["decode_streams"] < streams
        ):
            await asyncio.sleep(0.05)
        decoding.set()
        await watcher
        first_token = asyncio.Event()
        prefill = asyncio.create_task(scrape(client, None, first_token, "prefill", rows))
        started = time.perf_counter()
        long = await long_request(client, long_prompt(prompt_words), first_token)
        await prefill
        prefill_s = time.perf_counter() - started
        done = asyncio.Event()
        tail = asyncio.create_task(scrape(client, None, done, "decode", rows))
        ends = await asyncio.gather(*load, return_exceptions=True)
        done.set()
        await tail
    failed = [repr(e) for e in ends if isinstance(e, BaseException)]
    return {
        "system": system,
        "rows": rows,
        "long_prompt_tokens": long["prompt_tokens"],
        "long_prompt_ttft_s": round(prefill_s, 2),
        "streams_failed": failed,
    }


async def long_request(client: httpx.AsyncClient, prompt: str, first_token: asyncio.Event) -> dict:
    """The long prompt, streamed: `first_token` is set when its prefill is over (its first content;
    the role chunk comes at admission, before the prefill)."""
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    usage: dict = {}
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                usage = event.get("usage") or usage
                if usage or any(c["delta"].get("content") for c in event.get("choices") or []):
                    first_token.set()
    finally:
        first_token.set()
    return usage


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", help="a running server (else one is started here)")
    ap.add_argument("--model", help="GGUF for the server this script starts (default model when omitted)")
    ap.add_argument("--api-key", default=os.environ.get("GMLX_API_KEY") or None)
    ap.add_argument("--memory", help="--memory for the server started here (a small budget moves the band)")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--prompt-words", type=int, default=3000, help="the long prompt's length in words")
    ap.add_argument("--max-tokens", type=int, default=600)
    ap.add_argument("--idle-s", type=float, default=10)
    ap.add_argument("--quick", action="store_true", help="a shorter run: 3 s idle, 300 tokens a stream")
    ap.add_argument("--port", type=int, default=8097)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if args.quick:
        args.idle_s, args.max_tokens = 3, 300
    at_start = machine()
    server, url = None, args.url
    if url is None:
        url = f"http://127.0.0.1:{args.port}"
        # One slot more than the streams: the long prompt prefills beside them instead of waiting.
        cmd = (
            [
                sys.executable,
                "-m",
                "gmlx",
                "serve",
                "--port",
                str(args.port),
                "--log-level",
                "warning",
                "--decode-batch",
                str(args.streams + 1),
            ]
            + (["--memory", args.memory] if args.memory else [])
            + ([args.model] if args.model else [])
        )
        server = subprocess.Popen(cmd, env={**os.environ, "GMLX_API_KEY": args.api_key or ""})
    try:
        wait_ready(url)
        result = asyncio.run(run(url, args.api_key, args.streams, args.idle_s, args.max_tokens, args.prompt_words))
    finally:
        if server:
            server.terminate()
            server.wait(30)
    rows = result.pop("rows")
    out = {
        "model": result["system"]["model"],
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "url": url,
        "streams": args.streams,
        "max_tokens": args.max_tokens,
        "memory": args.memory,
        "scrape_interval_s": SCRAPE_INTERVAL_S,
        "machine": at_start,
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        **result,
        "latency": {
            phase: latency([r for r in rows if r["phase"] == phase]) for phase in ("idle", "ramp", "prefill", "decode")
        },
        "latency_under_load": latency([r for r in rows if r["phase"] != "idle"]),
        "kv_usage": fold(rows),
    }
    write_result(out, args.out, f"metrics-poll-{out['model']}{'-' + args.memory if args.memory else ''}.json")


if __name__ == "__main__":
    main()
