"""Llama 2/3, Mistral, SmolLM3 and Granite, as written by llama.cpp's converter (its LlamaModel and subclasses)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import initialize_rope

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

    def export_blocker(self, h: GGUFHeader) -> str | None:
        if "rope_freqs.weight" in h.tensors:
            return "per-frequency RoPE factors (rope_freqs) have no mlx_lm config equivalent"
        return None

    def finish(self, model: nn.Module, h: GGUFHeader, arrays: dict[str, mx.array]) -> None:
        if (factors := arrays.get("rope_freqs.weight")) is None:
            return
        g = h.geometry
        for layer in model.model.layers:
            if type(layer.self_attn.rope).__name__ != "NoPE":  # SmolLM3's position-free layers stay so
                layer.self_attn.rope = FactorRoPE(g.key_length, g.rope_theta, factors)


class SmolLM3(Llama):
    """Llama with no RoPE on every 4th layer (llama.cpp hard-codes the step; so does mlx_lm's default)."""

    gguf_name = "smollm3"
    model_type = "smollm3"


class Granite(Llama):
    """Llama with four multipliers: embeddings, each block's residual branch, attention scores, logits (divided)."""

    gguf_name = "granite"
    model_type = "granite"
    # GGUF key -> mlx_lm argument, and llama.cpp's value when the key is absent (1: no scaling; 0: 1/sqrt(head_dim))
    _SCALES = {
        "embedding_scale": ("embedding_multiplier", 1.0),
        "residual_scale": ("residual_multiplier", 1.0),
        "logit_scale": ("logits_scaling", 1.0),
        "attention.scale": ("attention_multiplier", 0.0),
    }

    def model_args(self, h: GGUFHeader) -> dict[str, Any]:
        args = super().model_args(h)
        for key, (name, default) in self._SCALES.items():
            args[name] = float(h.arch_key(key, default) or default)
        if not args["attention_multiplier"]:
            args["attention_multiplier"] = h.geometry.key_length**-0.5
        args["mlp_bias"] = "blk.0.ffn_up.bias" in h.tensors
        return args

    def finish(self, model: nn.Module, h: GGUFHeader, arrays: dict[str, mx.array]) -> None:
        # mlx_lm's granite hard-codes rotate-half RoPE; the converter permuted Q and K for the interleaved kind.
        args = model.args
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.rope = initialize_rope(
                attn.head_dim, args.rope_theta, True, args.rope_scaling, args.max_position_embeddings
            )
        super().finish(model, h, arrays)

    def export_blocker(self, h: GGUFHeader) -> str | None:
        return "mlx_lm's granite class runs rotate-half RoPE on the Q/K rows the converter permuted for interleaved"
