"""gmlx.kernels.fast: MLX's fast ops as single CPU nodes give what MLX's own composition gives."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import needs_kernels

from gmlx import kernels

pytestmark = needs_kernels

if kernels.available():
    from gmlx.kernels import fast

TOL = 2e-5


def close(a: mx.array, b: mx.array, tol: float = TOL) -> None:
    a_, b_ = np.array(a), np.array(b)
    assert a_.shape == b_.shape and a_.dtype == b_.dtype
    np.testing.assert_allclose(a_, b_, rtol=tol, atol=tol)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(7)


def randn(rng: np.random.Generator, *shape: int) -> mx.array:
    return mx.array(rng.standard_normal(shape).astype(np.float32))


@pytest.fixture(autouse=True)
def installed():
    assert fast.install()
    yield
    fast.install()  # as the session runs (conftest), whatever a test undid


def test_install_routes_mx_fast_and_uninstall_restores():
    assert fast.installed() and mx.fast.rope is fast.rope
    fast.uninstall()
    assert not fast.installed() and mx.fast.rope is fast.ORIGINAL["rope"]


@pytest.mark.parametrize("shape", [(1, 640), (3, 5, 7), (2, 4, 1, 256)])
def test_rms_norm(rng, shape):
    x, w = randn(rng, *shape), randn(rng, shape[-1])
    for weight in (w, None):
        close(mx.fast.rms_norm(x, weight, 1e-6), fast.ORIGINAL["rms_norm"](x, weight, 1e-6))
    xt = randn(rng, 2, 3, 4, 8).transpose(0, 2, 1, 3)  # a strided view, as q_norm sees
    close(mx.fast.rms_norm(xt, None, 1e-5), fast.ORIGINAL["rms_norm"](xt, None, 1e-5))


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("dims", [64, 32])
def test_rope(rng, traditional, dims):
    x = randn(rng, 3, 4, 5, 64)
    offsets = (0, 17, mx.array(9), mx.array([1, 40, 300], mx.int32))
    for offset in offsets:
        kw = dict(traditional=traditional, base=10000.0, scale=0.5, offset=offset)
        close(mx.fast.rope(x, dims, **kw), fast.ORIGINAL["rope"](x, dims, **kw), 1e-4)
    freqs = mx.array(rng.uniform(1, 1000, dims // 2).astype(np.float32))
    kw = dict(traditional=traditional, base=None, scale=1.0, offset=5, freqs=freqs)
    close(mx.fast.rope(x, dims, **kw), fast.ORIGINAL["rope"](x, dims, **kw))


@pytest.mark.parametrize("hq,hkv", [(4, 1), (4, 2), (3, 3)])
@pytest.mark.parametrize("L,D", [(1, 64), (4, 80), (32, 72), (33, 64), (70, 80), (300, 72)])
@pytest.mark.parametrize("B,past", [(2, 33), (1, 290)])
def test_attention_over_a_cache_view(rng, hq, hkv, L, D, B, past, isa):
    # L up to 32: the few-rows (decode) path; from 33, blocks of 64 rows over tiles of 128 keys, with
    # head sizes that leave a vector's and a scalar's tail. One batch row of a long cache: fewer KV
    # heads than threads, so decode splits the keys into parts (the window's first parts see nothing).
    T = L + past
    q = randn(rng, B, hq, L, D)
    kbuf, vbuf = randn(rng, B, hkv, T + 27, D), randn(rng, B, hkv, T + 27, D)
    k, v = kbuf[:, :, :T], vbuf[:, :, :T]  # what a KV cache hands back: a view of its buffer
    pos, key = np.arange(L)[:, None] + T - L, np.arange(T)[None]
    window = (key <= pos) & (key > pos - 40)  # a sliding window: whole tiles of keys closed to a block
    masks = [
        None,
        "causal",
        mx.array(rng.random((B, 1, L, T)) > 0.3),
        randn(rng, L, T),
        mx.array(rng.random((T,)) > 0.5),
        mx.array(window),
        mx.array(np.where(window, 0.0, -np.inf).astype(np.float32)),
    ]
    # a float16 cache's keys and values, read as they lie; keys whose rows are strided are copied first
    k16, v16 = kbuf.astype(mx.float16)[:, :, :T], vbuf.astype(mx.float16)[:, :, :T]
    k16t = mx.swapaxes(mx.contiguous(mx.swapaxes(k16, 2, 3)), 2, 3)
    for mask in masks:
        got = mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask=mask)
        want = fast.ORIGINAL["scaled_dot_product_attention"](q, k, v, scale=D**-0.5, mask=mask)
        close(got, want)
        widened = mx.fast.scaled_dot_product_attention(
            q, k16.astype(mx.float32), v16.astype(mx.float32), scale=D**-0.5, mask=mask
        )
        for kh in (k16, k16t):
            got = mx.fast.scaled_dot_product_attention(q, kh, v16, scale=D**-0.5, mask=mask)
            close(got, widened)


def test_logsumexp_over_a_vocabulary(rng):
    x = randn(rng, 3, 262_144) * 8  # logits over gemma3's vocabulary
    for axis in (-1, 1, [1]):
        for keepdims in (True, False):
            close(
                mx.logsumexp(x, axis=axis, keepdims=keepdims),
                fast.ORIGINAL["logsumexp"](x, axis=axis, keepdims=keepdims),
                1e-5,
            )
    edge = mx.array([[-np.inf, -np.inf], [np.inf, 1.0], [-100.0, -101.0], [1e30, 1.0]], mx.float32)
    close(mx.logsumexp(edge, axis=-1), fast.ORIGINAL["logsumexp"](edge, axis=-1))
    assert np.isnan(np.array(mx.logsumexp(mx.array([1.0, np.nan]), axis=-1)))


@pytest.mark.parametrize("L", [1, 40])
@pytest.mark.parametrize("T", [4, 500])
def test_attention_row_with_nothing_to_attend_is_zero_not_nan(rng, L, T):
    q, k, v = randn(rng, 1, 2, L, 64), randn(rng, 1, 1, T, 64), randn(rng, 1, 1, T, 64)
    out = np.array(mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0, mask=mx.zeros((T,), mx.bool_)))
    assert np.all(out == 0)


def test_other_calls_go_to_mlx(rng, monkeypatch):
    calls = []
    for name in fast.NAMES:
        orig = fast.ORIGINAL[name]
        monkeypatch.setitem(fast.ORIGINAL, name, lambda *a, _o=orig, _n=name, **k: calls.append(_n) or _o(*a, **k))
    x16 = randn(rng, 1, 2, 3, 8).astype(mx.float16)
    mx.fast.rms_norm(x16, None, 1e-5)
    mx.fast.rope(x16, 8, traditional=False, base=1e4, scale=1.0, offset=0)
    mx.fast.scaled_dot_product_attention(x16, x16, x16, scale=1.0, mask="causal")
    mx.logsumexp(randn(rng, 3, 4), axis=0)  # not the last axis
    assert calls == list(fast.NAMES)
    calls.clear()
    mx.fast.rms_norm(randn(rng, 2, 8), None, 1e-5)
    assert calls == []


def composed_heads(x: mx.array, n: int, norm, rope, offset) -> mx.array:
    """What mlx_lm's attention layers compute, node by node: reshape, transpose, rms_norm, rope."""
    B, L, _ = x.shape
    y = x.reshape(B, L, n, -1).transpose(0, 2, 1, 3)
    if norm is not None:
        y = mx.fast.rms_norm(y, *norm)
    return y if rope is None else rope(y, offset=offset)


