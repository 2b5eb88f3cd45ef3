"""Benchmarks of gmlx side by side with its peers, on one model file and one machine.

    python -m bench serve [--model M.gguf] [--peers gmlx,llama-cpp,mlx-lm] [--quick]
    python -m bench build-llama [--version V] [--force]

`serve` first readies every peer (building llama-server, exporting the model for mlx-lm, when
not cached; see bench/peers.py), then starts each server in turn and keeps them up, measures
them in rounds, one peer after another (bench/harness.py, `bench_peers`), and writes
bench/results/serve-<model>.json and .png; prints a markdown table of gmlx's ratios to each
peer: the median of the rounds' ratios, and the rounds gmlx led. Needs matplotlib (the `bench`
extra). The quick mode (4 rounds of 64 tokens, 2 requests per client, 1 TTFT sample each)
takes about 3 minutes for two peers on the default model with 2 cores. A 1-minute load average
above BUSY_LOAD at the start is warned about and recorded: other work on the cores lowers every
figure, and alternating rounds put it on every peer alike.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import replace
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import psutil

import gmlx
from bench import llama_build
from bench.harness import SCHEMA, Plan, bench_peers, endpoint, log
from bench.peers import PEERS, Missing, Peer, cores, peer
from gmlx.default_model import resolve_model
from gmlx.gguf.header import read_header
from gmlx.gguf.tokenizer import load_tokenizer

RESULTS = Path(__file__).parent / "results"
BUSY_LOAD = 0.5  # 1-minute load average above which the machine counts as busy
LENGTHS = (128, 512, 2048)
QUICK = Plan((1, 2, 4, 8), requests_per_client=2, max_tokens=64, prompt_lengths=LENGTHS, ttft_repeats=1, rounds=4)
FULL = Plan((1, 2, 4, 8), requests_per_client=4, max_tokens=128, prompt_lengths=LENGTHS, ttft_repeats=1, rounds=6)


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def machine() -> dict[str, Any]:
    cpu = (
        next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            platform.processor(),
        )
        if Path("/proc/cpuinfo").exists()
        else platform.processor()
    )
    packages = {}
    for name in ("gmlx", "mlx", "mlx-lm", "transformers", "tokenizers", "numpy"):
        try:
            packages[name] = version(name)
        except PackageNotFoundError:
            packages[name] = None
    return {
        "cpu": cpu,
        "cores": cores(),
        "memory_bytes": psutil.virtual_memory().total,
        "os": platform.platform(),
        "python": platform.python_version(),
        "packages": packages,
        "blas": {"name": gmlx.BLAS.name, "path": gmlx.BLAS.path},
    }


def run_record(model: Path) -> dict[str, Any]:
    """What a result file opens with: the model, this machine, the time and the load at the start."""
    return {
        "model": model.name,
        "machine": machine(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load_average_1m_start": os.getloadavg()[0],
    }


def save_result(name: str, out: dict[str, Any], shown: dict[str, Any]) -> None:
    """Write `out` as results/<name>, with the load at the end, and print `shown`."""
    out["load_average_1m_end"] = os.getloadavg()[0]
    path = RESULTS / name
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(shown, indent=2))
    log(f"wrote {path}")


def ratios(peers: dict[str, Any]) -> dict[str, Any]:
    """gmlx over each peer, as speed ratios (above 1: gmlx is faster; TTFT as peer TTFT / gmlx TTFT):
    the median of the rounds' ratios, each round's pair measured one after the other, with every
    round's ratio and the rounds gmlx led."""
    ours = peers.get("gmlx", {})
    out: dict[str, Any] = {}

    def paired(a: dict, b: dict, key: str, inverse: bool = False) -> dict[str, Any]:
        rs = [
            (y[key] / x[key] if inverse else x[key] / y[key])
            for x, y in zip(a["rounds"], b["rounds"])
            if x[key] and y[key]
        ]
        return {
            "median": round(statistics.median(rs), 2) if rs else None,
            "rounds": [round(r, 2) for r in rs],
            "led": sum(r > 1 for r in rs),
        }

    for name, other in peers.items():
        if name == "gmlx" or "decode" not in other or "decode" not in ours:
            continue
        each = {
            "aggregate": {a["width"]: paired(a, b, "aggregate_tok_s") for a, b in zip(ours["decode"], other["decode"])},
            "per_stream": {
                a["width"]: paired(a, b, "per_stream_decode_tok_s") for a, b in zip(ours["decode"], other["decode"])
            },
            "ttft": {
                a["target_tokens"]: paired(a, b, "ttft_s", inverse=True) for a, b in zip(ours["ttft"], other["ttft"])
            },
        }
        out[name] = {kind: {k: v["median"] for k, v in cells.items()} for kind, cells in each.items()}
        out[name]["rounds"] = each
    return out


