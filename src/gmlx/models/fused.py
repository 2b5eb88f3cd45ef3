"""mlx_lm's attention layers in fewer graph nodes, and with a float16 KV cache, where gmlx's kernels
run (docs/ARCHITECTURE.md, decisions 26 and 35).

Llama's, Qwen 2's, Qwen 3's and Gemma 3's attention split q, k and v into heads with a reshape and a
transpose each, normalise q and k (Qwen 3, Gemma 3), rotate them, and join the heads' output with a
transpose and a reshape. `FusedAttention` computes the same through `kernels.fast.heads`: one node
for each of q and k (split, norm and RoPE), a view for v and for the output. Only single-token steps
(decode) take it: there a node's fixed cost weighs against little compute, while in a prompt's
chunk fewer nodes let MLX allocate further ahead of the computation (it allocates a node's outputs
as it queues it, about fifty nodes ahead), and a fan-out's prefill peaked above the capacity table.

Every attention class of the architectures gmlx loads stores its keys and values as float16 where
the kernels run (`HalfStore`): the kernels' attention reads them as they lie, so a decode step
reads half the bytes, a row joining the batch moves half, and a stream takes half the memory
(`capacity.table.kv_float` counts it so).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import (
    deepseek_v3,
    gemma2,
    gemma3_text,
    granite,
    llama,
    olmo2,
    phi3,
    qwen2,
    qwen2_moe,
    qwen3,
    qwen3_moe,
)
from mlx_lm.models.base import scaled_dot_product_attention

from gmlx.kernels import fast

_NOT_FUSED = object()  # a q/k norm the kernels do not know: mlx_lm's own code runs


def _norm(m: nn.Module | None) -> Any:
    """An attention's q or k norm as rms_norm's (weight, eps): None where it has none."""
    if m is None:
        return None
    if hasattr(m, "folded"):  # gmlx's Gemma norms, the 1 added once
        return m.folded
    if type(m) is nn.RMSNorm:
        return m.weight, m.eps
    return _NOT_FUSED


KV_DTYPE = mx.float16  # the KV cache's store where the kernels run attention (decision 35)


class _HalfStore:
    """A cache that keys and values enter as KV_DTYPE (mlx_lm's caches, float or quantized, store in
    the dtype they are given); everything else is the cache's own."""

    def __init__(self, cache: Any):
        self._cache = cache

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        return self._cache.update_and_fetch(keys.astype(KV_DTYPE), values.astype(KV_DTYPE))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)


class HalfStore:
    """Put before an mlx_lm attention class: where the kernels run, its keys and values enter the
    cache as float16, which the kernels' attention reads as it lies (half the bytes of float32 to
    store, move and read a step)."""

    def __call__(self, x: mx.array, mask: mx.array | None = None, cache: Any = None) -> mx.array:
        if cache is not None and fast.takes(x):
            cache = _HalfStore(cache)
        return self._attend(x, mask, cache)

    def _attend(self, x: mx.array, mask: mx.array | None, cache: Any) -> mx.array:
        return super().__call__(x, mask, cache)  # type: ignore[misc]


class FusedAttention(HalfStore):
    """Put before an mlx_lm attention class: its computation with the heads split in one node each."""

    def _attend(self, x: mx.array, mask: mx.array | None, cache: Any) -> mx.array:
        q_norm, k_norm = _norm(getattr(self, "q_norm", None)), _norm(getattr(self, "k_norm", None))
        if x.shape[1] != 1 or not fast.takes(x) or _NOT_FUSED in (q_norm, k_norm):
            return super()._attend(x, mask, cache)
        B, L, _ = x.shape
        offset = cache.offset if cache is not None else 0
        q = fast.heads(self.q_proj(x), self.n_heads, norm=q_norm, rope=self.rope, offset=offset)
        k = fast.heads(self.k_proj(x), self.n_kv_heads, norm=k_norm, rope=self.rope, offset=offset)
        v = fast.heads(self.v_proj(x), self.n_kv_heads)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)  # the float16 store, as HalfStore handed it
        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(out.reshape(B, L, -1))  # one query row: the transpose moves nothing


def _forms(mixin: type, prefix: str, classes: tuple[type, ...]) -> dict[type, type]:
    return {cls: type(f"{prefix}{cls.__name__}", (mixin, cls), {"__module__": cls.__module__}) for cls in classes}


# Every attention class of the architectures gmlx loads (gmlx.models): the four above fused, the
# others with the float16 store alone.
_FORMS: dict[type, type] = {
    **_forms(FusedAttention, "Fused", (llama.Attention, qwen2.Attention, qwen3.Attention, gemma3_text.Attention)),
    **_forms(
        HalfStore,
        "HalfStore",
        (
            deepseek_v3.DeepseekV3Attention,
            gemma2.Attention,
            granite.Attention,
            olmo2.Attention,
            phi3.Attention,
            qwen2_moe.Attention,
            qwen3_moe.Attention,
        ),
    ),
}


def fuse_attention(model: nn.Module) -> None:
    """Give each of the model's attention layers its form above (same parameters)."""
    for _, m in model.named_modules():
        if (form := _FORMS.get(type(m))) is not None:
            m.__class__ = form
