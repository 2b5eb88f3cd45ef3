"""Samplers: gmlx.kernels' argmax and filtered draw give what mlx_lm's filters and MLX's ops give."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import needs_kernels
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from gmlx import kernels
from gmlx.engine.sampling import SamplingParams, greedy, make_sampler, sample_rows


def reference_probs(logprobs: np.ndarray, temperature: float, top_p: float, min_p: float, top_k: int) -> np.ndarray:
    """The distribution MLX's own sampler draws from: mlx_lm's filters in gmlx's order, then the temperature."""
    x = mx.array(logprobs)[None]
    if 0 < top_p < 1:
        x = apply_top_p(x, top_p)
    if min_p > 0:
        x = apply_min_p(x, min_p)
    if top_k > 0:
        x = apply_top_k(x, top_k)
    return np.array(mx.softmax(x * (1 / temperature), axis=-1))[0]


def logprobs_of(logits: np.ndarray) -> np.ndarray:
    finite = logits[np.isfinite(logits)].astype(np.float64)
    return (logits - (finite.max() + np.log(np.exp(finite - finite.max()).sum()))).astype(np.float32)


@needs_kernels
@pytest.mark.parametrize(
    "temperature,top_p,min_p,top_k",
    [
        (0.7, 1.0, 0.0, 0),
        (1.0, 0.9, 0.0, 0),
        (0.8, 1.0, 0.05, 0),
        (1.2, 1.0, 0.0, 40),
        (0.7, 0.95, 0.02, 50),
        (1.0, 0.5, 0.0, 3),
        (1.0, 0.999, 0.0, 0),
    ],
)
@pytest.mark.parametrize("spread", [3.0, 0.5])  # peaked, and flat (most of the vocabulary in the nucleus)
def test_sample_draws_the_filtered_distribution(temperature, top_p, min_p, top_k, spread, isa):
    # u on an even grid of n points: each token gets n times its probability, to within one draw
    rng = np.random.default_rng(3)
    V, n = 2000, 10000
    logits = rng.standard_normal(V).astype(np.float32) * spread
    logits[11] = logits[17]  # a tie
    logits[[5, 600]] = -np.inf  # masked tokens
    lp = logprobs_of(logits)
    want = reference_probs(lp, temperature, top_p, min_p, top_k)
    u = mx.array(((np.arange(n) + 0.5) / n).astype(np.float32))
    x = mx.broadcast_to(mx.array(lp)[None], (n, V))
    got = np.array(kernels.extension().sample(x, u, temperature=temperature, top_p=top_p, min_p=min_p, top_k=top_k))
    counts = np.bincount(got, minlength=V)
    assert np.abs(counts - n * want).max() <= 1.01
    assert counts[5] == counts[600] == 0


@needs_kernels
def test_greedy_is_the_first_maximum(isa):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 3, 262_144)).astype(np.float32)
    x[0, 1, [9, 70_000]] = 50.0  # tied: the first wins, as in mx.argmax
    x[1, 2, -1] = 60.0  # past the last whole vector
    got = greedy(mx.array(x))
    assert got.shape == (2, 3) and got.dtype == mx.uint32
    np.testing.assert_array_equal(np.array(got), np.array(mx.argmax(mx.array(x), axis=-1)))
    assert int(got[0, 1]) == 9 and int(got[1, 2]) == 262_143


@pytest.mark.parametrize("fused", [True, False] if kernels.available() else [False])
def test_seeded_sampler_repeats_and_keeps_inside_the_filters(fused, monkeypatch):
    if not fused:
        monkeypatch.setattr(kernels, "available", lambda: False)
    rng = np.random.default_rng(5)
    lp = mx.array(logprobs_of(rng.standard_normal((1, 2000)).astype(np.float32) * 2))
    params = SamplingParams(temperature=0.9, top_p=0.8, top_k=20, seed=42)
    allowed = np.flatnonzero(reference_probs(np.array(lp)[0], 0.9, 0.8, 0.0, 20))
    a, b = make_sampler(params), make_sampler(params)
    draws_a = [int(a(lp)[0]) for _ in range(40)]
    assert draws_a == [int(b(lp)[0]) for _ in range(40)]
    assert set(draws_a) <= set(allowed.tolist()) and len(set(draws_a)) > 1
    other = make_sampler(SamplingParams(temperature=0.9, top_p=0.8, top_k=20, seed=43))
    assert [int(other(lp)[0]) for _ in range(40)] != draws_a
    assert make_sampler(SamplingParams(temperature=0.0)) is greedy


@needs_kernels
def test_bad_sampling_arguments_raise():
    ext = kernels.extension()
    x = mx.zeros((2, 8))
    with pytest.raises(ValueError):
        ext.sample(x, mx.zeros((3,)), temperature=1.0)
    with pytest.raises(ValueError):
        ext.sample(x, mx.zeros((2,)), temperature=1.0, top_k=-1)
    with pytest.raises(ValueError):
        ext.argmax(mx.zeros((2, 0)))


@needs_kernels
def test_each_row_draws_with_its_own_settings(isa):
    rng = np.random.default_rng(6)
    settings = [(0.0, 1.0, 0.0, 0), (0.7, 0.9, 0.0, 0), (1.0, 1.0, 0.05, 0), (1.2, 0.95, 0.0, 5), (0.9, 1.0, 0.0, 1)]
    x = mx.array(rng.standard_normal((len(settings), 5000)).astype(np.float32) * 2)
    ext = kernels.extension()
    for step in range(20):
        u = mx.array(rng.random(len(settings)).astype(np.float32))
        got = np.array(ext.sample_rows(x, u, mx.array(settings)))
        alone = [
            int(ext.sample(x[r : r + 1], u[r : r + 1], temperature=t, top_p=p, min_p=m, top_k=k)[0])
            for r, (t, p, m, k) in enumerate(settings)
        ]
        assert got.tolist() == alone, step
    with pytest.raises(ValueError):
        ext.sample_rows(x, mx.zeros((len(settings),)), mx.zeros((len(settings), 3)))


@pytest.mark.parametrize("fused", [True, False] if kernels.available() else [False])
def test_a_batch_draws_each_row_as_its_own_sampler_would_alone(fused, monkeypatch):
    # The engine draws a step's rows together (one node); each seeded row must get the tokens it
    # gets drawn alone, step after step, whatever its neighbours ask for.
    if not fused:
        monkeypatch.setattr(kernels, "available", lambda: False)
    rng = np.random.default_rng(7)
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=1),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=20, seed=2),
        SamplingParams(temperature=0.6, min_p=0.1, seed=3),
    ]
    batched = [make_sampler(p) for p in params]
    alone = [make_sampler(p) for p in params]
    for _ in range(10):
        lp = mx.array(logprobs_of(rng.standard_normal((len(params), 3000)).astype(np.float32) * 2))
        got = sample_rows(lp, batched).tolist()
        assert got == [int(s(lp[e : e + 1])[0]) for e, s in enumerate(alone)]
        assert got[1] == int(np.argmax(np.array(lp[1])))
