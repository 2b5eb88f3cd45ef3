"""Which weight mode to load in, and what each costs in memory, from the header alone."""

from __future__ import annotations

from typing import Literal

from gmlx import platform
from gmlx.gguf.header import GGUFHeader

WeightsOption = Literal["auto", "native", "float", "gguf"]

# GGML type -> MLX affine bits in `native` mode. 16-wide-group K-quants go one width up.
NATIVE_BITS = {
    "Q8_0": 8,
    "Q4_0": 4,
    "Q4_1": 4,
    "Q5_0": 5,
    "Q5_1": 5,
    "Q4_K": 4,
    "Q5_K": 5,
    "Q6_K": 8,
    "Q3_K": 4,
    "Q2_K": 3,
}
FLOAT_BYTES = {"F32": 4, "F16": 2, "BF16": 4}  # BF16 widens: MLX's CPU bf16 matmul gains nothing
GROUP_SIZE = 32
_SCALE_BIAS_BYTES = 8  # a float32 scale and bias per group
# `gguf` mode: weights of these types stay in the file's blocks (gmlx.kernels); bytes per 32 weights.
GGUF_BLOCK_BYTES_PER_32 = {
    "Q4_0": 18,
    "Q4_1": 20,
    "Q5_0": 22,
    "Q5_1": 24,
    "Q8_0": 34,
    "Q4_K": 18,
    "Q5_K": 22,
    "Q6_K": 26.25,
}
# `auto` keeps float weights only when they leave most of the memory to KV caches.
_FLOAT_SHARE_OF_MEMORY = 0.4


def resident_bytes(h: GGUFHeader, mode: str) -> int:
    """Bytes the loaded weights take in MLX in this mode."""
    # gguf mode keeps llama.cpp's merged 3-D experts (gmlx.gguf.tensors.EXPERTS) in blocks too, as matrices
    return sum(
        _tensor_bytes(t.type_name, t.n_elements, mode, 2 if t.name.endswith("_exps.weight") else len(t.shape))
        for t in h.tensors.values()
    )


def _tensor_bytes(type_name: str, n: int, mode: str, ndim: int = 2) -> int:
    if mode == "float":
        return n * 4
    if mode == "gguf":  # the file's blocks for 2-D weights the kernels read, float32 for the rest
        if type_name in GGUF_BLOCK_BYTES_PER_32 and ndim == 2:
            return int(n // 32 * GGUF_BLOCK_BYTES_PER_32[type_name])
        return n * 4
    if type_name in FLOAT_BYTES:
        return n * FLOAT_BYTES[type_name]
    return n * NATIVE_BITS.get(type_name, 8) // 8 + n // GROUP_SIZE * _SCALE_BIAS_BYTES


def gguf_kernels_reason() -> str | None:
    """None where `gguf` mode can run (the CPU kernels loaded and MLX computes on the CPU), else why not."""
    from gmlx import kernels  # imports mlx: only after gmlx's platform bring-up

    return kernels.reason()


def choose_mode(weights: WeightsOption, h: GGUFHeader) -> str:
    if weights != "auto":
        return weights
    if platform.backend() != "cpu":
        return "native"  # quantized kernels are the fast path on Metal and CUDA
    if gguf_kernels_reason() is None and any(
        t.type_name in GGUF_BLOCK_BYTES_PER_32 and len(t.shape) == 2 for t in h.tensors.values()
    ):
        return "gguf"  # the file's own blocks, multiplied by gmlx.kernels: least memory, fastest here
    fits = resident_bytes(h, "float") < _FLOAT_SHARE_OF_MEMORY * platform.total_memory_bytes()
    return "float" if fits else "native"
