"""One stream's decode rate after a long prompt: gmlx beside llama-server, both running at once.

    python -m bench.bench_depth [--model M.gguf] [--depths 16 512 2048] [--max-tokens 96] [--rounds 3]

An agent's requests carry thousands of tokens of context, and each decode step reads the whole KV
cache: this is the rate at that depth. Both servers start (decode batch 8, as in `bench serve`) and
stay up; each round sends every depth to each server in turn, one request at a time: a unique
prompt of that many tokens, then `max_tokens` greedy tokens, streamed. A stream's rate is its
tokens after the first over the time from the first to the last (`harness.stream_once`); each
figure is the median of the rounds, so a shared machine's load falls on both alike. Writes
bench/results/depth-<model>.json with gmlx over llama-server per depth.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from typing import Any

import httpx

from bench.__main__ import run_record, save_result
from bench.harness import Server, log, prompt_of, stream_once
from bench.peers import peer
from gmlx.default_model import resolve_model
from gmlx.gguf.header import read_header
from gmlx.gguf.tokenizer import load_tokenizer

PEERS = ("gmlx", "llama-cpp")


async def rate(server: Server, tokenizer: Any, depth: int, max_tokens: int) -> float | None:
    async with httpx.AsyncClient(base_url=server.url, timeout=600) as client:
        r = await stream_once(client, server.peer, tokenizer, prompt_of(tokenizer, depth), max_tokens)
    return r["decode_tok_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--depths", type=int, nargs="+", default=[16, 512, 2048])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--port", type=int, default=8093, help="gmlx's; llama-server takes the next")
    args = ap.parse_args()
    model = resolve_model(args.model)
    tokenizer = load_tokenizer(read_header(model))
    context = max(args.depths) + args.max_tokens + 64
    servers = {
        name: Server(peer(name, model, args.port + i, context), args.port + i, f"/tmp/bench-depth-{name}.log")
        for i, name in enumerate(PEERS)
    }
    out: dict[str, Any] = {
        **run_record(model),
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
    }
    runs: dict[str, dict[int, list[float | None]]] = {name: {d: [] for d in args.depths} for name in PEERS}
    try:
        for s in servers.values():
            s.wait_ready()
        out["compute_type"] = servers["gmlx"].compute_type()
        for r in range(args.rounds):
            for d in args.depths:
                for name, s in servers.items():
                    runs[name][d].append(asyncio.run(rate(s, tokenizer, d, args.max_tokens)))
            log(f"round {r + 1}: {runs}")
    finally:
        for s in servers.values():
            s.stop()

    def median(xs: list[float | None]) -> float | None:
        got = [x for x in xs if x]
        return round(statistics.median(got), 1) if got else None

    out["tok_s"] = {name: {d: median(xs) for d, xs in by.items()} for name, by in runs.items()}
    out["runs"] = runs
    out["gmlx_over_llama_cpp"] = {
        d: round(g / lc, 2) if (g := out["tok_s"]["gmlx"][d]) and (lc := out["tok_s"]["llama-cpp"][d]) else None
        for d in args.depths
    }
    save_result(f"depth-{model.stem}.json", out, {k: out[k] for k in ("tok_s", "gmlx_over_llama_cpp")})


if __name__ == "__main__":
    main()
