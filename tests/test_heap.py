"""gmlx/heap.py's shed_stale_buffers: after buffers no step asks for again filled MLX's cache,
a step's own buffers come back from it instead of being mapped and faulted in afresh each step."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from gmlx.heap import cache_limit, shed_stale_buffers


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


def measure() -> dict[str, int]:
    """Both ways, in a process of their own (the page faults are the whole process's, and a test
    process may still have other tests' engines about)."""
    alone, shed = faults_over_steps(False), faults_over_steps(True)
    return {"limit": cache_limit(), "alone": alone, "shed": shed, "shed_empty": shed_stale_buffers()}


def test_a_steps_buffers_come_back_from_the_cache_after_stale_ones_filled_it() -> None:
    if cache_limit() > 2**30:
        pytest.skip("MLX's cache here is bounded by the device's memory (Metal, CUDA), not filled by a step")
    run = subprocess.run(
        [sys.executable, "-c", "import json, test_heap; print(json.dumps(test_heap.measure()))"],
        cwd=Path(__file__).parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    m = json.loads(run.stdout.strip().splitlines()[-1])
    pages = m["limit"] // 4 // resource.getpagesize()  # one step's buffer
    assert m["alone"] > 4 * pages, m  # every step faulted its buffer in afresh
    assert m["shed"] < 2 * pages, m  # at most the first after the shed
    assert not m["shed_empty"], m  # an empty cache is left as it is
