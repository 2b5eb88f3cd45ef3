"""Gemma 3 (text): llama.cpp stores what mlx_lm computes, so a few values come back here."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from gmlx.gguf.header import GGUFHeader
from gmlx.models.architecture import Architecture
from gmlx.models.names import BLOCK_NAMES

_GEMMA3_27B_LAYERS = 62


class Gemma3(Architecture):
    gguf_name = "gemma3"
    model_type = "gemma3_text"
    block_names = {
        **BLOCK_NAMES,
        "ffn_norm": "pre_feedforward_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    }

    def model_args(self, h: GGUFHeader) -> dict[str, Any]:
        g = h.geometry
        args = super().model_args(h)
        # Not in the GGUF: llama.cpp hard-codes these for gemma3, and so do we.
        args["rope_local_base_freq"] = 10000.0
        args["sliding_window"] = g.sliding_window or g.context_length
        args["sliding_window_pattern"] = g.sliding_layers.index(False) + 1 if False in g.sliding_layers else 1
        # 27B scales queries by 1/sqrt(n_embd / n_head); the others by 1/sqrt(head_dim).
        big = g.n_layers == _GEMMA3_27B_LAYERS
        args["query_pre_attn_scalar"] = g.n_embd // g.n_heads if big else g.key_length
        return args

    def adjust(self, name: str, array: mx.array) -> mx.array:
        # llama.cpp stores gemma's RMSNorm weights with the +1 folded in; mlx_lm adds it itself.
        if name.endswith("norm.weight"):
            return array - 1.0
        return array
