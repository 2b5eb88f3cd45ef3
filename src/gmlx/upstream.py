"""Every reach into a library's private parts, in one place, with the version it was checked against.

gmlx leans on a few things mlx_lm, uvicorn and typer do not promise. Each is named here once;
the rest of gmlx calls these functions, and `tests/test_upstream.py` checks each one's behaviour
on the installed version, so an upgrade that changes one fails there, by name, rather than deep
in a request. `pyproject.toml` pins mlx-lm and uvicorn to the ranges checked.

The libraries are imported when first used: `gmlx top` and the completions must not pay for
mlx_lm, and mlx must be imported after gmlx.platform's BLAS bring-up.
"""

from __future__ import annotations

import functools
import signal
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from types import MethodType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator, GenerationBatch, PromptProcessingBatch
    from mlx_lm.models.cache import BatchKVCache
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from transformers import PreTrainedTokenizerFast
    from uvicorn import Server

CHECKED = {"mlx-lm": "0.32.2", "uvicorn": "0.54.0", "typer": "0.29.2"}


def __getattr__(name: str) -> Any:
    """The class gmlx subclasses, resolved when first asked for (PEP 562)."""
    if name == "H11Protocol":  # gmlx.server.connections relies on its cycle, conn, transport and connections
        from uvicorn.protocols.http.h11_impl import H11Protocol

        return H11Protocol
    raise AttributeError(name)


# --- mlx_lm -------------------------------------------------------------------------------


def hf_tokenizer(wrapper: TokenizerWrapper) -> PreTrainedTokenizerFast:
    """The transformers tokenizer a TokenizerWrapper holds (it forwards most calls, not all)."""
    return wrapper._tokenizer


def right_padding(cache: BatchKVCache) -> mx.array | None:
    """Per row, the padding slots after a right-padded prefill chunk's real tokens (None outside one)."""
    return cache._right_padding


def filled(cache: BatchKVCache) -> int:
    """Slots a BatchKVCache has written along the sequence axis (its keys may be longer)."""
    return cache._idx


def set_filled(cache: BatchKVCache, slots: int) -> None:
    cache._idx = slots


# Row e of a (B, V) array drawn by samplers[e] (gmlx.engine.sampling.sample_rows).
SampleRows = Callable[["mx.array", list[Callable]], "mx.array"]
# What each row's response carries as its `logprobs`, from the step's logits (B, V) after the
# processors, its sampled tokens (B,) and the rows' uids: MLX arrays (or tuples of them), built
# lazily and evaluated with the step, or None (gmlx.engine.logprobs.score_rows).
KeepRows = Callable[["mx.array", "mx.array", list[int]], list[Any]]
# Takes a decode step's responses as soon as their tokens are read (Slotted.next).
Deliver = Callable[[list[Any]], None]


HOLE = -1  # the uid of a decode batch's row that no request holds


def own_steps(
    gen: BatchGenerator,
    keep: KeepRows,
    keep_last_apart: Callable[[int], bool],
    sample_rows: SampleRows,
    deliver: Deliver = lambda responses: None,
    least_chunk: int = 16,  # the engine passes its prefill budget's least_chunk
) -> None:
    """Make `gen` take gmlx's steps (mlx-lm 0.32's, changed where said):

    - a decode step that samples from the logits as they come, each row drawn by `sample_rows`,
      and keeps what `keep` makes of each row as its response's `logprobs` (`_step_on_logits`);
    - its responses handed to `deliver` once their tokens are read: where they hold a row's
      first token or every row's last, before the step after is queued whole
      (`_step_on_logits`, `_slotted_batch`); next() still returns them;
    - a prompt's first token sampled from its last prefill chunk, and no prompt's chunk longer
      than what the prompt ending soonest has left, or `least_chunk` (`_next_first_token_in_prefill`);
    - each prefill chunk run layer by layer, so it holds one layer's activations at a time, as
      the capacity table counts (`_prefill`, `layer_by_layer`);
    - a decode batch whose rows keep their slots, so a row joining or leaving moves only its own
      KV cache (`_slotted_batch`).
    """
    batch = gen._generation_batch = _slotted_batch().empty(gen.model, gen.sampler)
    batch.keep, batch.sample_rows, batch.deliver = keep, sample_rows, deliver
    gen._next = MethodType(
        lambda g: _next_first_token_in_prefill(g, keep, keep_last_apart, sample_rows, least_chunk), gen
    )


