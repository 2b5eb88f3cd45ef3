"""Prediction against measurement for a fan-out: W prompts of 2,000 tokens arriving together at
the server's engine (prefilled as one batch, then decoding) peak within 10% of what the capacity
table counts for W streams of that depth (at a longer chunk, at most 10% over it), and the
process's resident size stays within it too: on the default model, and on models of other shapes
and with mlx_lm's own blocks by what the warm-up measured of them."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import psutil
import pytest

from gmlx import kernels
from gmlx.deployment import Deployment
from gmlx.engine.engine import Engine, Event, Failed, Finished, Request
from gmlx.engine.sampling import SamplingParams
from gmlx.heap import trim_heap
from gmlx.server.build import build_engine
from gmlx.server.prometheus import Histograms
from gmlx.server.state import ModelState
from gmlx.settings import resolve_settings

PROMPT_TOKENS = 2000
MAX_TOKENS = 4
GREEDY = SamplingParams(temperature=0)


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


def fan_out(
    engine: Engine, width: int, salt: int, tokens: int = PROMPT_TOKENS, max_tokens: int = MAX_TOKENS
) -> list[Event]:
    """`width` distinct prompts of `tokens` submitted at once; their final events once all have ended."""
    ends: list[Event] = []
    done = threading.Event()

    def emit(event: Event) -> None:
        if isinstance(event, Finished | Failed):
            ends.append(event)
            if len(ends) == width:
                done.set()

    for i in range(width):  # token ids unlike any other prompt's, so the prompt cache supplies none
        ids = [2] + [100 + (7919 * salt + 37 * (i * tokens + j)) % 200_000 for j in range(tokens - 1)]
        request = Request(id=f"fan-{salt}-{i}", prompt_ids=ids, max_tokens=max_tokens, emit=emit, sampling=GREEDY)
        engine.submit(request)
    assert done.wait(600), "the fan-out did not end"
    # Greedy, so that a run repeats. What is measured is the prefill: a prompt whose first token is a
    # stop token (random sampling once drew one) has had it whole.
    assert all(isinstance(e, Finished) and e.prompt_tokens == tokens for e in ends), ends
    return ends


@contextmanager
def serving(path: Path, **settings: object) -> Iterator[tuple[Engine, ModelState]]:
    """The server's engine for the model and the model state that builds its table."""
    model = ModelState(
        Deployment(path.stem, path, resolve_settings({"decode_batch": 8, **settings}, env={})), Histograms()
    )
    engine = build_engine(model.deployment)
    model.attach(engine, others_bytes=0)
    engine.start()
    try:
        assert engine.ready.wait(300) and engine.loaded is not None, engine.load_error
        yield engine, model
    finally:
        engine.stop(30)


def measure(engine: Engine, width: int, tokens: int = PROMPT_TOKENS) -> Peak:
    mx.synchronize()
    mx.clear_cache()
    trim_heap()
    with Peak(engine) as peak:
        fan_out(engine, width, salt=width, tokens=tokens)
    return peak


@pytest.mark.slow
@pytest.mark.parametrize("prefill_step", [512, 1024])  # the default, and a chunk MLX once ran layers ahead in
def test_a_fan_out_peaks_where_the_capacity_table_says(default_model: Path, prefill_step: int) -> None:
    with serving(default_model, prefill_step=prefill_step) as (engine, model):
        table = model.table()
        assert table is not None
        for width in (8, 1):  # the widest first: what it touches once is no part of the narrower one
            peak = measure(engine, width)
            planned = table.streams_bytes(width, PROMPT_TOKENS + MAX_TOKENS)
            assert peak.mlx <= 1.10 * planned, (width, peak.mlx, planned)
            # The resident size counts the kernels' scratch too, which a prefill grows and decoding
            # frees (docs/ARCHITECTURE.md, decision 39): at 1,024 and W = 8, 0.97 of the plan.
            assert peak.rss <= 1.10 * planned, (width, peak.rss, planned)
            if prefill_step == 512:  # and at the default chunk, the plan sets little more aside than it needs
                assert max(peak.mlx, peak.rss) >= 0.85 * planned, (width, peak.mlx, peak.rss, planned)


@pytest.mark.slow
def test_with_mlx_lm_own_blocks_the_plan_holds_by_what_the_warm_up_measured(default_model: Path) -> None:
    """`--weights native` on the CPU runs mlx_lm's blocks (MLX's affine matmuls; the gelu, norms
    and RoPE as nodes of their own), which hold more for each token of a chunk than the derivation
    counts (the kernels' fused blocks, which it was measured on). Three chunks: about 70 s, as
    MLX's quantized CPU matmuls prefill at about 15 tokens a second."""
    tokens = 1100
    with serving(default_model, weights="native") as (engine, model):
        table, growth = model.table(), model.prefill_growth()
        assert table is not None and growth is not None and growth.unplanned > 0, growth
        peak = measure(engine, 1, tokens)
    planned = table.streams_bytes(1, tokens + MAX_TOKENS)
    # MLX's figure, what the warm-up measures, and the resident size: after the rest of the suite
    # had run in the process it read 1.43 and 1.53 of the plan while heap memory stayed advised for
    # huge pages, 0.92 since (docs/ARCHITECTURE.md, "Memory model").
    assert peak.mlx <= planned and peak.rss <= 1.10 * planned, (peak.mlx, peak.rss, planned)
    derived = planned - (growth.unplanned + growth.scratch) * table.prefill_step
    assert peak.mlx > derived  # the derivation alone fell short


