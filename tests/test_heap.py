"""engine/heap.py's shed_stale_buffers: after buffers no step asks for again filled MLX's cache,
a step's own buffers come back from it instead of being mapped and faulted in afresh each step."""

from __future__ import annotations

import resource

import mlx.core as mx
import pytest

from gmlx.engine.heap import cache_limit, map_large_buffers, shed_stale_buffers


def faults_over_steps(shed: bool, steps: int = 8) -> int:
    """Minor page faults of `steps` steps that each take and free a quarter of the cache limit,
    after stale buffers filled 7/8 of it."""
    limit = cache_limit()
    mx.clear_cache()
    stale = [mx.zeros((limit // 32 + 1000 * i + 333,)) for i in range(7)]  # 7 x ~1/8 of the limit (float32)
    mx.eval(stale)
    del stale
    assert mx.get_cache_memory() > limit * 3 // 4
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(steps):
        if shed:
            shed_stale_buffers()
        out = mx.zeros((limit // 16,)) + 1  # a step's logits: a quarter of the limit
        mx.eval(out)
        del out
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    mx.clear_cache()
    return faults


def test_a_steps_buffers_come_back_from_the_cache_after_stale_ones_filled_it() -> None:
    limit = cache_limit()
    if limit > 2**30:
        pytest.skip("MLX's cache here is bounded by the device's memory (Metal, CUDA), not filled by a step")
    map_large_buffers()  # as an engine's start does: a buffer MLX does not keep leaves the process
    alone, shed = faults_over_steps(False), faults_over_steps(True)
    pages = limit // 4 // resource.getpagesize()  # one step's buffer
    assert alone > 4 * pages, (alone, pages)  # every step faulted its buffer in afresh
    assert shed < 2 * pages, (shed, pages)  # at most the first after the shed
    assert not shed_stale_buffers()  # an empty cache is left as it is
