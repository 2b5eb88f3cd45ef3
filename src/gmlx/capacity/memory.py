"""The memory model: bytes a model's KV cache takes, from its geometry alone (no MLX here)."""

from __future__ import annotations

from dataclasses import dataclass

from gmlx.gguf.header import ModelGeometry

FP16_BYTES = 2


@dataclass(frozen=True)
class LayerKind:
    kind: str  # "full" or "sliding"
    layers: int
    bytes_per_token: int  # all layers of this kind together
    window: int | None  # tokens a sliding layer keeps; None for full attention


def kv_layer_kinds(g: ModelGeometry, dtype_bytes: int = FP16_BYTES) -> list[LayerKind]:
    """KV-cache bytes per token by layer kind: sliding layers stop growing at their window."""
    kinds = []
    for kind, sliding in (("full", False), ("sliding", True)):
        idx = [i for i, s in enumerate(g.sliding_layers) if s == sliding]
        if not idx:
            continue
        per_token = sum(g.n_kv_heads[i] * (g.key_length + g.value_length) for i in idx) * dtype_bytes
        kinds.append(LayerKind(kind, len(idx), per_token, g.sliding_window if sliding else None))
    return kinds


def kv_bytes(g: ModelGeometry, tokens: int, dtype_bytes: int = FP16_BYTES) -> int:
    """KV-cache bytes for one stream holding `tokens` tokens."""
    return sum(
        k.bytes_per_token * (min(tokens, k.window) if k.window else tokens) for k in kv_layer_kinds(g, dtype_bytes)
    )