def _step_on_logits(batch: GenerationBatch, keep: KeepRows, sample_rows: SampleRows) -> tuple[list[int], list]:
    """GenerationBatch._step, as of mlx-lm 0.32, without the normalisation: run the model on the
    tokens sampled last step, apply each row's logits processors, sample, and start evaluating
    that while the caller reads the last step's tokens.

    MLX's async_eval keeps at most 10 of a graph's nodes queued ahead of the stream thread, so
    queuing a whole step returns only when it is 83-90 % done, and tokens read after it reach
    their clients a step after they were computed. Where that step holds a row's first token,
    or where every row ends by its length (the step after runs for no one), only the step's
    first layer is queued here (its KV cache, where the first layer has one), the last step's
    tokens read, and the rest queued by `finish_step` once the caller has handed them out.
    Not every step: with only the first layer's few nodes queued, the stream thread runs dry
    while the tokens go out (default model, 1-3 % of the decode rate when every step did).

    mlx_lm's step turns each row into log-probabilities (`logits - logsumexp(logits)`) before
    sampling; over a 262,144-token vocabulary that is a single-threaded pass of about 3 ms a
    row, a tenth of a step at width 8. gmlx's samplers do not need it (each is invariant to a
    shift of its row, engine/sampling.py), and a request that asks for logprobs has its own row
    normalised (engine/logprobs.py). So a response's `logprobs` is what `keep` makes of its row,
    computed in the step's own graph (read a step later, it never waits for the step after).
    """
    import mlx.core as mx

    batch._current_tokens, batch._current_logprobs = batch._next_tokens, batch._next_logprobs
    inputs = batch._current_tokens
    logits = batch.model(inputs[:, None], cache=batch.prompt_cache)[:, -1, :]
    contexts: list[mx.array] = []

    def context(e: int) -> mx.array:
        contexts.append(batch._token_context[e].update_and_fetch(inputs[e : e + 1]))
        return contexts[-1]

    logits, sampled = _sample(
        logits, batch.logits_processors, context, batch.samplers, batch.fallback_sampler, sample_rows
    )
    batch._next_tokens = sampled
    batch._next_logprobs = keep(logits, sampled, batch.uids)
    batch._queued = (sampled, [r for r in batch._next_logprobs if r is not None], contexts)
    live = [(n, limit) for n, limit, uid in zip(batch._num_tokens, batch.max_tokens, batch.uids) if uid != HOLE]
    early = any(n == 0 for n, _ in live) or all(n + 1 >= limit for n, limit in live)
    first = getattr(batch.prompt_cache[0], "keys", None) if early and batch.prompt_cache else None
    if first is not None:
        mx.async_eval(first)
    else:
        finish_step(batch)
    mx.eval(inputs, [r for r in batch._current_logprobs if r is not None])
    tokens = inputs.tolist()
    for history, token in zip(batch.tokens, tokens):
        history.append(token)
    return tokens, batch._current_logprobs


def finish_step(batch: GenerationBatch) -> None:
    """Queue the rest of the step `_step_on_logits` built (once)."""
    import mlx.core as mx

    if (queued := batch._queued) is not None:
        batch._queued = None
        mx.async_eval(*queued)


def _sample(
    logits: mx.array,
    processors: list[list[Callable]],
    context: Callable[[int], mx.array],
    samplers: list[Callable | None],
    fallback: Callable,
    sample_rows: SampleRows,
) -> tuple[mx.array, mx.array]:
    """Each row's logits through its processors (given `context(row)`, the tokens before), then
    its sampler (`sample_rows`). Returns the processed logits and tokens."""
    import mlx.core as mx

    if any(processors):
        rows = []
        for e, row_processors in enumerate(processors):
            row = logits[e : e + 1]
            if row_processors:
                tokens = context(e)
                for processor in row_processors:
                    row = processor(tokens, row)
            rows.append(row)
        logits = mx.concatenate(rows, axis=0)
    return logits, sample_rows(logits, [s or fallback for s in samplers] or [fallback])