@pytest.mark.slow
@pytest.mark.parametrize(
    "shape",
    [  # two layers of random Q4_K weights: the architecture, n_embd, n_ff, heads, KV heads, head size
        pytest.param(("qwen3", 1024, 3072, 16, 8, 128), id="qwen3-0.6b"),  # where the derivation falls short
        pytest.param(("llama", 2048, 8192, 32, 8, 64), id="llama-3.2-1b"),  # where it does not
    ],
)
def test_a_fan_out_of_another_shape_peaks_within_the_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shape: tuple[str, int, int, int, int, int]
) -> None:
    """A model of another shape than the default one, on the kernels: the table holds by the warm-up's
    measure where the derivation falls short. Random weights: memory depends on shapes alone."""
    import tiny_models
    from gguf import GGMLQuantizationType

    arch, hidden, ff, heads, kv_heads, head_dim = shape
    monkeypatch.setattr(tiny_models, "HIDDEN", hidden)
    monkeypatch.setattr(tiny_models, "FF", ff)
    path = tiny_models.write_model(
        tmp_path / "m.gguf",
        arch,
        GGMLQuantizationType.Q4_K,
        context=8192,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
    )
    with serving(path) as (engine, model):
        table, growth = model.table(), model.prefill_growth()
        assert table is not None and growth is not None
        for width in (8, 1):
            peak = measure(engine, width)
            planned = table.streams_bytes(width, PROMPT_TOKENS + MAX_TOKENS)
            assert peak.mlx <= 1.10 * planned and peak.rss <= 1.10 * planned, (width, peak.mlx, peak.rss, planned)
            derived = (
                planned
                - width * round(growth.unplanned * table.prefill_step)
                - round(growth.scratch * table.prefill_step)
            )
            if growth.unplanned:  # the derivation alone fell short
                assert peak.mlx > derived, (width, peak.mlx, derived)


def test_once_a_prompt_is_prefilled_the_kernels_give_back_the_scratch_it_grew(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU kernels keep scratch outside MLX from one call to the next (a chunk's gate and up
    rows, among others). Once no prompt is left to prefill, their next call frees it (the first
    prompt's decoding, else the next prompt's prefill): a server does not keep its largest chunk's
    for good."""
    if not kernels.available():
        pytest.skip(kernels.reason() or "the kernels do not run here")
    import tiny_models
    from gguf import GGMLQuantizationType

    tokens = 1024
    gate_up = 2 * tokens * tiny_models.FF * 4  # the fused MLP's float rows for one chunk
    path = tiny_models.write_model(tmp_path / "m.gguf", "llama", GGMLQuantizationType.Q8_0, context=4096)
    at_release: list[int] = []
    release = kernels.release_scratch

    def spy(streams: list[mx.Stream]) -> None:
        at_release.append(kernels.scratch_bytes())
        release(streams)

    with serving(path, prefill_step=tokens) as (engine, _):
        monkeypatch.setattr(kernels, "release_scratch", spy)  # after the warm-up's own
        fan_out(engine, 1, salt=1, tokens=tokens)
        fan_out(engine, 1, salt=2, tokens=16)  # whose first call frees what the first prompt grew
        after = kernels.scratch_bytes()
    assert at_release and at_release[0] >= gate_up, (at_release, gate_up)  # the long prompt grew it
    assert after <= at_release[0] - 0.9 * gate_up, (at_release, after, gate_up)


def test_an_engine_left_idle_after_a_prompt_answered_in_its_prefill_keeps_none_of_its_scratch(
    tmp_path: Path,
) -> None:
    """A prompt whose first token is its last (a score, a classification) leaves no decoding to
    free what its prefill grew; the threads that ran it free it as they go idle."""
    if not kernels.available():
        pytest.skip(kernels.reason() or "the kernels do not run here")
    import tiny_models
    from gguf import GGMLQuantizationType

    tokens = 1024
    gate_up = 2 * tokens * tiny_models.FF * 4  # the fused MLP's float rows for one chunk
    path = tiny_models.write_model(tmp_path / "m.gguf", "llama", GGMLQuantizationType.Q8_0, context=4096)
    with serving(path, prefill_step=tokens) as (engine, _):
        before = kernels.scratch_bytes()
        fan_out(engine, 1, salt=1, tokens=tokens, max_tokens=1)
        deadline = time.monotonic() + 30  # the engine releases after its step; the threads then drop
        while (held := kernels.scratch_bytes()) > before + 0.1 * gate_up and time.monotonic() < deadline:
            time.sleep(0.05)
    assert held <= before + 0.1 * gate_up, (before, held, gate_up)
