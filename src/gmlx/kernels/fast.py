"""MLX's fast ops (rms_norm, rope, scaled_dot_product_attention) and logsumexp as single,
vectorized CPU graph nodes, and the fused model ops a decode step's layers take (heads, add_norm).

MLX has no CPU kernels for the fast ops: on the CPU each call is composed from 8 to 25 graph
nodes, and a decode step of a small model then spends more time scheduling thousands of
nodes than computing (gemma3-270m: 3,338 nodes a step, 553 with these, 359 with the fused
model ops at the end). Its CPU logsumexp takes a scalar exp, and mlx_lm's BatchGenerator
normalizes every step's logits with it: 38 ms a step for 8 rows of a 262,144-token
vocabulary, 0.9 ms here. install() points mx.fast and mx.logsumexp at dispatchers that send
the calls gmlx.kernels handles (float32 on the CPU; logsumexp over the last axis) to its own
primitives and every other call to MLX's, so mlx_lm's code is unchanged. GMLX_FAST_OPS=0
keeps MLX's own. Attention takes a few query rows (decode, speculative verification) by
KV-head group, and more (prefill) as flash attention over tiles of keys: MLX materializes
every score, causal or not (gemma3-270m's layer at 511 tokens: 16.7 ms there, 4.5 ms here;
at 2,048: 290 and 63 ms).
"""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from gmlx import kernels

_TARGETS = ((mx.fast, "rms_norm"), (mx.fast, "rope"), (mx.fast, "scaled_dot_product_attention"), (mx, "logsumexp"))
NAMES = tuple(name for _, name in _TARGETS)
# MLX's own, as found before install(): every call gmlx does not handle goes here.
ORIGINAL: dict[str, Any] = {name: getattr(module, name) for module, name in _TARGETS}


def enabled() -> bool:
    return os.environ.get("GMLX_FAST_OPS", "1") != "0" and kernels.available()


def installed() -> bool:
    return mx.fast.rms_norm is rms_norm


def install() -> bool:
    """Route mx.fast's ops and mx.logsumexp to gmlx.kernels where they apply; True when installed."""
    if not enabled():
        return False
    for module, name in _TARGETS:
        setattr(module, name, globals()[name])
    return True


def uninstall() -> None:
    for module, name in _TARGETS:
        setattr(module, name, ORIGINAL[name])


def _cpu(stream: Any) -> bool:
    if stream is None:
        return mx.default_device() == mx.cpu
    return (stream.device if isinstance(stream, mx.Stream) else stream) == mx.cpu


def _f32(*arrays: mx.array | None) -> bool:
    return all(a is None or a.dtype == mx.float32 for a in arrays)


def rms_norm(x: mx.array, weight: mx.array | None, eps: float, *, stream: Any = None) -> mx.array:
    if _cpu(stream) and _f32(x, weight) and x.ndim >= 1 and (weight is None or weight.ndim == 1):
        return kernels.extension().rms_norm(x, weight, eps, stream=mx.cpu)
    return ORIGINAL["rms_norm"](x, weight, eps, stream=stream)


def _rope_ours(
    shape: tuple[int, ...], dims: int, base: float | None, freqs: mx.array | None, offset: int | mx.array
) -> bool:
    """Whether the kernels' RoPE takes these arguments for a float32 x of this shape, (B, ..., L, D)."""
    return (
        _f32(freqs)
        and len(shape) >= 3
        and dims % 2 == 0
        and 0 < dims <= shape[-1]
        and (base is None) != (freqs is None)
        and (isinstance(offset, int) or offset.size == 1 or offset.shape == (shape[0],))
    )


def rope(
    a: mx.array,
    dims: int,
    *,
    traditional: bool,
    base: float | None,
    scale: float,
    offset: int | mx.array,
    freqs: mx.array | None = None,
    stream: Any = None,
) -> mx.array:
    if _cpu(stream) and _f32(a) and _rope_ours(a.shape, dims, base, freqs, offset):
        return kernels.extension().rope(
            a, dims, traditional=traditional, base=base, scale=scale, offset=offset, freqs=freqs, stream=mx.cpu
        )
    return ORIGINAL["rope"](
        a, dims, traditional=traditional, base=base, scale=scale, offset=offset, freqs=freqs, stream=stream
    )


