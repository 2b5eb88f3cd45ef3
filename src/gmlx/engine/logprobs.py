"""Log-probabilities of generated tokens, for the requests that ask (OpenAI's `logprobs`).

They are the log-softmax of the row the sampler drew from: the logits after the row's logits
processors (penalties, logit bias, a grammar's mask), before temperature and top-k/p/min-p.
The engine's decode step samples from the logits unnormalised (gmlx.upstream.decode_on_logits),
so only the rows that ask are normalised, here. Every row that asks is scored in one batched
pass, so a step costs one top-k over the vocabulary per row, not a Python loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

MAX_TOP = 20  # OpenAI's bound on top_logprobs
_BLOCK = 1024  # entries per block of top_k's first pass


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability and the most likely tokens at its position, best first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def score_logprobs(rows: list[mx.array], tokens: list[int], tops: list[int]) -> list[TokenLogprob]:
    """`rows[i]` is the logits (or log-probability) vector `tokens[i]` was drawn from; `tops[i]`
    how many alternatives that request wants (0 to MAX_TOP)."""
    if not rows:
        return []
    lp = mx.stack(rows)
    lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(lp, mx.array(tokens)[:, None], axis=-1)[:, 0]
    k = min(max(tops), lp.shape[-1])
    if k == 0:
        return [TokenLogprob(t, v) for t, v in zip(tokens, chosen.tolist())]
    ids, values = top_k(lp, k)
    mx.eval(chosen, ids, values)
    out = []
    for t, v, row_ids, row_values, want in zip(tokens, chosen.tolist(), ids.tolist(), values.tolist(), tops):
        best = sorted(zip(row_ids, row_values), key=lambda p: (-p[1], p[0]))[:want]  # ties: as argmax, lowest id
        out.append(TokenLogprob(t, v, tuple(best)))
    return out


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