@pytest.mark.parametrize("L", [1, 5, 70])
def test_heads_are_the_composed_ops_to_the_bit(rng, L, isa):
    # every mix of norm and rope, a partial and a traditional rotation, per-row offsets (a batch
    # cache), and a RoPE of another kind (run after): the same floats as the four nodes composed
    import mlx.nn as nn

    B, n, D = 3, 4, 64
    x = randn(rng, B, L, n * D)
    norm = (randn(rng, D), 1e-6)
    ropes = [None, nn.RoPE(D, base=10000.0), nn.RoPE(32, traditional=True, base=500.0, scale=0.25)]
    ropes.append(lambda y, offset: nn.RoPE(D)(y, offset=offset) * 2.0)  # not an nn.RoPE: applied after
    for rope in ropes:
        for nm in (None, norm):
            for offset in (0, 17, mx.array([1, 40, 300], mx.int32)):
                got = fast.heads(x, n, norm=nm, rope=rope, offset=offset)
                want = composed_heads(x, n, nm, rope, offset)
                assert got.shape == (B, n, L, D)
                assert np.array_equal(np.array(got), np.array(want)), (rope, nm is not None, offset)


def test_add_norm_is_the_composed_ops_to_the_bit(rng, isa):
    x, r = randn(rng, 2, 3, 640), randn(rng, 2, 3, 640)
    norm, nxt = (randn(rng, 640), 1e-6), (randn(rng, 640), 1e-5)
    h = x + mx.fast.rms_norm(r, *norm)
    assert np.array_equal(np.array(fast.add_norm(x, r, norm)), np.array(h))
    y = mx.fast.rms_norm(h, *nxt)
    for operands in ((x, r), (x * 1.0, r * 1.0)):  # the second held by the graph alone: h and y take their buffers
        got_h, got_y = fast.add_norm(*operands, norm, nxt)
        assert np.array_equal(np.array(got_h), np.array(h))
        assert np.array_equal(np.array(got_y), np.array(y))


