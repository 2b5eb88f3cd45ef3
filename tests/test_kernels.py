"""The GGUF block-format matmul (gmlx.kernels): exactness against a float64 reference.

Reference: gguf.quants.dequantize (gguf's own numpy code) in float64, times float64
activations. Bounds, per output y[m, n]:
- float path (any batch; the only path of the generic ISA, and of AVX2, and AVX-512 without
  VNNI, from 64 activation rows, through OpenBLAS's sgemm on dequantized panels where gmlx
  preloaded it): |y - ref| <= BOUND * sum_k |x_k| |w_k| (float32 products summed in
  float32; measured max about 1e-7 for K up to 4096);
- integer path (AVX2 and AVX-512 below 64 activation rows, AVX-512 with VNNI and AMX at any;
  `integer_rows(m)` says which): each
  activation is coded as an integer of `bits` bits with one scale per 32-block (8: llama.cpp's Q8_0
  activations; 16: the default). Add sum over blocks b of (max_b |x| / qmax / 2) * sum_{k in b} |w_k|,
  qmax = 2^(bits-1) - 1 (AMX, 16 bits: 32639).
Dequantized rows must equal gguf's float32 values exactly.
"""

from __future__ import annotations

import os

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize
from mlx.utils import tree_flatten

import gmlx.kernels as gk


@pytest.fixture(autouse=True)
def _needs_kernels(request):
    if not request.node.name.startswith("test_fallback") and not gk.available():
        pytest.skip(f"gguf kernels unavailable: {gk.reason()}")


BOUND = 1e-6
QUANTIZABLE = {T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0}  # gguf.quants.quantize implements these


def random_weights(t: T, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """(n, row_bytes) uint8 rows of type t: quantized from normal floats where gguf can,
    else random bytes with small positive f16 super-block scales (every code pattern occurs)."""
    if t in QUANTIZABLE:
        return quantize(rng.standard_normal((n, k)).astype(np.float32), t)
    bs, ts = GGML_QUANT_SIZES[t]
    nb = n * k // bs
    b = rng.integers(0, 256, size=(nb, ts), dtype=np.uint8)
    cols = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}[t]
    for c in cols:
        b[:, c : c + 2] = rng.uniform(1e-3, 2e-2, size=nb).astype(np.float16).view(np.uint8).reshape(nb, 2)
    return b.reshape(n, -1)


@pytest.fixture(params=[16, 8, 0], ids=["int16", "int8", "float"])
def act_bits(request):
    ext = gk.extension()
    ext.set_act_bits(request.param)
    yield request.param
    ext.set_act_bits(16)