def _next_first_token_in_prefill(
    gen: BatchGenerator,
    keep: KeepRows,
    keep_last_apart: Callable[[int], bool],
    sample_rows: SampleRows,
    least_chunk: int,
) -> tuple[list, list]:
    """BatchGenerator._next, as of mlx-lm 0.32, each prompt's first token sampled from the
    prefill chunk that ends the prompt, and the decode batch's free slots kept for the rows
    coming to it (`_slotted_batch`).

    mlx_lm prefills a prompt but for its last token; the step after, that token runs alone
    through the model (a 1-token forward, its rows only) to sample the first token, which the
    decode step after that returns. Here the last token goes with the chunk before it, the head
    runs on that position alone (`logits_at`), and the row joins the decode batch with its first
    token sampled: the next decode step returns it. A prompt prefilled beside others so no longer
    waits one more of their steps, and rows joining a decode batch need no forward of their own.
    (Alone, TTFT is the same within the noise: the 1-token forward saved costs about what running
    the last layer over the whole chunk adds.) Where `keep_last_apart(uid)` (the engine keeps the
    cache just before the last token) the chunk stops there, and the last token is a chunk of its own.
    """
    import time

    import mlx.core as mx
    from mlx_lm.generate import PromptProcessingBatch

    counters, decoding = gen._counters, gen._generation_batch
    generated = []
    if len(decoding) > 0:
        tic = time.perf_counter()
        generated = decoding.next()
        counters.decode_time += time.perf_counter() - tic
        counters.generation_tokens += len(generated)
        counters.generation_steps += 1
        if counters.generation_steps % 512 == 0:
            mx.clear_cache()
    decoding.tidy(coming=len(gen._unprocessed_sequences) + len(gen._prompt_batch))
    if decoding.live >= gen.completion_batch_size:
        return [], generated
    joining = min(
        gen.prefill_batch_size - len(gen._prompt_batch),
        gen.completion_batch_size - decoding.live,
        len(gen._unprocessed_sequences),
    )
    if joining > 0:
        gen._prompt_batch.extend(gen._make_batch(joining))
    if not gen._currently_processing:
        return [], generated

    batch, chunks, progress, ending = gen._prompt_batch, [], [], []
    # Each row's chunk is padded to the longest (_prefill): a prompt that ends this step would be
    # padded to a long one's whole chunk (two rows of 512 tokens to end one of 16, with nothing
    # decoding), so no row takes more than the row ending soonest has left, unless that is under
    # `least_chunk` (then a step would advance the others by too little for its fixed cost).
    left = min(len(seq[0][0]) for seq in gen._currently_processing)
    size = min(gen.prefill_step_size, max(least_chunk, left))
    for i, (uid, seq) in enumerate(zip(batch.uids, gen._currently_processing)):
        segments = seq[0]  # what is left of the prompt, cut where the engine keeps the cache
        chunk, segments[0] = segments[0][:size], segments[0][size:]
        end_of_segment = not segments[0]
        if end_of_segment:
            segments.pop(0)
            # insert_segments split the prompt's last token off: it goes with this chunk
            if len(segments) == 1 and len(segments[0]) == 1 and not keep_last_apart(uid):
                chunk += segments.pop(0)
        seq[1] += len(chunk)
        chunks.append(chunk)
        progress.append(PromptProcessingBatch.Response(uid, (seq[1], seq[2]), end_of_segment, not segments))
        if not segments:
            ending.append(i)

    tic = time.perf_counter()
    first = _prefill(batch, chunks, ending)
    if ending:
        rows = [batch.tokens[i] for i in ending]
        logits, sampled = _sample(
            first,
            [batch.logits_processors[i] for i in ending],
            lambda e: mx.array(rows[e], dtype=mx.int32),
            [batch.samplers[i] for i in ending],
            batch.fallback_sampler,
            sample_rows,
        )
        kept = keep(logits, sampled, [batch.uids[i] for i in ending])
        mx.async_eval(sampled, [r for r in kept if r is not None])
        gen._currently_processing = [s for i, s in enumerate(gen._currently_processing) if i not in ending]
        done, left = _split(batch, ending)
        if left is None:
            left = PromptProcessingBatch.empty(batch.model, batch.fallback_sampler, batch.prefill_step_size)
        gen._prompt_batch = left
        for cache in done.prompt_cache:  # as its first decode step would, a row's or the prompt cache's
            _fit_window(cache)
        if last := [e for e, n in enumerate(done.max_tokens) if n <= 1]:
            going = [e for e in range(len(ending)) if e not in last]
            ended, done = _split(done, last)
            generated = generated + _answered_in_prefill(ended, sampled[mx.array(last)], [kept[e] for e in last])
            if done is not None:
                sampled, kept = sampled[mx.array(going)], [kept[e] for e in going]
        if done is not None:
            joined = _sampled_batch()(
                done.model,
                done.uids,
                sampled,
                done.prompt_cache,
                done.tokens,
                done.samplers,
                done.fallback_sampler,
                done.logits_processors,
                done.stop_sequences,
                done.max_tokens,
            )
            joined._next_logprobs = kept
            decoding.take(joined)
    counters.prompt_tokens += sum(len(c) for c in chunks)
    counters.prompt_time += time.perf_counter() - tic
    return progress, generated


