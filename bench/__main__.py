"""Benchmarks of gmlx side by side with its peers, on one model file and one machine.

    python -m bench serve [--model M.gguf] [--peers gmlx,llama-cpp,mlx-lm] [--quick]

Starts each server in turn (see bench/peers.py for how each is found and started, and how to
build llama-server), measures it (bench/harness.py), and writes bench/results/serve-<model>.json
and .png; prints a markdown table of gmlx's ratios to each peer. Needs matplotlib (the `bench`
extra). The quick mode (64 tokens, 2 requests per client, 2 TTFT samples) takes under 10
minutes on the default model with 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import httpx
import psutil

import gmlx
from bench.harness import Plan, bench_peer, log
from bench.peers import PEERS, Missing, cores, peer
from bench.plot import plot
from gmlx.default_model import resolve_model
from gmlx.gguf.header import read_header
from gmlx.gguf.tokenizer import load_tokenizer

RESULTS = Path(__file__).parent / "results"
QUICK = Plan(widths=(1, 2, 4, 8), requests_per_client=2, max_tokens=64, prompt_lengths=(128, 512, 2048),
             ttft_repeats=2)
FULL = Plan(widths=(1, 2, 4, 8), requests_per_client=4, max_tokens=128, prompt_lengths=(128, 512, 2048),
            ttft_repeats=3)


def machine() -> dict[str, Any]:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() \
        else platform.processor()
    packages = {}
    for name in ("gmlx", "mlx", "mlx-lm", "transformers", "tokenizers", "numpy"):
        try:
            packages[name] = version(name)
        except PackageNotFoundError:
            packages[name] = None
    return {"cpu": cpu, "cores": cores(), "memory_bytes": psutil.virtual_memory().total,
            "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
            "os": platform.platform(), "python": platform.python_version(), "packages": packages,
            "blas": {"name": gmlx.BLAS.name, "path": gmlx.BLAS.path}}


def ratios(peers: dict[str, Any]) -> dict[str, Any]:
    """gmlx over each peer, as speed ratios (above 1: gmlx is faster); TTFT as peer TTFT / gmlx TTFT."""
    ours = peers.get("gmlx", {})
    out: dict[str, Any] = {}
    for name, other in peers.items():
        if name == "gmlx" or "decode" not in other or "decode" not in ours:
            continue
        out[name] = {
            "aggregate": {a["width"]: round(a["aggregate_tok_s"] / b["aggregate_tok_s"], 2)
                          for a, b in zip(ours["decode"], other["decode"])},
            "per_stream": {a["width"]: round(a["per_stream_decode_tok_s"] / b["per_stream_decode_tok_s"], 2)
                           for a, b in zip(ours["decode"], other["decode"])},
            "ttft": {a["target_tokens"]: round(b["ttft_s"] / a["ttft_s"], 2) for a, b in zip(ours["ttft"], other["ttft"])},
        }
    return out


def table(results: dict[str, Any]) -> str:
    plan, peers = results["plan"], results["peers"]
    widths, lengths = plan["widths"], plan["prompt_lengths"]
    head = ["server"] + [f"agg w{w}" for w in widths] + [f"stream w{w}" for w in widths] + \
        [f"TTFT {n}" for n in lengths] + ["ready", "RSS idle / w8"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, p in peers.items():
        if "decode" not in p:
            lines.append(f"| {name} | " + p.get("missing", p.get("failed", "")) + " |")
            continue
        cells = [f"{r['aggregate_tok_s']}" for r in p["decode"]] + [f"{r['per_stream_decode_tok_s']}" for r in p["decode"]]
        cells += [f"{t['ttft_s']} s ({t['prefill_tok_s']:.0f}/s)" for t in p["ttft"]]
        cells += [f"{p['ready_s']} s", f"{p['rss_idle_bytes'] / 2**20:.0f} / {p['rss_width_max_bytes'] / 2**20:.0f} MiB"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for name, r in results["ratios"].items():
        cells = [f"{r['aggregate'][w]}x" for w in widths] + [f"{r['per_stream'][w]}x" for w in widths]
        cells += [f"{r['ttft'][n]}x" for n in lengths] + ["", ""]
        lines.append(f"| gmlx / {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def serve(args: argparse.Namespace) -> None:
    model = resolve_model(args.model)
    plan = QUICK if args.quick else FULL
    names = [n.strip() for n in args.peers.split(",") if n.strip()]
    if unknown := set(names) - set(PEERS):
        sys.exit(f"unknown peers {sorted(unknown)} (known: {', '.join(PEERS)})")
    tokenizer = load_tokenizer(read_header(model))
    context = -(-(max(plan.prompt_lengths) + plan.max_tokens + 64) // 256) * 256
    args.out.mkdir(parents=True, exist_ok=True)
    peers: dict[str, Any] = {}
    for i, name in enumerate(names):
        log(f"{name} ...")
        try:
            p = peer(name, model, args.port + i, context)
        except Missing as e:
            peers[name] = {"missing": str(e)}
            log(f"{name}: missing: {e}")
            continue
        try:
            peers[name] = bench_peer(p, args.port + i, tokenizer, plan, str(args.out / f"{name}.log"))
        except (RuntimeError, httpx.HTTPError) as e:  # a peer that dies mid-run is reported, not fatal
            peers[name] = {"failed": f"{type(e).__name__}: {e}"}
            log(f"{name}: failed: {e}")
    results = {"model": model.name, "created": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine(),
               "plan": {**plan.__dict__, "quick": args.quick, "endpoint": "/v1/completions", "greedy": True,
                        "llama_context_per_slot": context},
               "peers": peers}
    results["ratios"] = ratios(peers)
    stem = args.out / f"serve-{model.stem}"
    Path(f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, Path(f"{stem}.png"))
    print(table(results))
    log(f"wrote {stem}.json and .png")


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench")
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="gmlx against llama-server and mlx_lm.server")
    s.add_argument("--model", help="GGUF file (the default model when omitted)")
    s.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated, from {', '.join(PEERS)}")
    s.add_argument("--quick", action="store_true", help="fewer, shorter requests (under 10 minutes)")
    s.add_argument("--port", type=int, default=8190, help="first loopback port; one per peer")
    s.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    serve(args)


if __name__ == "__main__":
    main()
