"""Quantized KV caches that batch: per-request caches and the batch forms BatchGenerator merges them into.

mlx_lm 0.32's `QuantizedKVCache` has no `merge`, so it cannot join a BatchGenerator batch. The
caches here store one layer's keys and values the way `mx.quantize` returns them (packed uint32
words, scales, biases) and keep those three arrays in three of mlx_lm's own float caches: a
`KVCache` per request and a `BatchKVCache` per batch. Every batch operation mlx_lm needs (merge,
extract, filter, extend, prepare/finalize of right-padded prompts, trim, masks) moves whole token
slots along the sequence axis and never looks inside one, so mlx_lm's tested float logic applies
unchanged to the packed words, the scales and the biases alike, and the three stay in step.

Two schemes (`gmlx.capacity.kv_quant` decides which, and where):

- `uniform`: keys and values at `bits`. The cache exposes `bits` and `group_size`, so mlx_lm's
  `scaled_dot_product_attention` runs its quantized attention (`mx.quantized_matmul` over the
  packed cache). Measured on this 2-core CPU (one decode query, 4 query heads on 1 KV head of
  256, float32), that is 1.2-4.2x faster than dequantizing the cache for
  `mx.fast.scaled_dot_product_attention` in 5 of 6 cases (4 and 8 bits; batch 1 and 4; 2048 and
  8192 tokens), and slower only for 8 bits at batch 1 (6.4 against 4.9 ms at 2048 tokens).
- `kvarn`: keys at `key_bits`, values at `value_bits`, and the newest `tail_tokens` also kept in
  float, which attention reads instead of their quantized copies. It has no `bits` attribute:
  mlx_lm's quantized attention takes one width and no float tail, so this cache hands attention
  dequantized float keys and values (transient working memory, one layer at a time).

The float tail is one more `KVCache`/`BatchKVCache` holding the newest slots, right-aligned
with the quantized store (slot n-1 of the tail is the newest slot of the store). Its
`left_padding` marks, per row, the leading tail slots that hold no float copy (padding, or slots
lost to a right-padding roll); attention reads the quantized copy there. Attention reads float
for exactly the newest `tail_tokens` slots; the tail stores up to 255 more, so that it is cut
(a contiguous copy of the newest `tail_tokens`, which frees the old buffer) once every 256
tokens rather than every step. `capacity.memory` predicts those stored slots.

Sliding-window layers (`RotatingKVCache`) stay float: their cache stops at the window whatever
the depth, so quantizing them saves a constant, not a share of the context.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from gmlx import upstream
from gmlx.capacity.kv_quant import KVQuantPlan

TAIL_STEP = 256  # the tail is cut back to tail_tokens once it holds this many more


def _dequantize(q: tuple[mx.array, mx.array, mx.array], group_size: int, bits: int) -> mx.array:
    return mx.dequantize(q[0], q[1], q[2], group_size=group_size, bits=bits)


def _overlay(full: mx.array, tail: mx.array, valid: mx.array | None) -> mx.array:
    """`full` with its newest tail.shape[2] slots read from the float `tail` where valid."""
    n, length = tail.shape[2], full.shape[2]
    if n == 0:
        return full
    recent = tail if valid is None else mx.where(valid, tail, full[..., length - n :, :])
    return recent if n == length else mx.concatenate([full[..., : length - n, :], recent], axis=2)


class _PackedLayerCache:
    """What the per-request and the batch forms share; `parts` are three float caches holding
    (key words, value words), (key scales, value scales) and (key biases, value biases)."""

    parts: list
    tail: object | None

    def _setup(self, key_bits: int, value_bits: int, group_size: int, tail_tokens: int) -> None:
        self.key_bits, self.value_bits, self.group_size, self.tail_tokens = (
            key_bits,
            value_bits,
            group_size,
            tail_tokens,
        )

    # --- what attention calls -------------------------------------------------------------

    @property
    def offset(self):
        return self.parts[0].offset

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        qk = mx.quantize(keys, group_size=self.group_size, bits=self.key_bits)
        qv = mx.quantize(values, group_size=self.group_size, bits=self.value_bits)
        for part, k, v in zip(self.parts, qk, qv):
            part.update_and_fetch(k, v)
        if self.tail is not None:
            self.tail.update_and_fetch(keys, values)
            self._cut_tail()
        return self._fetch()

    def _stored(self) -> tuple[tuple, tuple]:
        kv = [p.keys_and_values() for p in self.parts]
        return tuple(k for k, _ in kv), tuple(v for _, v in kv)

    def _fetch(self):
        keys, values = self._stored()
        if self._quantized_attention:
            return keys, values
        keys = _dequantize(keys, self.group_size, self.key_bits)
        values = _dequantize(values, self.group_size, self.value_bits)
        if self.tail is not None and self.tail.keys is not None:
            tk, tv, valid = self._tail_view(*self.tail.keys_and_values())
            keys, values = _overlay(keys, tk, valid), _overlay(values, tv, valid)
        return keys, values

    _quantized_attention = False

    def _tail_view(self, tk: mx.array, tv: mx.array) -> tuple[mx.array, mx.array, mx.array | None]:
        """The tail slots attention reads as float (exactly the newest `tail_tokens`), and per
        row which of them hold a float copy (None: all do)."""
        n = tk.shape[2]
        m = min(n, self.tail_tokens)
        return tk[..., n - m :, :], tv[..., n - m :, :], None

    def _cut_tail(self) -> None:
        raise NotImplementedError

    def make_mask(self, *args, **kwargs):
        return self.parts[0].make_mask(*args, **kwargs)

    # --- what BatchGenerator and the prompt cache call --------------------------------------

    def _all(self) -> list:
        return [*self.parts, *([self.tail] if self.tail is not None else [])]

    def __copy__(self):
        """Shallow, as mlx_lm's caches copy: the arrays are shared, but the inner caches are
        copies, so trimming the copy (the prompt cache does) leaves the original as it was."""
        out = self.__class__.__new__(self.__class__)
        out.__dict__.update(self.__dict__)
        out.parts = [copy.copy(p) for p in self.parts]
        out.tail = copy.copy(self.tail)
        return out

    @property
    def state(self):
        return [c.state for c in self._all()]

    @state.setter
    def state(self, v):
        raise NotImplementedError("quantized KV caches are not saved to files")

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        done = [p.trim(n) for p in self.parts]
        if self.tail is not None:
            self.tail.trim(n)
        return done[0]

    def size(self) -> int:
        return self.parts[0].size()

    def empty(self) -> bool:
        return self.parts[0].empty()

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self._all())


class PackedKVCache(_PackedLayerCache):
    """One request's quantized cache for one full-attention layer (dequantized attention)."""

    def __init__(self, key_bits: int = 4, value_bits: int = 4, group_size: int = 64, tail_tokens: int = 0):
        self._setup(key_bits, value_bits, group_size, tail_tokens)
        self.parts = [KVCache() for _ in range(3)]
        self.tail = KVCache() if tail_tokens > 0 else None

    def _cut_tail(self) -> None:
        t = self.tail
        if t.offset >= self.tail_tokens + TAIL_STEP:
            keep = self.tail_tokens
            t.keys = mx.contiguous(t.keys[..., t.offset - keep : t.offset, :])
            t.values = mx.contiguous(t.values[..., t.offset - keep : t.offset, :])
            t.offset = keep

    @classmethod
    def merge(cls, caches: list[PackedKVCache]) -> BatchPackedKVCache:
        first = caches[0]
        out = cls.batch_cls.__new__(cls.batch_cls)
        out._setup(first.key_bits, first.value_bits, first.group_size, first.tail_tokens)
        out.parts = [BatchKVCache.merge([c.parts[i] for c in caches]) for i in range(3)]
        out.tail = BatchKVCache.merge([c.tail for c in caches]) if first.tail is not None else None
        return out


