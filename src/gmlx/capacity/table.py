"""The capacity table: how many streams of how many tokens fit in the KV budget."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Protocol

from gmlx.capacity.budget import (
    FLOAT32_BYTES,
    HOST_BYTES_ESTIMATE,
    GovernorTerms,
    MemoryBudget,
    prefill_working_bytes,
)
from gmlx.capacity.kv_quant import KVQuantPlan, KVQuantSettings, server_plan
from gmlx.capacity.memory import (
    FP16,
    FP16_BYTES,
    KVFormat,
    KVProfile,
    decode_overhead_bytes,
    kv_profile,
    outgrown_bytes,
    profile_bytes,
    rotating_prefill_bytes,
    sliding_prefill_bytes,
    store_cast_bytes,
)
from gmlx.gguf.header import GGUFHeader, ModelGeometry
from gmlx.models.weights_mode import resident_bytes

DEPTH_GRID_START = 512


def depth_grid(context_length: int) -> list[int]:
    """Powers of two from 512 below the context window, then the window itself."""
    grid, depth = [], DEPTH_GRID_START
    while depth < context_length:
        grid.append(depth)
        depth *= 2
    return [*grid, context_length]


@dataclass(frozen=True)
class CapacityTable:
    """Figures use the bytes mlx_lm's caches allocate (whole steps of 256 tokens), not the bare count."""

    geometry: ModelGeometry
    budget: MemoryBudget
    kv: KVFormat
    decode_batch: int
    context_length: int  # the window the server uses: the GGUF's, or max_kv_size when smaller
    prefill_step: int | None = None  # the prefill chunk; None: prompts prefill whole, nothing is outgrown

    @cached_property
    def _profile(self) -> KVProfile:
        return kv_profile(self.geometry, self.kv)

    @cached_property
    def _overhead(self) -> int:
        return decode_overhead_bytes(self.geometry)

    def stream_bytes(self, depth: int) -> int:
        """One stream's cache as allocated, plus what it holds to decode (see memory.stream_bytes)."""
        return profile_bytes(self._profile, depth, True) + self._overhead

    def _outgrown(self, depth: int, one_layer: bool = False) -> int:
        if self.prefill_step is None:
            return 0
        return outgrown_bytes(self.geometry, depth, self.prefill_step, self.kv, one_layer)

    def _per_stream(self, depth: int) -> int:
        """What each stream of `depth` tokens takes at the peak of a fan-out's prefill: the streams
        arrive together and mlx_lm prefills up to decode_batch prompts as one batch, so each
        brings its own chunk, and the buffer the layer running it outgrows."""
        return self.stream_bytes(depth) + self.budget.prefill_bytes + self._outgrown(depth, one_layer=True)

    def _per_batch(self, depth: int) -> int:
        """What MLX's buffer cache holds beside them while a chunk runs, whatever the width: about
        one stream's replaced buffers (docs/ARCHITECTURE.md, "Memory model": measured, not derived)."""
        return self.budget.batch_bytes + self._outgrown(depth)

    def streams_bytes(self, width: int, depth: int) -> int:
        """What `width` streams of `depth` tokens arriving together take of the drained budget."""
        return width * self._per_stream(depth) + self._per_batch(depth)

    def max_context_at_width(self, width: int) -> int:
        """Largest depth <= the window with `width` streams of it in the budget; 0 if 1 token does not fit."""
        budget = self.budget.drained_bytes
        lo, hi = 0, self.context_length  # invariant: lo fits (0 always does); above hi is out of the window
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.streams_bytes(width, mid) <= budget:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def max_width_at_depth(self, depth: int) -> int:
        """Streams of `depth` tokens that fit, at most decode_batch; 0 past the window."""
        if depth > self.context_length:
            return 0
        need, room = self._per_stream(depth), self.budget.drained_bytes - self._per_batch(depth)
        return self.decode_batch if need == 0 else min(self.decode_batch, max(0, room) // need)

    def widths(self) -> dict[int, int]:
        return {w: self.max_context_at_width(w) for w in range(1, self.decode_batch + 1)}

    def depths(self) -> dict[int, int]:
        return {d: self.max_width_at_depth(d) for d in depth_grid(self.context_length)}

    def headline(self) -> str:
        """One line for the start-up log, such as 'capacity: 8 streams of 32768 tokens, or 1 stream of 131072'."""
        one, batch = self.max_context_at_width(1), self.decode_batch
        if one == 0:
            return (
                f"capacity: no room for a KV cache ({self.budget.kv_bytes} bytes left after weights, reserve, "
                "prompt cache, prefill and the process's memory outside MLX)"
            )
        full = self.max_context_at_width(batch)
        if batch == 1 or full == one:
            return f"capacity: {_streams(batch)} of {full} tokens"
        if full == 0:
            return f"capacity: 1 stream of {one} tokens; {batch} streams do not fit"
        return f"capacity: {_streams(batch)} of {full} tokens, or 1 stream of {one}"

    def to_json(self) -> dict:
        return {
            "kv_format": self.kv.to_json(),
            "budget": self.budget.to_json(),
            "decode_batch": self.decode_batch,
            "context_length": self.context_length,
            "prefill_step": self.prefill_step,
            "headline": self.headline(),
            "widths": {str(w): c for w, c in self.widths().items()},
            "depths": {str(d): w for d, w in self.depths().items()},
        }


def _streams(n: int) -> str:
    return f"{n} stream" if n == 1 else f"{n} streams"


def build_table(
    g: ModelGeometry,
    budget: MemoryBudget,
    decode_batch: int,
    kv: KVFormat = FP16,
    context_length: int | None = None,
    prefill_step: int | None = None,
) -> CapacityTable:
    """`context_length` is max_kv_size where the server sets one; the GGUF's window caps it."""
    if decode_batch < 1:
        raise ValueError(f"decode_batch must be at least 1, not {decode_batch}")
    window = g.context_length if context_length is None else min(context_length, g.context_length)
    return CapacityTable(g, budget, kv, decode_batch, window, prefill_step)


def prefill_bytes(g: ModelGeometry, chunk_tokens: int, window: int, kv: KVFormat, tiled_attention: bool) -> int:
    """One stream's prefill set-aside, derived, for chunks of `chunk_tokens` in a `window`: the
    chunk's working set attending across the window (its scores whole, unless `tiled_attention`:
    gmlx's CPU kernels), what it adds to its sliding-window caches, and its keys and values cast
    to a float16 store."""
    chunk = min(chunk_tokens, window)
    return (
        prefill_working_bytes(g, chunk, window, tiled_attention)
        + sliding_prefill_bytes(g, chunk, kv)
        + store_cast_bytes(g, chunk, kv)
    )


@dataclass(frozen=True)
class PrefillGrowth:
    """What each token of a prefill chunk adds to the prefill's memory, as `prefill_bytes` derives
    it and as a server's warm-up measures it (`prefill_growth`)."""

    predicted: float
    measured: float
    # Bytes a chunk token holds in the CPU kernels' scratch, outside MLX's buffers (measured; 0
    # where they do not run): counted once a batch (capacity_table).
    scratch: float = 0.0

    @property
    def unplanned(self) -> float:
        """Bytes a token that the derivation leaves out: its blocks hold more than it counts (mlx_lm's
        own blocks, on a backend the derivation was not measured on), 0 where it counts enough."""
        return max(0.0, self.measured - self.predicted)

    def to_json(self) -> dict:
        return {
            "prefill_bytes_per_token_predicted": round(self.predicted, 1),
            # Below zero the two peaks were noise (a tiny model's): no measure, null.
            "prefill_bytes_per_token_measured": round(self.measured, 1) if self.measured >= 0 else None,
            "prefill_scratch_bytes_per_token_measured": round(self.scratch, 1),
        }


def prefill_growth(
    g: ModelGeometry,
    kv: KVFormat,
    tiled_attention: bool,
    tokens: int,
    peak_bytes: int,
    doubled_peak_bytes: int,
    scratch_bytes: int = 0,
) -> PrefillGrowth:
    """From the warm-up's two prefills of an empty cache, `tokens` and twice as many, which peaked
    `peak_bytes` and `doubled_peak_bytes` above their caches in MLX's buffers, the second needing
    `scratch_bytes` of the kernels' scratch; the prediction is the same difference of
    `prefill_bytes`. A difference, so what does not grow with the chunk (the one position's
    logits, one-time buffers) drops out. From an empty cache no sliding-window buffer is replaced,
    which `prefill_bytes` counts: the measured growth falls short of a chunk's deep in a prompt, and
    what it exceeds the prediction by is a lower bound of what the set-aside misses."""
    predicted = prefill_bytes(g, 2 * tokens, 2 * tokens, kv, tiled_attention) - prefill_bytes(
        g, tokens, tokens, kv, tiled_attention
    )
    return PrefillGrowth(predicted / tokens, (doubled_peak_bytes - peak_bytes) / tokens, scratch_bytes / (2 * tokens))


def capacity_table(
    g: ModelGeometry,
    *,
    weight_bytes: int,
    decode_batch: int,
    prefill_step: int,
    memory: int,
    kv: KVFormat = FP16,
    reserve_fraction: float = 0.10,
    reserve_floor: int = 512 * 2**20,
    context_length: int | None = None,
    prompt_cache_bytes: int = 0,
    tiled_attention: bool = False,
    governor: GovernorTerms | None = None,
    others_bytes: int = 0,
    growth: PrefillGrowth | None = None,
) -> CapacityTable:
    """The table the server builds at start and `gmlx plan` builds offline, from the same budget arithmetic.

    A prompt's prefill holds `prefill_bytes`: a server adds, for each token of a chunk, what its
    warm-up measured beyond that (`growth`: PrefillGrowth.unplanned). Once per batch, MLX's buffer
    cache holds about one stream's sliding-window transient more (`batch_bytes`), and the process
    one stream's chunk of the CPU kernels' scratch (`growth`: PrefillGrowth.scratch; not one a
    stream: beside W streams MLX's figure counts buffers whose pages are not written yet,
    docs/ARCHITECTURE.md, decision 39). With a `governor`, the budget also counts what the
    governor counts (GovernorTerms): the process's memory outside MLX comes off, and the table
    fills only up to where orange starts.
    `others_bytes`: the weights of the other models resident beside it.
    """
    window = g.context_length if context_length is None else min(context_length, g.context_length)
    chunk = min(prefill_step, window)
    prefill = prefill_bytes(g, chunk, window, kv, tiled_attention)
    if growth is not None:
        prefill += round(growth.unplanned * chunk)
    budget = MemoryBudget(
        memory,
        weight_bytes,
        prefill,
        reserve_floor,
        reserve_fraction,
        prompt_cache_bytes,
        batch_bytes=rotating_prefill_bytes(g, chunk, kv) + (round(growth.scratch * chunk) if growth else 0),
        others_bytes=others_bytes,
    )
    if governor is not None:
        budget = replace(budget, host_bytes=governor.host_bytes, ceiling=governor.ceiling)
    return build_table(g, budget, decode_batch, kv, window, chunk)


class TableSettings(Protocol):
    """The server settings a table depends on (gmlx.settings.Settings has them)."""

    @property
    def decode_batch(self) -> int: ...
    @property
    def prefill_step(self) -> int: ...
    @property
    def reserve_fraction(self) -> float: ...
    @property
    def reserve_floor(self) -> int: ...
    @property
    def max_kv_size(self) -> int | None: ...
    @property
    def governor(self) -> bool: ...
    @property
    def governor_orange(self) -> float: ...
    @property
    def governor_hysteresis(self) -> float: ...
    def kv_quant(self) -> KVQuantSettings: ...
    def prompt_cache_limit(self, memory: int) -> int: ...


def attention_in_tiles(fast_kernels: bool, kv_plan: KVQuantPlan | None) -> bool:
    """Whether prefill attends over tiles of keys: gmlx's CPU kernels run it, unless the KV plan
    sends attention through mlx_lm's quantized path."""
    return fast_kernels and not (kv_plan is not None and kv_plan.scores_whole)


def governor_terms(s: TableSettings, host_bytes: int, host_memory: bool) -> GovernorTerms | None:
    """capacity_table's `governor` for a server with settings `s` (None without a governor): host
    memory counts only where the governor reads it (`host_memory`: not on CUDA). The table fills
    up to orange less the hysteresis: the process's memory outside MLX moves by tens of MiB as
    requests come and go, and a plan filled to orange itself tipped into it (docs/ARCHITECTURE.md,
    "Memory model")."""
    if not s.governor:
        return None
    return GovernorTerms(host_bytes if host_memory else 0, round(s.governor_orange - s.governor_hysteresis, 4))


def kv_float(fast_kernels: bool) -> tuple[int, str]:
    """The KV cache's float width a server allocates, in every weight mode, and why: float16 where
    gmlx's CPU kernels run attention (gmlx.models.fused, docs/ARCHITECTURE.md decision 35), else
    the float32 the engine computes in."""
    if fast_kernels:
        return FP16_BYTES, "float16: gmlx's CPU kernels run attention and read float16 keys and values"
    return FLOAT32_BYTES, "float32: the engine computes in float32 (float32 weights or float32 scales)"


def header_table(
    h: GGUFHeader,
    s: TableSettings,
    *,
    mode: str,
    memory: int,
    fast_kernels: bool = False,
    host_memory: bool = True,
    others_bytes: int = 0,
) -> tuple[CapacityTable, KVQuantPlan | None]:
    """The table a server with settings `s` would build for this file, from its header alone (no
    weights): its weights as `mode` loads them, and the KV quantization plan it would make (None
    when off). `gmlx plan`/`gmlx estimate` and /v1/estimate for a model not loaded use it.
    fast_kernels: gmlx's CPU kernels run attention (see attention_in_tiles and kv_float). With no server to
    measure, the process's memory outside MLX is HOST_BYTES_ESTIMATE (`host_memory`: the budget
    is host memory, as everywhere but CUDA); `others_bytes`, the weights of the models resident
    beside it."""
    g, weight_bytes, cache_bytes = h.geometry, resident_bytes(h, mode), s.prompt_cache_limit(memory)
    float_bytes, _ = kv_float(fast_kernels)
    window = g.context_length if s.max_kv_size is None else min(g.context_length, s.max_kv_size)
    kv_plan = (
        server_plan(
            s.kv_quant(),
            g,
            memory=memory,
            weight_bytes=weight_bytes + others_bytes,
            reserve_fraction=s.reserve_fraction,
            reserve_floor=s.reserve_floor,
            prompt_cache_bytes=cache_bytes,
            streams=s.decode_batch,
            context_length=window,
            float_bytes=float_bytes,
        )
        if s.kv_quant().enabled
        else None
    )
    kv = kv_plan.kv_format(float_bytes) if kv_plan is not None else KVFormat(float_bytes=float_bytes)
    table = capacity_table(
        g,
        weight_bytes=weight_bytes,
        decode_batch=s.decode_batch,
        prefill_step=s.prefill_step,
        kv=kv,
        memory=memory,
        reserve_fraction=s.reserve_fraction,
        reserve_floor=s.reserve_floor,
        context_length=window,
        prompt_cache_bytes=cache_bytes,
        tiled_attention=attention_in_tiles(fast_kernels, kv_plan),
        governor=governor_terms(s, HOST_BYTES_ESTIMATE, host_memory),
        others_bytes=others_bytes,
    )
    return table, kv_plan
