"""MLX's fast ops (rms_norm, rope, scaled_dot_product_attention) and logsumexp as single,
vectorized CPU graph nodes.

MLX has no CPU kernels for the fast ops: on the CPU each call is composed from 8 to 25 graph
nodes, and a decode step of a small model then spends more time scheduling thousands of
nodes than computing (gemma3-270m: 3,338 nodes a step, 553 with these). Its CPU logsumexp
takes a scalar exp, and mlx_lm's BatchGenerator normalizes every step's logits with it: 38 ms
a step for 8 rows of a 262,144-token vocabulary, 0.9 ms here. install() points mx.fast and
mx.logsumexp at dispatchers that send the calls gmlx.kernels handles (float32 on the CPU;
logsumexp over the last axis) to its own primitives and every other call to MLX's, so
mlx_lm's code is unchanged. GMLX_FAST_OPS=0 keeps MLX's own. Attention takes a few query
rows (decode, speculative verification) by KV-head group, and more (prefill) as flash
attention over tiles of keys: MLX materializes every score, causal or not (gemma3-270m's
layer at 511 tokens: 16.7 ms there, 4.5 ms here; at 2,048: 290 and 63 ms).
"""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx

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
    ours = (
        _cpu(stream)
        and _f32(a, freqs)
        and a.ndim >= 3
        and dims % 2 == 0
        and 0 < dims <= a.shape[-1]
        and (base is None) != (freqs is None)
        and (isinstance(offset, int) or offset.size == 1 or offset.shape == (a.shape[0],))
    )
    if ours:
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
        and _f32(q, k, v)
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
