"""Read a GGUF file's header (metadata and tensor table) without touching tensor data.

`gguf.GGUFReader` builds numpy views of every array, which takes seconds for a
262k-entry vocabulary. This reader walks the header once with `struct` over an
mmap and keeps large arrays as lazy references, parsed only when asked for.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
_EAGER_ARRAY_MAX = 256  # arrays longer than this are read on demand

# Scalar value types: GGUF type id -> struct format.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {
    0: np.uint8,
    1: np.int8,
    2: np.uint16,
    3: np.int16,
    4: np.uint32,
    5: np.int32,
    6: np.float32,
    7: np.bool_,
    10: np.uint64,
    11: np.int64,
    12: np.float64,
}
_STRING, _ARRAY = 8, 9

# Sliding-window layer patterns that llama.cpp's converter does not store in the file.
_SLIDING_PATTERN_DEFAULTS = {"gemma3": 6, "gemma2": 2}
# Files whose sliding_window llama.cpp ignores, attending to the whole context as mlx_lm's classes for them do
# (Phi-3's converter writes one; a `llama` file may carry Mistral 7B v0.1's): a full-length KV cache on every layer.
_WINDOW_IGNORED = ("llama", "phi3")


class GGUFError(ValueError):
    """A file that is not a readable GGUF, with a message fit for one line."""


@dataclass(frozen=True)
class LazyArray:
    """A metadata array left in the file until someone asks for it."""

    offset: int
    item_type: int
    count: int


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: fastest-varying dimension first
    ggml_type: int
    offset: int  # absolute file offset of the data

    @property
    def type_name(self) -> str:
        try:
            return GGMLQuantizationType(self.ggml_type).name
        except ValueError:
            return f"type{self.ggml_type}"

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        try:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(self.ggml_type)]
        except (ValueError, KeyError):
            raise GGUFError(f"tensor {self.name}: unknown GGML type id {self.ggml_type}") from None
        return self.n_elements // block * size


class _Cursor:
    def __init__(self, buf: mmap.mmap | bytes, pos: int = 0):
        self.buf, self.pos = buf, pos

    def unpack(self, fmt: str) -> Any:
        try:
            (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        except struct.error:
            raise GGUFError("truncated GGUF header") from None
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("Q")
        if self.pos + n > len(self.buf):
            raise GGUFError("truncated GGUF header")
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item_type, count = self.unpack("I"), self.unpack("Q")
            if count > _EAGER_ARRAY_MAX:
                ref = LazyArray(self.pos, item_type, count)
                self.skip_array(item_type, count)
                return ref
            return [self.value(item_type) for _ in range(count)]
        raise GGUFError(f"unknown GGUF value type {vtype}")

    def skip_array(self, item_type: int, count: int) -> None:
        if item_type in _SCALARS:
            self.pos += struct.calcsize(_SCALARS[item_type]) * count
        elif item_type == _STRING:
            buf, pos, unpack = self.buf, self.pos, struct.unpack_from
            try:
                for _ in range(count):
                    pos += 8 + unpack("<Q", buf, pos)[0]
            except struct.error:
                raise GGUFError("truncated GGUF header") from None
            self.pos = pos
        else:
            for _ in range(count):
                self.value(item_type)
        if self.pos > len(self.buf):
            raise GGUFError("truncated GGUF header")


@dataclass
class GGUFHeader:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    data_offset: int
    file_size: int
    _map: mmap.mmap | None = field(default=None, repr=False)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "unknown"))

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value, with large arrays materialized (lists or numpy arrays)."""
        value = self.metadata.get(key, default)
        return self.array(value) if isinstance(value, LazyArray) else value

    def arch_key(self, suffix: str, default: Any = None) -> Any:
        return self.get(f"{self.architecture}.{suffix}", default)

    def array(self, ref: LazyArray) -> list | np.ndarray:
        buf = self._buffer()
        if ref.item_type in _NUMPY:
            return np.frombuffer(buf, dtype=_NUMPY[ref.item_type], count=ref.count, offset=ref.offset).copy()
        cur = _Cursor(buf, ref.offset)
        return [cur.value(ref.item_type) for _ in range(ref.count)]

    def _buffer(self) -> mmap.mmap:
        if self._map is None:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return self._map

    @cached_property
    def geometry(self) -> ModelGeometry:
        return ModelGeometry.from_header(self)


def read_header(path: str | os.PathLike) -> GGUFHeader:
    """Parse the header of a GGUF file; raises GGUFError with a one-line reason."""
    path = Path(path)
    if not path.exists():
        raise GGUFError(f"no such file: {path}")
    if not path.is_file():
        raise GGUFError(f"not a file: {path}")
    size = path.stat().st_size
    if size < 24:
        raise GGUFError(f"not a GGUF file (only {size} bytes): {path}")
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return _parse(path, buf, size)
    except GGUFError as e:
        raise GGUFError(f"{e}: {path}") from None


