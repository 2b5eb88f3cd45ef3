"""The memory model: bytes a model's KV cache takes, from its geometry alone (no MLX here)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from gmlx.capacity.budget import FLOAT32_BYTES
from gmlx.gguf.header import ModelGeometry

FP16_BYTES = 2
# mlx_lm's KVCache, BatchKVCache and QuantizedKVCache grow in steps of this many tokens.
ALLOC_STEP = 256
_KV_BITS = (2, 4, 8)  # widths that pack evenly into QuantizedKVCache's uint32 words
_GROUP_SIZES = (32, 64, 128)  # the group sizes mx.quantize accepts

# Per-token KV bytes summed over the layers that share a window (None: full attention), and a
# third figure: 0, or for a quantized cache's float tail (kvarn) the tokens that tail keeps.
KVProfile = tuple[tuple[int | None, float, int], ...]


@dataclass(frozen=True)
class KVFormat:
    """How the KV cache stores one element.

    `float_bytes` is the cache's float dtype: 2 for float16 (where gmlx's CPU kernels run
    attention) or bfloat16, 4 for the float32 the engine computes in elsewhere.

    With `bits` set, full-attention layers store keys at `bits` and values at `value_bits`
    (None: `bits`), packed into uint32 words with one scale and one bias per `group_size`
    elements, both in the float dtype (gmlx.engine.kv_cache). Sliding-window layers keep a
    float cache (their cache stops at the window), and with `tail_tokens` each quantized layer
    also keeps its newest `tail_tokens` in float (kvarn).
    """

    bits: int | None = None  # None: a float cache; else the key width
    group_size: int = 64
    float_bytes: int = FP16_BYTES
    value_bits: int | None = None  # None: `bits`
    tail_tokens: int = 0  # kvarn: newest tokens each quantized layer also keeps in float

    def __post_init__(self) -> None:
        for name, bits in (("bits", self.bits), ("value bits", self.value_bits)):
            if bits is not None and bits not in _KV_BITS:
                raise ValueError(f"KV cache {name} must be one of {_KV_BITS}, not {bits}")
        if self.group_size not in _GROUP_SIZES:
            raise ValueError(f"KV cache group size must be one of {_GROUP_SIZES}, not {self.group_size}")
        if self.float_bytes not in (2, 4):
            raise ValueError(f"KV cache float width must be 2 or 4 bytes, not {self.float_bytes}")
        if self.tail_tokens < 0:
            raise ValueError(f"KV cache tail tokens must be >= 0, not {self.tail_tokens}")
        if self.bits is None and (self.value_bits is not None or self.tail_tokens):
            raise ValueError("value bits and tail tokens need bits")

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    def _width_bytes(self, bits: int | None) -> float:
        if bits is None:
            return float(self.float_bytes)
        # Packed `bits` per element, one scale and one bias per group in the float dtype.
        return bits / 8 + 2 * self.float_bytes / self.group_size

    def element_bytes(self) -> float:
        """Bytes of one key element (of every element, but under kvarn's narrower values)."""
        return self._width_bytes(self.bits)

    def value_element_bytes(self) -> float:
        return self._width_bytes(self.bits if self.value_bits is None else self.value_bits)

    def describe(self) -> str:
        float_name = f"fp{8 * self.float_bytes}"
        if self.bits is None:
            return float_name
        vbits = self.bits if self.value_bits is None else self.value_bits
        width = f"{self.bits}-bit" if vbits == self.bits else f"K{self.bits}/V{vbits}-bit"
        tail = f", newest {self.tail_tokens} tokens {float_name}" if self.tail_tokens else ""
        return f"{width} g{self.group_size}, {float_name} scales{tail}"

    def to_json(self) -> dict:
        return {
            "bits": self.bits,
            "group_size": self.group_size,
            "float_bytes": self.float_bytes,
            "value_bits": self.value_bits,
            "tail_tokens": self.tail_tokens,
            "element_bytes": self.element_bytes(),
            "describe": self.describe(),
        }


FP16 = KVFormat()
FP32 = KVFormat(float_bytes=4)  # a float32 cache (where the kernels do not run attention)


def layer_window(g: ModelGeometry, layer: int) -> int | None:
    """Tokens a layer's cache keeps at most; None for full attention."""
    sliding = layer < len(g.sliding_layers) and g.sliding_layers[layer]
    return g.sliding_window if sliding else None


def layer_quantized(g: ModelGeometry, layer: int, kv: KVFormat) -> bool:
    """Whether a layer's cache is stored quantized under `kv` (sliding layers stay float)."""
    return kv.quantized and layer_window(g, layer) is None


def layer_bytes_per_token(g: ModelGeometry, layer: int, kv: KVFormat = FP16) -> float:
    """A layer's cache bytes per token, its float tail (kvarn) aside."""
    if g.kv_lora_rank:
        # MLA: llama.cpp caches one compressed latent plus the shared rotary key per token, and
        # reads V out of the same latent, so heads and value width do not enter.
        return (g.kv_lora_rank + (g.rope_dim or 0)) * kv.element_bytes()
    heads = g.n_kv_heads[layer]
    if not layer_quantized(g, layer, kv):
        return heads * (g.key_length + g.value_length) * kv.float_bytes
    return heads * (g.key_length * kv.element_bytes() + g.value_length * kv.value_element_bytes())


def tail_bytes_per_token(g: ModelGeometry, kv: KVFormat) -> float:
    """Float bytes per token of the kvarn tails, all quantized layers together (0 without one)."""
    if not kv.tail_tokens or g.kv_lora_rank:
        return 0.0
    return sum(
        g.n_kv_heads[i] * (g.key_length + g.value_length) * kv.float_bytes
        for i in range(g.n_layers)
        if layer_quantized(g, i, kv)
    )


def kv_profile(g: ModelGeometry, kv: KVFormat = FP16) -> KVProfile:
    """Per-token bytes grouped by window: a hashable summary that `profile_bytes` caches on."""
    sums: dict[int | None, float] = {}
    for layer in range(g.n_layers):
        window = layer_window(g, layer)
        sums[window] = sums.get(window, 0.0) + layer_bytes_per_token(g, layer, kv)
    profile = [(window, per_token, 0) for window, per_token in sums.items()]
    if tail := tail_bytes_per_token(g, kv):
        profile.append((None, tail, kv.tail_tokens))
    return tuple(profile)


def allocated_tokens(depth: int) -> int:
    """Tokens a growing mlx_lm cache has room for once it holds `depth`: whole steps of 256."""
    return -(-depth // ALLOC_STEP) * ALLOC_STEP


def tail_tokens_held(tail: int, depth: int, allocated: bool = False) -> int:
    """Slots a kvarn float tail of `tail` tokens holds at `depth`. It grows like a KVCache, in
    steps of 256, and once it reaches tail + 256 slots it is cut back to the newest `tail`, so
    while decoding it has tail + 256 slots allocated (gmlx.engine.kv_cache)."""
    if not allocated:
        return min(depth, tail)
    return allocated_tokens(depth) if depth < tail + ALLOC_STEP else tail + ALLOC_STEP


@functools.cache
def profile_bytes(profile: KVProfile, depth: int, allocated: bool = False) -> int:
    held = allocated_tokens(depth) if allocated else depth
    total = 0.0
    for window, per_token, tail in profile:
        if tail:
            total += per_token * tail_tokens_held(tail, depth, allocated)
        else:
            total += per_token * (min(held, window) if window else held)
    return round(total)


def kv_bytes(g: ModelGeometry, depth: int, kv: KVFormat = FP16, *, allocated: bool = False) -> int:
    """KV-cache bytes for one stream of `depth` tokens.

    Each layer holds min(depth, window) tokens when it slides, else depth. With `allocated`,
    the figure is what mlx_lm's caches have allocated while decoding: full-attention caches
    round up to whole steps of 256 tokens, and a RotatingKVCache grows in the same steps but
    never past its window. (Right after a prefill chunk of S tokens a rotating cache briefly
    holds up to window - 1 + S tokens; the next decode step trims it back.)
    """
    return profile_bytes(kv_profile(g, kv), depth, allocated)


def decode_overhead_bytes(g: ModelGeometry) -> int:
    """Memory a decoding stream holds besides its cache: mlx_lm's BatchGenerator keeps two rows
    of log-probabilities over the vocabulary (this step's and the next, computed ahead), in the
    float32 the engine computes in whatever its KV cache stores. With a 262k vocabulary that is
    2 MiB a stream, worth counting."""
    return 2 * g.vocab_size * FLOAT32_BYTES


def stream_bytes(g: ModelGeometry, depth: int, kv: KVFormat = FP16) -> int:
    """All one decoding stream of `depth` tokens holds: its cache as allocated, and its logits."""
    return kv_bytes(g, depth, kv, allocated=True) + decode_overhead_bytes(g)


@dataclass(frozen=True)
class LayerKind:
    kind: str  # "full" or "sliding"
    layers: int
    bytes_per_token: int  # all layers of this kind together
    window: int | None  # tokens a sliding layer keeps; None for full attention

    @property
    def layer_bytes_per_token(self) -> float:
        return self.bytes_per_token / self.layers


def kv_layer_kinds(g: ModelGeometry, kv: KVFormat = FP16) -> list[LayerKind]:
    """KV-cache bytes per token by layer kind: sliding layers stop growing at their window."""
    kinds = []
    for kind, sliding in (("full", False), ("sliding", True)):
        idx = [i for i, s in enumerate(g.sliding_layers) if s == sliding]
        if idx:
            per_token = round(sum(layer_bytes_per_token(g, i, kv) for i in idx))
            kinds.append(LayerKind(kind, len(idx), per_token, g.sliding_window if sliding else None))
    return kinds


def _kind(g: ModelGeometry, kv: KVFormat, sliding: bool) -> LayerKind | None:
    """The model's sliding-window layers, or its full-attention ones; None if it has none."""
    return next((k for k in kv_layer_kinds(g, kv) if bool(k.window) == sliding), None)


def store_cast_bytes(g: ModelGeometry, chunk_tokens: int, kv: KVFormat = FP16) -> int:
    """A prefill chunk's keys and values cast to a float store narrower than the float32 the model
    computes in (float16 where the kernels run attention), the widest layer's: the chunk runs
    layer by layer (upstream.layer_by_layer), so one layer's cast is alive at a time."""
    if kv.float_bytes >= FLOAT32_BYTES:
        return 0
    plain = KVFormat(float_bytes=kv.float_bytes)
    return round(chunk_tokens * max(layer_bytes_per_token(g, i, plain) for i in range(g.n_layers)))


def rotating_prefill_bytes(g: ModelGeometry, chunk_tokens: int, kv: KVFormat = FP16) -> int:
    """The buffers one stream's sliding-window caches replace in a prefill chunk: a RotatingKVCache
    concatenates the chunk to the window - 1 tokens it keeps into a new buffer, every layer's."""
    return round(sum(k.bytes_per_token * (k.window - 1 + chunk_tokens) for k in kv_layer_kinds(g, kv) if k.window))


def sliding_prefill_bytes(g: ModelGeometry, chunk_tokens: int, kv: KVFormat = FP16) -> int:
    """What one stream's sliding-window caches hold beyond their window while its prompt is
    prefilled: each keeps its window - 1 tokens and the last chunk until the prompt ends, and the
    layer running its chunk holds its buffer from before as well."""
    sliding = _kind(g, kv, sliding=True)
    if sliding is None:
        return 0
    assert sliding.window is not None
    return round(
        sliding.bytes_per_token * (chunk_tokens - 1)
        + sliding.layer_bytes_per_token * (sliding.window - 1 + chunk_tokens)
    )


def outgrown_bytes(
    g: ModelGeometry, depth: int, chunk_tokens: int, kv: KVFormat = FP16, one_layer: bool = False
) -> int:
    """What one stream's full-attention caches outgrew in the last prefill chunk of a `depth`-token
    prompt: a KVCache grows by concatenation, and the buffer it had before that chunk stays in
    MLX's buffer cache until the chunk ends (mlx_lm clears the cache after each chunk). With
    `one_layer`, a layer's: what the stream holds itself, its buffer from before alive only while
    its layer runs (upstream.layer_by_layer)."""
    full = _kind(g, kv, sliding=False)
    if full is None:
        return 0
    per_token = full.layer_bytes_per_token if one_layer else full.bytes_per_token
    return round(per_token * allocated_tokens(max(0, depth - chunk_tokens)))


def kv_bytes_after_prefill(g: ModelGeometry, depth: int, kv: KVFormat = FP16) -> int:
    """KV bytes of one stream right after its prompt is prefilled in one chunk: full-attention
    caches have grown in whole 256-token steps, while a RotatingKVCache has concatenated the
    chunk and holds exactly min(depth, window) tokens until decoding starts to grow it. A kvarn
    tail has grown like a full cache, or been cut to its `tail_tokens` if it reached 256 more."""
    total = sum(
        k.bytes_per_token * (min(depth, k.window) if k.window else allocated_tokens(depth))
        for k in kv_layer_kinds(g, kv)
    )
    if tail := tail_bytes_per_token(g, kv):
        t = kv.tail_tokens
        total += round(tail * (allocated_tokens(depth) if depth < t + ALLOC_STEP else t))
    return total


def kv_bytes_per_token(g: ModelGeometry, kv: KVFormat = FP16) -> float:
    """What one more token costs while no layer has filled its window (nor a kvarn tail its length)."""
    return sum(per_token for _, per_token, _ in kv_profile(g, kv))


def warmup_per_token(g: ModelGeometry, tokens: int, measured_kv_bytes: int | None, kv: KVFormat = FP16) -> dict:
    """Per-token KV bytes at the warm-up, predicted and measured.

    Right after a prefill of `tokens` the caches do not all hold `tokens` slots: full-attention
    layers have grown in whole steps of 256, sliding ones hold exactly min(tokens, window). So
    the measured total is divided by the slots held, each layer weighted by its bytes per token
    (the predicted total over the predicted per-token cost); for a model whose layers all attend
    fully that is simply the measured bytes over the 256-token steps allocated.
    """
    per_token = kv_bytes_per_token(g, kv)
    predicted = kv_bytes_after_prefill(g, tokens, kv)
    slots = predicted / per_token if per_token else 0
    return {
        "kv_bytes_per_token_predicted": round(per_token, 1),
        "kv_bytes_per_token_measured": round(measured_kv_bytes / slots, 1)
        if slots and measured_kv_bytes is not None
        else None,
    }
