"""Prediction against measurement: the memory MLX really allocates for W streams of D tokens
decoding together in mlx_lm's BatchGenerator (their KV caches, and the logits rows each stream
keeps) is within 5% of what capacity/ predicts."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import pytest
from conftest import kv_float_bytes
from mlx_lm.generate import BatchGenerator

from gmlx.capacity.memory import KVFormat, stream_bytes, warmup_per_token
from gmlx.models.loader import LoadedModel, load


@contextmanager
def quiet() -> Iterator[None]:
    """MLX's active memory is process-wide: let engines of servers from earlier tests end, free
    the arrays that earlier tests left in reference cycles, and keep the collector from freeing
    more of them in the middle of a measurement."""
    for t in threading.enumerate():
        if t.name.startswith("engine-"):
            t.join(30)
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def measure(m: LoadedModel, width: int, depth: int) -> tuple[int, int]:
    """(measured, predicted) bytes once W streams of D prompt tokens have decoded a step."""
    with quiet():
        return _measure(m, width, depth)


def _measure(m: LoadedModel, width: int, depth: int) -> tuple[int, int]:
    gen = BatchGenerator(m.model, completion_batch_size=width, prefill_batch_size=width, prefill_step_size=512)
    mx.synchronize()
    mx.clear_cache()
    before = mx.get_active_memory()
    gen.insert([[7 + i] * depth for i in range(width)], [8] * width)
    steps = 0
    while steps < 2:  # the first decode step trims the sliding caches back to their window
        _, generated = gen.next()
        steps += bool(generated)
    mx.synchronize(gen.stream)  # the generator evaluates ahead on its own stream
    mx.clear_cache()
    measured = mx.get_active_memory() - before
    # The generator has run one step ahead (async), so the caches hold depth + steps + 1 tokens.
    predicted = width * stream_bytes(m.geometry, depth + steps + 1, KVFormat(float_bytes=kv_float_bytes()))
    gen.close()
    return measured, predicted


@pytest.fixture(scope="module")
def tiny_long(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoadedModel]:
    from tiny_models import write_model

    root = tmp_path_factory.mktemp("kv")
    return {arch: load(write_model(root / f"{arch}.gguf", arch, context=4096), "float") for arch in ("llama", "gemma3")}


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("width", [1, 4, 8])
@pytest.mark.parametrize("depth", [256, 2048])
def test_kv_prediction_matches_mlx(tiny_long: dict[str, LoadedModel], arch: str, width: int, depth: int) -> None:
    measured, predicted = measure(tiny_long[arch], width, depth)
    assert abs(measured - predicted) <= 0.05 * predicted, (measured, predicted)


@pytest.fixture(scope="module")
def default_loaded(default_model: Path) -> LoadedModel:
    return load(default_model, "float")


@pytest.mark.slow
@pytest.mark.parametrize("width", [1, 4, 8])
@pytest.mark.parametrize("depth", [256, 1024])  # both sides of its 512-token sliding window
def test_kv_prediction_matches_mlx_on_default_model(default_loaded: LoadedModel, width: int, depth: int) -> None:
    measured, predicted = measure(default_loaded, width, depth)
    assert abs(measured - predicted) <= 0.05 * predicted, (measured, predicted)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_warm_up_measures_what_is_predicted(tiny_long: dict[str, LoadedModel], arch: str) -> None:
    """The start-up warm-up's measured cache equals the prediction the server logs beside it
    (right after a prefill: full layers in 256-token steps, sliding layers exactly)."""
    from gmlx.capacity.memory import kv_bytes_after_prefill
    from gmlx.engine.engine import warm_up

    m = tiny_long[arch]
    with quiet():
        measured = warm_up(m)
    assert measured.kv_dtype_bytes == kv_float_bytes()  # what the offline plan counts
    kv = KVFormat(float_bytes=measured.kv_dtype_bytes)
    predicted = kv_bytes_after_prefill(m.geometry, measured.tokens, kv)
    assert abs(measured.kv_bytes - predicted) <= 0.01 * predicted, (measured.kv_bytes, predicted)
    # Per token: 2 layers (gemma3 tiny: 6) x 2 KV heads x (64 + 64) x the float width, all below the window.
    per_token = warmup_per_token(m.geometry, measured.tokens, measured.kv_bytes, kv)
    assert per_token["kv_bytes_per_token_predicted"] == m.geometry.n_layers * 2 * 128 * kv_float_bytes()
    assert per_token["kv_bytes_per_token_measured"] == pytest.approx(
        per_token["kv_bytes_per_token_predicted"], rel=0.01
    )
