"""Quantized test data: gguf's own quantizer where it has one, else random valid blocks."""

from __future__ import annotations

import numpy as np
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import quantize

# Byte offsets of the fp16 scale fields in each block, set to sane values in random blocks.
FP16_FIELDS = {
    T.Q8_0: [0],
    T.Q4_0: [0],
    T.Q4_1: [0, 2],
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
    T.Q3_K: [108],
    T.Q2_K: [80, 82],
}


def random_blocks(qtype: T, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random valid blocks: every code pattern, finite positive fp16 scales."""
    block, size = GGML_QUANT_SIZES[qtype]
    n = int(np.prod(shape)) // block
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    for off in FP16_FIELDS[qtype]:
        raw[:, off : off + 2] = rng.uniform(1e-3, 2e-2, size=(n, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(*shape[:-1], -1)


def tensor_bytes(qtype: T, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Quantized bytes in numpy order: gguf's own quantizer where it has one, else random blocks."""
    if qtype in (T.F32, T.F16):
        return rng.standard_normal(shape).astype(np.float32 if qtype == T.F32 else np.float16)
    data = rng.standard_normal(shape).astype(np.float32) * 0.05
    try:
        return quantize(data, qtype)
    except NotImplementedError:
        return random_blocks(qtype, shape, rng)
