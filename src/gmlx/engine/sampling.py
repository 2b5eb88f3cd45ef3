"""Per-request samplers: each stream samples with its own parameters and its own random key.

On the CPU a sampler is one gmlx.kernels node (an argmax, or a draw with the filters of
mlx_lm.sample_utils applied in its order, the same distribution): MLX's CPU sort, cumsum and
categorical are scalar and single-threaded, and over gemma3's 262,144-token vocabulary they
took 4.4 ms a row at a temperature and 26 ms with top_p, beside a 5 ms decode step per row.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from gmlx import kernels

Sampler = Callable[[mx.array], mx.array]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0 or self.top_k == 1


def greedy(logprobs: mx.array) -> mx.array:
    """The most likely token of each row (over the last axis). Samplers take logits or
    log-probabilities alike: each gives the same draw for a row shifted by a constant."""
    if kernels.available():
        return kernels.extension().argmax(logprobs, stream=mx.cpu)
    return mx.argmax(logprobs, axis=-1)


class Draw:
    """A sampled request's sampler over log-probabilities (or logits: each draw is invariant to a
    shift of its row). It carries its own key, split every step, so a seeded request repeats
    whatever else runs beside it. With `on_error`, a failure to build the draw is reported there
    and the row gets a placeholder token (the argmax), which the caller must not emit: a raise
    inside a batch's step would fail every request in it."""

    def __init__(self, params: SamplingParams, on_error: Callable[[Exception], None] | None = None):
        self.params = params
        self.on_error = on_error
        self.fused = kernels.available()  # drawn by gmlx.kernels' node, else by MLX's ops
        self._key = mx.random.key(params.seed if params.seed is not None else secrets.randbits(63))

    def settings(self) -> list[float]:
        """The row's settings as gmlx.kernels' sample_rows takes them."""
        p = self.params
        return [p.temperature, p.top_p, p.min_p, float(p.top_k)]

    def uniform(self, rows: int) -> mx.array:
        """This step's draws for `rows` rows, from the next key."""
        return mx.random.uniform(shape=(rows,), key=self._next_key())

    def __call__(self, logprobs: mx.array) -> mx.array:
        try:
            return self._draw(logprobs)
        except Exception as e:
            if self.on_error is None:
                raise
            self.on_error(e)
            return greedy(logprobs)

    def _next_key(self) -> mx.array:
        self._key, step_key = mx.random.split(self._key)
        return step_key

    def _draw(self, logprobs: mx.array) -> mx.array:
        p = self.params
        if self.fused:
            u = self.uniform(logprobs.size // logprobs.shape[-1]).reshape(logprobs.shape[:-1])
            return kernels.extension().sample(
                logprobs, u, temperature=p.temperature, top_p=p.top_p, min_p=p.min_p, top_k=p.top_k, stream=mx.cpu
            )
        if 0 < p.top_p < 1:  # mlx_lm's top_p sums exp(row): it must be normalised
            logprobs = apply_top_p(logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True), p.top_p)
        if p.min_p > 0:
            logprobs = apply_min_p(logprobs, p.min_p)
        if p.top_k > 0:
            logprobs = apply_top_k(logprobs, p.top_k)
        return mx.random.categorical(logprobs * (1 / p.temperature), key=self._next_key())


def make_sampler(p: SamplingParams, on_error: Callable[[Exception], None] | None = None) -> Sampler:
    """A sampler over log-probabilities: `greedy` itself for greedy requests, so a batch of them
    samples in one call; else a Draw of the request's own."""
    return greedy if p.greedy else Draw(p, on_error)


def sample_rows(logprobs: mx.array, samplers: Sequence[Sampler]) -> mx.array:
    """Row e of `logprobs` (B, V) drawn by samplers[e]. Rows that share a sampler take one call.
    Mixed greedy rows and Draws go to one gmlx.kernels node that draws the rows in parallel, each
    with its own settings and its own key's draw, so each row gets the token it gets alone (a
    call per row ran them in series on one thread: with top_p, 0.13 to 1.2 ms a row over gemma3's
    vocabulary). Other samplers, and Draws whose node fails to build, take a call per row."""
    if all(s is samplers[0] for s in samplers):
        return samplers[0](logprobs)
    if kernels.available() and all(s is greedy or (isinstance(s, Draw) and s.fused) for s in samplers):
        try:
            u = mx.concatenate([s.uniform(1) if isinstance(s, Draw) else mx.zeros((1,)) for s in samplers])
            settings = mx.array([s.settings() if isinstance(s, Draw) else [0.0, 1.0, 0.0, 0.0] for s in samplers])
            return kernels.extension().sample_rows(logprobs, u, settings, stream=mx.cpu)
        except Exception:  # each row's own call reports its own failure
            pass
    return mx.concatenate([s(logprobs[e : e + 1]) for e, s in enumerate(samplers)], axis=0)
