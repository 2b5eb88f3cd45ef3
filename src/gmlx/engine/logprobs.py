"""Log-probabilities of generated tokens, for the requests that ask (OpenAI's `logprobs`).

They are the log-softmax of the row the sampler drew from: the logits after the row's logits
processors (penalties, logit bias, a grammar's mask), before temperature and top-k/p/min-p.
The engine's decode step samples from the logits unnormalised (gmlx.upstream.own_steps),
so only the rows that ask are normalised, here. Every row that asks is scored in one batched
pass, so a step costs one top-k over the vocabulary per row, not a Python loop, and the pass is
part of the step's own graph: scored after the step, a row waited for the step after it (MLX
runs one ahead), and the engine built no graph meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from gmlx import kernels

MAX_TOP = 20  # OpenAI's bound on top_logprobs
_BLOCK = 1024  # entries per block of top_k's first pass


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability and the most likely tokens at its position, best first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


# A row's scores, lazily: its token's log-probability (a scalar), then, where alternatives were
# asked for, the ids and log-probabilities of the row's k most likely tokens, unordered.
Scored = tuple[mx.array, ...]


def score_rows(logits: mx.array, tokens: mx.array, tops: list[int | None]) -> list[Scored | None]:
    """Row e's Scored where tops[e] (alternatives wanted, 0 to MAX_TOP) is not None, else None:
    `logits` (B, V) is what `tokens` (B,) were drawn from. Every row that asks is scored in one
    batched graph, built lazily, so that it runs with the step that drew the tokens."""
    rows = [e for e, want in enumerate(tops) if want is not None]
    if not rows:
        return [None] * len(tops)
    if len(rows) < len(tops):
        at = mx.array(rows)
        logits, tokens = logits[at], tokens[at]
    k = min(max(tops[e] or 0 for e in rows), logits.shape[-1])
    if kernels.available():  # one node, the rows in parallel: no (B, V) log-softmax written out
        chosen, ids, values = kernels.extension().logprob_top(logits, tokens, k, stream=mx.cpu)
    else:
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        chosen = mx.take_along_axis(lp, tokens[:, None].astype(mx.int32), axis=-1)[:, 0]
        ids, values = top_k(lp, k) if k else (None, None)
    out: list[Scored | None] = [None] * len(tops)
    for j, e in enumerate(rows):
        out[e] = (chosen[j], ids[j], values[j]) if k else (chosen[j],)
    return out


def token_logprob(scored: Scored, token: int, want: int) -> TokenLogprob:
    """A scored row, evaluated, as the TokenLogprob of `token` with its `want` best alternatives."""
    if want == 0 or len(scored) == 1:
        return TokenLogprob(token, scored[0].item())
    pairs = zip(scored[1].tolist(), scored[2].tolist())
    best = sorted(pairs, key=lambda p: (-p[1], p[0]))[:want]  # ties: as argmax, lowest id
    return TokenLogprob(token, scored[0].item(), tuple(best))


def top_k(x: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """The ids and values of each row's k largest entries, unordered. MLX's CPU partition of a
    262,144-wide row takes about 3 ms, a fifth of a decode step for 8 rows; so the row is cut in
    blocks, and only the k blocks with the largest maxima, which hold the k largest entries
    (a block without one has a maximum below k others), are partitioned."""
    n, width = x.shape
    if width <= _BLOCK * k:
        ids = mx.argpartition(-x, kth=k - 1, axis=-1)[:, :k]
        return ids, mx.take_along_axis(x, ids, axis=-1)
    blocks_n = -(-width // _BLOCK)
    if blocks_n * _BLOCK != width:
        x = mx.concatenate([x, mx.full((n, blocks_n * _BLOCK - width), -mx.inf, dtype=x.dtype)], axis=-1)
    blocks = x.reshape(n, blocks_n, _BLOCK)
    best = mx.argpartition(-blocks.max(axis=-1), kth=k - 1, axis=-1)[:, :k]
    candidates = mx.take_along_axis(blocks, best[:, :, None], axis=1).reshape(n, k * _BLOCK)
    picked = mx.argpartition(-candidates, kth=k - 1, axis=-1)[:, :k]
    ids = mx.take_along_axis(best, picked // _BLOCK, axis=-1) * _BLOCK + picked % _BLOCK
    return ids, mx.take_along_axis(candidates, picked, axis=-1)
