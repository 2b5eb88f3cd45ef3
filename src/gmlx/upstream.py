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
from collections.abc import Callable, Iterable
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


def decode_on_logits(gen: BatchGenerator, keep: KeepRows, sample_rows: SampleRows) -> None:
    """Make `gen`'s decode steps sample from the logits as they come, not normalised first.

    mlx_lm's step turns each row into log-probabilities (`logits - logsumexp(logits)`) before
    sampling; over a 262,144-token vocabulary that is a single-threaded pass of about 3 ms a
    row, a tenth of a step at width 8. gmlx's samplers do not need it (each is invariant to a
    shift of its row, engine/sampling.py), and a request that asks for logprobs has its own row
    normalised (engine/logprobs.py). So a response's `logprobs` is what `keep` makes of its row,
    computed in the step's own graph (read a step later, it never waits for the step after).

    The step replaced is the batch generator's one generation batch's (it is created once and
    extended, never replaced); a prompt's first token is sampled as it ends its prefill
    (`first_token_from_prefill`), through the same processors and samplers (`_sample`), the
    batch's rows drawn by `sample_rows`.
    """
    batch = gen._generation_batch
    batch._step = MethodType(lambda b: _step_on_logits(b, keep, sample_rows), batch)


def _step_on_logits(batch: GenerationBatch, keep: KeepRows, sample_rows: SampleRows) -> tuple[list[int], list]:
    """GenerationBatch._step, as of mlx-lm 0.32, without the normalisation: run the model on the
    tokens sampled last step, apply each row's logits processors, sample, and start evaluating
    that while the caller reads the last step's tokens."""
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
    mx.async_eval(sampled, [r for r in batch._next_logprobs if r is not None], contexts)
    mx.eval(inputs, [r for r in batch._current_logprobs if r is not None])
    tokens = inputs.tolist()
    for history, token in zip(batch.tokens, tokens):
        history.append(token)
    return tokens, batch._current_logprobs


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


def first_token_from_prefill(
    gen: BatchGenerator,
    keep: KeepRows,
    keep_last_apart: Callable[[int], bool],
    sample_rows: SampleRows,
) -> None:
    """Make `gen` sample each prompt's first token from the prefill chunk that ends the prompt.

    mlx_lm prefills a prompt but for its last token; the step after, that token runs alone
    through the model (a 1-token forward, its rows only) to sample the first token, which the
    decode step after that returns. Here the last token goes with the chunk before it, the head
    runs on that position alone (`logits_at`), and the row joins the decode batch with its first
    token sampled: the next decode step returns it. A prompt prefilled beside others so no longer
    waits one more of their steps, and rows joining a decode batch need no forward of their own.
    (Alone, TTFT is the same within the noise: the 1-token forward saved costs about what running
    the last layer over the whole chunk adds.) Where `keep_last_apart(uid)` (the engine keeps the
    cache just before the last token) the chunk stops there, and the last token is a chunk of its own.

    `BatchGenerator._next`, as of mlx-lm 0.32, with that change; the decode step stays
    the generation batch's (`decode_on_logits`).
    """
    gen._next = MethodType(lambda g: _next_first_token_in_prefill(g, keep, keep_last_apart, sample_rows), gen)


def _next_first_token_in_prefill(
    gen: BatchGenerator,
    keep: KeepRows,
    keep_last_apart: Callable[[int], bool],
    sample_rows: SampleRows,
) -> tuple[list, list]:
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
    if len(decoding) >= gen.completion_batch_size:
        return [], generated
    joining = min(
        gen.prefill_batch_size - len(gen._prompt_batch),
        gen.completion_batch_size - len(decoding),
        len(gen._unprocessed_sequences),
    )
    if joining > 0:
        gen._prompt_batch.extend(gen._make_batch(joining))
    if not gen._currently_processing:
        return [], generated

    batch, chunks, progress, ending = gen._prompt_batch, [], [], []
    for i, (uid, seq) in enumerate(zip(batch.uids, gen._currently_processing)):
        segments = seq[0]  # what is left of the prompt, cut where the engine keeps the cache
        chunk, segments[0] = segments[0][: gen.prefill_step_size], segments[0][gen.prefill_step_size :]
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
            _join(decoding, joined)
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
    pads), returning the logits at the last token of each row in `ending` (None if none)."""
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
    way and 53-76 ms here (the rest is the new buffers' first touch), and every stream waits it.
    """
    import mlx.core as mx

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
    keys = mx.zeros((sum(rows), heads, length, dims), like.keys.dtype)
    values = mx.zeros((sum(rows), heads, length, value_dims), like.values.dtype)
    row, padding = 0, []
    for c, n_rows, side, written in zip(parts, rows, slots, filled):
        at = last - written  # right-aligned on the last written slot, as mlx_lm pads
        for k, v in side:
            n = min(k.shape[2], length - at)
            if n <= 0:
                break
            keys[row : row + n_rows, :, at : at + n] = k[..., :n, :]
            values[row : row + n_rows, :, at : at + n] = v[..., :n, :]
            at += n
        padding.append(c.left_padding + (last - written))
        row += n_rows
    cache.keys, cache.values = keys, values
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
