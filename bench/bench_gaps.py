"""Decode gaps while long prompts keep arriving: gmlx beside llama-server, one after the other.

    python -m bench.bench_gaps [--model M.gguf] [--peers gmlx,llama-cpp] [--streams 6] [--long 2000] [--rounds 3]

Each server (decode batch 8) runs `streams` greedy streams of `max_tokens`; while they decode, a
`long`-token prompt is sent one after another (`prompts` of them, one token each), and a short
prompt (16 tokens) a moment after each long one starts; `rounds` times on each server. Reported
per server: the gaps between two decode steps of a stream (bench_gaps.step_gaps), every round's
pooled, as median, p99 and max, p99 over median (issue 23 asks at most 2) pooled and by round,
and the short and long prompts' TTFT. Writes bench/results/gaps-<model>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import httpx

from bench.__main__ import run_record, save_result
from bench.harness import Server, log, prompt_of, story_prompt
from bench.peers import Peer, peer
from gmlx.default_model import resolve_model
from gmlx.gguf.header import read_header
from gmlx.gguf.tokenizer import load_tokenizer

SHORT = 16


async def stream_arrivals(client: httpx.AsyncClient, p: Peer, prompt: str, max_tokens: int) -> list[tuple[float, int]]:
    """When each text event came, and how many tokens it carries: a server may hold text back until
    it decodes whole and send several tokens in one event, so each event's logprobs count them."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "logprobs": 0, **p.body}
    events: list[tuple[float, int]] = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices = json.loads(line[6:]).get("choices")
                if choices and choices[0].get("text"):
                    tokens = len((choices[0].get("logprobs") or {}).get("tokens") or [None])
                    events.append((time.perf_counter(), tokens))
    return events


def step_gaps(events: list[tuple[float, int]]) -> list[float]:
    """Per decode step: an event of k tokens after a gap g counts as k steps of g / k (the stream's
    first event, its prefill, left out)."""
    return [(b - a) / k for (a, _), (b, k) in zip(events[1:], events[2:]) for _ in range(k)]


async def ttft(client: httpx.AsyncClient, p: Peer, prompt: str) -> float:
    start = time.perf_counter()
    events = await stream_arrivals(client, p, prompt, 2)
    return (events[0][0] if events else time.perf_counter()) - start


async def measure(url: str, p: Peer, tokenizer, streams: int, max_tokens: int, long: int, prompts: int) -> dict:
    """One round: the streams' step gaps and the prompts' TTFTs (seconds)."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        decoding = [asyncio.create_task(stream_arrivals(client, p, story_prompt(), max_tokens)) for _ in range(streams)]
        await asyncio.sleep(2.0)  # every stream decoding
        longs, shorts = [], []
        for _ in range(prompts):
            long_task = asyncio.create_task(ttft(client, p, prompt_of(tokenizer, long)))
            await asyncio.sleep(0.3)
            shorts.append(await ttft(client, p, prompt_of(tokenizer, SHORT)))
            longs.append(await long_task)
        arrivals = await asyncio.gather(*decoding)
    return {"gaps": [g for events in arrivals for g in step_gaps(events)], "short": shorts, "long": longs}


def p99_over_median(gaps: list[float]) -> tuple[float, float, float]:
    median, p99 = statistics.median(gaps), statistics.quantiles(gaps, n=100)[98]
    return median, p99, p99 / median


def summary(rounds: list[dict]) -> dict:
    """The rounds' gaps pooled (a p99 of one round's ~1,200 gaps is its ~12 slowest: a few steps),
    each round's p99 over median beside them."""
    gaps = [g for r in rounds for g in r["gaps"]]
    median, p99, ratio = p99_over_median(gaps)
    return {
        "gap_median_s": round(median, 4),
        "gap_p99_s": round(p99, 4),
        "gap_max_s": round(max(gaps), 4),
        "p99_over_median": round(ratio, 2),
        "p99_over_median_by_round": [round(p99_over_median(r["gaps"])[2], 2) for r in rounds],
        "gaps": len(gaps),
        "short_ttft_s": [round(t, 3) for r in rounds for t in r["short"]],
        "long_ttft_s": [round(t, 3) for r in rounds for t in r["long"]],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--peers", default="gmlx,llama-cpp")
    ap.add_argument("--streams", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--long", type=int, default=2000)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3, help="rounds on each server, their gaps pooled")
    ap.add_argument("--port", type=int, default=8091)
    args = ap.parse_args()
    model = resolve_model(args.model)
    tokenizer = load_tokenizer(read_header(model))
    out: dict[str, Any] = {
        **run_record(model),
        "streams": args.streams,
        "long_prompt_tokens": args.long,
        "rounds": args.rounds,
        "peers": {},
    }
    for name in args.peers.split(","):
        p = peer(name, model, args.port, args.long + 1024)
        server = Server(p, args.port, f"/tmp/bench-gaps-{name}.log")
        try:
            server.wait_ready()
            log(f"{name} ...")
            result = summary(
                [
                    asyncio.run(
                        measure(server.url, p, tokenizer, args.streams, args.max_tokens, args.long, args.prompts)
                    )
                    for _ in range(args.rounds)
                ]
            )
            if name == "gmlx":
                result["compute_type"] = server.compute_type()
            out["peers"][name] = result
            log(f"{name}: {result}")
        finally:
            server.stop()
    save_result(f"gaps-{model.stem}.json", out, out["peers"])


if __name__ == "__main__":
    main()
