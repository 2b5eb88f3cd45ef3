"""Clients that send their next request as the last ends: gmlx beside llama-server, both running at once.

    python -m bench.bench_relay [--model M.gguf] [--clients 8] [--requests 4] [--rounds 3] [--url URL ...]

An agent harness's subagents, or a router's users, do not arrive together and leave together:
each sends its next request when its last answer ends, so rows join and leave the decode batch
every few steps (docs/ARCHITECTURE.md, decision 30). Each of `clients` streams `requests` greedy
completions one after another, of 24 to 56 tokens (client i's j-th: 24 + 8 x ((i + j) mod 5)),
each with a unique short prompt. The figure is every completion token over the wall time, the
median of the rounds; each round runs every server in turn, so a shared machine's load falls on
all alike. `--url` adds servers already running (an older gmlx build, say), named by their URL.
Writes bench/results/relay-<model>.json with gmlx over llama-server.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import httpx

from bench.__main__ import run_record, save_result
from bench.harness import Server, log, story_prompt, stream_once
from bench.peers import Peer, peer
from gmlx.default_model import resolve_model
from gmlx.gguf.header import read_header
from gmlx.gguf.tokenizer import load_tokenizer

PEERS = ("gmlx", "llama-cpp")


async def relay(url: str, p: Peer, tokenizer: Any, clients: int, requests: int) -> float:
    """Completion tokens a second, every client sending its requests one after another."""
    limits = httpx.Limits(max_connections=clients + 1, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        await stream_once(client, p, tokenizer, story_prompt(), 8)  # warm-up

        async def one(i: int) -> int:
            sent = [
                await stream_once(client, p, tokenizer, story_prompt(), 24 + 8 * ((i + j) % 5)) for j in range(requests)
            ]
            return sum(r["tokens"] for r in sent)

        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(i) for i in range(clients)))
        return sum(tokens) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=4, help="each client's, one after another")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--url", nargs="*", default=[], help="running servers to measure too (OpenAI routes)")
    ap.add_argument("--port", type=int, default=8095, help="gmlx's; llama-server takes the next")
    args = ap.parse_args()
    model = resolve_model(args.model)
    tokenizer = load_tokenizer(read_header(model))
    servers = {
        name: Server(peer(name, model, args.port + i, 4096), args.port + i, f"/tmp/bench-relay-{name}.log")
        for i, name in enumerate(PEERS)
    }
    targets = {name: (s.url, s.peer) for name, s in servers.items()}
    targets |= {url: (url, Peer(url, [], "running")) for url in args.url}
    out: dict[str, Any] = {**run_record(model), "clients": args.clients, "requests": args.requests}
    runs: dict[str, list[float]] = {name: [] for name in targets}
    try:
        for s in servers.values():
            s.wait_ready()
        out["compute_type"] = servers["gmlx"].compute_type()
        for r in range(args.rounds):
            for name, (url, p) in targets.items():
                runs[name].append(round(asyncio.run(relay(url, p, tokenizer, args.clients, args.requests)), 1))
            log(f"round {r + 1}: {runs}")
    finally:
        for s in servers.values():
            s.stop()
    out["tok_s"] = {name: round(statistics.median(xs), 1) for name, xs in runs.items()}
    out["runs"] = runs
    out["gmlx_over_llama_cpp"] = round(out["tok_s"]["gmlx"] / out["tok_s"]["llama-cpp"], 2)
    save_result(f"relay-{model.stem}.json", out, {k: out[k] for k in ("tok_s", "gmlx_over_llama_cpp")})


if __name__ == "__main__":
    main()