def _parse(path: Path, buf: mmap.mmap, size: int) -> GGUFHeader:
    if buf[:4] != GGUF_MAGIC:
        raise GGUFError(f"not a GGUF file (bad magic {bytes(buf[:4])!r})")
    cur = _Cursor(buf, 4)
    version = cur.unpack("I")
    if version not in (2, 3):
        raise GGUFError(f"unsupported GGUF version {version} (gmlx reads versions 2 and 3)")
    n_tensors, n_kv = cur.unpack("Q"), cur.unpack("Q")
    if n_tensors > 1_000_000 or n_kv > 1_000_000:
        raise GGUFError(f"corrupt GGUF header ({n_tensors} tensors, {n_kv} keys)")

    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.unpack("I"))

    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.unpack("I")
        if n_dims > 8:
            raise GGUFError(f"corrupt GGUF tensor table (tensor {name!r} has {n_dims} dims)")
        shape = tuple(cur.unpack("Q") for _ in range(n_dims))
        infos.append((name, shape, cur.unpack("I"), cur.unpack("Q")))

    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    data_offset = -(-cur.pos // alignment) * alignment
    tensors = {name: TensorInfo(name, shape, t, data_offset + off) for name, shape, t, off in infos}
    # A vocab-only file (no tensors, as llama.cpp's test vocabularies) may end before the padded data offset.
    end = max((t.offset + t.nbytes for t in tensors.values()), default=0)
    if end > size:
        raise GGUFError(f"truncated GGUF: tensor data needs {end} bytes, the file has {size}")
    return GGUFHeader(path, version, metadata, tensors, data_offset, size, buf)


@dataclass(frozen=True)
class ModelGeometry:
    """What capacity planning needs to know about a model, from its header alone."""

    architecture: str
    name: str
    n_layers: int
    n_embd: int
    n_ff: int
    n_heads: int
    n_kv_heads: tuple[int, ...]  # per layer
    key_length: int
    value_length: int
    context_length: int
    vocab_size: int
    sliding_window: int | None
    sliding_layers: tuple[bool, ...]  # per layer: True where attention slides
    rope_theta: float
    norm_eps: float
    kv_lora_rank: int | None  # MLA (DeepSeek-style) ranks, where present
    q_lora_rank: int | None
    n_experts: int | None
    n_params: int
    weight_bytes: int
    file_bytes: int
    tensor_types: dict[str, int]  # GGML type name -> tensor count
    has_chat_template: bool
    rope_dim: int | None = None  # rotary dimensions; MLA caches this many beside its latent

    @classmethod
    def from_header(cls, h: GGUFHeader) -> ModelGeometry:
        arch = h.architecture
        n_layers = int(h.arch_key("block_count", 0))
        n_embd = int(h.arch_key("embedding_length", 0))
        n_heads = _first(h.arch_key("attention.head_count", 0))
        kv = h.arch_key("attention.head_count_kv", n_heads)
        n_kv = tuple(int(x) for x in kv) if isinstance(kv, (list, np.ndarray)) else (int(kv),) * n_layers
        head_dim = n_embd // n_heads if n_heads else 0
        window = None if arch in _WINDOW_IGNORED else h.arch_key("attention.sliding_window")
        vocab = h.arch_key("vocab_size")
        if vocab is None:
            tokens = h.metadata.get("tokenizer.ggml.tokens")
            vocab = tokens.count if isinstance(tokens, LazyArray) else len(tokens or [])
        return cls(
            architecture=arch,
            name=str(h.metadata.get("general.name") or h.path.stem),
            n_layers=n_layers,
            n_embd=n_embd,
            n_ff=_first(h.arch_key("feed_forward_length", 0)),
            n_heads=n_heads,
            n_kv_heads=n_kv,
            key_length=int(h.arch_key("attention.key_length", head_dim)),
            value_length=int(h.arch_key("attention.value_length", head_dim)),
            context_length=int(h.arch_key("context_length", 2048)),
            vocab_size=int(vocab),
            sliding_window=int(window) if window else None,
            sliding_layers=_sliding_layers(h, n_layers, bool(window)),
            rope_theta=float(h.arch_key("rope.freq_base", 10000.0)),
            norm_eps=float(h.arch_key("attention.layer_norm_rms_epsilon", 1e-6)),
            kv_lora_rank=_opt_int(h.arch_key("attention.kv_lora_rank")),
            q_lora_rank=_opt_int(h.arch_key("attention.q_lora_rank")),
            n_experts=_opt_int(h.arch_key("expert_count")),
            n_params=sum(t.n_elements for t in h.tensors.values()),
            weight_bytes=sum(t.nbytes for t in h.tensors.values()),
            file_bytes=h.file_size,
            tensor_types=dict(Counter(t.type_name for t in h.tensors.values()).most_common()),
            has_chat_template="tokenizer.chat_template" in h.metadata,
            rope_dim=_opt_int(h.arch_key("rope.dimension_count")),
        )


def _first(value: Any) -> int:
    """Per-layer arrays (some converters store one value per layer) -> the first value."""
    if isinstance(value, (list, np.ndarray)):
        return int(value[0]) if len(value) else 0
    return int(value)


def _opt_int(value: Any) -> int | None:
    return int(value) if value else None


def _sliding_layers(h: GGUFHeader, n_layers: int, has_window: bool) -> tuple[bool, ...]:
    stored = h.arch_key("attention.sliding_window_pattern")
    if isinstance(stored, (list, np.ndarray)):  # newer converters: one bool per layer
        return tuple(bool(x) for x in stored)
    pattern = int(stored) if stored else _SLIDING_PATTERN_DEFAULTS.get(h.architecture)
    if not has_window:
        return (False,) * n_layers
    if not pattern:  # a window with no pattern: every layer slides
        return (True,) * n_layers
    return tuple((i + 1) % pattern != 0 for i in range(n_layers))
