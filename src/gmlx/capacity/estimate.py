"""The estimate answer: what one request would need, whether it fits, and when its first token comes."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from gmlx.capacity.memory import FP16, KVFormat, stream_bytes
from gmlx.capacity.table import CapacityTable
from gmlx.gguf.header import ModelGeometry


@dataclass(frozen=True)
class PrefillFit:
    """Prefill time as served: `fixed_s` a chunk plus `per_token_s` a token. A single rate
    misjudges short prompts, whose chunk pays a fixed cost, and the prompts it was not measured on."""

    fixed_s: float
    per_token_s: float

    def seconds(self, tokens: int, chunk: int) -> float:
        return math.ceil(tokens / chunk) * self.fixed_s + tokens * self.per_token_s if tokens > 0 else 0.0


def fit_prefill(chunks: Iterable[tuple[int, float]]) -> PrefillFit | None:
    """Least squares of seconds = fixed + tokens x per_token over served prefill steps (tokens,
    seconds; a step prefills a chunk of each prompt it takes); None until the steps span at least
    2x in length, or when the fit is not physical."""
    rows = [(float(n), t) for n, t in chunks if n > 0 and t > 0]
    if len(rows) < 2 or max(n for n, _ in rows) < 2 * min(n for n, _ in rows):
        return None
    slope, fixed = statistics.linear_regression([n for n, _ in rows], [t for _, t in rows])
    if slope <= 0:
        return None
    return PrefillFit(max(fixed, 0.0), slope)


def estimate(
    g: ModelGeometry,
    *,
    prompt_tokens: int,
    max_tokens: int | None,
    context_limit: int,
    prefill_bytes: int,
    free_now_bytes: int | None,
    free_drained_bytes: int | None,
    prefill_tok_s: float | None,
    queue_wait_s: float,
    prefill_fit: PrefillFit | None = None,
    prefill_step: int = 512,
    first_step_s: float = 0.0,
    warm_tokens: int = 0,
    cache_tier: str = "miss",
    resident: bool = True,
    kv: KVFormat = FP16,
    running: int = 0,
    longest: int = 0,
    choices: int = 1,
) -> dict:
    """The fields of POST /v1/estimate.

    need_bytes is one prefill chunk's working set plus the stream's memory (its KV cache as
    mlx_lm allocates it, and its logits rows) for the prompt and `max_tokens` more when set, for
    each of its `choices` (`n`: each choice is a row of its own, its own cache).
    context_ok says whether the request fits the window as the
    generation routes judge it: the prompt leaves room for one generated token, and the prompt
    plus `max_tokens`, when set, does not pass the window (else a 400 context_length_exceeded).
    est_ttft_s is the queue wait, plus the cold
    prompt tokens' prefill (by `prefill_fit` over chunks of `prefill_step` where the server has
    one, else at the measured prefill rate), plus one decode step (`first_step_s`: mlx_lm runs
    the prompt's last token as the first generation step); null without either.

    need_now_bytes is what joining the batch now costs, which fits_now is judged on: mlx_lm's
    batched caches pad every row to the longest, so beside `running` streams whose longest is
    `longest` tokens deep, the request takes a row of max(its depth, longest), and a request
    deeper than the rest pads theirs to its depth too.
    """
    depth = prompt_tokens + (max_tokens or 0)
    need = prefill_bytes + choices * stream_bytes(g, depth, kv)
    need_now = need
    if running:
        joined = max(depth, longest)
        need_now = (
            prefill_bytes + (running + choices) * stream_bytes(g, joined, kv) - running * stream_bytes(g, longest, kv)
        )
    cold = max(0, prompt_tokens - warm_tokens)
    prefill_s = (
        prefill_fit.seconds(cold, prefill_step) if prefill_fit else cold / prefill_tok_s if prefill_tok_s else None
    )
    ttft = round(queue_wait_s + prefill_s + first_step_s, 3) if prefill_s is not None else None
    return {
        "kind": "generation",
        "prompt_tokens": prompt_tokens,
        "warm_tokens": warm_tokens,
        "cache_tier": cache_tier,
        "need_bytes": need,
        "need_now_bytes": need_now,
        "fits_now": None if free_now_bytes is None else need_now <= free_now_bytes,
        "fits_drained": None if free_drained_bytes is None else need <= free_drained_bytes,
        "context_ok": prompt_tokens < context_limit and (max_tokens is None or depth <= context_limit),
        "context_limit": context_limit,
        "est_ttft_s": ttft,
        "resident": resident,
    }


def estimate_embedding(
    g: ModelGeometry,
    *,
    input_tokens: list[int],
    context_limit: int,
    prefill_bytes: int,
    free_now_bytes: int | None,
    free_drained_bytes: int | None,
    prefill_tok_s: float | None,
    queue_wait_s: float,
    prefill_fit: PrefillFit | None = None,
    prefill_step: int = 512,
    resident: bool = True,
    kv: KVFormat = FP16,
) -> dict:
    """The fields of POST /v1/estimate for an embeddings body (kind `embedding`).

    The engine embeds one input at a time through a cache of its own, beside the batch rather than
    padded into it, so need_bytes is a prefill chunk's working set plus the longest input's cache
    (as the metrics count a running embedding), now as once drained. context_ok: every input fits
    the window. est_ttft_s is the time to the answer, which an embedding gives all at once: the
    queue wait plus each input's prefill, as for a prompt; null without a measured rate.
    """
    need = prefill_bytes + stream_bytes(g, max(input_tokens), kv)
    if prefill_fit is not None:
        prefill_s: float | None = sum(prefill_fit.seconds(n, prefill_step) for n in input_tokens)
    else:
        prefill_s = sum(input_tokens) / prefill_tok_s if prefill_tok_s else None
    return {
        "kind": "embedding",
        "inputs": len(input_tokens),
        "prompt_tokens": sum(input_tokens),
        "warm_tokens": 0,  # embeddings do not use the prompt cache
        "cache_tier": "miss",
        "need_bytes": need,
        "need_now_bytes": need,
        "fits_now": None if free_now_bytes is None else need <= free_now_bytes,
        "fits_drained": None if free_drained_bytes is None else need <= free_drained_bytes,
        "context_ok": max(input_tokens) <= context_limit,
        "context_limit": context_limit,
        "est_ttft_s": round(queue_wait_s + prefill_s, 3) if prefill_s is not None else None,
        "resident": resident,
    }


def _not_loaded_terms(table: CapacityTable, free_now_bytes: int | None) -> dict:
    """What an estimate for a model that is not loaded reads: the table built for its header alone,
    fits_drained against the budget it would have served, no measured rate (est_ttft_s null)."""
    b = table.budget
    return {
        "context_limit": table.context_length,
        "prefill_bytes": b.prefill_bytes,
        "free_now_bytes": free_now_bytes,
        "free_drained_bytes": b.drained_bytes,
        "prefill_tok_s": None,
        "queue_wait_s": 0.0,
        "resident": False,
        "kv": table.kv,
    }


def estimate_not_loaded(
    table: CapacityTable,
    *,
    prompt_tokens: int,
    max_tokens: int | None,
    free_now_bytes: int | None,
    choices: int = 1,
) -> dict:
    """The estimate for a model that is not loaded (_not_loaded_terms)."""
    terms = _not_loaded_terms(table, free_now_bytes)
    return estimate(table.geometry, prompt_tokens=prompt_tokens, max_tokens=max_tokens, choices=choices, **terms)


def estimate_embedding_not_loaded(table: CapacityTable, *, input_tokens: list[int], free_now_bytes: int | None) -> dict:
    """estimate_not_loaded for an embeddings body."""
    return estimate_embedding(table.geometry, input_tokens=input_tokens, **_not_loaded_terms(table, free_now_bytes))
