"""How good is /v1/estimate's est_ttft_s? Compare it with measured TTFT for prompts of 64 to 4096 tokens.

    python bench/bench_ttft.py                      # starts `gmlx serve` on the default model
    python bench/bench_ttft.py --url http://127.0.0.1:8080 --lengths 64 256 1024 4096

Each prompt is estimated, then run alone (max_tokens 1, streaming). Writes and prints
bench/results/ttft-<model>.json: both figures per length and the relative error, (estimated -
measured) / measured, with what the server runs on and this machine's load. The peer is the
measurement in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
from bench_serve import wait_ready

RESULTS = Path(__file__).parent / "results"


def body_of(words: int) -> dict:
    # Distinct words per length, so no prompt cache (when one exists) serves another's prefix.
    text = " ".join(f"w{words}x{i}" for i in range(words))
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 1, "temperature": 0}


def fit_words(client: httpx.Client, tokens: int) -> dict:
    """A body whose rendered prompt has about `tokens` tokens, found through /v1/estimate itself."""
    words = max(1, tokens // 4)
    for _ in range(6):
        got = client.post("/v1/estimate", json=body_of(words)).json()["prompt_tokens"]
        words = max(1, round(words * tokens / got))
    return body_of(words)


def measure_ttft(client: httpx.Client, body: dict) -> float:
    start = time.perf_counter()
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content"' in line and '"content": ""' not in line:
                return time.perf_counter() - start
            if line.startswith("data: ") and '"finish_reason": "' in line:
                return time.perf_counter() - start
    raise RuntimeError("no token came back")


def machine(client: httpx.Client) -> dict[str, Any]:
    """What the server says it runs on (/system), and this machine's cores, memory and load."""
    system = client.get("/system").json()
    return {
        "server": {k: system.get(k) for k in ("version", "device", "compute_type", "gpu")},
        "cores": os.cpu_count(),
        "memory_bytes": psutil.virtual_memory().total,
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "os": platform.platform(),
        "python": platform.python_version(),
    }


def summary(rows: list[dict]) -> dict[str, float | None]:
    errors = [abs(r["error"]) for r in rows if r["error"] is not None]
    return {
        "mean_abs_error": round(sum(errors) / len(errors), 3) if errors else None,
        "max_abs_error": max(errors, default=None),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url")
    ap.add_argument("--model")
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024, 4096])
    ap.add_argument("--port", type=int, default=8098)
    ap.add_argument("--out", type=Path, default=RESULTS, help="folder for ttft-<model>.json")
    args = ap.parse_args()
    server, url = None, args.url
    if url is None:
        url = f"http://127.0.0.1:{args.port}"
        cmd = [sys.executable, "-m", "gmlx", "serve", "--port", str(args.port), "--log-level", "warning"]
        server = subprocess.Popen(cmd + ([args.model] if args.model else []), env={**os.environ, "GMLX_API_KEY": ""})
    rows = []
    try:
        wait_ready(url)
        with httpx.Client(base_url=url, timeout=600) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
            info = machine(client)  # before the run: the load average it records is not the benchmark's own
            measure_ttft(client, body_of(8))  # warm-up
            for n in args.lengths:
                body = fit_words(client, n)
                est = client.post("/v1/estimate", json=body).json()
                ttft = measure_ttft(client, body)
                err = (est["est_ttft_s"] - ttft) / ttft if est["est_ttft_s"] is not None else None
                rows.append(
                    {
                        "target_tokens": n,
                        "prompt_tokens": est["prompt_tokens"],
                        "est_ttft_s": est["est_ttft_s"],
                        "ttft_s": round(ttft, 3),
                        "error": round(err, 3) if err is not None else None,
                    }
                )
    finally:
        if server:
            server.terminate()
            server.wait(30)
    result = {
        "model": model,
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "url": url,
        "machine": info,
        "results": rows,
        "summary": summary(rows),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"ttft-{model}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
