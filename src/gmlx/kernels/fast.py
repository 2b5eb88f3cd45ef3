"""MLX's fast ops (rms_norm, rope, scaled_dot_product_attention) as single CPU graph nodes.

MLX has no CPU kernels for these: on the CPU each call is composed from 8 to 25 graph
nodes, and a decode step of a small model then spends more time scheduling thousands of
nodes than computing (gemma3-270m: 3,338 nodes a step, 1,100 of them here). install()
points mx.fast at dispatchers that send the calls gmlx.kernels handles (float32 on the CPU;
attention for up to MAX_QUERY_ROWS query rows, where decode and speculative verification
live) to its own primitives and every other call to MLX's, so mlx_lm's model code is
unchanged. GMLX_FAST_OPS=0 keeps MLX's own.
"""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx

from gmlx import kernels

NAMES = ("rms_norm", "rope", "scaled_dot_product_attention")
# MLX's own, as found before install(): every call gmlx does not handle goes here.
ORIGINAL: dict[str, Any] = {name: getattr(mx.fast, name) for name in NAMES}
# Longer queries (prefill) are matmul-bound: MLX's composition runs them through BLAS.
MAX_QUERY_ROWS = 32


def enabled() -> bool:
    return os.environ.get("GMLX_FAST_OPS", "1") != "0" and kernels.available()


def installed() -> bool:
    return mx.fast.rms_norm is rms_norm


def install() -> bool:
    """Route mx.fast's ops to gmlx.kernels where they apply; True when installed."""
    if not enabled():
        return False
    for name in NAMES:
        setattr(mx.fast, name, globals()[name])
    return True


def uninstall() -> None:
    for name in NAMES:
        setattr(mx.fast, name, ORIGINAL[name])


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


def rope(a: mx.array, dims: int, *, traditional: bool, base: float | None, scale: float,
         offset: int | mx.array, freqs: mx.array | None = None, stream: Any = None) -> mx.array:
    ours = (_cpu(stream) and _f32(a, freqs) and a.ndim >= 3 and dims % 2 == 0 and 0 < dims <= a.shape[-1]
            and (base is None) != (freqs is None)
            and (isinstance(offset, int) or offset.size == 1 or offset.shape == (a.shape[0],)))
    if ours:
        return kernels.extension().rope(a, dims, traditional=traditional, base=base, scale=scale, offset=offset,
                                        freqs=freqs, stream=mx.cpu)
    return ORIGINAL["rope"](a, dims, traditional=traditional, base=base, scale=scale, offset=offset, freqs=freqs,
                            stream=stream)


def scaled_dot_product_attention(q: mx.array, k: mx.array, v: mx.array, *, scale: float,
                                 mask: mx.array | str | None = None, sinks: mx.array | None = None,
                                 stream: Any = None) -> mx.array:
    causal = isinstance(mask, str) and mask == "causal"
    array_mask = mask if isinstance(mask, mx.array) else None
    ours = (_cpu(stream) and sinks is None and _f32(q, k, v) and q.ndim == 4 and k.ndim == 4
            and k.shape == v.shape and q.shape[2] <= MAX_QUERY_ROWS and q.shape[0] == k.shape[0]
            and q.shape[-1] == k.shape[-1] and q.shape[1] % k.shape[1] == 0
            and (mask is None or causal or (array_mask is not None and array_mask.ndim <= 4
                                            and array_mask.dtype in (mx.bool_, mx.float32)))
            and (not causal or q.shape[2] <= k.shape[2]))
    if ours:
        return kernels.extension().attention(q, k, v, scale=scale, mask=array_mask, causal=causal, stream=mx.cpu)
    return ORIGINAL["scaled_dot_product_attention"](q, k, v, scale=scale, mask=mask, sinks=sinks, stream=stream)
