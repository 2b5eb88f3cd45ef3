"""Gemma 2: mlx_lm's gemma2 model, plus the sliding window llama.cpp runs on every other layer
(mlx_lm's class attends to the whole context on every layer, which differs past 4,096 tokens)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models import gemma2
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, RotatingKVCache

from gmlx.gguf.header import GGUFHeader
from gmlx.models.gemma3 import Gemma3

_GEMMA2_27B_LAYERS = 46
_SOFTCAP_DEFAULTS = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}  # llama.cpp's, as HF's


@dataclass
class ModelArgs(gemma2.ModelArgs):
    sliding_window: int = 4096
    sliding_layers: list[bool] = field(default_factory=list)  # per layer: True where attention slides


class SlidingGemmaModel(gemma2.GemmaModel):
    def __call__(self, inputs: mx.array, cache: list | None = None) -> mx.array:
        h = self.embed_tokens(inputs) * (self.args.hidden_size**0.5)
        cache = cache or [None] * len(self.layers)
        sliding = self.args.sliding_layers
        masks = {}
        for kind in set(sliding):  # one mask per kind, from a cache of that kind
            c = cache[sliding.index(kind)]
            masks[kind] = create_attention_mask(
                h, c, window_size=self.args.sliding_window if kind else None, return_array=True
            )
        for layer, c, kind in zip(self.layers, cache, sliding, strict=True):
            h = layer(h, masks[kind], c)
        return self.norm(h)


class Model(gemma2.Model):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.model = SlidingGemmaModel(args)

    def make_cache(self) -> list:
        return [
            RotatingKVCache(max_size=self.args.sliding_window) if s else KVCache() for s in self.args.sliding_layers
        ]


class Gemma2(Gemma3):
    """Gemma 3's names and norm convention, without its QK norms and local RoPE base; with soft-capping."""

    gguf_name = "gemma2"
    model_type = "gemma2"

    @property
    def module(self) -> str:
        return __name__

    def model_args(self, h: GGUFHeader) -> dict[str, Any]:
        g = h.geometry
        args = super(Gemma3, self).model_args(h)
        for key, default in _SOFTCAP_DEFAULTS.items():
            args[key] = float(h.arch_key(key, default))
        args["sliding_window"] = g.sliding_window or g.context_length
        args["sliding_layers"] = list(g.sliding_layers)
        big = g.n_layers == _GEMMA2_27B_LAYERS  # as llama.cpp: 27B scales queries by 1/sqrt(n_embd / n_head)
        args["query_pre_attn_scalar"] = g.n_embd // g.n_heads if big else g.key_length
        return args

    def export_blocker(self, h: GGUFHeader) -> str | None:
        if any(h.geometry.sliding_layers):
            return "mlx_lm's gemma2 class has no sliding window (gmlx adds it when it loads the GGUF)"
        return None
