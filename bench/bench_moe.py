"""The `gguf` weight mode's mixture-of-experts layers (gmlx.models.experts) against the fallbacks, in one process.

    python -m bench.bench_moe [--steps 32] [--prompt 128] [--rounds 3]

Writes a mid-size random qwen3moe GGUF (Q8_0; MID below: 8 layers, 32 experts of which 4 are used, hidden
1024), loads it in `gguf` mode, and times three versions of its expert layers with everything else the same
(the attention and router on gmlx's kernels in all three):
- kernels: GGUFSwitchGLU, the file's blocks, one fused gate/up/down kernel call per used expert;
- float: mlx_lm's SwitchGLU on the experts dequantized to float32 (what `gguf` mode falls back to without it);
- native: mlx_lm's SwitchGLU quantized to MLX 8-bit affine g32 (gather_qmm, as `native` mode runs it).
Figures: decode tok/s at batch 1 (greedy, after a 16-token prompt) and prefill tok/s (--prompt tokens), the best
of --rounds; and each version's resident expert bytes. Prints a JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.models.switch_layers import SwitchGLU

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))  # the tiny writers live beside the tests

from tiny_moe import Size, write_moe  # noqa: E402

from gmlx.gguf.header import read_header  # noqa: E402
from gmlx.gguf.tensors import load_tensors  # noqa: E402
from gmlx.kernels import dequant_rows  # noqa: E402
from gmlx.kernels import fast as kernels_fast  # noqa: E402
from gmlx.models.experts import GGUFSwitchGLU  # noqa: E402
from gmlx.models.loader import _build, architecture_for  # noqa: E402

MID = Size(hidden=1024, heads=8, kv_heads=4, head_dim=128, experts=32, experts_used=4, expert_ff=512, layers=8)


def load_gguf(path: Path) -> nn.Module:
    h = read_header(path)
    kernels_fast.install()
    arrays, quant, _ = load_tensors(h, "gguf")
    model = _build(architecture_for(h), h, arrays, quant)
    mx.eval(model.parameters())
    return model


def float_glu(glu: GGUFSwitchGLU) -> SwitchGLU:
    g = glu.gate_proj
    out = SwitchGLU(g.input_dims, g.output_dims, g.num_experts)
    out.update(
        tree_unflatten(
            [
                (f"{name}.weight", dequant_rows(p.weight, p.ggml_type, p.input_dims))
                for name, p in (("gate_proj", g), ("up_proj", glu.up_proj), ("down_proj", glu.down_proj))
            ]
        )
    )
    return out


def with_experts(model: nn.Module, version: str, originals: list[tuple[str, GGUFSwitchGLU]]) -> int:
    """Put `version` of every expert layer into the model; returns the experts' resident bytes."""
    swaps = []
    for path, glu in originals:
        if version == "kernels":
            swaps.append((path, glu))
            continue
        f = float_glu(glu)
        if version == "native":
            nn.quantize(f, group_size=32, bits=8)
        mx.eval(f.parameters())
        swaps.append((path, f))
    model.update_modules(tree_unflatten(swaps))
    return sum(a.nbytes for _, m in swaps for _, a in tree_flatten(m.parameters()))


def decode_rate(model: nn.Module, steps: int) -> float:
    cache = make_prompt_cache(model)
    y = mx.argmax(model(mx.arange(8, 24)[None], cache=cache)[:, -1], axis=-1)
    mx.eval(y)
    start = time.perf_counter()
    for _ in range(steps):
        y = mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)
        mx.eval(y)
    return steps / (time.perf_counter() - start)


def prefill_rate(model: nn.Module, n: int) -> float:
    ids = (mx.arange(n) % 200 + 8)[None]
    start = time.perf_counter()
    mx.eval(model(ids, cache=make_prompt_cache(model)))
    return n / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_moe")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = load_gguf(write_moe(Path(tmp) / "mid-qwen3moe.gguf", "qwen3moe", size=MID))
    originals = [(p, m) for p, m in model.named_modules() if isinstance(m, GGUFSwitchGLU)]
    versions = ("kernels", "float", "native")
    best: dict[str, dict[str, float]] = {v: {"decode_tok_s": 0.0, "prefill_tok_s": 0.0} for v in versions}
    for _ in range(args.rounds):  # interleaved, so a shared machine's load falls on all alike
        for v in versions:
            best[v]["expert_mib"] = with_experts(model, v, originals) / 2**20
            best[v]["decode_tok_s"] = max(best[v]["decode_tok_s"], decode_rate(model, args.steps))
            best[v]["prefill_tok_s"] = max(best[v]["prefill_tok_s"], prefill_rate(model, args.prompt))
    print(
        json.dumps(
            {
                "size": MID.__dict__,
                "rounds": args.rounds,
                "steps": args.steps,
                "prompt": args.prompt,
                "versions": {v: {k: round(x, 1) for k, x in r.items()} for v, r in best.items()},
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
