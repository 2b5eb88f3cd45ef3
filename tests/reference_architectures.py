"""The architectures checked against llama.cpp's logits: name -> a writer of its tiny GGUF.

One entry per architecture in ARCHITECTURES (quantized files, every weight mode) and, where the writer can
make one, its F32 copy in EXACT (float mode, tight bounds). `python -m bench.llamacpp_architectures`
writes each file, runs llama.cpp's llama-server on it and stores tests/data/architectures/<name>.json;
tests/test_architectures.py writes the file again, checks its hash against that JSON, and compares
gmlx's logits. A writer takes the path and returns it; it must write the same bytes on every run (fixed
seed, no timestamps).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import tiny_architectures as dense
import tiny_moe as moe
from gguf import GGMLQuantizationType

Writer = Callable[[Path], Path]

DENSE: dict[str, dense.Spec] = {
    "llama": dense.LLAMA3,
    "mistral": dense.MISTRAL,
    "qwen2": dense.QWEN2,
    "qwen3": dense.QWEN3,
    "gemma2": dense.GEMMA2,
    "gemma3": dense.GEMMA3,
    "phi3": dense.PHI3,
    "granite": dense.GRANITE,
    "olmo2": dense.OLMO2,
    "smollm3": dense.SMOLLM3,
}

# Q8_0 matrices: compared in every weight mode.
ARCHITECTURES: dict[str, Writer] = {
    **{name: partial(dense.write, spec=spec) for name, spec in DENSE.items()},
    "qwen2moe": partial(moe.write_moe, arch="qwen2moe"),
    "qwen3moe": partial(moe.write_moe, arch="qwen3moe"),
    "deepseek2": moe.write_deepseek2,  # V3's layout (sigmoid router, groups, query compression)
    "deepseek2-lite": partial(moe.write_deepseek2, z=moe.V2_LITE),
    "deepseek2-legacy": partial(moe.write_deepseek2, z=moe.V3_LEGACY, seed=moe.LEGACY_SEED),
}

# The same dense files with F32 matrices: llama.cpp then multiplies in float32 as well (no 8-bit activations),
# so gmlx's float mode must agree to the rounding of llama.cpp's f16 KV cache: the mapping itself, tightly.
EXACT: dict[str, Writer] = {
    **{f"{name}-f32": partial(dense.write, spec=spec, qtype=GGMLQuantizationType.F32) for name, spec in DENSE.items()},
    "qwen2moe-f32": partial(moe.write_moe, arch="qwen2moe", qtype=GGMLQuantizationType.F32),
    "qwen3moe-f32": partial(moe.write_moe, arch="qwen3moe", qtype=GGMLQuantizationType.F32),
    "deepseek2-f32": partial(moe.write_deepseek2, qtype=GGMLQuantizationType.F32),
    "deepseek2-lite-f32": partial(moe.write_deepseek2, qtype=GGMLQuantizationType.F32, z=moe.V2_LITE),
    "deepseek2-legacy-f32": partial(
        moe.write_deepseek2, qtype=GGMLQuantizationType.F32, z=moe.V3_LEGACY, seed=moe.LEGACY_SEED
    ),
}