def scaled_dot_product_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    mask: mx.array | str | None = None,
    sinks: mx.array | None = None,
    stream: Any = None,
) -> mx.array:
    causal = isinstance(mask, str) and mask == "causal"
    array_mask = mask if isinstance(mask, mx.array) else None
    ours = (
        _cpu(stream)
        and sinks is None
        and _f32(q)
        and (_f32(k, v) or k.dtype == v.dtype == mx.float16)
        and q.ndim == 4
        and k.ndim == 4
        and k.shape == v.shape
        and q.shape[0] == k.shape[0]
        and q.shape[-1] == k.shape[-1]
        and q.shape[1] % k.shape[1] == 0
        and (
            mask is None
            or causal
            or (array_mask is not None and array_mask.ndim <= 4 and array_mask.dtype in (mx.bool_, mx.float32))
        )
        and (not causal or q.shape[2] <= k.shape[2])
    )
    if ours:
        return kernels.extension().attention(q, k, v, scale=scale, mask=array_mask, causal=causal, stream=mx.cpu)
    return ORIGINAL["scaled_dot_product_attention"](q, k, v, scale=scale, mask=mask, sinks=sinks, stream=stream)


def logsumexp(
    a: mx.array, /, axis: int | list[int] | None = None, keepdims: bool = False, *, stream: Any = None
) -> mx.array:
    axes = [axis] if isinstance(axis, int) else axis
    last = a.ndim >= 1 and axes is not None and len(axes) == 1 and axes[0] in (-1, a.ndim - 1)
    if _cpu(stream) and _f32(a) and last and a.shape[-1] > 0:
        return kernels.extension().logsumexp(a, keepdims=keepdims, stream=mx.cpu)
    return ORIGINAL["logsumexp"](a, axis=axis, keepdims=keepdims, stream=stream)


# Fused model ops: what mlx_lm's layers compose from several nodes, as one node where the kernels
# run (float32 on the CPU, the ops installed), and as those nodes elsewhere.


def takes(x: mx.array) -> bool:
    """Whether the fused ops below run as one node for x: float32 on the CPU, the fast ops installed."""
    return installed() and _cpu(None) and x.dtype == mx.float32


def heads(
    x: mx.array,
    n: int,
    *,
    norm: tuple[mx.array, float] | None = None,
    rope: nn.Module | None = None,
    offset: int | mx.array = 0,
) -> mx.array:
    """x (B, L, n * D) split into its n heads, (B, n, L, D), each row normalised by `norm` (rms_norm's
    weight and eps) and rotated by `rope` at positions offset + l: an attention layer's reshape,
    transpose, q/k norm and RoPE (four nodes) as one. A RoPE other than nn.RoPE's runs after it."""
    B, L, _ = x.shape
    if norm is None and rope is None and L == 1:
        return x.reshape(B, n, 1, -1)  # one head row each: the transpose moves nothing
    if takes(x):
        shape = (B, n, L, x.shape[-1] // n)
        plain = type(rope) is nn.RoPE and _rope_ours(shape, rope.dims, rope.base, None, offset)
        kw: dict[str, Any] = {"weight": norm[0], "eps": norm[1]} if norm is not None else {}
        if plain:
            kw.update(dims=rope.dims, traditional=rope.traditional, base=rope.base, scale=rope.scale, offset=offset)
        if norm is None or _f32(norm[0]):
            y = kernels.extension().heads(x, n, **kw, stream=mx.cpu)
            return y if plain or rope is None else rope(y, offset=offset)
    y = x.reshape(B, L, n, -1).transpose(0, 2, 1, 3)
    if norm is not None:
        y = mx.fast.rms_norm(y, *norm)
    return y if rope is None else rope(y, offset=offset)


def add_norm(
    x: mx.array, r: mx.array, norm: tuple[mx.array, float], next_norm: tuple[mx.array, float] | None = None
) -> Any:
    """h = x + rms_norm(r, *norm), a residual stream and a block's output normalised; with next_norm
    also (h, rms_norm(h, *next_norm)), the input of the block after: up to three nodes as one."""
    if takes(x) and _f32(r, norm[0], next_norm[0] if next_norm else None) and x.shape == r.shape:
        nxt = {"next_weight": next_norm[0], "next_eps": next_norm[1]} if next_norm is not None else {}
        ys = kernels.extension().add_norm(x, r, *norm, **nxt, stream=mx.cpu)
        return ys[0] if next_norm is None else (ys[0], ys[1])
    h = x + mx.fast.rms_norm(r, *norm)
    return h if next_norm is None else (h, mx.fast.rms_norm(h, *next_norm))
