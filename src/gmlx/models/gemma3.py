"""Gemma 3 (text): llama.cpp stores what mlx_lm computes, so a few values come back here."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten
from mlx_lm.models import gemma3_text

from gmlx.gguf.header import GGUFHeader
from gmlx.kernels import fast
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

    def finish(self, model: nn.Module, h: GGUFHeader, arrays: dict[str, mx.array]) -> None:
        # mlx_lm's Gemma RMSNorm adds the 1 back at every call: two graph nodes per norm, six
        # norms a layer. Fold it once; the parameter keeps mlx_lm's convention (export relies on it).
        swaps = [
            (path, FoldedRMSNorm(m.weight, m.eps))
            for path, m in model.named_modules()
            if type(m).__name__ == "RMSNorm" and type(m).__module__ == f"mlx_lm.models.{self.model_type}"
        ]
        model.update_modules(tree_unflatten(swaps))
        # The same blocks in fewer graph nodes where the kernels run (docs/ARCHITECTURE.md, decision 26).
        for _, m in model.named_modules():
            if type(m) is gemma3_text.TransformerBlock:
                m.__class__ = Gemma3Block

    def adjust(self, name: str, array: mx.array) -> mx.array:
        # llama.cpp stores gemma's RMSNorm weights with the +1 folded in; mlx_lm adds it itself.
        if name.endswith("norm.weight"):
            return array - 1.0
        return array


class FoldedRMSNorm(nn.Module):
    """mlx_lm's Gemma RMSNorm (scale 1 + weight) with the sum computed once."""

    def __init__(self, weight: mx.array, eps: float):
        super().__init__()
        self.weight, self.eps = weight, eps
        self._scale = 1.0 + weight  # underscored: not a parameter, so not exported or loaded

    @property
    def folded(self) -> tuple[mx.array, float]:
        """rms_norm's weight and eps."""
        return self._scale, self.eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, self._scale, self.eps)


class Gemma3Block(gemma3_text.TransformerBlock):
    """mlx_lm's Gemma 3 block with each residual sum and the norms about it as one node
    (`fast.add_norm`) in single-token steps, as `models.fused` says why; in float32 mlx_lm's
    clip_residual is that sum."""

    def __call__(self, x: mx.array, mask: mx.array | None = None, cache: Any = None) -> mx.array:
        if x.shape[1] != 1 or not fast.takes(x):
            return super().__call__(x, mask, cache)
        r = self.self_attn(self.input_layernorm(x), mask, cache)
        h, y = fast.add_norm(x, r, self.post_attention_layernorm.folded, self.pre_feedforward_layernorm.folded)
        return fast.add_norm(h, self.mlp(y), self.post_feedforward_layernorm.folded)
