"""Soak: mixed traffic at the width the plan route advertises, for N minutes, sampling the
server's resident memory; reports the RSS slope and the outcome counts as one JSON object.

    python bench/soak.py --url http://127.0.0.1:8080 [--minutes 30] [--api-key KEY]

The server must run on this machine (its pid comes from /health). Designed refusals (503
queue_full, queue_timeout, memory_pressure) are counted apart from errors; anything else is an error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from typing import Any

import httpx
import psutil

DESIGNED_503 = frozenset({"queue_full", "queue_timeout", "memory_pressure"})
TOKENS_PER_WORD = 3  # generous, for small vocabularies; plus a chat template's few dozen


def _slope_per_min(samples: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, MB), in MB per minute."""
    if len(samples) < 3:
        return None
    n = len(samples)
    mt, mv = sum(t for t, _ in samples) / n, sum(v for _, v in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    return 60 * sum((t - mt) * (v - mv) for t, v in samples) / var if var else None


async def _request(c: httpx.AsyncClient, rng: random.Random, words: int, max_tokens: int) -> str:
    prompt = " ".join(rng.choice(("cat", "sea", "blue", "tree", "runs")) for _ in range(rng.randint(4, words)))
    stream, chat = rng.random() < 0.5, rng.random() < 0.7
    body: dict[str, Any] = {
        "max_tokens": rng.randint(8, max_tokens),
        "temperature": rng.choice((0, 0.8)),
        "stream": stream,
    }
    body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
    async with c.stream("POST", "/v1/chat/completions" if chat else "/v1/completions", json=body) as r:
        text = (await r.aread()).decode(errors="replace")
    if r.status_code == 200:
        ended = text.rstrip().endswith("data: [DONE]") and '"error"' not in text if stream else True
        return "ok" if ended else "error: stream ended badly"
    code = (
        r.json().get("error", {}).get("code")
        if r.headers.get("content-type", "").startswith("application/json")
        else None
    )
    return f"503 {code}" if r.status_code == 503 and code in DESIGNED_503 else f"error: {r.status_code} {code}"


async def soak(url: str, minutes: float, api_key: str | None = None, sample_s: float = 5.0, seed: int = 0) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=300) as c:
        pid = (await c.get("/health")).json()["pid"]
        context = (await c.get("/v1/models")).json()["data"][0]["context_length"]
        words, max_tokens = max(4, min(120, context // 6)), max(8, min(48, context // 8))  # fit small contexts
        depth = min(context, TOKENS_PER_WORD * words + max_tokens + 32)
        plan = (await c.get("/v1/capacity/plan", params={"width": 1, "depth": depth})).json()
        width = max(1, min(plan["max_width_at_depth"], plan["decode_batch"]))
        proc, rng = psutil.Process(pid), random.Random(seed)
        outcomes: Counter[str] = Counter()
        rss: list[tuple[float, float]] = []
        t0 = time.monotonic()
        deadline = t0 + 60 * minutes

        async def worker() -> None:
            while time.monotonic() < deadline:
                try:
                    outcomes[await _request(c, rng, words, max_tokens)] += 1
                except httpx.HTTPError as e:
                    outcomes[f"error: {type(e).__name__}"] += 1

        async def sampler() -> None:
            while time.monotonic() < deadline:
                rss.append((time.monotonic() - t0, proc.memory_info().rss / 2**20))
                await asyncio.sleep(sample_s)

        await asyncio.gather(sampler(), *(worker() for _ in range(width)))
    steady = rss[len(rss) // 10 :]  # the first tenth warms caches and allocators
    errors = {k: v for k, v in outcomes.items() if k.startswith("error")}
    return {
        "url": url,
        "minutes": minutes,
        "width": width,
        "depth": depth,
        "requests": sum(outcomes.values()),
        "ok": outcomes["ok"],
        "designed_503": sum(v for k, v in outcomes.items() if k.startswith("503")),
        "errors": sum(errors.values()),
        "error_kinds": errors,
        "rss_mb_start": round(rss[0][1], 1) if rss else None,
        "rss_mb_end": round(rss[-1][1], 1) if rss else None,
        "rss_mb_max": round(max(v for _, v in rss), 1) if rss else None,
        "rss_slope_mb_per_min": None if (s := _slope_per_min(steady)) is None else round(s, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--api-key")
    ap.add_argument("--sample-s", type=float, default=5.0, help="seconds between RSS samples")
    args = ap.parse_args()
    print(json.dumps(asyncio.run(soak(args.url, args.minutes, args.api_key, args.sample_s)), indent=2))


if __name__ == "__main__":
    main()
