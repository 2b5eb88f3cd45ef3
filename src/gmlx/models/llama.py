"""Llama 2/3 and Mistral, as written by llama.cpp's converter."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from gmlx.gguf.header import GGUFHeader
from gmlx.models.architecture import Architecture


class FactorRoPE(nn.Module):
    """RoPE with per-frequency factors (Llama 3.1's `rope_freqs.weight`)."""

    def __init__(self, dims: int, base: float, factors: mx.array):
        super().__init__()
        self.dims = dims
        self._freqs = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims) * factors

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        return mx.fast.rope(x, self.dims, traditional=True, base=None, scale=1.0, offset=offset, freqs=self._freqs)


class Llama(Architecture):
    gguf_name = "llama"
    model_type = "llama"

    def model_args(self, h: GGUFHeader) -> dict[str, Any]:
        # The converter permutes Q and K rows so that llama.cpp's interleaved RoPE
        # reproduces HF's rotate-half; in MLX that interleaved form is `traditional`.
        args = super().model_args(h)
        args["rope_traditional"] = True
        args["attention_bias"] = "blk.0.attn_q.bias" in h.tensors
        return args

    def finish(self, model: nn.Module, h: GGUFHeader, arrays: dict[str, mx.array]) -> None:
        if (factors := arrays.get("rope_freqs.weight")) is None:
            return
        g = h.geometry
        for layer in model.model.layers:
            layer.self_attn.rope = FactorRoPE(g.key_length, g.rope_theta, factors)