def _split(batch: PromptProcessingBatch, rows: list[int]) -> tuple[PromptProcessingBatch, PromptProcessingBatch | None]:
    """batch.split(rows) as (those rows, the rest), the rest None where the rows are all of it:
    then the batch itself, not mlx_lm's split, which copies every cache and gathers the rows."""
    return (batch, None) if len(rows) == len(batch.uids) else (batch.split(rows), batch)


def _answered_in_prefill(ended: PromptProcessingBatch, sampled: mx.array, kept: list) -> list:
    """The responses of rows whose first token is their last (max_tokens 1: a score, a
    classification, a prompt cache warmed): they never join the decode batch. Joining and then
    leaving it would copy every decoding row's KV cache twice while each stream waits, for a row
    that decodes nothing (beside 6 streams decoding in 17-25 ms steps, a 2,000-token row's join
    took 53-76 ms and its leave 85 ms more)."""
    from mlx_lm.generate import GenerationBatch

    responses = []
    for e, token in enumerate(sampled.tolist()):
        stopped = ended.stop_sequences[e].matcher().advance(token)
        responses.append(
            GenerationBatch.Response(
                uid=ended.uids[e],
                token=token,
                logprobs=kept[e],
                finish_reason="stop" if stopped else "length",
                prompt_cache=ended.extract_cache(e),
                all_tokens=ended.tokens[e],
            )
        )
    return responses


def _prefill(batch: PromptProcessingBatch, chunks: list[list[int]], ending: list[int]) -> mx.array | None:
    """PromptProcessingBatch.prompt for one chunk a row (right-padded to the longest, as mlx_lm
    pads), returning the logits at the last token of each row in `ending` (None if none); the
    chunk runs layer by layer (`layer_by_layer`)."""
    import mlx.core as mx

    for history, chunk in zip(batch.tokens, chunks):
        history += chunk  # the tokens the cache holds
    lengths = [len(c) for c in chunks]
    longest = max(lengths)
    padding = [longest - n for n in lengths]
    if max(padding) > 0:
        for c in batch.prompt_cache:
            c.prepare(lengths=lengths, right_padding=padding)
    inputs = mx.array([c + [0] * p for c, p in zip(chunks, padding)])
    with layer_by_layer(batch.model):
        if ending:
            logits = logits_at(batch.model, inputs, batch.prompt_cache, ending, [lengths[i] - 1 for i in ending])
        else:
            batch.model(inputs, cache=batch.prompt_cache)
            logits = None
    mx.eval([c.state for c in batch.prompt_cache], logits)
    if max(padding) > 0:
        for c in batch.prompt_cache:
            c.finalize()
        mx.eval([c.state for c in batch.prompt_cache])
    mx.clear_cache()
    return logits


