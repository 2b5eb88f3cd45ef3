"""GGUF tensor data -> MLX arrays.

Most GGML block formats are affine per group of 32 (value = scale * q + bias), which
is exactly MLX's "affine" quantization with group size 32. Those blocks are repacked,
not dequantized: the integer codes are re-laid out as MLX's LSB-first bitstream in
uint32 words and the block scales become MLX scales and biases. Formats with 16-wide
groups (Q6_K, Q3_K, Q2_K) cannot be expressed at group size 32 without loss, so they
are dequantized and re-quantized one width up. Everything is vectorized numpy over
views of the file's mmap; no Python loop runs per block.

In `gguf` mode (the CPU kernels of gmlx.kernels) a quantized weight is not converted
at all: it stays the file's block bytes, one uint8 array of shape (rows, row_bytes).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import Literal

import mlx.core as mx
import numpy as np
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize

from gmlx.gguf.header import GGUFError, GGUFHeader, TensorInfo

WeightMode = Literal["native", "float", "gguf"]
GROUP = 32  # MLX group size used for every repack (GGML's finest affine group width)
CHUNK = 1 << 19  # weights per vectorized step
SHARE_MLX_BUFFERS = True  # let numpy write into MLX buffers on the CPU (see _Out)
GGUF_BLOCKS = 0  # quant[name] = (GGUF_BLOCKS, ggml_type): the weight is the file's blocks (gguf mode)
# GGML types gmlx.kernels multiplies in their own blocks (kept in step with gmlx.kernels.TYPES,
# which needs mlx and the extension; this module only needs the names).
GGUF_KERNEL_TYPES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K)
EXPERTS = "_exps.weight"  # llama.cpp's merged experts, [in, out, n_expert]: blocks in gguf mode too

# (q codes in element order (n_blocks, block_size), scale (n_blocks, groups), bias (n_blocks, groups))
Unpacked = tuple[np.ndarray, np.ndarray, np.ndarray]


def _f16(b: np.ndarray) -> np.ndarray:
    """Two-byte columns of a block array -> float32 (n_blocks, 1)."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(n, 16) bytes, low nibbles are elements 0-15 and high nibbles 16-31 -> (n, 32) codes."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """(n, 4) bytes holding 32 little-endian bits -> (n, 32) values of 0 or 16."""
    return np.unpackbits(qh, axis=1, bitorder="little") << 4


def _q8_0(b: np.ndarray) -> Unpacked:
    d = _f16(b[:, :2])
    return b[:, 2:] ^ np.uint8(0x80), d, -128 * d  # int8 q -> q + 128 as uint8


def _q4_0(b: np.ndarray) -> Unpacked:
    d = _f16(b[:, :2])
    return _nibbles(b[:, 2:]), d, -8 * d


def _q4_1(b: np.ndarray) -> Unpacked:
    return _nibbles(b[:, 4:]), _f16(b[:, :2]), _f16(b[:, 2:4])


def _q5_0(b: np.ndarray) -> Unpacked:
    d = _f16(b[:, :2])
    return _nibbles(b[:, 6:]) | _high_bits(b[:, 2:6]), d, -16 * d


