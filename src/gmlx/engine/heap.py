"""The C heap under MLX's CPU buffers (glibc on Linux): how freed buffers leave the process.

On the CPU, MLX's buffers come from malloc. glibc serves a large request with its own mapping
and unmaps it on free, but after the first such free it raises its mapping threshold to that
size (up to 32 MiB), so later buffers come from the heap and what they free stays resident
until the heap is trimmed. A prefill chunk's activations are such buffers: four prompts of
2,000 tokens prefilled together left the process 1.1-1.3x what MLX itself held
(docs/ARCHITECTURE.md, "Memory model"). Fixing the threshold keeps every large buffer mapped on its
own, so the resident size follows MLX's allocations and the capacity table's arithmetic.
Elsewhere (macOS, musl; CUDA and Metal buffers are not malloc's) both calls do nothing.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

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


def trim_heap() -> None:
    """Give the heap's free pages back to the system (what smaller buffers freed)."""
    if _malloc_trim is not None:
        _malloc_trim(0)
