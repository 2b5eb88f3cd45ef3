"""Log-probabilities of generated tokens, for the requests that ask (OpenAI's `logprobs`).

They are what mlx_lm hands the sampler: the log-softmax of a row's logits after its logits
processors (penalties, logit bias, a grammar's mask), before temperature and top-k/p/min-p.
Every row that asks is scored in one batched pass, so a step costs one top-k over the
vocabulary per row, not a Python loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

MAX_TOP = 20  # OpenAI's bound on top_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability and the most likely tokens at its position, best first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def score_logprobs(rows: list[mx.array], tokens: list[int], tops: list[int]) -> list[TokenLogprob]:
    """`rows[i]` is the log-probability vector `tokens[i]` was drawn from; `tops[i]` how many
    alternatives that request wants (0 to MAX_TOP)."""
    if not rows:
        return []
    lp = mx.stack(rows)
    chosen = mx.take_along_axis(lp, mx.array(tokens)[:, None], axis=-1)[:, 0]
    k = min(max(tops), lp.shape[-1])
    if k == 0:
        return [TokenLogprob(t, v) for t, v in zip(tokens, chosen.tolist())]
    ids = mx.argpartition(-lp, kth=k - 1, axis=-1)[:, :k]
    values = mx.take_along_axis(lp, ids, axis=-1)
    mx.eval(chosen, ids, values)
    out = []
    for t, v, row_ids, row_values, want in zip(tokens, chosen.tolist(), ids.tolist(), values.tolist(), tops):
        best = sorted(zip(row_ids, row_values), key=lambda p: (-p[1], p[0]))[:want]  # ties: as argmax, lowest id
        out.append(TokenLogprob(t, v, tuple(best)))
    return out