def activation_rounding_bound(x: np.ndarray, wd: np.ndarray, bits: int, isa: str) -> np.ndarray:
    """(m, n): sum over 32-blocks of half an integer code's step of x's block times sum |w| in that block.
    The largest code is 2^(bits - 1) - 1, but 32639 for AMX's 16 bits (two int8 halves, hi = (code + 128) >> 8)."""
    m, k = x.shape
    qmax = 32639 if isa == "amx" and bits == 16 else 2 ** (bits - 1) - 1
    step = np.abs(x.astype(np.float64)).reshape(m, k // 32, 32).max(-1) / qmax
    wabs = np.abs(wd).reshape(wd.shape[0], k // 32, 32).sum(-1)
    return 0.5 * step @ wabs.T


# (N output rows, K, M activation rows): ragged against the 16-row tile, the 4-row and
# 3-row micro-kernel, the integer path's 8-row passes and its end (a last pass of one row: AMX
# lays it out apart), and the single-thread cutoff; K a single block up to 4096.
SHAPES = [
    (1, 256, 1),
    (5, 256, 2),
    (17, 512, 3),
    (37, 768, 4),
    (64, 256, 8),
    (29, 512, 9),
    (33, 1024, 13),
    (23, 512, 63),
    (100, 512, 64),
    (19, 256, 300),
    (130, 4096, 7),
]
# K not a multiple of 256 (32-block types only): the AVX-512 decode path takes 8 blocks at a time,
# then 4, then one by one (K = 640 is gemma3-270m's: 8 + 8 + 4 blocks)
SHAPES_32 = [(21, 96, 1), (40, 640, 8), (7, 352, 2), (18, 640, 5), (9, 224, 3)]


@pytest.fixture(params=[True, False], ids=["blas", "own"])
def blas(request):
    """Prefill (>= 64 rows) through the process's OpenBLAS where gmlx preloaded one, or the own kernel."""
    ext = gk.extension()
    ext.set_blas(request.param)
    if request.param and not ext.blas():
        pytest.skip("no optimized BLAS in this process")
    yield request.param
    ext.set_blas(True)


@pytest.mark.parametrize("t", gk.TYPES, ids=lambda t: t.name)
def test_matmul_matches_float64_reference(t, isa, act_bits, blas):
    rng = np.random.default_rng(int(t))
    for n, k, m in SHAPES + (SHAPES_32 if GGML_QUANT_SIZES[t][0] == 32 else []):
        w = random_weights(t, n, k, rng)
        assert w.shape == (n, gk.row_bytes(t, k))
        wd = dequantize(w, t).reshape(n, k).astype(np.float64)
        x = rng.standard_normal((m, k)).astype(np.float32)
        ref = x.astype(np.float64) @ wd.T
        y = np.array(gk.matmul(mx.array(x), mx.array(w), t, n, k))
        assert y.shape == (m, n) and y.dtype == np.float32
        bound = BOUND * (np.abs(x).astype(np.float64) @ np.abs(wd).T)
        if act_bits and gk.extension().integer_rows(m):
            bound = bound + activation_rounding_bound(x, wd, act_bits, isa)
        worst = np.max(np.abs(y - ref) - bound)
        assert worst <= 0, f"{t.name} {isa} N={n} K={k} M={m}: error over bound by {worst}"


@pytest.mark.parametrize("t", gk.TYPES, ids=lambda t: t.name)
def test_dequant_rows_is_exact(t, isa):
    rng = np.random.default_rng(100 + int(t))
    n, k = 23, 768
    w = random_weights(t, n, k, rng)
    ref = dequantize(w, t).reshape(n, k)
    ids = np.array([[0, 22, 5], [5, 5, 1]])
    rows = np.array(gk.dequant_rows(mx.array(w)[mx.array(ids)], t, k))
    np.testing.assert_array_equal(rows, ref[ids])


def test_leading_dims_dtypes_and_strides():
    rng = np.random.default_rng(7)
    t, n, k = T.Q8_0, 48, 256
    w = random_weights(t, n, k, rng)
    wd = dequantize(w, t).reshape(n, k)
    x = rng.standard_normal((2, 3, k)).astype(np.float32)
    ref = x @ wd.T
    wm = mx.array(w)
    flat = np.array(gk.matmul(mx.array(x.reshape(6, k)), wm, t, n, k))
    bound = BOUND * (np.abs(x) @ np.abs(wd).T).reshape(6, n) + activation_rounding_bound(
        x.reshape(6, k), wd, 16, gk.isa()
    )
    assert np.all(np.abs(flat - ref.reshape(6, n)) <= bound)
    # leading dimensions and a transposed (non-contiguous) input give the same products
    y = gk.matmul(mx.array(x), wm, t, n, k)
    assert y.shape == (2, 3, n)
    assert np.array_equal(np.array(y), flat.reshape(2, 3, n))
    xt = mx.array(np.ascontiguousarray(x.reshape(6, k).T)).T
    assert np.array_equal(np.array(gk.matmul(xt, wm, t, n, k)), flat)
    for dt in (mx.float16, mx.bfloat16):
        yh = gk.matmul(mx.array(x).astype(dt), wm, t, n, k)
        assert yh.dtype == dt
        np.testing.assert_allclose(np.array(yh.astype(mx.float32)), ref, rtol=5e-2, atol=0.5)
    # zero rows
    assert gk.matmul(mx.zeros((0, k)), wm, t, n, k).shape == (0, n)


def test_rejects_bad_shapes():
    w = mx.zeros((4, 34), mx.uint8)
    with pytest.raises(ValueError):
        gk.matmul(mx.zeros((1, 33)), w, T.Q8_0, 4, 32)  # K not x's width
    with pytest.raises(ValueError):
        gk.matmul(mx.zeros((1, 32)), w, T.Q8_0, 5, 32)  # N not w's rows
    with pytest.raises(ValueError):
        gk.matmul(mx.zeros((1, 32)), w, T.Q2_K, 4, 32)  # unsupported type


def test_modules_behave_like_linear_and_embedding():
    import mlx.nn as nn

    rng = np.random.default_rng(3)
    t, n, k = T.Q4_K, 40, 512
    w = random_weights(t, n, k, rng)
    wd = dequantize(w, t).reshape(n, k)
    bias = rng.standard_normal(n).astype(np.float32)
    lin = gk.GGUFLinear(mx.array(w), t, k, bias=mx.array(bias))
    ref = nn.Linear(k, n)
    ref.weight, ref.bias = mx.array(wd), mx.array(bias)
    x = mx.array(rng.standard_normal((3, k)).astype(np.float32))
    expected = np.array(ref(x))
    tol = 1e-4 * np.abs(expected).max()  # the integer decode path: well under 1e-4 of the output scale
    np.testing.assert_allclose(np.array(lin(x)), expected, rtol=0, atol=tol)
    assert lin.trainable_parameters() == {}

    emb = gk.GGUFEmbedding(mx.array(w), t, k)
    ids = mx.array([[3, 0, 39]])
    np.testing.assert_array_equal(np.array(emb(ids)), wd[np.array([[3, 0, 39]])])
    np.testing.assert_allclose(np.array(emb.as_linear(x)), np.array(x) @ wd.T, rtol=0, atol=tol)


PACKABLE = {t: gk.PACKED + t for t in gk.PACKABLE}


def table(t: T, n: int, k: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Random bytes of type t (n, k / 32 * type size), every code occurring, and their float32 values."""
    w = random_weights(t, n, k, rng)
    return w, dequantize(w, t).reshape(n, k).astype(np.float32)


@pytest.mark.parametrize("t", list(PACKABLE), ids=lambda t: t.name)
def test_a_packed_table_looks_up_the_files_rows_exactly(t, isa):
    """The packed layouts move bits only: every row a lookup gathers is the file's row, in any id
    shape, whatever the ISA, those without a packed product included (the lookup and the packing
    are plain code)."""
    rng = np.random.default_rng(11)
    w, wd = table(t, 48, 1024, rng)
    packed = gk.extension().pack(mx.array(w), t)
    assert packed.shape == w.shape and packed.dtype == mx.uint8
    assert not np.array_equal(np.array(packed), w)  # rearranged, not copied
    ids = np.array([[0, 15, 16], [47, 31, 5]])
    for weights, layout in ((packed, PACKABLE[t]), (mx.array(w), int(t))):
        got = gk.extension().gguf_embed(weights, mx.array(ids), layout, 1024, stream=mx.cpu)
        np.testing.assert_array_equal(np.array(got), wd[ids])
    with pytest.raises(ValueError, match="multiple of 16"):
        gk.extension().pack(mx.array(w[:40]), t)
    with pytest.raises(ValueError, match="Q4_0, Q8_0, Q5_0, Q4_K, Q5_K or Q6_K"):
        gk.extension().pack(mx.array(random_weights(T.Q4_1, 16, 1024, rng)), T.Q4_1)
    with pytest.raises(ValueError, match="file's layout only"):
        gk.dequant_rows(packed, PACKABLE[t], 1024)


@pytest.mark.parametrize("t", list(PACKABLE), ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8, 64, 70])
def test_a_packed_weight_gives_the_file_layouts_products(t, rows, act_bits, isa):
    """Where the kernels take a packed layout (avx2, avx512, avx512vnni), its products stay within
    the integer path's bound of the float64 reference. With VNNI they are the file layout's floats
    wherever both run the grouped kernel on the same codes (from 4 rows, or any with 8-bit codes);
    the file's rows otherwise go row by row, summed in another order. A packed Q5_0 weight always
    meets 16-bit codes."""
    ext = gk.extension()
    if not ext.packs(t):
        pytest.skip(f"the {isa} kernels do not take packed {t.name}")
    rng = np.random.default_rng(rows)
    n, k = 96, 1024
    w, wd = table(t, n, k, rng)
    x = mx.array(rng.standard_normal((rows, k)).astype(np.float32))
    got = np.array(gk.matmul(x, ext.pack(mx.array(w), t), PACKABLE[t], n, k))
    bits = 16 if act_bits == 0 or t != T.Q8_0 else act_bits  # a packed weight always takes the integer path
    if isa == "avx512vnni" and bits == act_bits and (bits == 8 or rows >= 4):
        np.testing.assert_array_equal(got, np.array(gk.matmul(x, mx.array(w), t, n, k)))
    xb = np.abs(np.array(x)).reshape(rows, k // 32, 32).max(axis=2) / (2 ** (bits - 1) - 1) / 2
    bound = (np.abs(np.array(x)) @ np.abs(wd).T) * BOUND + xb @ np.abs(wd).reshape(n, k // 32, 32).sum(2).T
    assert (np.abs(got - np.array(x, dtype=np.float64) @ wd.T.astype(np.float64)) <= bound * 1.01).all()


@pytest.mark.parametrize("t", list(PACKABLE), ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 5, 70])
def test_a_packed_weight_gives_the_same_floats_on_every_isa_that_takes_it(t, rows, act_bits):
    """The packed kernels sum each block's integers exactly and scale them in one order, so
    AVX2's (madd), AVX-512's and VNNI's (dpwssd) agree to the bit, and AMX hands fewer than 16 rows
    to VNNI's (more may take its tiles, whose 16-bit codes stop at 32639): a server's decode steps
    do not depend on which of them the CPU has."""
    ext = gk.extension()
    rng = np.random.default_rng(rows)
    w, _ = table(t, 64, 1024, rng)
    packed = ext.pack(mx.array(w), t)
    x = mx.array(rng.standard_normal((rows, 1024)).astype(np.float32))
    outs = {}
    try:
        for name in ("avx2", "avx512", "avx512vnni") + (("amx",) if rows < 16 else ()):
            if ext.set_isa(name) == name and ext.packs(t):
                outs[name] = np.array(gk.matmul(x, packed, PACKABLE[t], 64, 1024))
    finally:
        ext.set_isa("")
    if len(outs) < 2:
        pytest.skip(f"one ISA here takes packed {t.name}: {list(outs)}")
    first, *rest = outs.values()
    for out in rest:
        np.testing.assert_array_equal(out, first)


@pytest.mark.parametrize("t", list(PACKABLE), ids=lambda t: t.name)
def test_a_packed_weight_refuses_an_isa_without_its_kernel(t):
    ext = gk.extension()
    if not ext.packs(t):
        pytest.skip(f"the {gk.isa()} kernels do not take packed {t.name}")
    w = random_weights(t, 32, 256, np.random.default_rng(0))
    packed = ext.pack(mx.array(w), t)
    try:
        ext.set_isa("generic")
        with pytest.raises(ValueError, match="do not take this packed layout"):
            gk.matmul(mx.zeros((1, 256)), packed, PACKABLE[t], 32, 256)
    finally:
        ext.set_isa("")


@pytest.mark.parametrize("t", list(PACKABLE), ids=lambda t: t.name)
def test_an_embedding_packs_its_table_only_where_the_kernels_take_it(t, monkeypatch):
    """A tied head of any packable type (Q8_0 as the default model's, Q6_K as many K-quant files')
    is packed where the kernels take it; lookups still give the file's rows, and the head's
    products are the file layout's (to the bit with VNNI's grouped kernel, at 8 rows)."""
    rng = np.random.default_rng(12)
    w, wd = table(t, 64, 256, rng)
    x = mx.array(rng.standard_normal((8, 256)).astype(np.float32))
    emb = gk.GGUFEmbedding(mx.array(w), t, 256)
    affinity = getattr(os, "sched_getaffinity", lambda _: None)  # Linux
    cpus = affinity(0)
    assert emb.pack() == gk.extension().packs(t)
    assert affinity(0) == cpus  # the loading thread (the engine's) keeps every CPU
    assert emb.ggml_type == t
    assert (emb.kernel_type == PACKABLE[t]) == gk.extension().packs(t)
    assert not emb.pack()  # once
    monkeypatch.setenv("GMLX_KERNELS_PACK", "0")
    plain = gk.GGUFEmbedding(mx.array(w), t, 256)
    assert not plain.pack()
    assert plain.kernel_type == t and np.array_equal(np.array(plain.weight), w)
    np.testing.assert_array_equal(np.array(emb(mx.array([[1, 63]]))), wd[[[1, 63]]])
    head, plain_head = np.array(emb.as_linear(x)), np.array(plain.as_linear(x))
    atol = 1e-5 * np.abs(plain_head).max()
    if gk.isa() == "avx512vnni":
        np.testing.assert_array_equal(head, plain_head)
    elif gk.isa() == "amx":  # the packed head takes VNNI's codes, the file's AMX's: each rounds on its own
        step = np.abs(np.array(x)).reshape(8, -1, 32).max(2) / 32639 / 2
        atol = atol + 2 * step @ np.abs(wd).reshape(64, -1, 32).sum(2).T
    assert (np.abs(head - plain_head) <= atol).all()


@pytest.mark.parametrize("rows", [1, 8, 80], ids=["decode", "decode8", "prefill"])
def test_packed_linears_in_a_group_and_a_fused_mlp_give_the_file_layouts_products(rows):
    """pack_weights packs the linears whose layout the kernels take (Q5_0, Q8_0, Q4_K here; 24 rows
    is no whole group) and leaves the rest; grouped and fused, each product stays the file layout's
    within the integer codes' rounding, and a packed Q5_0 weight keeps 16-bit codes when 8 are asked for."""
    ext = gk.extension()
    rng = np.random.default_rng(21)
    k = 640
    specs = [(T.Q5_0, 64), (T.Q5_0, 24), (T.Q8_0, 32)]
    ws = [random_weights(t, n, k, rng) for t, n in specs]
    attn = nn.Module()
    attn.q_proj, attn.k_proj, attn.v_proj = (gk.GGUFLinear(mx.array(w), t, k) for w, (t, _) in zip(ws, specs))
    mlp, _ = _mlp(rng, k, 1024, (T.Q5_0, T.Q5_0, T.Q4_K))
    fused = gk.GatedMLP(mlp.gate_proj, mlp.up_proj, mlp.down_proj, "gelu_approx")
    model = nn.Module()
    model.attn, model.mlp = attn, fused
    gk.group_linears(attn)
    x = mx.array(rng.standard_normal((rows, k)).astype(np.float32))
    before = [np.array(y) for y in (attn.q_proj(x), attn.k_proj(x), attn.v_proj(x), fused(x))]
    packed = gk.pack_weights(model)
    wanted = [ext.packs(T.Q5_0), False, ext.packs(T.Q8_0), ext.packs(T.Q5_0), ext.packs(T.Q5_0), ext.packs(T.Q4_K)]
    linears = [attn.q_proj, attn.k_proj, attn.v_proj, fused.gate_proj, fused.up_proj, fused.down_proj]
    assert [m.kernel_type > gk.PACKED for m in linears] == wanted and packed == sum(wanted)
    assert all(m.ggml_type < gk.PACKED for m in linears)
    after = {}
    try:
        for bits in (16, 8):
            ext.set_act_bits(bits)
            after[bits] = [np.array(y) for y in (attn.q_proj(x), attn.k_proj(x), attn.v_proj(x), fused(x))]
            for a, b in zip(after[bits], before):
                np.testing.assert_allclose(a, b, rtol=0, atol=(1e-4 if bits == 16 else 0.05) * np.abs(b).max())
    finally:
        ext.set_act_bits(16)
    assert np.array_equal(after[8][0], after[16][0]) == ext.packs(T.Q5_0)


def _vma(address: int) -> dict[str, str]:
    """The smaps entry of this process's mapping that holds `address` (Linux): its name ("" where
    anonymous), VmFlags and sizes."""
    entry: dict[str, str] | None = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head, *rest = line.split()
            if "-" in head and not head.endswith(":"):
                if entry is not None:
                    break
                lo, hi = (int(v, 16) for v in head.split("-"))
                entry = {"name": rest[4] if len(rest) > 4 else ""} if lo <= address < hi else None
            elif entry is not None:
                entry[head.rstrip(":")] = " ".join(rest)
    if entry is None:
        raise LookupError(hex(address))
    return entry


def _in_huge_pages(address: int) -> bool:
    """Backed by huge pages now, or advised so that khugepaged collapses it (no huge page was free)."""
    vma = _vma(address)
    return int(vma["AnonHugePages"].split()[0]) > 0 or "hg" in vma["VmFlags"].split()


class _Weights(nn.Module):
    def __init__(self, rng: np.random.Generator):
        super().__init__()
        self.layers = [{"w": mx.array(rng.integers(0, 256, (n, 1024), dtype=np.uint8))} for n in (6144, 6144, 6000, 96)]
        self.norm = mx.array(rng.standard_normal(333).astype(np.float32))


@pytest.mark.skipif(not gk._huge_pages_allowed(), reason="no transparent huge pages here (not Linux, or `never`)")
def test_weights_move_unchanged_into_huge_pages_a_group_at_a_time(monkeypatch, tmp_path):
    """The loader moves every parameter into buffers in transparent huge pages (a
    decode step streams them all); the values stay, each old buffer is freed a group at a time,
    so the move never holds the weights twice; GMLX_KERNELS_HUGE_PAGES=0 leaves them, as does a
    kernel whose setting is `never`."""
    m = _Weights(np.random.default_rng(3))
    before = {name: np.array(a) for name, a in tree_flatten(m.parameters())}
    monkeypatch.setenv("GMLX_KERNELS_HUGE_PAGES", "0")
    assert gk.in_huge_pages(m) == 0
    monkeypatch.delenv("GMLX_KERNELS_HUGE_PAGES")
    never = tmp_path / "enabled"
    never.write_text("always madvise [never]\n")  # the kernel gives none: copying would gain nothing
    with monkeypatch.context() as patch:
        patch.setattr(gk, "THP_ENABLED", str(never))
        assert gk.in_huge_pages(m) == 0
    mx.clear_cache()
    mx.reset_peak_memory()
    start = mx.get_active_memory()
    total = sum(v.nbytes for v in before.values())
    assert gk.in_huge_pages(m, group_bytes=8 << 20) == total
    # Over what was held: the largest group (6 MiB: the three large arrays go one at a time), and
    # each of three buffers' room to start at a huge page; holding them twice would add all 18 MiB.
    assert mx.get_peak_memory() - start <= (6 << 20) + 3 * (2 << 20) + (64 << 10) < total
    after = dict(tree_flatten(m.parameters()))
    assert all(np.array_equal(np.array(after[name]), v) for name, v in before.items())
    for name in ("layers.0.w", "layers.1.w", "layers.2.w"):  # each spans a 2 MiB page of its buffer
        assert _in_huge_pages(np.asarray(memoryview(after[name])).ctypes.data), name


HEAP_AFTER_HUGE_PAGES = """
import sys
import numpy as np
import mlx.core as mx
import gmlx.kernels as gk
sys.path.insert(0, "tests")
from test_kernels import _Weights, _in_huge_pages, _vma

def advised(address):
    try:
        return "hg" in _vma(address)["VmFlags"].split()
    except LookupError:  # unmapped
        return False

big = np.ones(24 << 20, np.uint8)  # NumPy would advise an array this large
print(advised(big.ctypes.data + (4 << 20)), end=" ")
del big
blocks = [bytearray(100_000) for _ in range(400)]  # under glibc's threshold: from the heap
keep = bytearray(100_000)  # so that freeing the blocks leaves 40 MB free inside the heap
del blocks
m = _Weights(np.random.default_rng(3))
gk.in_huge_pages(m, group_bytes=8 << 20)
at = np.asarray(memoryview(m.layers[0]["w"])).ctypes.data
print(_vma(at)["name"] or "-", _in_huge_pages(at), end=" ")
del m
mx.clear_cache()
print(advised(at))
"""


@pytest.mark.skipif(not gk._huge_pages_allowed(), reason="no transparent huge pages here (not Linux, or `never`)")
def test_no_heap_memory_is_left_advised_for_huge_pages():
    """glibc serves a request from free heap space whatever its size, and advice on heap memory
    outlives the buffer: whatever the heap put there later faulted in 2 MiB pages (after the test
    suite's other tests, one stream's resident size read 1.53x the plan where MLX's figure was
    within it). So the weights' buffers are collapsed into huge pages, not advised, and NumPy, which
    advises its arrays of 4 MiB and more, is told not to as gmlx is imported."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", HEAP_AFTER_HUGE_PAGES], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "[heap]", "True", "False"], r.stdout


@pytest.mark.parametrize("rows", [1, 3, 80], ids=["decode", "decode3", "prefill"])
def test_grouped_linears_give_each_members_own_product(rows):
    """q, k and v as one group (mixed types, a bias), called as mlx_lm's attention calls them,
    in another order, and with a different input per member: each gets its own x @ W.T."""
    import mlx.nn as nn

    rng = np.random.default_rng(5)
    k = 256
    specs = [(T.Q5_0, 64), (T.Q4_K, 32), (T.Q8_0, 32)]
    ws = [random_weights(t, n, k, rng) for t, n in specs]
    members = [gk.GGUFLinear(mx.array(w), t, k) for w, (t, _) in zip(ws, specs)]
    members[2] = gk.GGUFLinear(mx.array(ws[2]), T.Q8_0, k, bias=mx.array(np.ones(32, np.float32)))
    parent = nn.Module()
    parent.q_proj, parent.k_proj, parent.v_proj = members
    assert gk.group_linears(parent) == 1 and members[0].group is members[1].group

    def alone(i: int, x: mx.array) -> np.ndarray:
        return np.array(gk.matmul(x, members[i].weight, specs[i][0], specs[i][1], k)) + (1.0 if i == 2 else 0.0)

    x, x2 = (mx.array(rng.standard_normal((rows, k)).astype(np.float32)) for _ in range(2))
    for order in ([0, 1, 2], [2, 0, 1]):
        outs = {i: np.array(members[i](x)) for i in order}
        for i in range(3):
            np.testing.assert_allclose(outs[i], alone(i, x), rtol=0, atol=1e-5)
    q, k_other = members[0](x), members[1](x2)  # a member called on another input computes its own
    np.testing.assert_allclose(np.array(k_other), alone(1, x2), rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.array(q), alone(0, x), rtol=0, atol=1e-5)


def _mlp(rng, k: int, n: int, types=(T.Q5_0, T.Q4_K, T.Q6_K)):
    import mlx.nn as nn

    ws = [random_weights(types[0], n, k, rng), random_weights(types[1], n, k, rng), random_weights(types[2], k, n, rng)]
    module = nn.Module()
    module.gate_proj, module.up_proj, module.down_proj = (
        gk.GGUFLinear(mx.array(w), t, kk) for w, t, kk in zip(ws, types, (k, k, n))
    )
    floats = [dequantize(w, t).reshape(w.shape[0], -1) for w, t in zip(ws, types)]
    return module, floats


@pytest.mark.parametrize("act", list(gk.ACTIVATIONS))
@pytest.mark.parametrize("rows", [1, 3, 80], ids=["decode", "decode3", "prefill"])
def test_gated_mlp_is_one_node_computing_down_of_act_gate_times_up(act, rows):
    import mlx.nn as nn

    rng = np.random.default_rng(11)
    k, n = 256, 512
    module, (g, u, d) = _mlp(rng, k, n)
    fused = gk.GatedMLP(module.gate_proj, module.up_proj, module.down_proj, act)
    # inputs wide enough that the activation's tails (silu -> 0 and x, tanh -> -1 and 1) matter
    x = rng.standard_normal((rows, k)).astype(np.float32) * 4
    h = getattr(nn, act)(mx.array(x @ g.T)) * mx.array(x @ u.T)
    expected = np.array(h) @ d.T
    got = np.array(fused(mx.array(x)))
    assert got.shape == (rows, k)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4 * np.abs(expected).max())
    assert dict(fused.parameters()).keys() == dict(module.parameters()).keys()


def test_fuse_mlps_takes_the_activation_the_module_computes_and_leaves_others_alone():
    import mlx.nn as nn

    class SiluMLP(nn.Module):
        def __call__(self, x):
            return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))

    class GeluMLP(SiluMLP):
        def __call__(self, x):
            return self.down_proj(nn.gelu_approx(self.gate_proj(x)) * self.up_proj(x))

    class ReluMLP(SiluMLP):
        def __call__(self, x):
            return self.down_proj(nn.relu(self.gate_proj(x)) * self.up_proj(x))

    rng = np.random.default_rng(12)
    model = nn.Module()
    model.layers = []
    for cls in (SiluMLP, GeluMLP, ReluMLP):
        proto, _ = _mlp(rng, 256, 256)
        mlp = cls()
        mlp.gate_proj, mlp.up_proj, mlp.down_proj = proto.gate_proj, proto.up_proj, proto.down_proj
        model.layers.append(mlp)
    x = mx.array(rng.standard_normal((2, 256)).astype(np.float32))
    before = [np.array(m(x)) for m in model.layers]
    assert gk.fuse_mlps(model) == 2
    assert [type(m).__name__ for m in model.layers] == ["GatedMLP", "GatedMLP", "ReluMLP"]
    assert [m.act for m in model.layers[:2]] == ["silu", "gelu_approx"]
    for m, b in zip(model.layers, before):
        np.testing.assert_allclose(np.array(m(x)), b, rtol=0, atol=1e-4 * np.abs(b).max())


# ---- whole models in `gguf` mode ----

MODEL_TYPES = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K]
PROMPT = [2, 10, 20, 30, 40, 50]


def _logits(path, weights: str) -> np.ndarray:
    from gmlx.models.loader import load

    m = load(path, weights)
    assert m.mode == weights
    return np.array(m.model(mx.array([PROMPT]))[0].astype(mx.float32))


@pytest.mark.parametrize("qtype", MODEL_TYPES, ids=lambda q: q.name)
def test_tiny_model_gguf_mode_matches_float(tmp_path, qtype):
    from tiny_models import write_model

    path = write_model(tmp_path / f"{qtype.name}.gguf", "llama", qtype=qtype)
    blocks, floats = _logits(path, "gguf"), _logits(path, "float")
    # 6 prompt rows take the integer decode path; random-weight models amplify its ~1e-5 error
    assert np.abs(blocks - floats).max() <= 5e-4 * np.abs(floats).max()
    assert (blocks.argmax(-1) == floats.argmax(-1)).all()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_every_architectures_mlps_run_fused_in_gguf_mode(tmp_path, arch):
    from tiny_models import write_model

    from gmlx.models.loader import load

    path = write_model(tmp_path / f"{arch}.gguf", arch, qtype=T.Q8_0)
    m = load(path, "gguf")
    acts = {mod.act for _, mod in m.model.named_modules() if isinstance(mod, gk.GatedMLP)}
    assert len([1 for _, mod in m.model.named_modules() if isinstance(mod, gk.GatedMLP)]) == len(m.model.layers)
    assert acts == {"gelu_approx" if arch == "gemma3" else "silu"}
    blocks, floats = _logits(path, "gguf"), _logits(path, "float")
    assert np.abs(blocks - floats).max() <= 5e-4 * np.abs(floats).max()


@pytest.mark.parametrize("tied", [True, False])
def test_gguf_mode_layers_resident_bytes_and_biases(tmp_path, tied):
    from tiny_models import write_model

    from gmlx.gguf.header import read_header
    from gmlx.models.loader import load
    from gmlx.models.weights_mode import resident_bytes

    path = write_model(tmp_path / "m.gguf", "qwen2", qtype=T.Q8_0, tied=tied)  # qwen2: biased QKV
    m = load(path, "gguf")
    inner = m.model.model
    assert isinstance(inner.embed_tokens, gk.GGUFEmbedding)
    assert isinstance(inner.layers[0].self_attn.q_proj, gk.GGUFLinear)
    assert "bias" in inner.layers[0].self_attn.q_proj
    assert isinstance(dict(m.model.children()).get("lm_head"), gk.GGUFLinear) is not tied
    h = read_header(path)
    assert m.report.resident_bytes == resident_bytes(h, "gguf")
    blocks, floats = _logits(path, "gguf"), _logits(path, "float")
    assert np.abs(blocks - floats).max() <= 5e-4 * np.abs(floats).max()


@pytest.mark.slow
def test_default_model_gguf_mode_matches_float_and_writes_about_the_sea(default_model):
    """The default model (Q8_0/Q5_0/Q4_K/Q6_K) in gguf mode: the same greedy text as the other
    modes (the loader's llama.cpp-checked prompt), and next-token logits that agree with the
    float32 model (itself within KL 0.005 of llama.cpp's) on the top 10."""
    from mlx_lm import generate

    from gmlx.gguf.header import read_header
    from gmlx.models.loader import load

    g = load(default_model, "gguf")
    tensor_bytes = sum(t.nbytes for t in read_header(default_model).tensors.values())
    assert abs(g.report.resident_bytes - tensor_bytes) <= 0.05 * tensor_bytes
    prompt = g.tokenizer.encode("Here is a short poem about the sea:\n")
    text = generate(g.model, g.tokenizer, prompt, max_tokens=8)
    assert text.startswith("The sea is a beautiful place"), text

    ids = mx.array([g.tokenizer.encode("The capital of France is")])
    lg = np.array(g.model(ids)[0, -1].astype(mx.float32), np.float64)
    del g
    f = load(default_model, "float")
    lf = np.array(f.model(ids)[0, -1].astype(mx.float32), np.float64)
    top_g, top_f = np.argsort(-lg)[:10], np.argsort(-lf)[:10]
    assert top_g[0] == top_f[0] and len(set(top_g) & set(top_f)) >= 9
    pg, pf = np.exp(lg - lg.max()), np.exp(lf - lf.max())
    pg, pf = pg / pg.sum(), pf / pf.sum()
    assert float(np.sum(pf * (np.log(pf + 1e-30) - np.log(pg + 1e-30)))) < 1e-3


def test_fallback_without_the_extension_uses_mlx_kernels_and_says_why(tmp_path):
    """Where the extension cannot load, gmlx imports, `auto` keeps MLX's own kernels,
    inspect names the reason, and asking for gguf mode is a clear error."""
    import subprocess
    import sys

    code = """
import json
import gmlx.kernels as k
from gmlx.cli.inspect import describe
from gmlx.gguf.header import GGUFError
from gmlx.models.loader import load
from gmlx.models.weights_mode import choose_mode
from gmlx.gguf.header import read_header
import sys
sys.path.insert(0, "tests")
from tiny_models import write_model
from gguf import GGMLQuantizationType as Q
path = write_model(sys.argv[1], "llama", qtype=Q.Q8_0)
out = {"available": k.available(), "reason": k.reason(), "auto": choose_mode("auto", read_header(path)),
       "inspect": describe(str(path), "auto")["platform"]["gguf_kernels"]}
try:
    load(path, "gguf")
    out["gguf"] = "loaded"
except GGUFError as e:
    out["gguf"] = str(e)
print(json.dumps(out))
"""
    env = {**__import__("os").environ, "GMLX_KERNELS_EXT": str(tmp_path / "missing" / "_ext.so")}
    r = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "m.gguf")], capture_output=True, text=True, env=env, timeout=300
    )
    assert r.returncode == 0, r.stderr
    import json

    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["available"] is False and "not built or not loadable" in out["reason"]
    assert out["auto"] in ("float", "native")
    assert out["inspect"]["isa"] is None and out["inspect"]["reason"] == out["reason"]
    assert out["gguf"].startswith("weights mode gguf is not available here")


PINNED_THREADS = """
import os, sys
import numpy as np
import mlx.core as mx
import gmlx.kernels as gk
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import quantize
w = mx.array(quantize(np.ones((4096, 256), np.float32), T.Q8_0))
mx.eval(gk.matmul(mx.ones((1, 256)), w, T.Q8_0, 4096, 256))  # a parallel region: 1M multiply-adds
for tid in os.listdir("/proc/self/task"):
    status = open(f"/proc/self/task/{tid}/status").read()
    print(status.split("Cpus_allowed_list:")[1].split()[0])
"""


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_getaffinity"), reason="thread affinity is Linux's")
@pytest.mark.parametrize("setting", ["default", "pin off", "more threads than cpus"])
def test_the_kernels_threads_each_keep_a_cpu_of_their_own_where_they_use_them_all(setting):
    """A parallel kernel's threads are pinned one to a CPU, the process's first CPUs in order (the
    engine thread's graph building no longer moves them about). GMLX_KERNELS_PIN=0 leaves every
    thread to the scheduler, as does a thread count other than the process's CPUs."""
    import os
    import subprocess
    import sys

    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs 2 CPUs")
    env = {k: v for k, v in os.environ.items() if k not in ("GMLX_KERNELS_THREADS", "GMLX_KERNELS_PIN")}
    env |= {
        "pin off": {"GMLX_KERNELS_PIN": "0"},
        "more threads than cpus": {"GMLX_KERNELS_THREADS": str(len(allowed) + 1)},
    }.get(setting, {})
    r = subprocess.run([sys.executable, "-c", PINNED_THREADS], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    masks = r.stdout.split()
    single = sorted(int(m) for m in masks if "," not in m and "-" not in m)
    if setting == "default":
        assert len(single) >= 2 and single == allowed[: len(single)], masks
    else:
        assert single == [], masks


def test_parallel_regions_from_several_streams_at_once_each_get_their_own_product():
    """Several MLX streams (several models, a drafter) run the kernels' parallel regions at the same
    time: the pool runs them one after another, and each caller gets its own product, every time."""
    import threading

    rng = np.random.default_rng(7)
    n, k = 2048, 512
    w = mx.array(quantize(rng.standard_normal((n, k)).astype(np.float32), T.Q8_0))
    xs = [mx.array(rng.standard_normal((rows, k)).astype(np.float32)) for rows in (1, 3, 8, 64)]
    want = [np.array(gk.matmul(x, w, T.Q8_0, n, k)) for x in xs]
    failures: list[str] = []

    def caller(i: int) -> None:
        with mx.stream(mx.new_stream(mx.cpu)):
            for r in range(40):
                j = (i + r) % len(xs)
                got = np.array(gk.matmul(xs[j], w, T.Q8_0, n, k))
                if not np.array_equal(got, want[j]):
                    failures.append(f"caller {i}, round {r}: rows {xs[j].shape[0]} differ")

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a caller never returned"
    assert failures == []


def _settled_scratch_bytes() -> int:
    """The scratch count once the pool's workers have dropped what they were woken to drop."""
    import time

    last, deadline = gk.scratch_bytes(), time.monotonic() + 30
    while time.monotonic() < deadline:
        time.sleep(0.05)
        if (now := gk.scratch_bytes()) == last:
            break
        last = now
    return last


def test_released_scratch_is_freed_by_the_threads_that_run_no_kernel_after():
    """A prompt-sized matmul grows the scratch of the threads that run it (the stream's thread and
    the pool's workers). Released, it is freed once the work queued on the stream is done, though
    no kernel runs after it: an engine left idle after a prompt keeps none (decision 39)."""
    rng = np.random.default_rng(3)
    n, k, rows = 2048, 512, 256
    w = mx.array(quantize(rng.standard_normal((n, k)).astype(np.float32), T.Q8_0))
    x = mx.array(rng.standard_normal((rows, k)).astype(np.float32))
    stream = mx.new_stream(mx.cpu)
    gk.release_scratch([stream])
    mx.synchronize(stream)
    before = _settled_scratch_bytes()
    with mx.stream(stream):
        mx.eval(gk.matmul(x, w, T.Q8_0, n, k))
    grown = gk.scratch_bytes() - before
    assert grown >= rows * k, grown  # at least the activations' codes or a float panel
    gk.release_scratch([stream])
    mx.synchronize(stream)
    assert _settled_scratch_bytes() <= before, (before, grown, gk.scratch_bytes())
