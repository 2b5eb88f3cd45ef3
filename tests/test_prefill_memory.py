"""Prediction against measurement for a fan-out: W prompts of 2,000 tokens arriving together at
the server's engine (prefilled as one batch, then decoding) peak within 10% of what the capacity
table counts for W streams of that depth (at a longer chunk, at most 10% over it), and the
process's resident size stays within it too."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import psutil
import pytest

from gmlx.deployment import Deployment
from gmlx.engine.engine import Engine, Event, Failed, Finished, Request
from gmlx.engine.heap import trim_heap
from gmlx.server.build import build_engine
from gmlx.server.prometheus import Histograms
from gmlx.server.state import ModelState
from gmlx.settings import resolve_settings

PROMPT_TOKENS = 2000
MAX_TOKENS = 4


class Peak:
    """Samples, every few milliseconds, what the governor reads: MLX's active and cached memory,
    and the process's resident size; both less what the prompt cache holds, which the budget
    bounds on its own (prompt_cache_bytes)."""

    def __init__(self, engine: Engine) -> None:
        self._held: Callable[[], int] = lambda: engine.prompt_cache.bytes if engine.prompt_cache else 0
        self._process = psutil.Process()
        self.mlx = self.rss = 0
        self._base = self._read()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _read(self) -> tuple[int, int]:
        held = self._held()
        return (mx.get_active_memory() + mx.get_cache_memory() - held, self._process.memory_info().rss - held)

    def _run(self) -> None:
        while not self._stop.is_set():
            mlx, rss = self._read()
            self.mlx, self.rss = max(self.mlx, mlx - self._base[0]), max(self.rss, rss - self._base[1])
            time.sleep(0.005)

    def __enter__(self) -> Peak:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def fan_out(engine: Engine, width: int, salt: int) -> list[Event]:
    """`width` distinct prompts submitted at once; their final events once all have ended."""
    ends: list[Event] = []
    done = threading.Event()

    def emit(event: Event) -> None:
        if isinstance(event, Finished | Failed):
            ends.append(event)
            if len(ends) == width:
                done.set()

    for i in range(width):  # token ids unlike any other prompt's, so the prompt cache supplies none
        ids = [2] + [100 + (7919 * salt + 37 * (i * PROMPT_TOKENS + j)) % 200_000 for j in range(PROMPT_TOKENS - 1)]
        engine.submit(Request(id=f"fan-{salt}-{i}", prompt_ids=ids, max_tokens=MAX_TOKENS, emit=emit))
    assert done.wait(600), "the fan-out did not end"
    return ends


@pytest.mark.slow
@pytest.mark.parametrize("prefill_step", [512, 1024])  # the default, and a chunk MLX once ran layers ahead in
def test_a_fan_out_peaks_where_the_capacity_table_says(default_model: Path, prefill_step: int) -> None:
    settings = resolve_settings({"decode_batch": 8, "prefill_step": prefill_step}, env={})
    model = ModelState(Deployment(default_model.stem, default_model, settings), Histograms())
    engine = build_engine(model.deployment)
    model.attach(engine, others_bytes=0)
    engine.start()
    try:
        assert engine.ready.wait(300) and engine.loaded is not None, engine.load_error
        table = model.table()
        assert table is not None
        for width in (8, 1):  # the widest first: what it touches once is no part of the narrower one
            mx.synchronize()
            mx.clear_cache()
            trim_heap()
            with Peak(engine) as peak:
                ends = fan_out(engine, width, salt=width)
            assert all(isinstance(e, Finished) and e.finish_reason == "length" for e in ends), ends
            planned = table.streams_bytes(width, PROMPT_TOKENS + MAX_TOKENS)
            assert peak.mlx <= 1.10 * planned and peak.rss <= 1.10 * planned, (width, peak.mlx, peak.rss, planned)
            if prefill_step == 512:  # and at the default chunk, the plan sets no more aside than it needs
                assert peak.mlx >= 0.90 * planned, (width, peak.mlx, planned)
    finally:
        engine.stop(30)