def test_fused_ops_compose_mlxs_own_where_the_kernels_do_not_run(rng):
    import mlx.nn as nn

    x16, r16 = randn(rng, 1, 2, 64).astype(mx.float16), randn(rng, 1, 2, 64).astype(mx.float16)
    norm = (randn(rng, 16).astype(mx.float16), 1e-6)
    got = fast.heads(x16, 4, norm=norm, rope=nn.RoPE(16), offset=3)
    assert got.dtype == mx.float16
    close(got.astype(mx.float32), composed_heads(x16, 4, norm, nn.RoPE(16), 3).astype(mx.float32))
    norm64 = (randn(rng, 64), 1e-6)
    got = fast.add_norm(x16, r16, norm64)
    assert np.array_equal(np.array(got), np.array(x16 + mx.fast.rms_norm(r16, *norm64)))
    fast.uninstall()  # float32, but the fast ops are not installed (GMLX_FAST_OPS=0)
    x, norm32 = randn(rng, 1, 2, 64), (randn(rng, 16), 1e-6)
    assert np.array_equal(np.array(fast.heads(x, 4, norm=norm32)), np.array(composed_heads(x, 4, norm32, None, 0)))


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_place_rows_is_zeros_with_the_sources_written_in(rng, dtype):
    # A join's buffer (upstream._extend_in_one_copy): 6 decoding rows right-aligned on slot 300,
    # a rotated window's two runs in one row, a joining row; several MiB, in a recycled buffer.
    def rand(*shape: int) -> mx.array:
        return randn(rng, *shape).astype(dtype)

    shape = (8, 2, 1030, 64)
    batch, window, joining = rand(6, 2, 400, 64), rand(1, 2, 512, 64), rand(1, 2, 1030, 64)
    parts = [
        (batch[..., 100:400, :], 0, 0),  # a view: the cache's slots from its oldest
        (window[..., 200:, :], 6, 0),  # a rotated window from its oldest slot, then the rest
        (window[..., :200, :], 6, 312),
        (joining, 7, 0),
    ]
    dirty = mx.ones(shape, dtype) * 3
    mx.eval(dirty)
    del dirty
    got = kernels.place_rows(shape, dtype, parts)
    expected = np.zeros(shape, np.float32)
    for source, row, at in parts:
        expected[row : row + source.shape[0], :, at : at + source.shape[2]] = np.array(source.astype(mx.float32))
    assert got.shape == shape and got.dtype == dtype
    assert np.array_equal(np.array(got.astype(mx.float32)), expected)
    got[1:2, :, 300:301] = mx.ones((1, 2, 1, 64), dtype)  # a decode step writes into it in place
    expected[1:2, :, 300:301] = 1
    assert np.array_equal(np.array(got.astype(mx.float32)), expected)
    empty = kernels.place_rows((0, 2, 4, 8), dtype, [])
    assert empty.shape == (0, 2, 4, 8)


def test_bad_arguments_raise_not_crash(rng):
    ext = kernels.extension()
    source = randn(rng, 1, 2, 4, 8)
    with pytest.raises(ValueError):  # past the output's slots
        ext.place_rows([source], [0], [2], [1, 2, 5, 8], mx.float32)
    with pytest.raises(ValueError):  # two sources on the same slots of a row
        ext.place_rows([source, source], [0, 0], [0, 3], [1, 2, 8, 8], mx.float32)
    with pytest.raises(ValueError):  # another dtype
        ext.place_rows([source], [0], [0], [1, 2, 4, 8], mx.float16)
    with pytest.raises(ValueError):
        ext.rms_norm(randn(rng, 2, 8), randn(rng, 4), 1e-5)
    with pytest.raises(ValueError):
        ext.rope(randn(rng, 1, 2, 8), 7, traditional=False, base=1e4, scale=1.0, offset=0)
    with pytest.raises(ValueError):
        ext.heads(randn(rng, 1, 2, 10), 4)  # 10 features are not 4 heads
    with pytest.raises(ValueError):
        ext.heads(randn(rng, 1, 2, 16), 2, weight=randn(rng, 16))  # the norm is per head: (8,)
    with pytest.raises(ValueError):
        ext.add_norm(randn(rng, 2, 8), randn(rng, 3, 8), randn(rng, 8), 1e-6)
    with pytest.raises(ValueError):
        ext.attention(randn(rng, 1, 3, 1, 8), randn(rng, 1, 2, 4, 8), randn(rng, 1, 2, 4, 8), scale=1.0)
    with pytest.raises(ValueError):
        ext.attention(
            randn(rng, 1, 2, 1, 8),
            randn(rng, 1, 2, 4, 8),
            randn(rng, 1, 2, 4, 8),
            scale=1.0,
            mask=mx.ones((3, 4), mx.bool_),
        )
