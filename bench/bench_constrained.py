"""What the per-row work costs: the engine's decode rate with every row constrained to a JSON schema,
with every row asking for top_logprobs 5, and with every row sampled (temperature 0.7, top_p 0.9,
each its own seed), against free greedy decoding, at the same widths, in one process.

    python -m bench.bench_constrained [--model M.gguf] [--widths 1 8] [--max-tokens 64] [--rounds 4]

B greedy requests with unique prompts go to gmlx's Engine together (the server's, built from
default settings, no prompt cache), either free, or each with its own matcher for SCHEMA (whose
long required string keeps every row decoding to max_tokens), or each scored for 5 alternatives.
The rate is bench_engine's while all B streams decode. Rounds interleave the three at each
width (each figure: the best of the rounds), so a shared machine's load falls on all alike.
`mask_ms` is one row's mask step alone on the model's vocabulary
(llguidance's mask, and applying it to the logits). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

import gmlx  # noqa: F401  (BLAS bring-up before mlx)
import mlx.core as mx

from bench.__main__ import load_average, machine
from bench.bench_engine import engine_round
from bench.harness import SCHEMA
from gmlx.default_model import resolve_model
from gmlx.engine.grammar import GrammarProcessor, json_schema_constraint
from gmlx.engine.processors import Decoding
from gmlx.engine.sampling import SamplingParams
from gmlx.deployment import Deployment
from gmlx.server.build import build_engine
from gmlx.settings import resolve_settings


def mask_ms(decoding: Decoding, vocab: int, steps: int = 64) -> float:
    """One row's mask per step: what the grammar adds to a decode step, the model aside."""
    assert decoding.constraint is not None
    row = GrammarProcessor(decoding.constraint, start=0)
    logits = mx.zeros((1, vocab))
    tokens: list[int] = []
    start = time.perf_counter()
    for _ in range(steps):
        masked = row(mx.array(tokens, dtype=mx.int32), logits)
        tokens.append(int(mx.argmax(masked[0]).item()))  # some allowed token: the matcher moves on
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="GGUF (default model when omitted)")
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    path = resolve_model(args.model)
    settings = resolve_settings(
        {"decode_batch": max(args.widths), "prompt_cache_bytes": 0, "log_level": "warning"}, env={}
    )
    engine = build_engine(Deployment(path.stem, path, settings))
    engine.start()
    engine.ready.wait()
    assert engine.load_error is None and engine.loaded is not None, engine.load_error
    vocab = engine.loaded.geometry.vocab_size
    start = time.perf_counter()
    constrained = Decoding(constraint=json_schema_constraint(SCHEMA, engine.loaded))
    first_compile_s = time.perf_counter() - start  # the vocabulary's first grammar builds llguidance's view of it
    start = time.perf_counter()
    json_schema_constraint({**SCHEMA, "title": "another"}, engine.loaded)
    compile_ms = (time.perf_counter() - start) * 1e3
    greedy, sampled = SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_p=0.9)
    ways = {
        "free": (Decoding(), None, greedy),
        "constrained": (constrained, None, greedy),
        "top_logprobs_5": (Decoding(), 5, greedy),
        "top_p_0.9": (Decoding(), None, sampled),
    }
    load_before = load_average()
    engine_round(engine, 1, 4, "warm", constrained)
    best: dict[str, dict[int, float]] = {name: {} for name in ways}
    for r in range(args.rounds):
        for b in args.widths:
            for name, (decoding, logprobs, sampling) in ways.items():
                rate = engine_round(engine, b, args.max_tokens, f"r{r}b{b}{name}", decoding, logprobs, sampling)[1]
                rate = rate or 0.0
                best[name][b] = max(best[name].get(b, 0.0), rate)
    engine.stop()
    out = {
        "model": path.name,
        "vocab": vocab,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "tok_s": {name: {b: round(v, 1) for b, v in rows.items()} for name, rows in best.items()},
        "vs_free": {
            name: {b: round(best[name][b] / best["free"][b], 3) for b in args.widths} for name in ways if name != "free"
        },
        "mask_ms": round(mask_ms(constrained, vocab), 3),
        "schema_compile_ms": round(compile_ms, 2),
        "first_grammar_s": round(first_compile_s, 2),
        "machine": machine(),
        "load_average": {"before": load_before, "after": load_average()},
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
