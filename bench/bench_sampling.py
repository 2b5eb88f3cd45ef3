"""What sampling costs a decode step: MLX's own ops against gmlx.kernels' one node, in one process.

    python -m bench.bench_sampling [--model M.gguf] [--rows 8] [--reps 10]

The logits are the default model's own, after 8 text prompts (the vocabulary's real shape: a
flat distribution makes top_p keep most of it). Each row has a sampler of its own: MLX's run
once per row; gmlx's rows are drawn together in one node (sampling.sample_rows), as the engine
draws a step's rows; greedy runs once for the whole batch. Figures
are ms a step for all rows, best of the repetitions, the two ways interleaved.
Writes bench/results/sampling-<model>.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
PROMPTS = [
    "The lighthouse keeper climbed the stairs and",
    "Tides rise and fall because",
    "At dawn the harbour was",
    "The history of sailing ships begins with",
    "Write a short poem about the sea:",
    "My favourite food is",
    "The capital of France is",
    "def fibonacci(n):",
]
SETTINGS = {
    "greedy": {"temperature": 0.0},
    "temperature 0.7": {"temperature": 0.7},
    "top_p 0.9": {"temperature": 0.7, "top_p": 0.9},
    "top_p 0.95, T 1": {"temperature": 1.0, "top_p": 0.95},
    "top_k 40": {"temperature": 0.7, "top_k": 40},
    "min_p 0.05": {"temperature": 0.7, "min_p": 0.05},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="GGUF file (the default model when omitted)")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()

    import gmlx  # noqa: F401  (BLAS bring-up before mlx)
    import mlx.core as mx

    from gmlx import kernels
    from gmlx.default_model import resolve_model
    from gmlx.engine import sampling
    from gmlx.kernels import fast as kernels_fast
    from gmlx.models.loader import load

    kernels_fast.install()  # as a server's engine does
    path = resolve_model(args.model)
    m = load(path, "auto")
    prompts = [m.tokenizer.encode(PROMPTS[i % len(PROMPTS)]) for i in range(args.rows)]
    width = min(len(p) for p in prompts)
    logits = m.model(mx.array([p[-width:] for p in prompts]))[:, -1, :].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    mx.eval(logprobs)
    rows = [logprobs[i : i + 1] for i in range(args.rows)]

    def samplers(settings: dict, fused: bool) -> list:
        real = kernels.available
        kernels.available = lambda: fused and real()  # type: ignore[method-assign]
        try:
            return [sampling.make_sampler(sampling.SamplingParams(**settings)) for _ in range(args.rows)]
        finally:
            kernels.available = real  # type: ignore[method-assign]

    def step(ss: list, fused: bool):
        if ss[0] is sampling.greedy:
            return kernels.extension().argmax(logprobs) if fused else mx.argmax(logprobs, axis=-1)
        if fused:  # the engine's step: the rows in one node
            return sampling.sample_rows(logprobs, ss)
        return mx.concatenate([s(r) for s, r in zip(ss, rows)])

    out = {}
    for name, settings in SETTINGS.items():
        ways = {fused: samplers(settings, fused) for fused in (False, True)}
        best = {False: float("inf"), True: float("inf")}
        for _ in range(args.reps):
            for fused, ss in ways.items():
                t = time.perf_counter()
                mx.eval(step(ss, fused))
                best[fused] = min(best[fused], time.perf_counter() - t)
        out[name] = {
            "mlx_ms": round(best[False] * 1e3, 2),
            "gmlx_ms": round(best[True] * 1e3, 2),
            "speedup": round(best[False] / best[True], 1),
        }
        print(
            f"{name:16} mlx {out[name]['mlx_ms']:8.2f} ms   gmlx {out[name]['gmlx_ms']:6.2f} ms   "
            f"{out[name]['speedup']:5.1f}x",
            flush=True,
        )
    RESULTS.mkdir(exist_ok=True)
    result = {
        "model": path.name,
        "rows": args.rows,
        "vocab": int(logits.shape[-1]),
        "reps": args.reps,
        "isa": kernels.isa(),
        "samplers": out,
    }
    (RESULTS / f"sampling-{path.stem}.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