def _fit_window(cache: Any) -> None:
    """Cut a sliding-window cache that a prefill chunk left longer than its window (mlx_lm keeps
    window + chunk - 1 slots there) to the window, as its first decode step would. Joining the
    decode batch uncut, it would pad every row's cache to that length: on the default model, 6
    decoding rows took a 2,000-token prompt (last chunk 464 tokens) in 199 ms uncut, 126 ms cut."""
    from mlx_lm.models.cache import BatchRotatingKVCache

    if not isinstance(cache, BatchRotatingKVCache) or cache.keys is None or cache.rotated:
        return
    cut = cache.keys.shape[2] - cache.max_size
    if cut > 0:
        cache.keys, cache.values = cache.keys[..., cut:, :], cache.values[..., cut:, :]
        cache._idx = cache.max_size
        cache.left_padding -= cut


def _join(decoding: GenerationBatch, joined: GenerationBatch) -> None:
    """decoding.extend(joined), the caches merged in one copy where gmlx knows the cache (mlx_lm's
    own extend elsewhere)."""
    from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache

    if decoding.prompt_cache:
        for mine, theirs in zip(decoding.prompt_cache, joined.prompt_cache):
            if type(mine) in (BatchKVCache, BatchRotatingKVCache):
                _extend_in_one_copy(mine, theirs)
            else:
                mine.extend(theirs)
        joined.prompt_cache = []  # merged: GenerationBatch.extend keeps the batch's own when the other has none
    decoding.extend(joined)


def _extend_in_one_copy(cache: Any, other: Any) -> None:
    """BatchKVCache.extend and BatchRotatingKVCache.extend (mlx-lm 0.32), the same state from
    one copy of each row's slots into a buffer for all rows.

    A row joining the decode batch extends every layer's cache with its own: mlx_lm rolls a
    rotated window into temporal order, pads each side to the longer, then concatenates them,
    each a copy of every row. On the default model, 7 rows taking one more cost 82-124 ms that
    way and 53-76 ms here, most of it the new buffers' first touch, and every stream waits it:
    `kernels.place_rows` writes each buffer's pages once, on every kernel thread (decision 30).
    """
    import mlx.core as mx

    from gmlx.kernels import place_rows

    parts = (cache, other)
    if cache.keys is None and other.keys is None:
        cache.left_padding = mx.concatenate([c.left_padding for c in parts])
        cache.offset = mx.concatenate([c.offset for c in parts])
        return
    rotating = hasattr(cache, "rotated")
    reorder = rotating and (cache.rotated != other.rotated or cache._idx != other._idx)
    slots, filled = [], []  # each side's slots in the order they take, and how many count as written
    for c in parts:
        if c.keys is None:
            slots.append([])
            filled.append(c._idx)
        elif reorder and c.rotated:  # the window from its oldest slot: mlx_lm's _temporal_order
            i = c._idx
            slots.append([(c.keys[..., i:, :], c.values[..., i:, :]), (c.keys[..., :i, :], c.values[..., :i, :])])
            filled.append(c.keys.shape[2])
        else:
            slots.append([(c.keys, c.values)])
            filled.append(c._idx)
    like = cache if cache.keys is not None else other
    heads, dims, value_dims = like.keys.shape[1], like.keys.shape[3], like.values.shape[3]
    length = max(c.keys.shape[2] for c in parts if c.keys is not None)
    last = max(filled)
    rows = [c.offset.shape[0] for c in parts]
    row, padding, key_parts, value_parts = 0, [], [], []
    for c, n_rows, side, written in zip(parts, rows, slots, filled):
        at = last - written  # right-aligned on the last written slot, as mlx_lm pads
        for k, v in side:
            n = min(k.shape[2], length - at)
            if n <= 0:
                break
            key_parts.append((k[..., :n, :], row, at))
            value_parts.append((v[..., :n, :], row, at))
            at += n
        padding.append(c.left_padding + (last - written))
        row += n_rows
    cache.keys = place_rows((sum(rows), heads, length, dims), like.keys.dtype, key_parts)
    cache.values = place_rows((sum(rows), heads, length, value_dims), like.values.dtype, value_parts)
    cache.offset = mx.concatenate([c.offset for c in parts])
    cache.left_padding = mx.concatenate(padding)
    cache._idx = last
    if rotating:
        cache.rotated = cache.rotated and not reorder
        cache._offset = max(cache._offset, other._offset)


