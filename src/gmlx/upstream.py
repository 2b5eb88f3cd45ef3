"""Every reach into a library's private parts, in one place, with the version it was checked against.

gmlx leans on a few things mlx_lm, uvicorn and typer do not promise. Each is named here once;
the rest of gmlx calls these functions, and `tests/test_upstream.py` checks each one's behaviour
on the installed version, so an upgrade that changes one fails there, by name, rather than deep
in a request. `pyproject.toml` pins mlx-lm and uvicorn to the ranges checked.

The libraries are imported when first used: `gmlx top` and the completions must not pay for
mlx_lm, and mlx must be imported after gmlx.platform's BLAS bring-up.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterable
from types import MethodType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator, GenerationBatch
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


def decode_on_logits(gen: BatchGenerator, keeps_logits: Callable[[int], bool]) -> None:
    """Make `gen`'s decode steps sample from the logits as they come, not normalised first.

    mlx_lm's step turns each row into log-probabilities (`logits - logsumexp(logits)`) before
    sampling; over a 262,144-token vocabulary that is a single-threaded pass of about 3 ms a
    row, a tenth of a step at width 8. gmlx's samplers do not need it (each is invariant to a
    shift of its row, engine/sampling.py), and a request that asks for logprobs has its own row
    normalised (engine/logprobs.py). So rows are kept for the responses only where
    `keeps_logits(uid)`; elsewhere a response's `logprobs` is None.

    The step replaced is the batch generator's one generation batch's (it is created once and
    extended, never replaced); a prompt's first token, sampled as its rows join, is mlx_lm's.
    """
    batch = gen._generation_batch
    batch._step = MethodType(lambda b: _step_on_logits(b, keeps_logits), batch)


def _step_on_logits(batch: GenerationBatch, keeps_logits: Callable[[int], bool]) -> tuple[list[int], list]:
    """GenerationBatch._step, as of mlx-lm 0.32, without the normalisation: run the model on the
    tokens sampled last step, apply each row's logits processors, sample, and start evaluating
    that while the caller reads the last step's tokens."""
    import mlx.core as mx

    batch._current_tokens, batch._current_logprobs = batch._next_tokens, batch._next_logprobs
    inputs = batch._current_tokens
    logits = batch.model(inputs[:, None], cache=batch.prompt_cache)[:, -1, :]
    contexts = []
    if any(batch.logits_processors):
        rows = []
        for e, processors in enumerate(batch.logits_processors):
            row = logits[e : e + 1]
            if processors:
                context = batch._token_context[e].update_and_fetch(inputs[e : e + 1])
                contexts.append(context)
                for processor in processors:
                    row = processor(context, row)
            rows.append(row)
        logits = mx.concatenate(rows, axis=0)
    samplers = [s or batch.fallback_sampler for s in batch.samplers] or [batch.fallback_sampler]
    if all(s is samplers[0] for s in samplers):
        sampled = samplers[0](logits)
    else:
        sampled = mx.concatenate([s(logits[e : e + 1]) for e, s in enumerate(samplers)], axis=0)
    batch._next_tokens = sampled
    batch._next_logprobs = [logits[e] if keeps_logits(uid) else None for e, uid in enumerate(batch.uids)]
    mx.async_eval(sampled, [r for r in batch._next_logprobs if r is not None], contexts)
    mx.eval(inputs, [r for r in batch._current_logprobs if r is not None])
    tokens = inputs.tolist()
    for history, token in zip(batch.tokens, tokens):
        history.append(token)
    return tokens, batch._current_logprobs


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
