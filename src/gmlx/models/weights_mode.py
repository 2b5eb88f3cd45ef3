"""Which weight mode to load in, and what each costs in memory, from the header alone."""

from __future__ import annotations

from typing import Literal

from gmlx import platform
from gmlx.gguf.header import GGUFHeader

WeightsOption = Literal["auto", "native", "float"]

# GGML type -> MLX affine bits in `native` mode. 16-wide-group K-quants go one width up.
NATIVE_BITS = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q4_K": 4, "Q5_K": 5, "Q6_K": 8, "Q3_K": 4, "Q2_K": 3}
FLOAT_BYTES = {"F32": 4, "F16": 2, "BF16": 4}  # BF16 widens: MLX's CPU bf16 matmul gains nothing
GROUP_SIZE = 32
_SCALE_BIAS_BYTES = 8  # a float32 scale and bias per group
# `auto` keeps float weights only when they leave most of the memory to KV caches.
_FLOAT_SHARE_OF_MEMORY = 0.4


def resident_bytes(h: GGUFHeader, mode: str) -> int:
    """Bytes the loaded weights take in MLX in this mode."""
    return sum(_tensor_bytes(t.type_name, t.n_elements, mode) for t in h.tensors.values())


def _tensor_bytes(type_name: str, n: int, mode: str) -> int:
    if mode == "float":
        return n * 4
    if type_name in FLOAT_BYTES:
        return n * FLOAT_BYTES[type_name]
    return n * NATIVE_BITS.get(type_name, 8) // 8 + n // GROUP_SIZE * _SCALE_BIAS_BYTES


def choose_mode(weights: WeightsOption, h: GGUFHeader) -> str:
    if weights != "auto":
        return weights
    if platform.backend() != "cpu":
        return "native"  # quantized kernels are the fast path on Metal and CUDA
    fits = resident_bytes(h, "float") < _FLOAT_SHARE_OF_MEMORY * platform.total_memory_bytes()
    return "float" if fits else "native"