@functools.cache
def _sampled_batch() -> type:
    from mlx_lm.generate import GenerationBatch

    class Sampled(GenerationBatch):
        """Rows whose first token is sampled already: built without the step mlx_lm's runs at once."""

        def _step(self) -> tuple[list[int], list]:
            return [], []

    return Sampled


# Steps a decode batch's free slots wait for rows to fill them before it gathers its rows out of
# them: a free slot costs about a row's share of every step, gathering them one copy of each row.
IDLE_STEPS = 16


@functools.cache
def _slotted_batch() -> type:
    from mlx_lm.generate import GenerationBatch

    class Slotted(GenerationBatch):
        """The decode batch, each row in a slot it keeps until it leaves.

        mlx_lm's batch gathers the remaining rows into new buffers when a row leaves, and pads
        and concatenates every row when one joins: each a copy of every row's KV cache. On the
        default model, with 7 rows decoding, a join stalled every stream for about 60 ms and a
        leave for 25-60 ms (a step is 26 ms), and 8 clients sending short requests one after
        another got 172 tok/s where the batch decodes 300 at full width.

        Here a row that leaves frees its slot (its uid becomes HOLE; the slot runs on, unread,
        sampled by the batch's fallback sampler). A row that joins takes a free slot, its KV
        cache written there alone and aligned to the batch's write position
        (`_slot_runs`); only where it cannot be (a row longer than the batch has filled) does
        the batch move its rows. Slots nothing comes to fill are gathered out after IDLE_STEPS
        steps (`tidy`), and all at once when no row is left.
        """

        keep: KeepRows
        sample_rows: SampleRows
        deliver: Deliver
        idle = 0  # steps the free slots have outnumbered the rows coming
        _queued: tuple | None = None  # what _step_on_logits built and finish_step has not yet queued

        def _step(self) -> tuple[list[int], list]:
            return _step_on_logits(self, self.keep, self.sample_rows)

        @property
        def live(self) -> int:
            return len(self.uids) - self.uids.count(HOLE)

        def next(self) -> list:
            """GenerationBatch.next, a row that ends freeing its slot (holes give no response)."""
            if not self.uids:
                return []
            tokens, logprobs = self._step()
            responses, ended = [], []
            for i, uid in enumerate(self.uids):
                if uid == HOLE:
                    continue
                self._num_tokens[i] += 1
                reason = "length" if self._num_tokens[i] >= self.max_tokens[i] else None
                if self._matchers[i].advance(tokens[i]):
                    reason = "stop"
                cache, history = (self.extract_cache(i), self.tokens[i]) if reason else (None, None)
                responses.append(self.Response(uid, tokens[i], logprobs[i], reason, cache, history))
                if reason:
                    ended.append(i)
            if ended:
                self.leave(ended)
            try:
                self.deliver(responses)
            finally:
                if self.live:
                    finish_step(self)
                else:  # no row reads the step: it need not run
                    self._queued = None
            return responses

        def filter(self, keep: list[int]) -> None:
            """BatchGenerator.remove's call: the rows not kept leave."""
            kept = set(keep)
            self.leave([i for i in range(len(self.uids)) if i not in kept])

        def leave(self, rows: list[int]) -> None:
            for i in rows:
                self.uids[i], self.samplers[i], self.logits_processors[i] = HOLE, None, []
                self.tokens[i], self._next_logprobs[i] = [], None  # the row's history went with its response
            if not self.live:
                super().filter([])
                self.idle = 0
            else:
                _trim_front(self.prompt_cache, [i for i, uid in enumerate(self.uids) if uid != HOLE])

        def tidy(self, coming: int) -> None:
            """Gather the rows out of the free slots that more than the `coming` rows would fill,
            once they have waited IDLE_STEPS steps."""
            holes = self.uids.count(HOLE)
            self.idle = self.idle + 1 if holes > coming else 0
            if self.idle >= IDLE_STEPS:
                self._gather(keep_holes=coming)

        def _gather(self, keep_holes: int) -> None:
            rows = []
            for i, uid in enumerate(self.uids):
                if uid != HOLE or keep_holes > 0:
                    keep_holes -= uid == HOLE
                    rows.append(i)
            super().filter(rows)
            self.idle = 0

        def take(self, joined: GenerationBatch) -> None:
            """Add `joined`'s rows (their first tokens sampled), into free slots where they fit."""
            import mlx.core as mx

            holes = [i for i, uid in enumerate(self.uids) if uid == HOLE]
            n = min(len(holes), len(joined.uids))
            if n == 0:
                _join(self, joined)
                return
            paddings = [c.left_padding.tolist() for c in joined.prompt_cache]
            places = [
                [
                    _slot_runs(mine, theirs, j, p[j])
                    for mine, theirs, p in zip(self.prompt_cache, joined.prompt_cache, paddings)
                ]
                for j in range(n)
            ]
            if any(place is None for row in places for place in row):
                self._gather(keep_holes=0)
                _join(self, joined)
                return
            slots = mx.arange(len(self.uids))
            for j, (hole, row) in enumerate(zip(holes, places)):
                for mine, theirs, (runs, padding) in zip(self.prompt_cache, joined.prompt_cache, row):
                    _write_row(mine, hole, theirs, j, runs, padding)
                self.uids[hole] = joined.uids[j]
                self.tokens[hole] = joined.tokens[j]
                self.samplers[hole] = joined.samplers[j]
                self.logits_processors[hole] = joined.logits_processors[j]
                self.max_tokens[hole] = joined.max_tokens[j]
                self.stop_sequences[hole] = joined.stop_sequences[j]
                self._next_tokens = mx.where(slots == hole, joined._next_tokens[j], self._next_tokens)
                self._next_logprobs[hole] = joined._next_logprobs[j]
                self._token_context[hole] = joined._token_context[j]
                self._num_tokens[hole] = joined._num_tokens[j]
                self._matchers[hole] = joined._matchers[j]
            if n < len(joined.uids):
                joined.filter(list(range(n, len(joined.uids))))
                _join(self, joined)

    return Slotted


