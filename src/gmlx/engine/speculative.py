"""Speculative decoding for one stream: a drafter proposes, the served model verifies.

The engine decodes every request in mlx_lm's BatchGenerator. When a drafter is loaded and a
single request is running alone, the engine takes that request's cache out of the batch and
runs it here, in a "lane", one draft-and-verify round at a time; when another request arrives
it hands the stream back with `release()`. mlx_lm's `speculative_generate_step` is the model
for each round (greedy or sampled drafting, verification of every draft in one forward pass of
the served model, both caches trimmed back by what was rejected); what this module adds is a
stream that can be entered and left mid-generation, with its caches consistent at each end.

Exactness: every token that comes out is the served model's own choice (its sampler applied to
its logits at that position, given the tokens before it), so under greedy sampling the output
is the non-speculative output token for token; the drafter only decides how many of those
choices one forward pass yields. A sampled request keeps the served model's distribution, but
not the non-speculative run's exact tokens under a seed: the sampler is called a different
number of times.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx import nn
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache, trim_prompt_cache

from gmlx.engine.sampling import Sampler, greedy
from gmlx.upstream import layer_by_layer

DEFAULT_NUM_DRAFT = 3


@dataclass
class SpeculativeCounters:
    """A request's (or the engine's lifetime) drafting figures; the `speculative` of a request row.

    `rounds` counts draft-and-verify rounds that drafted at least one token; `drafted` the tokens
    the drafter proposed, `accepted` those the served model agreed with; `emitted` every token the
    lane produced (accepted drafts plus one of the served model's own per forward pass).
    `batched` is True once the request has decoded in the batch without the drafter.
    """

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    batched: bool = False

    @property
    def accept_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tokens_per_round(self) -> float | None:
        return self.emitted / self.rounds if self.rounds else None

    def add(self, other: SpeculativeCounters) -> None:
        """Fold another request's figures into these (the engine's lifetime totals)."""
        self.rounds += other.rounds
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.emitted += other.emitted

    def to_json(self) -> dict[str, Any]:
        rate = self.accept_rate
        return {
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "emitted": self.emitted,
            "accept_rate": None if rate is None else round(rate, 4),
            "batched": self.batched,
        }


def _window(cache: Sequence[Any]) -> int | None:
    """The smallest sliding window among the caches (None: no rotating cache)."""
    return min((c.max_size for c in cache if isinstance(c, RotatingKVCache)), default=None)


def _describe(c: Any) -> str:
    if isinstance(c, RotatingKVCache):
        return f"its sliding-window cache is past its {c.max_size}-token window"
    return f"its {type(c).__name__} cannot be trimmed"


def can_speculate(cache: Sequence[Any], tokens: int | None = None, num_draft: int = 1) -> str | None:
    """None when a stream whose served-model cache is `cache` can run speculatively, else why not.

    Rejected drafts are taken back out of the cache, so every layer's cache must be trimmable:
    a sliding-window cache (RotatingKVCache) is only while it holds fewer tokens than its window,
    since past it the oldest entries have been overwritten. With `tokens` (the stream's length,
    history and pending) the check also looks ahead: a round that would verify `num_draft` drafts
    must leave every sliding cache below its window. Quantized KV caches trim exactly and pass.
    """
    if not cache:
        return "the model has no KV cache"
    for c in cache:
        if type(c).__name__.startswith("Batch"):
            return f"its cache is a batch's ({type(c).__name__}); extract one stream's cache first"
        if not c.is_trimmable():
            return _describe(c)
    window = _window(cache)
    if tokens is not None and window is not None and tokens + num_draft >= window:
        return f"{tokens} tokens and {num_draft} draft(s) reach the {window}-token sliding window"
    return None


class SpeculativeStream:
    """One request decoding speculatively.

    `cache` is the served model's KV for the `history` tokens; `pending` (at least one token) are
    tokens chosen but not yet in that cache: after the prompt, its last token; inside a generation,
    the newest token. The drafter's own cache is made here and filled from history and pending at
    the first round. Each `round` returns the next tokens; `release` returns (cache, history,
    pending) in the same sense, for mlx_lm's `BatchGenerator.insert`.
    """

    def __init__(
        self,
        model: nn.Module,
        draft_model: nn.Module,
        cache: list[Any],
        history: Sequence[int],
        pending: Sequence[int],
        sampler: Sampler | None = None,
        num_draft: int = DEFAULT_NUM_DRAFT,
        draft_sampler: Sampler | None = None,
        prefill_step: int = 512,
        draft_state: tuple[list[Any], int] | None = None,
    ):
        if not pending:
            raise ValueError("a speculative stream needs at least one pending token")
        if num_draft < 1:
            raise ValueError("num_draft must be at least 1")
        if (why := can_speculate(cache)) is not None:
            raise ValueError(f"cannot decode speculatively: {why}")
        self.model, self.draft_model = model, draft_model
        self.cache = cache
        self.history: list[int] = list(history)
        self.pending: list[int] = list(pending)
        self.sampler = sampler or greedy
        self.draft_sampler = draft_sampler or self.sampler
        self.num_draft = num_draft
        self.prefill_step = prefill_step
        self.counters = SpeculativeCounters()
        self._draft_cache: list[Any] | None = None  # filled at the first round
        self._draft_len = 0  # how many tokens of history + pending the drafter's cache holds
        if draft_state is not None:  # an earlier lane's drafter cache for this request: catch up from it
            self._draft_cache, self._draft_len = draft_state
        self.draft_state: tuple[list[Any], int] | None = None  # set by release()
        # Both caches must stay below the smallest sliding window to remain trimmable.
        windows = [w for w in (_window(cache), _window(make_prompt_cache(draft_model))) if w is not None]
        self._window = min(windows, default=None)
        self._released = False

    @classmethod
    def from_batch(
        cls, model: nn.Module, draft_model: nn.Module, cache: list[Any], tokens: Sequence[int], **kw: Any
    ) -> SpeculativeStream:
        """A stream from what `BatchGenerator.remove(..., return_prompt_caches=True)` returns for a
        decoding request: its cache holds `tokens`, the last of them the newest token emitted (the
        batch's next token, sampled ahead, is dropped). That last token is trimmed back out of the
        cache to become pending, so the first round recomputes the batch's dropped token."""
        tokens = list(tokens)
        if len(tokens) < 2:
            raise ValueError("a stream taken from the batch needs at least two tokens in its cache")
        if (why := can_speculate(cache)) is not None:
            raise ValueError(f"cannot decode speculatively: {why}")
        if trim_prompt_cache(cache, 1) != 1:
            raise ValueError("cannot decode speculatively: trimming the cache failed")
        return cls(model, draft_model, cache, tokens[:-1], tokens[-1:], **kw)

    # --- counters -------------------------------------------------------------------------

    @property
    def rounds(self) -> int:
        return self.counters.rounds

    @property
    def drafted(self) -> int:
        return self.counters.drafted

    @property
    def accepted(self) -> int:
        return self.counters.accepted

    @property
    def accept_rate(self) -> float | None:
        return self.counters.accept_rate

    @property
    def length(self) -> int:
        return len(self.history) + len(self.pending)

    def headroom(self) -> int:
        """How many tokens the next round may draft before a sliding cache would reach its window."""
        if self._window is None:
            return self.num_draft
        return max(0, min(self.num_draft, self._window - 1 - self.length))

    def reason(self) -> str | None:
        """None while the next round can draft; else why this stream should go back to the batch."""
        if self._released:
            return "released"
        if self.headroom() == 0:
            return f"{self.length} tokens reach the {self._window}-token sliding window"
        return None

    # --- rounds ---------------------------------------------------------------------------

    def _run(self, model: nn.Module, cache: list[Any], tokens: Sequence[int]) -> mx.array:
        """Feed tokens through a model in prefill-sized chunks; the last position's logits."""
        tokens = list(tokens)
        while len(tokens) > self.prefill_step:
            with layer_by_layer(model):
                model(mx.array(tokens[: self.prefill_step])[None], cache=cache)
            mx.eval([c.state for c in cache])
            tokens = tokens[self.prefill_step :]
        return model(mx.array(tokens)[None], cache=cache)[:, -1, :]

    def _draft(self, k: int) -> mx.array:
        """The drafter's k proposals after history + pending (lazy, shape (k,)).

        On return the drafter's cache holds history + pending + the first k-1 drafts."""
        seq = self.history + self.pending
        if self._draft_cache is None:
            self._draft_cache = make_prompt_cache(self.draft_model)
        if self._draft_len >= len(seq):  # never by construction; keep one token to feed
            trim_prompt_cache(self._draft_cache, self._draft_len - len(seq) + 1)
            self._draft_len = len(seq) - 1
        logits = self._run(self.draft_model, self._draft_cache, seq[self._draft_len :])
        drafts = []
        for i in range(k):
            y = self.draft_sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
            mx.async_eval(y)
            drafts.append(y)
            if i < k - 1:
                logits = self.draft_model(y[None], cache=self._draft_cache)[:, -1, :]
        self._draft_len = len(seq) + k - 1
        return mx.concatenate(drafts)

    def round(self, max_new: int, stop_tokens: Collection[int] = ()) -> list[int]:
        """One draft-and-verify round: 1 to min(num_draft + 1, max_new) new tokens.

        The served model runs once over pending + drafts; the drafts it agrees with come back,
        then its own token at the first disagreement (or after the last draft). Output stops
        after the first of `stop_tokens` (an EOS) so the caches never run past it. Both caches
        are trimmed so that the served one holds `history` and the last token is `pending`.
        """
        if self._released:
            raise RuntimeError("the stream was released")
        if max_new < 1:
            return []
        k = min(self.num_draft, max_new - 1, self.headroom())
        pending = self.pending
        if k > 0:
            drafts = self._draft(k)
            inputs = mx.concatenate([mx.array(pending, dtype=mx.uint32), drafts.astype(mx.uint32)])
        else:
            drafts = None
            inputs = mx.array(pending, dtype=mx.uint32)
        if len(pending) > self.prefill_step:  # a long pending run: prefill all but the last chunk
            self._run(self.model, self.cache, pending[:-1])
            inputs = inputs[len(pending) - 1 :]
        logits = self.model(inputs[None], cache=self.cache)[0, -(k + 1) :, :]
        tokens = self.sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        if drafts is not None:
            mx.eval(tokens, drafts)
            proposed = drafts.tolist()
        else:
            mx.eval(tokens)
            proposed = []
        chosen = tokens.tolist()
        n = 0
        while n < k and chosen[n] == proposed[n]:
            n += 1
        out = chosen[: n + 1]
        for i, t in enumerate(out):
            if t in stop_tokens:
                out = out[: i + 1]
                break

        # The served cache holds pending + all k drafts; keep pending + out[:-1].
        served_trim = k - (len(out) - 1)
        if served_trim > 0:
            trim_prompt_cache(self.cache, served_trim)
        if k > 0:  # the drafter's holds history + pending + k - 1 drafts; keep at most out[:-1]
            draft_keep = min(len(out) - 1, k - 1)
            if (k - 1) - draft_keep > 0:
                trim_prompt_cache(self._draft_cache, (k - 1) - draft_keep)
            self._draft_len = len(self.history) + len(pending) + draft_keep
            c = self.counters
            c.rounds += 1
            c.drafted += k
            c.accepted += n
        self.counters.emitted += len(out)
        self.history.extend(pending)
        self.history.extend(out[:-1])
        self.pending = out[-1:]
        return out

    def release(self) -> tuple[list[Any], list[int], list[int]]:
        """Hand the stream back: (served cache, the tokens it holds, pending tokens).
        `BatchGenerator.insert([pending], ..., caches=[cache], all_tokens=[history])` continues the
        request without the drafter. The drafter's cache and how many of the request's tokens it
        holds stay in `draft_state`: passed to a later stream of the same request (`draft_state=`),
        the drafter catches up on the tokens decoded meanwhile instead of prefilling them all;
        dropped, it frees the drafter's KV."""
        self._released = True
        if self._draft_cache is not None:
            self.draft_state = (self._draft_cache, self._draft_len)
        self._draft_cache = None
        return self.cache, list(self.history), list(self.pending)


def plain_round(model: nn.Module, cache: list[Any], pending: Sequence[int], sampler: Sampler | None = None) -> int:
    """One ordinary decode step on a single stream (no drafter): feed pending, sample one token."""
    logits = model(mx.array(pending, dtype=mx.uint32)[None], cache=cache)[:, -1, :]
    y = (sampler or greedy)(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    return int(y.item())
