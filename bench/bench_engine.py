"""The engine alone (no HTTP) against stepping the model directly, at the same widths, in one process.

    python -m bench.bench_engine [--model M.gguf] [--widths 1 8] [--max-tokens 64] [--rounds 3] [--profile]
                                 [--url http://127.0.0.1:8101 ...]

`direct`: B streams stepped as bench_kernels steps them (one token each per step, greedy, each
step's graph built while the previous one computes). `engine`: B greedy requests with unique
prompts submitted together to gmlx's Engine (the server's, built from default settings, no
prompt cache); its aggregate decode rate is measured as bench_serve measures a server's: tokens
after each stream's first, over the span from the first stream's first token to the last token.
`engine_full_width`: the rate while all B streams decode (no admission, no tail). `--url`: gmlx
servers measured in the same rounds, as bench_serve measures them. Rounds interleave them all
(each figure: the best of the rounds), so a shared machine's load falls on each alike. `--profile`
runs one more engine round per width under cProfile (the engine thread)
and prints its top functions by own time. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import pstats
import threading
import time

import gmlx  # noqa: F401  (BLAS bring-up before mlx)
import numpy as np

from bench.bench_kernels import step_decode
from bench.bench_serve import run_width
from gmlx.default_model import resolve_model
from gmlx.engine.engine import Chunk, Engine, Event, Finished, Request
from gmlx.engine.processors import Decoding
from gmlx.engine.sampling import SamplingParams
from gmlx.deployment import Deployment
from gmlx.server.build import build_engine
from gmlx.settings import resolve_settings

TOPICS = [
    "a lighthouse keeper",
    "the tides",
    "a harbour at dawn",
    "sailing ships",
    "a mountain village",
    "the first railway",
    "a desert caravan",
    "an old clock maker",
]


def engine_round(
    engine: Engine,
    b: int,
    max_tokens: int,
    tag: str,
    decoding: Decoding = Decoding(),
    logprobs: int | None = None,
    sampling: SamplingParams = SamplingParams(temperature=0),
) -> tuple[float | None, float | None]:
    """(aggregate decode tok/s as bench_serve measures it, tok/s while all B streams decode), each
    stream shaped by `decoding`, scored for `logprobs` alternatives and drawn with `sampling`
    (bench_constrained)."""
    tok = engine.loaded.tokenizer  # type: ignore[union-attr]
    done = threading.Event()
    firsts: list[float] = []
    lasts: list[float] = []
    counts: list[int] = []
    chunks: list[float] = []  # every chunk's time, for the rate while all B streams decode

    def emitter() -> object:
        first: list[float] = []

        def emit(e: Event) -> None:
            if isinstance(e, Chunk):
                now = time.perf_counter()
                if not first:
                    first.append(now)
                    firsts.append(now)
                emit.last = now  # type: ignore[attr-defined]
                chunks.append(now)
            elif isinstance(e, Finished):
                counts.append(e.completion_tokens)
                lasts.append(getattr(emit, "last", 0.0))
                if len(counts) == b:
                    done.set()
            else:
                raise SystemExit(f"request failed: {e}")

        return emit

    for i in range(b):
        text = f"Write a long story about {TOPICS[i % len(TOPICS)]} ({tag}, stream {i}), in many sentences."
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        engine.submit(
            Request(
                f"{tag}-{i}",
                list(ids),
                max_tokens,
                sampling,
                emit=emitter(),
                decoding=decoding,
                logprobs=logprobs,
            )
        )
    done.wait()
    span = max(lasts) - min(firsts)
    tokens = sum(counts)
    lo, hi = max(firsts), min(lasts)
    full = sum(1 for t in chunks if lo < t <= hi) / (hi - lo) if hi > lo else None
    return ((tokens - b) / span if span > 0 else None), full


def profile_engine(engine: Engine, b: int, max_tokens: int, top: int) -> str:
    prof = cProfile.Profile()
    step = engine._step  # the engine thread's work per step: profile it there

    def profiled(gen):
        prof.enable()
        try:
            step(gen)
        finally:
            prof.disable()

    engine._step = profiled  # type: ignore[method-assign]
    try:
        engine_round(engine, b, max_tokens, f"prof{b}")
    finally:
        engine._step = step  # type: ignore[method-assign]
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="GGUF (default model when omitted)")
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument(
        "--url",
        nargs="*",
        default=[],
        help="gmlx servers to measure too, each round (as bench_serve does); start them with "
        "--decode-batch at the widest width and --prompt-cache-bytes 0",
    )
    args = ap.parse_args()
    path = resolve_model(args.model)
    settings = resolve_settings(
        {"decode_batch": max(args.widths), "prompt_cache_bytes": 0, "log_level": "warning"}, env={}
    )
    engine = build_engine(Deployment(path.stem, path, settings))
    engine.start()
    engine.ready.wait()
    assert engine.load_error is None, engine.load_error
    rng = np.random.default_rng(0)
    engine_round(engine, 1, 4, "warm")
    best: dict[str, dict[int, float]] = {"direct": {}, "engine": {}, "engine_full_width": {}}
    for r in range(args.rounds):
        for b in args.widths:
            d = step_decode(engine.loaded.model, b, args.max_tokens, rng)  # type: ignore[union-attr]
            e, full = engine_round(engine, b, args.max_tokens, f"r{r}b{b}")
            rows = [("direct", d), ("engine", e), ("engine_full_width", full)]
            for url in args.url:
                http = asyncio.run(run_width(url, b, args.max_tokens))
                rows += [(url, http["aggregate_decode_tok_s"]), (f"{url} full_width", http["full_width_tok_s"])]
            for key, v in rows:
                best.setdefault(key, {})
                best[key][b] = max(best[key].get(b, 0), v or 0)
    out: dict = {
        "model": path.name,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "tok_s": {k: {b: round(v, 1) for b, v in rows.items()} for k, rows in best.items()},
        "engine_vs_direct": {b: round(best["engine"][b] / best["direct"][b], 3) for b in args.widths},
    }
    if args.profile:
        for b in args.widths:
            print(profile_engine(engine, b, args.max_tokens, 25))
    engine.stop()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
