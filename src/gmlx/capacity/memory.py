"""The memory model: bytes a model's KV cache takes, from its geometry alone (no MLX here)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from gmlx.gguf.header import ModelGeometry

FP16_BYTES = 2
# mlx_lm's KVCache, BatchKVCache and QuantizedKVCache grow in steps of this many tokens.
ALLOC_STEP = 256
_KV_BITS = (2, 4, 8)  # widths that pack evenly into QuantizedKVCache's uint32 words
_GROUP_SIZES = (32, 64, 128)  # the group sizes mx.quantize accepts

# Per-token KV bytes summed over the layers that share a window (None: full attention).
KVProfile = tuple[tuple[int | None, float], ...]


@dataclass(frozen=True)
class KVFormat:
    """How the KV cache stores one element.

    `float_bytes` is the cache's float dtype, which is the model's activation dtype: 2 for
    float16 or bfloat16, 4 where the engine runs float32 (as it does on Linux CPU).
    """

    bits: int | None = None  # None: a float cache; else mlx_lm QuantizedKVCache's width
    group_size: int = 64
    float_bytes: int = FP16_BYTES

    def __post_init__(self) -> None:
        if self.bits is not None and self.bits not in _KV_BITS:
            raise ValueError(f"KV cache bits must be one of {_KV_BITS}, not {self.bits}")
        if self.group_size not in _GROUP_SIZES:
            raise ValueError(f"KV cache group size must be one of {_GROUP_SIZES}, not {self.group_size}")
        if self.float_bytes not in (2, 4):
            raise ValueError(f"KV cache float width must be 2 or 4 bytes, not {self.float_bytes}")

    def element_bytes(self) -> float:
        if self.bits is None:
            return float(self.float_bytes)
        # QuantizedKVCache packs `bits` per element into uint32 words and keeps one scale and
        # one bias per group, both in the activation dtype.
        return self.bits / 8 + 2 * self.float_bytes / self.group_size

    def describe(self) -> str:
        float_name = f"fp{8 * self.float_bytes}"
        if self.bits is None:
            return float_name
        return f"{self.bits}-bit g{self.group_size}, {float_name} scales"

    def to_json(self) -> dict:
        return {"bits": self.bits, "group_size": self.group_size, "float_bytes": self.float_bytes,
                "element_bytes": self.element_bytes(), "describe": self.describe()}


FP16 = KVFormat()
FP32 = KVFormat(float_bytes=4)  # the cache of a model whose activations are float32 (Linux CPU)


def layer_window(g: ModelGeometry, layer: int) -> int | None:
    """Tokens a layer's cache keeps at most; None for full attention."""
    sliding = layer < len(g.sliding_layers) and g.sliding_layers[layer]
    return g.sliding_window if sliding else None


def layer_bytes_per_token(g: ModelGeometry, layer: int, kv: KVFormat = FP16) -> float:
    if g.kv_lora_rank:
        # MLA: llama.cpp caches one compressed latent plus the shared rotary key per token, and
        # reads V out of the same latent, so heads and value width do not enter.
        elements = g.kv_lora_rank + (g.rope_dim or 0)
    else:
        elements = g.n_kv_heads[layer] * (g.key_length + g.value_length)
    return elements * kv.element_bytes()


def kv_profile(g: ModelGeometry, kv: KVFormat = FP16) -> KVProfile:
    """Per-token bytes grouped by window: a hashable summary that `profile_bytes` caches on."""
    sums: dict[int | None, float] = {}
    for layer in range(g.n_layers):
        window = layer_window(g, layer)
        sums[window] = sums.get(window, 0.0) + layer_bytes_per_token(g, layer, kv)
    return tuple(sums.items())


def allocated_tokens(depth: int) -> int:
    """Tokens a growing mlx_lm cache has room for once it holds `depth`: whole steps of 256."""
    return -(-depth // ALLOC_STEP) * ALLOC_STEP


@functools.cache
def profile_bytes(profile: KVProfile, depth: int, allocated: bool = False) -> int:
    held = allocated_tokens(depth) if allocated else depth
    return round(sum(per_token * (min(held, window) if window else held) for window, per_token in profile))


def kv_bytes(g: ModelGeometry, depth: int, kv: KVFormat = FP16, *, allocated: bool = False) -> int:
    """KV-cache bytes for one stream of `depth` tokens.

    Each layer holds min(depth, window) tokens when it slides, else depth. With `allocated`,
    the figure is what mlx_lm's caches have allocated while decoding: full-attention caches
    round up to whole steps of 256 tokens, and a RotatingKVCache grows in the same steps but
    never past its window. (Right after a prefill chunk of S tokens a rotating cache briefly
    holds up to window - 1 + S tokens; the next decode step trims it back.)
    """
    return profile_bytes(kv_profile(g, kv), depth, allocated)


def decode_overhead_bytes(g: ModelGeometry, kv: KVFormat = FP16) -> int:
    """Memory a decoding stream holds besides its cache: mlx_lm's BatchGenerator keeps two rows
    of log-probabilities over the vocabulary (this step's and the next, computed ahead). With
    a 262k vocabulary that is 2 MiB a stream in float32, worth counting."""
    return 2 * g.vocab_size * kv.float_bytes


def stream_bytes(g: ModelGeometry, depth: int, kv: KVFormat = FP16) -> int:
    """All one decoding stream of `depth` tokens holds: its cache as allocated, and its logits."""
    return kv_bytes(g, depth, kv, allocated=True) + decode_overhead_bytes(g, kv)


@dataclass(frozen=True)
class LayerKind:
    kind: str  # "full" or "sliding"
    layers: int
    bytes_per_token: int  # all layers of this kind together
    window: int | None  # tokens a sliding layer keeps; None for full attention


def kv_layer_kinds(g: ModelGeometry, kv: KVFormat = FP16) -> list[LayerKind]:
    """KV-cache bytes per token by layer kind: sliding layers stop growing at their window."""
    kinds = []
    for kind, sliding in (("full", False), ("sliding", True)):
        idx = [i for i, s in enumerate(g.sliding_layers) if s == sliding]
        if idx:
            per_token = round(sum(layer_bytes_per_token(g, i, kv) for i in idx))
            kinds.append(LayerKind(kind, len(idx), per_token, g.sliding_window if sliding else None))
    return kinds


def kv_bytes_after_prefill(g: ModelGeometry, depth: int, kv: KVFormat = FP16) -> int:
    """KV bytes of one stream right after its prompt is prefilled in one chunk: full-attention
    caches have grown in whole 256-token steps, while a RotatingKVCache has concatenated the
    chunk and holds exactly min(depth, window) tokens until decoding starts to grow it."""
    return sum(k.bytes_per_token * (min(depth, k.window) if k.window else allocated_tokens(depth))
               for k in kv_layer_kinds(g, kv))