Runs = list[tuple[int, int, int]]  # (destination, source, length) along the sequence axis


def _slot_runs(mine: Any, theirs: Any, j: int, padding: int) -> tuple[Runs, int] | None:
    """Where row j of `theirs` (a joining row's cache, its left padding `padding`) goes in a slot
    of `mine` (the decode batch's cache of the same layer), and the slot's left padding then: the
    row's filled slots end where the batch writes next, as mlx_lm's extend aligns them. None
    where gmlx does not know the cache, or the row is longer than the batch has filled."""
    from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache

    if type(mine) not in (BatchKVCache, BatchRotatingKVCache) or type(theirs) is not type(mine):
        return None
    if mine.keys is None or theirs.keys is None:
        return None
    start = max(padding, 0)  # a sliding cache's padding goes below 0 once the window has cut it
    n = theirs._idx - start
    if type(mine) is BatchKVCache:
        return ([(mine._idx - n, start, n)], mine._idx - n) if n <= mine._idx else None
    window = mine.max_size
    if theirs.rotated or theirs._idx != theirs.keys.shape[2] or n > window:
        return None
    if mine.rotated or mine._idx >= window:
        # Full: the batch writes next at _idx (0 once it is the window), and a row's padding
        # counts from the oldest slot, the one written next.
        if mine.keys.shape[2] != window:
            return None
        at = (mine._idx - n) % window
        first = min(n, window - at)
        runs = [(at, start, first)] + ([(0, start + first, n - first)] if n > first else [])
        return runs, window - n
    if mine._offset != mine._idx or n > mine._idx:
        return None
    return [(mine._idx - n, start, n)], mine._idx - n


def _write_row(mine: Any, slot: int, theirs: Any, j: int, runs: Runs, padding: int) -> None:
    """Row j of `theirs` into `slot` of `mine` along `runs`; the other rows are not moved (the
    keys and values are written in place: nothing else holds them between steps)."""
    import mlx.core as mx

    for at, start, n in runs:
        mine.keys[slot : slot + 1, :, at : at + n, :] = theirs.keys[j : j + 1, :, start : start + n, :]
        mine.values[slot : slot + 1, :, at : at + n, :] = theirs.values[j : j + 1, :, start : start + n, :]
    row = mx.arange(mine.offset.shape[0]) == slot
    mine.left_padding = mx.where(row, padding, mine.left_padding)
    mine.offset = mx.where(row, theirs.offset[j], mine.offset)


