"""How freed buffers leave the process: MLX's cache of them, and the C heap under its CPU
buffers (glibc on Linux).

On the CPU, MLX's buffers come from malloc. glibc serves a large request with its own mapping
and unmaps it on free, but after the first such free it raises its mapping threshold to that
size (up to 32 MiB), so later buffers come from the heap and what they free stays resident
until the heap is trimmed. A prefill chunk's activations are such buffers: four prompts of
2,000 tokens prefilled together left the process 1.1-1.3x what MLX itself held
(docs/ARCHITECTURE.md, "Memory model"). gmlx's bring-up fixes the threshold as it is first imported,
before the process allocates much, so every large buffer that finds no room in the heap is mapped
on its own: the resident size follows MLX's allocations and the capacity table's arithmetic.
glibc still serves a request from free heap space where it has room, so nothing may advise heap
memory for huge pages: the advice would outlive the buffer and give whatever the heap put there
later 2 MiB pages. NumPy advises its arrays of 4 MiB and more; the bring-up turns that off.
Imports MLX lazily: the bring-up runs before it.
Elsewhere (macOS, musl; CUDA and Metal buffers are not malloc's) the heap's two calls do nothing.
What MLX keeps of its freed buffers for reuse, it keeps in its own cache: `shed_stale_buffers`.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Callable
from functools import cache

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
# glibc's own default: buffers from 128 KiB get their own mapping. Setting it turns the dynamic
# raise off; smaller allocations (Python objects, small arrays) stay on the heap.
MMAP_THRESHOLD_BYTES = 128 * 2**10


def _libc(name: str) -> Callable[..., int] | None:
    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError, TypeError):
        return None


_malloc_trim = _libc("malloc_trim")
_mallopt = _libc("mallopt")


def map_large_buffers() -> bool:
    """Give every allocation of MMAP_THRESHOLD_BYTES or more its own mapping from now on, so
    that freeing it returns its pages at once; True where the C library took the setting."""
    return _mallopt is not None and _mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1


def keep_numpy_off_huge_pages() -> None:
    """Have NumPy advise none of its arrays for huge pages (gmlx's NumPy arrays are transient: loading,
    tests), so that no freed one leaves advised heap memory behind."""
    os.environ.setdefault("NUMPY_MADVISE_HUGEPAGE", "0")  # read as NumPy is imported
    if (numpy := sys.modules.get("numpy")) is not None:
        core = getattr(numpy, "_core", None) or numpy.core  # NumPy 2, NumPy 1
        core.multiarray._set_madvise_hugepage(False)


def trim_heap() -> None:
    """Give the heap's free pages back to the system (what smaller buffers freed)."""
    if _malloc_trim is not None:
        _malloc_trim(0)


# Held while the limit is not MLX's own: a shed lowers it for a moment, and another model's
# engine reading it then would take half of it for the limit.
_limit_lock = threading.Lock()


@cache
def cache_limit() -> int:
    """What MLX keeps of its freed buffers at most: 32 MiB on the CPU (MLX 0.32); Metal's and
    CUDA's start at their memory limit. Read once, by raising it, which frees nothing."""
    import mlx.core as mx

    with _limit_lock:
        limit = mx.set_cache_limit(2**62)
        mx.set_cache_limit(limit)
    return limit


def shed_stale_buffers() -> bool:
    """Free the buffers MLX kept longest ago once they fill 3/4 of its cache limit; True if it did
    (docs/ARCHITECTURE.md, decision 31).

    MLX keeps a freed buffer only while it is under its limit, and hands one out again only for
    a request of about its size; it never drops one to make room. Buffers of sizes no later step
    asks for (a join's, a leave's, what a growing KV cache outgrew) so filled it, and every decode
    step's own buffers were then freed and mapped afresh: in `gmlx serve` on the default model at
    width 8, about 300 page faults a token (a step's 8 MiB of logits), against 47 with this.
    Lowering the limit frees the buffers kept longest ago, and a step's own were kept a step
    ago. Setting the limit waits for MLX's CPU stream, so it is done only then (9 times in
    4,096 tokens at width 8). What MLX holds never exceeds its own limit, so the capacity table's
    arithmetic is unchanged."""
    import mlx.core as mx

    limit = cache_limit()
    if mx.get_cache_memory() <= limit * 3 // 4:
        return False
    with _limit_lock:
        mx.set_cache_limit(limit // 2)
        mx.set_cache_limit(limit)
    return True
