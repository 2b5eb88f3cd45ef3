"""Phi-3 / Phi-4-mini: fused QKV and gate|up projections, stored fused by llama.cpp's converter as mlx_lm keeps them."""

from __future__ import annotations

from typing import Any

from gmlx.gguf.header import GGUFError, GGUFHeader
from gmlx.models.architecture import Architecture
from gmlx.models.names import BLOCK_NAMES


class Phi3(Architecture):
    gguf_name = "phi3"
    model_type = "phi3"
    block_names = {**BLOCK_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}

    def model_args(self, h: GGUFHeader) -> dict[str, Any]:
        # LongRoPE files (Phi-3-*-128k, Phi-3.5) carry per-frequency factors whose choice llama.cpp makes from
        # the context size; not mapped yet, so refused rather than run with the wrong positions.
        if "rope_factors_long.weight" in h.tensors:
            raise GGUFError(f"{h.architecture}: LongRoPE (rope_factors_long) is not supported: {h.path}")
        g = h.geometry
        if g.key_length * g.n_heads != g.n_embd:
            raise GGUFError(f"{h.architecture}: head_dim {g.key_length} x {g.n_heads} heads is not n_embd {g.n_embd}")
        args = super().model_args(h)
        # The file's sliding_window is ignored on purpose: llama.cpp turns Phi-3's off, and mlx_lm has none.
        args["partial_rotary_factor"] = (h.arch_key("rope.dimension_count") or g.key_length) / g.key_length
        return args
