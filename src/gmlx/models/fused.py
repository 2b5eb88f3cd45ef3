"""mlx_lm's attention layers in fewer graph nodes where gmlx's kernels run (docs/ARCHITECTURE.md,
decision 26).

Llama's, Qwen 2's, Qwen 3's and Gemma 3's attention split q, k and v into heads with a reshape and a
transpose each, normalise q and k (Qwen 3, Gemma 3), rotate them, and join the heads' output with a
transpose and a reshape. `FusedAttention` computes the same through `kernels.fast.heads`: one node
for each of q and k (split, norm and RoPE), a view for v and for the output. Only single-token steps
(decode) take it: there a node's fixed cost weighs against little compute, while in a prompt's
chunk fewer nodes let MLX allocate further ahead of the computation (it allocates a node's outputs
as it queues it, about fifty nodes ahead), and a fan-out's prefill peaked above the capacity table.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma3_text, llama, qwen2, qwen3
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


class FusedAttention:
    """Put before an mlx_lm attention class: its computation with the heads split in one node each."""

    def __call__(self, x: mx.array, mask: mx.array | None = None, cache: Any = None) -> mx.array:
        q_norm, k_norm = _norm(getattr(self, "q_norm", None)), _norm(getattr(self, "k_norm", None))
        if x.shape[1] != 1 or not fast.takes(x) or _NOT_FUSED in (q_norm, k_norm):
            return super().__call__(x, mask, cache)  # type: ignore[misc]
        B, L, _ = x.shape
        offset = cache.offset if cache is not None else 0
        q = fast.heads(self.q_proj(x), self.n_heads, norm=q_norm, rope=self.rope, offset=offset)
        k = fast.heads(self.k_proj(x), self.n_kv_heads, norm=k_norm, rope=self.rope, offset=offset)
        v = fast.heads(self.v_proj(x), self.n_kv_heads)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(out.reshape(B, L, -1))  # one query row: the transpose moves nothing


_FUSED: dict[type, type] = {
    cls: type(f"Fused{cls.__name__}", (FusedAttention, cls), {"__module__": cls.__module__})
    for cls in (llama.Attention, qwen2.Attention, qwen3.Attention, gemma3_text.Attention)
}


def fuse_attention(model: nn.Module) -> None:
    """Give each of the model's attention layers of a class above its fused form (same parameters)."""
    for _, m in model.named_modules():
        if (fused := _FUSED.get(type(m))) is not None:
            m.__class__ = fused