class BatchPackedKVCache(_PackedLayerCache):
    """The batch form: left-padded rows, as mlx_lm's BatchKVCache."""

    def __init__(
        self,
        left_padding: list[int],
        key_bits: int = 4,
        value_bits: int = 4,
        group_size: int = 64,
        tail_tokens: int = 0,
    ):
        self._setup(key_bits, value_bits, group_size, tail_tokens)
        self.parts = [BatchKVCache(left_padding) for _ in range(3)]
        self.tail = BatchKVCache(left_padding) if tail_tokens > 0 else None

    @property
    def left_padding(self):
        return self.parts[0].left_padding

    def _tail_view(self, tk: mx.array, tv: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        # Per row: the newest tail_tokens real tokens, which while a right-padded prefill chunk
        # is in flight end `right padding` slots before the last; never the row's invalid front.
        t, n = self.tail, tk.shape[2]
        start = n - self.tail_tokens
        if (padding := upstream.right_padding(t)) is not None:
            start = start - padding
        start = mx.maximum(t.left_padding, start)
        return tk, tv, (mx.arange(n)[None] >= start[:, None])[:, None, :, None]

    def _cut_tail(self) -> None:
        t = self.tail
        filled = upstream.filled(t)
        if filled >= self.tail_tokens + TAIL_STEP:
            cut = filled - self.tail_tokens
            t.keys = mx.contiguous(t.keys[..., cut:filled, :])
            t.values = mx.contiguous(t.values[..., cut:filled, :])
            upstream.set_filled(t, self.tail_tokens)
            t.left_padding = mx.maximum(t.left_padding - cut, 0)

    def prepare(self, **kwargs) -> None:
        for c in self._all():
            c.prepare(**kwargs)

    def finalize(self) -> None:
        for c in self._all():
            c.finalize()

    def filter(self, batch_indices) -> None:
        for c in self._all():
            c.filter(batch_indices)

    def extend(self, other: BatchPackedKVCache) -> None:
        for mine, theirs in zip(self._all(), other._all()):
            mine.extend(theirs)

    def extract(self, idx: int) -> PackedKVCache:
        out = self.single_cls.__new__(self.single_cls)
        out._setup(self.key_bits, self.value_bits, self.group_size, self.tail_tokens)
        out.parts = [p.extract(idx) for p in self.parts]
        out.tail = None
        if self.tail is not None:
            out.tail = self.tail.extract(idx) if self.tail.keys is not None else KVCache()
        return out


class UniformKVCache(PackedKVCache):
    """`uniform`: one width for keys and values and no tail, so attention runs quantized."""

    _quantized_attention = True

    def __init__(self, bits: int = 4, group_size: int = 64):
        super().__init__(bits, bits, group_size, 0)

    @property
    def bits(self) -> int:  # mlx_lm's scaled_dot_product_attention checks for this attribute
        return self.key_bits


class BatchUniformKVCache(BatchPackedKVCache):
    _quantized_attention = True

    @property
    def bits(self) -> int:
        return self.key_bits


PackedKVCache.batch_cls = BatchPackedKVCache
BatchPackedKVCache.single_cls = PackedKVCache
UniformKVCache.batch_cls = BatchUniformKVCache
BatchUniformKVCache.single_cls = UniformKVCache


CacheFactory = Callable[[object], list]


def make_cache_factory(plan: KVQuantPlan | None) -> CacheFactory:
    """A request's fresh caches under `plan`: mlx_lm's own caches, with every plain `KVCache`
    (a full-attention layer) replaced by a quantized one. Without a plan, or where the plan's
    verdict is `dropped`, mlx_lm's caches as they are."""
    if plan is None or not plan.quantizes:
        return make_prompt_cache

    def one(layer_cache: object) -> object:
        if type(layer_cache) is not KVCache:  # sliding (RotatingKVCache) and other kinds stay as they are
            return layer_cache
        if plan.scheme == "uniform":
            return UniformKVCache(plan.bits, plan.group_size)
        return PackedKVCache(plan.bits, plan.value_bits, plan.group_size, plan.tail_tokens)

    def make_cache(model: object) -> list:
        return [one(c) for c in make_prompt_cache(model)]

    return make_cache