def _ratio_cell(ratio: dict[str, Any], kind: str, key: int) -> str:
    """The median ratio and the rounds gmlx led of those paired (int keys are strings once read back)."""
    cells = ratio["rounds"][kind]
    each = cells[key] if key in cells else cells[str(key)]
    return f"{each['median']}x ({each['led']}/{len(each['rounds'])})"


def table(results: dict[str, Any]) -> str:
    plan, peers = results["plan"], results["peers"]
    widths, lengths = plan["widths"], plan["prompt_lengths"]
    head = (
        ["server"]
        + [f"agg w{w}" for w in widths]
        + [f"stream w{w}" for w in widths]
        + [f"TTFT {n}" for n in lengths]
        + ["ready", "RSS idle / w8"]
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, p in peers.items():
        if "decode" not in p:
            lines.append(f"| {name} | " + p.get("missing", p.get("failed", "")) + " |")
            continue
        cells = [f"{r['aggregate_tok_s']}" for r in p["decode"]] + [
            f"{r['per_stream_decode_tok_s']}" for r in p["decode"]
        ]
        cells += [f"{t['ttft_s']} s ({t['prefill_tok_s']:.0f}/s)" for t in p["ttft"]]
        cells += [
            f"{p['ready_s']} s",
            f"{p['rss_idle_bytes'] / 2**20:.0f} / {p['rss_width_max_bytes'] / 2**20:.0f} MiB",
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for name, r in results["ratios"].items():
        cells = [_ratio_cell(r, "aggregate", w) for w in widths] + [_ratio_cell(r, "per_stream", w) for w in widths]
        cells += [_ratio_cell(r, "ttft", n) for n in lengths] + ["", ""]
        lines.append(f"| gmlx / {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def busy_warning(load: list[float]) -> str | None:
    if load[0] <= BUSY_LOAD:
        return None
    return (
        f"the 1-minute load average was {load[0]} at the start (above {BUSY_LOAD}): other work shares the "
        f"{cores()} cores, so every figure here is low; rerun when the machine is quiet"
    )


def shout(message: str) -> None:
    bar = "!" * 78
    log(f"{bar}\n[bench] WARNING: {message}\n[bench] {bar}")


def serve(args: argparse.Namespace) -> None:
    from bench.plot import plot  # matplotlib, the `bench` extra: needed here only, not by build-llama

    started, load_start = time.monotonic(), load_average()
    if warning := busy_warning(load_start):
        shout(warning)
    model = resolve_model(args.model)
    plan = QUICK if args.quick else FULL
    if args.temperature > 0:
        plan = replace(plan, sampling=(("temperature", args.temperature), ("top_p", args.top_p)))
    if args.json_schema:
        plan = replace(plan, schema=SCHEMA)
    names = [n.strip() for n in args.peers.split(",") if n.strip()]
    if unknown := set(names) - set(PEERS):
        sys.exit(f"unknown peers {sorted(unknown)} (known: {', '.join(PEERS)})")
    tokenizer = load_tokenizer(read_header(model))
    context = -(-(max(plan.prompt_lengths) + plan.max_tokens + 64) // 256) * 256
    args.out.mkdir(parents=True, exist_ok=True)
    # Every build and export happens here, before the first timed cell, not between two peers.
    ready: dict[str, Peer] = {}
    peers: dict[str, Any] = {}
    for i, name in enumerate(names):
        try:
            ready[name] = peer(name, model, args.port + i, context)
        except Missing as e:
            peers[name] = {"missing": str(e)}
            log(f"{name}: missing: {e}")
    prepare_s = time.monotonic() - started
    ports = {name: args.port + i for i, name in enumerate(names)}
    peers.update(bench_peers(ready, ports, tokenizer, plan, str(args.out)))
    peers = {name: peers[name] for name in names}
    results = {
        "model": model.name,
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "duration_s": round(time.monotonic() - started, 1),
        "prepare_s": round(prepare_s, 1),
        "machine": {
            **machine(),
            "load_average_at_start": load_start,
            "load_average_at_end": load_average(),
            "busy_at_start": warning is not None,
        },
        "warnings": [warning] if warning else [],
        "plan": {
            **plan.__dict__,
            "quick": args.quick,
            "endpoint": endpoint(plan.schema),
            "sampling": dict(plan.sampling),
            "llama_context_per_slot": context,
        },
        "peers": peers,
    }
    results["ratios"] = ratios(peers)
    sampled = f"-t{args.temperature:g}-p{args.top_p:g}" if args.temperature > 0 else ""
    stem = args.out / f"serve-{model.stem}{sampled}{'-json-schema' if plan.schema else ''}"
    Path(f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, Path(f"{stem}.png"))
    print(table(results))
    for name, p in peers.items():
        if p.get("compute_type"):
            print(f"{name} ran as {p['compute_type']}")
    log(f"wrote {stem}.json and .png ({results['duration_s']} s)")
    if warning:
        shout(warning)


def build_llama(args: argparse.Namespace) -> None:
    try:
        print(llama_build.build(args.version, force=args.force))
    except llama_build.BuildError as e:
        sys.exit(f"llama.cpp build failed: {e}")


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench")
    sub = ap.add_subparsers(dest="command", required=True)
    fmt = argparse.ArgumentDefaultsHelpFormatter
    s = sub.add_parser(
        "serve",
        help="gmlx against llama-server and mlx_lm.server",
        formatter_class=fmt,
        description="Start each server in turn on the same GGUF and measure decode tok/s at widths "
        "1-8, TTFT per prompt length, time to ready and memory. A missing llama-server is built "
        "first (about 5 minutes); a peer that cannot run is reported as missing.",
    )
    s.add_argument("--model", help="GGUF file (the default model when omitted)")
    s.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated, from {', '.join(PEERS)}")
    s.add_argument("--quick", action="store_true", help="fewer, shorter requests (under 10 minutes)")
    s.add_argument("--port", type=int, default=8190, help="first loopback port; one per peer")
    s.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON, PNG and server logs")
    s.add_argument("--temperature", type=float, default=0.0, help="decode requests' temperature (0: greedy)")
    s.add_argument("--top-p", type=float, default=1.0, help="decode requests' top_p, with --temperature")
    s.add_argument(
        "--json-schema",
        action="store_true",
        help="decode requests through chat completions, each output held to a JSON schema (response_format)",
    )
    s.set_defaults(run=serve)
    b = sub.add_parser(
        "build-llama",
        help="build and cache llama-server and llama-tokenize (about 5 minutes)",
        formatter_class=fmt,
        description=f"Cache both under {llama_build.build_dir().parent}.",
    )
    b.add_argument("--version", default=llama_build.LLAMA_CPP_PYTHON, help="llama-cpp-python sdist to build from")
    b.add_argument("--force", action="store_true", help="rebuild even when cached")
    b.set_defaults(run=build_llama)
    args = ap.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