def _trim_front(caches: list, rows: list[int]) -> None:
    """Cut the slots before every one of `rows`' first from the full-attention caches, as
    mlx_lm's filter does on each leave: rows taking free slots would otherwise keep the batch's
    caches as long as it has lived. Cutting copies the cache (a write into the cut view is not
    in place), so only once a step's worth of slots (BatchKVCache.step) is to be had."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    for c in caches:
        if type(c) is not BatchKVCache or c.keys is None:
            continue
        cut = min(c.left_padding[mx.array(rows)].tolist())
        if cut >= c.step:
            c.keys, c.values = c.keys[..., cut:, :], c.values[..., cut:, :]
            c._idx -= cut
            c.left_padding = c.left_padding - cut


class _Evaluated:
    """A layer whose output is evaluated as soon as its graph is built; it is the layer otherwise."""

    def __init__(self, inner: Any):
        self._inner = inner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import mlx.core as mx

        out = self._inner(*args, **kwargs)
        mx.eval(out)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@contextmanager
def layer_by_layer(model: Any) -> Iterator[None]:
    """Within the block, each of the model's layers but the last runs to its end before the next
    is queued (docs/ARCHITECTURE.md, decision 37).

    MLX allocates a node's output when it queues the node, and queues about 100 nodes ahead of
    the ones running: over a prefill chunk that is several layers' activations at once, more
    the longer the chunk, where the capacity table counts one layer's. The last layer's output
    is left to the caller: a chunk that does not end a prompt evaluates only its caches, and so
    never computes that layer's attention output or MLP. mlx_lm's models run
    `model.model.layers` in a loop; their entries are swapped for the block's length.
    """
    layers = model.model.layers
    inner = list(layers)
    layers[:-1] = [_Evaluated(layer) for layer in inner[:-1]]
    try:
        yield
    finally:
        layers[:] = inner


class _AtPositions:
    """An inner model whose output is cut to some positions; it is the inner model otherwise (a
    tied head reads its embedding)."""

    def __init__(self, inner: Any, rows: mx.array, positions: mx.array):
        self._inner, self._rows, self._positions = inner, rows, positions

    def __call__(self, *args: Any, **kwargs: Any) -> mx.array:
        return self._inner(*args, **kwargs)[self._rows, self._positions][:, None]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def logits_at(model: Any, inputs: mx.array, cache: list, rows: list[int], positions: list[int]) -> mx.array:
    """The model's logits for inputs[rows[i], positions[i]] only, one row each.

    mlx_lm's models apply their head (tied embedding, lm_head, soft-capping) to every position
    the inner `model.model` returns; over a 512-token chunk and a 262,144-token vocabulary that
    head would cost more than the chunk. So the inner model's output is cut to those positions
    first, by shadowing the child for this call.
    """
    import mlx.core as mx

    object.__setattr__(model, "model", _AtPositions(model.model, mx.array(rows), mx.array(positions)))
    try:
        return model(inputs, cache=cache)[:, -1]
    finally:
        object.__delattr__(model, "model")


# --- uvicorn ------------------------------------------------------------------------------


def forget_signals(server: Server, signals: Iterable[int] = (signal.SIGTERM, signal.SIGINT)) -> None:
    """uvicorn re-raises each signal it handled once it has stopped; forget these."""
    drop = set(signals)
    server._captured_signals = [s for s in server._captured_signals if s not in drop]


# --- typer --------------------------------------------------------------------------------


def completion_script(prog_name: str, complete_var: str, shell: str) -> str:
    """The completion script typer would install for `shell` (it has no public way to ask for
    another shell's script than the one it detects)."""
    from typer._completion_shared import get_completion_script

    return get_completion_script(prog_name=prog_name, complete_var=complete_var, shell=shell)
