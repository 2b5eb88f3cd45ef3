"""Quantized matmul over GGUF block formats for MLX on the CPU (the `gguf` weight mode).

The compiled part, `gmlx.kernels._ext`, is built by the package's own build
(scikit-build-core + CMake, csrc/). It is optional: where it was not built (no
compiler), cannot load (an MLX version other than the one it was built against), or
does not apply (MLX's default device is a GPU), `available()` is False, `reason()`
says why, and gmlx runs on MLX's own kernels.

GGUFLinear and GGUFEmbedding hold the tensor's bytes as one uint8 MLX array
(N rows of K / block_size * type_size bytes), so resident memory equals the
file's tensor bytes; mlx_lm's model code calls them like nn.Linear / nn.Embedding.
Linears that take one input (q, k, v; gate, up) form a LinearGroup: one graph node for
all of them; and an MLP down(act(gate(x)) * up(x)) becomes one GatedMLP node (fuse_mlps,
with a vectorized activation where MLX's CPU backend calls a scalar tanh). gmlx.kernels.fast
does the same for MLX's norms, RoPE and attention.

Paths (a header each in csrc/kernels/; csrc/kernels_impl.cpp picks them): for fewer than 64
activation rows (decode, short prompts, speculative verification), each activation is coded as a
16-bit integer with one scale per
32-block (error about 1/65000 of the block's max) and each weight block, unpacked once to
int16, meets 8 rows at a time in integer dot products (AVX2/AVX-512 madd); more rows (prefill)
go through OpenBLAS's sgemm on dequantized panels, or without it dequantize 16 weight rows at a
time to float for a register-blocked FMA micro-kernel. Where the CPU has AMX's int8 tiles (Intel
Sapphire Rapids on) and Linux grants them, every batch takes the integer path as tile products:
the same 16-bit codes split into two int8 halves, 16 weight rows' blocks against 8 rows of x;
packed weights (see packs) take AVX-512 VNNI's kernels there at decode's few rows, the tiles for prompts.
Knobs, for tests and benchmarks:
GMLX_KERNELS_THREADS (default: each CPU the process may run on),
GMLX_KERNELS_ISA (generic, avx2, avx512, avx512vnni, amx),
GMLX_KERNELS_ACT_BITS (16; 8 = llama.cpp's Q8_0 activations; 0 = float path only),
GMLX_KERNELS_PIN (0 leaves the threads unpinned; by default, on Linux, where they use every CPU the
process may run on, each keeps one of its own),
GMLX_KERNELS_SPIN_US (how long an idle thread waits for the next parallel region before it sleeps; 20),
GMLX_KERNELS_PACK (0 keeps Q4_0, Q8_0, Q5_0, Q4_K, Q5_K and Q6_K weights in the file's layout; by default,
where the kernels have an int16 path (AVX2, AVX-512; beside AMX, VNNI's), they are packed for them: see packs),
GMLX_KERNELS_HUGE_PAGES (0 leaves the weights where they were loaded; by default, on Linux unless its
transparent huge pages are `never`, they are moved into huge pages: see in_huge_pages),
GMLX_KERNELS_EXT (load the extension from another build).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Sequence
from functools import cache
from types import ModuleType

import mlx.core as mx
import mlx.nn as nn
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T
from mlx.utils import tree_flatten, tree_unflatten

# GGML types the kernels read directly.
TYPES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K)
TYPE_NAMES = tuple(t.name for t in TYPES)
# GGML types with a layout of gmlx's own, packed for the kernels; each as the kernels number it
# (PACKED + the type: Q8_0_R16 and the others in csrc/gguf_kernels.h).
PACKABLE = (T.Q4_0, T.Q8_0, T.Q5_0, T.Q4_K, T.Q5_K, T.Q6_K)
PACKED = 1000

_reason: str | None = None


@cache
def _load() -> ModuleType | None:
    global _reason
    try:
        path = os.environ.get("GMLX_KERNELS_EXT")  # a build elsewhere (development, benchmarks)
        if path:
            spec = importlib.util.spec_from_file_location("gmlx.kernels._ext", path)
            if spec is None or spec.loader is None:
                raise ImportError(f"GMLX_KERNELS_EXT={path}: not a loadable module")
            ext = importlib.util.module_from_spec(spec)
            sys.modules["gmlx.kernels._ext"] = ext
            spec.loader.exec_module(ext)
        else:
            from gmlx.kernels import _ext as ext  # type: ignore[attr-defined, no-redef]
    except ImportError as e:
        _reason = f"extension not built or not loadable ({e})"
        return None
    if ext.mlx_version != mx.__version__.split(".dev")[0]:
        _reason = (
            f"extension built against MLX {ext.mlx_version}, running MLX {mx.__version__}; reinstall gmlx to rebuild it"
        )
        return None
    try:  # the extension must share nanobind's type domain with mlx.core
        ext.gguf_dequant_rows(mx.zeros((1, 34), mx.uint8), int(T.Q8_0), 32, stream=mx.cpu)
    except TypeError as e:
        _reason = f"extension cannot exchange arrays with this mlx.core ({e})"
        return None
    return ext


def extension() -> ModuleType | None:
    return _load()


def scratch_bytes(used: bool = False) -> int:
    """Bytes the kernels' threads keep as scratch from one call to the next, outside MLX's buffers
    (0 without the extension); `used`: of the scratch used since `release_scratch` only."""
    ext = _load()
    return ext.scratch_bytes(used=used) if ext is not None else 0


def release_scratch(streams: Sequence[mx.Stream] = ()) -> None:
    """Have each of the kernels' threads free its scratch at its next use of it, keeping what that
    use needs: after a prefill, so that decoding does not keep what the prompts grew. Threads that
    run no kernel meanwhile free theirs sooner: the calling thread now, the threads of `streams`
    (the CPU streams the kernels ran on; none: the calling thread's default) once the work queued
    on them is done, the pool's workers between regions."""
    if (ext := _load()) is not None:
        ext.release_scratch(list(streams))


def available() -> bool:
    """True where the kernels loaded and MLX computes on the CPU (the only place they apply)."""
    return _load() is not None and mx.default_device() == mx.cpu


def reason() -> str | None:
    """Why the kernels are not used here; None when they are."""
    if _load() is None:
        return _reason
    if mx.default_device() != mx.cpu:
        return "MLX's default device is a GPU; its own quantized kernels apply there"
    return None


# Linux's transparent huge pages setting, "always [madvise] never" with the one in force bracketed.
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def _huge_pages_allowed() -> bool:
    """Whether the kernel gives transparent huge pages to memory advised for them."""
    try:
        with open(THP_ENABLED) as f:
            return "[never]" not in f.read()
    except OSError:  # not Linux, or a kernel without them
        return False


def in_huge_pages(model: nn.Module, group_bytes: int = 256 << 20) -> int:
    """Move the model's parameters, where the kernels run, into buffers whose 2 MiB pages are
    collapsed into transparent huge pages (docs/ARCHITECTURE.md, decision 33); returns the bytes
    moved. Each decode step reads every weight: in 4 KiB pages that is a TLB miss every 4 KiB
    of a stream the kernel threads read at memory bandwidth. Moved `group_bytes` at a time, each
    group's old buffers freed before the next, so loading never holds the weights twice: the
    caller must hold no other reference to them."""
    if not available() or not _huge_pages_allowed() or os.environ.get("GMLX_KERNELS_HUGE_PAGES") == "0":
        return 0
    params = tree_flatten(model.parameters())[::-1]  # popped in the model's order
    moved = 0
    while params:
        group = [params.pop()]
        size = group[0][1].nbytes
        while params and size + params[-1][1].nbytes <= group_bytes:
            group.append(params.pop())
            size += group[-1][1].nbytes
        names = [n for n, _ in group]
        model.update(tree_unflatten(list(zip(names, _load().in_huge_pages([a for _, a in group])))))
        moved += size
        del group
        mx.clear_cache()  # the group's old buffers, freed into MLX's cache
    return moved


def isa() -> str | None:
    ext = _load()
    return ext.isa() if ext is not None else None


def place_rows(shape: tuple[int, ...], dtype: mx.Dtype, parts: list[tuple[mx.array, int, int]]) -> mx.array:
    """A new (R, H, T, D) array of `shape`: each part's source (n, H, t, D) at rows `row`.. and
    slots `at`.., zeros elsewhere. On the CPU the kernel threads write each page once, in parallel:
    a new buffer's first touch is most of its cost (a joining row's KV cache, decision 30)."""
    if not available():
        out = mx.zeros(shape, dtype)
        for source, row, at in parts:
            out[row : row + source.shape[0], :, at : at + source.shape[2]] = source
        return out
    sources, rows, ats = ([p[i] for p in parts] for i in range(3))
    return _load().place_rows(sources, rows, ats, list(shape), dtype, stream=mx.cpu)


def row_bytes(ggml_type: int, k: int) -> int:
    block, size = GGML_QUANT_SIZES[T(ggml_type)]
    return k // block * size


def matmul(x: mx.array, w: mx.array, ggml_type: int, n: int, k: int) -> mx.array:
    """x (..., k) @ dequant(w).T -> (..., n), with w the GGUF tensor's bytes as uint8 (n, row_bytes)."""
    return _load().gguf_matmul(x, w, int(ggml_type), n, k, stream=mx.cpu)


def dequant_rows(rows: mx.array, ggml_type: int, k: int) -> mx.array:
    """uint8 (..., row_bytes) block rows -> float32 (..., k)."""
    return _load().gguf_dequant_rows(rows, int(ggml_type), k, stream=mx.cpu)


class GGUFLinear(nn.Module):
    """nn.Linear over a GGUF quantized weight: y = x @ W.T (+ bias). W stays in its blocks, in
    the file's layout or packed for the kernels (pack)."""

    def __init__(self, weight: mx.array, ggml_type: int, in_features: int, bias: mx.array | None = None):
        super().__init__()
        self.ggml_type = self.kernel_type = int(ggml_type)
        self.in_features, self.out_features = in_features, weight.shape[0]
        self.weight = weight
        if bias is not None:
            self.bias = bias
        self.group: LinearGroup | None = None
        self.freeze()

    def pack(self) -> bool:
        """Repack the weight for the active kernels where they take its layout (see packs); True
        if it was. `kernel_type` is then the layout the kernels are given; `ggml_type` stays the file's."""
        return _pack(self, self.out_features)

    def __call__(self, x: mx.array) -> mx.array:
        if self.group is not None:
            y = self.group.output(self, x)
        else:
            y = matmul(x, self.weight, self.kernel_type, self.out_features, self.in_features)
        return y + self["bias"] if "bias" in self else y

    def _extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, {T(self.ggml_type).name}"


class LinearGroup:
    """GGUFLinears that multiply the same input (a layer's q, k and v; gate and up). The first
    member called with an x computes every member's product in one node (x is coded once, one
    parallel region covers all the rows); the others then collect theirs for that same x."""

    def __init__(self, members: list[GGUFLinear]):
        self.members = members
        self._x: mx.array | None = None
        self._pending: dict[int, mx.array] = {}
        for m in members:
            m.group = self

    def output(self, member: GGUFLinear, x: mx.array) -> mx.array:
        if x is self._x and id(member) in self._pending:
            y = self._pending.pop(id(member))
            if not self._pending:
                self._x = None
            return y
        ms = self.members
        ys = _load().gguf_matmul_group(
            x,
            [m.weight for m in ms],
            [m.kernel_type for m in ms],
            [m.out_features for m in ms],
            member.in_features,
            stream=mx.cpu,
        )
        self._pending = {id(m): y for m, y in zip(ms, ys)}
        self._x = x
        return self._pending.pop(id(member))


# Sibling linears that mlx_lm's models call on one input.
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def group_linears(model: nn.Module) -> int:
    """Form a LinearGroup wherever a module holds a GROUPS set of GGUFLinears of one input width;
    returns how many were formed."""
    formed = 0
    for _, module in model.named_modules():
        for names in GROUPS:
            members = [module[n] if n in module else None for n in names]
            if all(isinstance(m, GGUFLinear) for m in members) and len({m.in_features for m in members}) == 1:
                LinearGroup(members)  # type: ignore[arg-type]
                formed += 1
    return formed


# Gated MLP activations, as the extension numbers them (GatedAct in csrc/gguf_kernels.h).
ACTIVATIONS = {"silu": 0, "gelu_approx": 1}
_MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")


class GatedMLP(nn.Module):
    """mlx_lm's MLP, down(act(gate(x)) * up(x)), over bias-free GGUFLinears as one graph node:
    the same three linears under the same names, so parameters and resident bytes do not change."""

    def __init__(self, gate_proj: GGUFLinear, up_proj: GGUFLinear, down_proj: GGUFLinear, act: str):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj
        self.act = act

    def __call__(self, x: mx.array) -> mx.array:
        g, u, d = self.gate_proj, self.up_proj, self.down_proj
        return _load().gguf_gated_mlp(
            x,
            g.weight,
            u.weight,
            d.weight,
            [g.kernel_type, u.kernel_type, d.kernel_type],
            g.out_features,
            g.in_features,
            ACTIVATIONS[self.act],
            stream=mx.cpu,
        )


def fuse_mlps(model: nn.Module) -> int:
    """Swap each module that holds just bias-free GGUFLinears gate_proj, up_proj and down_proj for
    a GatedMLP, with the activation of ACTIVATIONS that reproduces the module's own output on a
    probe input (one that matches none keeps its own code); returns how many were swapped."""
    swaps = []
    x = {}
    for path, module in model.named_modules():
        if set(module.keys()) != set(_MLP_LINEARS):
            continue
        g, u, d = (module[n] for n in _MLP_LINEARS)
        if not all(isinstance(m, GGUFLinear) and "bias" not in m for m in (g, u, d)):
            continue
        k, n = g.in_features, g.out_features
        if (u.in_features, u.out_features, d.in_features, d.out_features) != (k, n, n, k):
            continue
        if k not in x:
            x[k] = mx.random.normal((2, k), key=mx.random.key(k))
        ref = module(x[k])
        tol = 1e-3 * mx.abs(ref).max()
        for act in ACTIVATIONS:
            fused = GatedMLP(g, u, d, act)
            if mx.allclose(fused(x[k]), ref, rtol=0, atol=tol).item():
                swaps.append((path, fused))
                break
    model.update_modules(tree_unflatten(swaps))
    return len(swaps)


def pack_weights(model: nn.Module) -> int:
    """Pack each of the model's GGUF weights whose layout the active kernels take (see packs),
    after its weights are loaded; returns how many were packed. Each packed weight replaces the
    file's, so with no other reference to them loading holds one weight twice at most."""
    return sum(m.pack() for _, m in model.named_modules() if isinstance(m, GGUFLinear | GGUFEmbedding))


def packs(ggml_type: int, rows: int) -> bool:
    """Whether a weight of this type and row count is packed for the active kernels
    (docs/ARCHITECTURE.md, decisions 25 and 36): Q4_0, Q8_0, Q5_0 and Q4_K where they have an int16
    path (AVX2, AVX-512; beside AMX, VNNI's), Q5_K and Q6_K where it is AVX-512's. A packed weight
    other than Q8_0 always meets 16-bit activation codes, so with 8-bit ones asked for
    (GMLX_KERNELS_ACT_BITS=8: llama.cpp's arithmetic) it keeps the file's layout."""
    ext = _load()
    return (
        ext is not None
        and ext.packs(int(ggml_type))
        and rows % 16 == 0
        and os.environ.get("GMLX_KERNELS_PACK", "1") != "0"
        and ext.act_bits() != 0  # the float path reads only the file's layout
        and (ggml_type == T.Q8_0 or ext.act_bits() == 16)
    )


def _pack(module: GGUFLinear | GGUFEmbedding, rows: int) -> bool:
    if module.kernel_type != module.ggml_type or not packs(module.ggml_type, rows):
        return False
    module.weight, module.kernel_type = _load().pack(module.weight, module.ggml_type), PACKED + module.ggml_type
    return True


class GGUFEmbedding(nn.Module):
    """nn.Embedding over a GGUF quantized table: a lookup dequantizes only the rows it gathers;
    as_linear (a tied LM head) is the quantized matmul.

    A table of a type gmlx packs (the default model's Q8_0, a K-quant's Q6_K) is packed as a
    GGUFLinear's weight is (see packs): the same bytes, each 16 rows' blocks interleaved so the
    head's kernel reads them in order with no transposes (docs/ARCHITECTURE.md, decision 25), by
    `pack` once its weight is loaded; a lookup reads a row from either layout. `kernel_type` is the
    layout the kernels are given; `ggml_type` stays the file's."""

    def __init__(self, weight: mx.array, ggml_type: int, dims: int):
        super().__init__()
        self.ggml_type = self.kernel_type = int(ggml_type)
        self.num_embeddings, self.dims = weight.shape[0], dims
        self.weight = weight
        self.freeze()

    def pack(self) -> bool:
        """Repack the weight for the active kernels where they take its layout (see packs); True if it was."""
        return _pack(self, self.num_embeddings)

    def __call__(self, ids: mx.array) -> mx.array:
        return _load().gguf_embed(self.weight, ids, self.kernel_type, self.dims, stream=mx.cpu)

    def as_linear(self, x: mx.array) -> mx.array:
        return matmul(x, self.weight, self.kernel_type, self.num_embeddings, self.dims)

    def _extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.dims}, {T(self.ggml_type).name}"