def _q5_1(b: np.ndarray) -> Unpacked:
    return _nibbles(b[:, 8:]) | _high_bits(b[:, 4:8]), _f16(b[:, :2]), _f16(b[:, 2:4])


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K super-block header -> per-32 scale d*sc and bias -dmin*m (both exact in float32)."""
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    s = b[:, 4:16]
    lo, mn, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]  # 6-bit scales and mins, split low/high
    sc = np.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], axis=1)
    m = np.concatenate([mn & 0x3F, (hi >> 4) | ((mn >> 2) & 0x30)], axis=1)
    return d * sc, -(dmin * m)


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """(n, 128) bytes: each 32-byte chunk holds sub-block 2c in low and 2c+1 in high nibbles."""
    qs = qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (qs & 0x0F).reshape(-1, 256)


def _q4_k(b: np.ndarray) -> Unpacked:
    return (_k_low_nibbles(b[:, 16:]), *_k_scales(b))


def _q5_k(b: np.ndarray) -> Unpacked:
    # bit i of qh[j] is the fifth bit of element j of sub-block i
    qh = b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    q = _k_low_nibbles(b[:, 48:]) | ((qh & 1) << 4).reshape(-1, 256)
    return (q, *_k_scales(b))


def _requant(qtype: T, bits: int, b: np.ndarray) -> Unpacked:
    """16-wide-group K-quants: dequantize (gguf's reference), then min-max affine per 32 with
    round-to-nearest, so the error is at most half a step of each group's own range.
    (mx.quantize anchors a group's edge value instead and errs by up to a whole step.)"""
    x = gguf_dequantize(b.reshape(-1), qtype).reshape(-1, GROUP)
    lo = x.min(axis=1, keepdims=True)
    scale = (x.max(axis=1, keepdims=True) - lo) / (2**bits - 1)
    inv = np.divide(1, scale, out=np.zeros_like(scale), where=scale > 0)  # constant group: q = 0
    q = np.clip(np.rint((x - lo) * inv), 0, 2**bits - 1).astype(np.uint8)
    n = b.shape[0]
    return q.reshape(n, -1), scale.reshape(n, -1), lo.reshape(n, -1)


# Types that map exactly onto MLX affine g32: unpacker and bit width.
_EXACT: dict[int, tuple[Callable[[np.ndarray], Unpacked], int]] = {
    T.Q8_0: (_q8_0, 8),
    T.Q4_0: (_q4_0, 4),
    T.Q4_1: (_q4_1, 4),
    T.Q5_0: (_q5_0, 5),
    T.Q5_1: (_q5_1, 5),
    T.Q4_K: (_q4_k, 4),
    T.Q5_K: (_q5_k, 5),
}
# 16-wide groups: re-quantized one width up so the coarser g32 grid loses little.
_REQUANT: dict[int, int] = {T.Q6_K: 8, T.Q3_K: 4, T.Q2_K: 3}
_CODECS = {**_EXACT, **{t: (partial(_requant, T(t), bits), bits) for t, bits in _REQUANT.items()}}
_FLOATS = (T.F32, T.F16, T.BF16)
SUPPORTED = tuple(T(t).name for t in (*_FLOATS, *_EXACT, *_REQUANT))

_DTYPE_NAMES = {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16"}


def _pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Codes (..., K), K a multiple of 32, -> MLX's LSB-first bitstream as uint32 (..., K*bits/32).

    Every 8 codes fill exactly `bits` bytes, so each output byte is an OR of shifted
    codes; uint8 shifts drop the bits that belong to the neighbouring byte.
    """
    lead, k = q.shape[:-1], q.shape[-1]
    if bits == 8:
        return np.ascontiguousarray(q).view(np.uint32)
    v = q.reshape(-1, 8)
    out = np.zeros((v.shape[0], bits), np.uint8)
    for i in range(8):
        for byte in range(bits * i // 8, (bits * i + bits - 1) // 8 + 1):
            shift = bits * i - 8 * byte
            out[:, byte] |= (v[:, i] << np.uint8(shift)) if shift >= 0 else (v[:, i] >> np.uint8(-shift))
    return out.reshape(-1).view(np.uint32).reshape(*lead, k * bits // 32)


@dataclass
class LoadReport:
    # GGML type name -> {"tensors": n, "action": "exact 4-bit g32" | "re-quantized 8-bit g32" | "float32" | ...}
    by_type: dict[str, dict] = field(default_factory=dict)
    resident_bytes: int = 0  # bytes of the MLX arrays produced

    def add(self, type_name: str, action: str, nbytes: int) -> None:
        entry = self.by_type.setdefault(type_name, {"tensors": 0, "actions": Counter()})
        entry["tensors"] += 1
        entry["actions"][action] += 1
        # one tensor type nearly always gets one action; name each when it does not
        acts = entry["actions"]
        entry["action"] = next(iter(acts)) if len(acts) == 1 else ", ".join(f"{a} x{n}" for a, n in acts.items())
        self.resident_bytes += nbytes

    def lossy(self) -> list[str]:
        """What was not kept exactly, e.g. ["Q6_K: re-quantized 8-bit g32"], for the user to see."""
        return [f"{t}: {e['action']}" for t, e in self.by_type.items() if "re-quantized" in e["action"]]

    def describe(self) -> str:
        parts = [f"{t}: {e['tensors']} {e['action']}" for t, e in self.by_type.items()]
        return "; ".join(parts) + f" ({self.resident_bytes / 2**20:.1f} MiB resident)"


def _blocks(buf, info: TensorInfo) -> np.ndarray:
    """The tensor's raw bytes as (n_blocks, type_size) uint8, a view of the mmap."""
    _, size = GGML_QUANT_SIZES[T(info.ggml_type)]
    return np.frombuffer(buf, np.uint8, count=info.nbytes, offset=info.offset).reshape(-1, size)


def _chunks(n_blocks: int, block_size: int) -> Iterable[slice]:
    """Block ranges of about CHUNK weights, so temporaries stay small, cache-warm and reused."""
    step = max(1, CHUNK // block_size)
    return (slice(i, min(i + step, n_blocks)) for i in range(0, n_blocks, step))


class _Out:
    """An MLX array that numpy fills in place.

    Fresh memory is what loading costs here (first-touch page faults run at a few
    hundred MB/s in these VMs, while the arithmetic runs at GB/s), so on the CPU
    numpy writes straight into the MLX buffer (documented: np.array(a, copy=False)
    shares memory) and each output byte is touched once. Elsewhere it fills a numpy
    array and copies it in.
    """

    def __init__(self, shape: tuple[int, ...], dtype: type[np.generic]):
        self.mx: mx.array | None = None
        if SHARE_MLX_BUFFERS and mx.default_device() == mx.cpu:
            a = mx.zeros(shape, _MX_OF_NP[dtype])
            mx.eval(a)
            view = np.array(a, copy=False)
            if view.flags.writeable and view.flags.c_contiguous and view.shape == shape:
                self.mx, self.np = a, view
                return
        self.np = np.empty(shape, dtype)

    def rows(self, n_blocks: int) -> np.ndarray:
        return self.np.reshape(n_blocks, -1)

    def array(self) -> mx.array:
        return self.mx if self.mx is not None else mx.array(self.np)


_MX_OF_NP = {np.float32: mx.float32, np.float16: mx.float16, np.uint32: mx.uint32}


def _float(buf, info: TensorInfo, dtype: mx.Dtype) -> mx.array:
    """F32/F16/BF16 data in MLX shape, as dtype (BF16 is widened in numpy, which lacks bfloat16)."""
    shape, t, n = info.shape[::-1], info.ggml_type, info.n_elements
    src = np.frombuffer(
        buf, {T.F32: np.float32, T.F16: np.float16, T.BF16: np.uint16}[t], count=n, offset=info.offset
    ).reshape(shape)
    if t == T.F32 or (t == T.F16 and dtype == mx.float16):
        a = mx.array(src)
    else:
        out = _Out(shape, np.float32)
        if t == T.F16:
            np.copyto(out.np, src)
        else:  # bfloat16 is the top half of a float32
            np.left_shift(src, 16, out=out.np.view(np.uint32), dtype=np.uint32)
        a = out.array()
    return a if a.dtype == dtype else a.astype(dtype)


def _repack(buf, info: TensorInfo) -> tuple[mx.array, mx.array, mx.array, int]:
    """Quantized types -> (packed uint32, float32 scales, float32 biases, bits) in MLX layout."""
    unpack, bits = _CODECS[info.ggml_type]
    blocks = _blocks(buf, info)
    n, bs = blocks.shape[0], GGML_QUANT_SIZES[T(info.ggml_type)][0]
    shape = info.shape[::-1]
    gshape = (*shape[:-1], shape[-1] // GROUP)
    w, s, b = _Out((*shape[:-1], shape[-1] * bits // 32), np.uint32), _Out(gshape, np.float32), _Out(gshape, np.float32)
    wr, sr, br = w.rows(n), s.rows(n), b.rows(n)
    for c in _chunks(n, bs):
        q, scale, bias = unpack(blocks[c])
        wr[c] = _pack(q, bits)
        sr[c], br[c] = scale, bias
    return w.array(), s.array(), b.array(), bits


def _dequantize(buf, info: TensorInfo) -> mx.array:
    """Any supported quantized type -> float32 MLX array in MLX shape.

    Exact types use the repack unpackers (scale * q + bias in float32: the same
    products and one rounding as gguf's reference, so identical results); the
    16-wide-group K-quants use gguf's numpy reference, chunk by chunk.
    """
    t = info.ggml_type
    blocks = _blocks(buf, info)
    n, bs = blocks.shape[0], GGML_QUANT_SIZES[T(t)][0]
    out = _Out(info.shape[::-1], np.float32)
    rows = out.rows(n)
    for c in _chunks(n, bs):
        if t in _EXACT:
            q, scale, bias = _EXACT[t][0](blocks[c])
            dst = rows[c].reshape(q.shape[0], -1, GROUP)
            np.multiply(q.reshape(dst.shape), scale[..., None], out=dst)
            dst += bias[..., None]
        else:
            rows[c] = gguf_dequantize(blocks[c].reshape(-1), T(t)).reshape(-1, bs)
    return out.array()


def load_tensors(
    header: GGUFHeader,
    mode: WeightMode,
    float_dtype: mx.Dtype = mx.float32,
    names: Iterable[str] | None = None,
    *,
    scale_dtype: mx.Dtype = mx.float32,
) -> tuple[dict[str, mx.array], dict[str, tuple[int, int]], LoadReport]:
    """Returns (arrays, quant, report). arrays are keyed by GGUF tensor name, with MLX shapes =
    reversed GGUF shape (so a GGUF linear weight [in, out] becomes (out, in)). For a quantized
    weight "X.weight" in native mode: arrays["X.weight"] = packed uint32, arrays["X.scales"],
    arrays["X.biases"] (scale_dtype: float32 or float16, never bfloat16, which makes MLX's CPU
    quantized matmul ~10x slower), and quant["X.weight"] = (bits, group_size). 1-D tensors
    (norms, biases) are always float.

    In gguf mode a 2-D weight of a type in GGUF_KERNEL_TYPES is the tensor's bytes as uint8
    (rows, row_bytes), and merged experts (EXPERTS) as (experts, rows, row_bytes); quant["X.weight"] =
    (GGUF_BLOCKS, ggml_type). Other quantized tensors are dequantized to float32, and float tensors
    load as float32.
    """
    if mode not in ("native", "float", "gguf"):
        raise ValueError(f"mode must be 'native', 'float' or 'gguf', not {mode!r}")
    if scale_dtype not in (mx.float32, mx.float16):
        raise ValueError("scale_dtype must be float32 or float16")
    wanted = list(header.tensors) if names is None else list(names)
    infos = []
    for name in wanted:  # validate everything before reading any data
        info = header.tensors.get(name)
        if info is None:
            raise GGUFError(f"tensor {name}: not in {header.path.name}")
        if info.ggml_type not in _EXACT and info.ggml_type not in _REQUANT and info.ggml_type not in _FLOATS:
            raise GGUFError(
                f"tensor {name}: GGML type {info.type_name} is not supported (supported: {', '.join(SUPPORTED)})"
            )
        infos.append(info)

    buf = header._buffer()
    # numpy cannot hold bfloat16; off the CPU MLX's bf16 kernels are fine, on it they are slow
    bf16_dtype = mx.float32 if mx.default_device() == mx.cpu else mx.bfloat16
    arrays: dict[str, mx.array] = {}
    quant: dict[str, tuple[int, int]] = {}
    report = LoadReport()

    for info in infos:
        t, name = info.ggml_type, info.name
        out: dict[str, mx.array]
        if t in _FLOATS:
            native_dtype = {T.F32: mx.float32, T.F16: mx.float16, T.BF16: bf16_dtype}[t]
            dtype = native_dtype if mode == "native" else float_dtype
            out = {name: _float(buf, info, dtype)}
            action = _DTYPE_NAMES.get(dtype, str(dtype))
        elif (
            mode == "gguf"
            and t in GGUF_KERNEL_TYPES
            and name.endswith(".weight")
            and (len(info.shape) == 2 or name.endswith(EXPERTS))
        ):
            # (out features, row bytes), or (experts, out features, row bytes) for merged experts: a view of the mmap
            rows = _blocks(buf, info).reshape(*info.shape[:0:-1], -1)
            out = {name: mx.array(rows)}  # one copy into MLX: resident bytes == tensor bytes
            action = "gguf blocks"
            quant[name] = (GGUF_BLOCKS, int(t))
        elif mode == "native" and len(info.shape) >= 2 and name.endswith(".weight"):
            w, s, b, bits = _repack(buf, info)
            action = f"{'exact' if t in _EXACT else 're-quantized'} {bits}-bit g{GROUP}"
            base = name[: -len(".weight")]
            out = {name: w, f"{base}.scales": s.astype(scale_dtype), f"{base}.biases": b.astype(scale_dtype)}
            quant[name] = (bits, GROUP)
        else:  # float mode, a quantized 1-D tensor, or a type gguf mode has no kernel for
            dtype = mx.float32 if mode == "native" else float_dtype
            a = _dequantize(buf, info)
            out = {name: a if dtype == mx.float32 else a.astype(dtype)}
            action = f"dequantized {_DTYPE_NAMES.get(dtype, str(dtype))}"
        mx.eval(*out.values())  # materialize now so intermediates are freed tensor by tensor
        arrays.update(out)
        report.add(info.type_name, action, sum(a.nbytes for a in out.values()))
    return arrays, quant, report
