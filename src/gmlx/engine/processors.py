"""What shapes a row's logits before its sampler: logit_bias, penalties and a grammar, as mlx_lm
logits processors applied per row inside the batched decode step.

mlx_lm calls each row's processors with that row's tokens so far (the prompt, then each token
generated) and its logits, one row of the batch. Every processor here is vectorized in MLX over
the tokens it looks at; none loops over the vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from gmlx.engine.grammar import Constraint, GrammarProcessor

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]  # (tokens so far, logits [1, vocab]) -> logits
REPEAT_LAST_N = 64  # llama.cpp's default window for repetition_penalty


def add_bias(logits: mx.array, ids: mx.array, values: mx.array) -> mx.array:
    """OpenAI's logit_bias: `values` added to the logits of `ids` (distinct)."""
    return logits.at[:, ids].add(values.astype(logits.dtype))


def repetition(logits: mx.array, recent: mx.array, penalty: float) -> mx.array:
    """llama.cpp's repetition penalty: the logit of each token in `recent` is divided by
    `penalty` if positive and multiplied by it if not, once however often the token appears."""
    index = recent[None]
    picked = mx.take_along_axis(logits, index, axis=-1)
    penalized = mx.where(picked > 0, picked / penalty, picked * penalty).astype(logits.dtype)
    return mx.put_along_axis(logits, index, penalized, axis=-1)  # repeats write equal values


def frequency_presence(logits: mx.array, generated: mx.array, frequency: float, presence: float) -> mx.array:
    """OpenAI's penalties: logit[j] -= c[j] * frequency + (c[j] > 0) * presence, where c[j] is how
    many times token j is in `generated`."""
    if frequency:
        logits = logits.at[:, generated].add(-frequency)  # a scatter-add: c[j] times for token j
    if presence:
        index = generated[None]
        picked = mx.take_along_axis(logits, index, axis=-1) - presence
        logits = mx.put_along_axis(logits, index, picked.astype(logits.dtype), axis=-1)
    return logits


@dataclass(frozen=True)
class Decoding:
    """A request's logits shaping, fixed when it is parsed; `processors` builds a row's state.

    Penalties follow OpenAI over the tokens generated so far in this response (not the prompt),
    except `repetition_penalty`, which follows llama.cpp: over the last `repeat_last_n` tokens,
    prompt included (-1: the whole context, 0: off). They apply in llama.cpp's order, bias first;
    the grammar's mask comes last, so that no bias can bring back a token it bans.
    """

    constraint: Constraint | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    repeat_last_n: int = REPEAT_LAST_N
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids distinct

    @property
    def plain(self) -> bool:
        """Nothing to apply: the row decodes as sampled (and may take the speculative lane)."""
        return (
            self.constraint is None
            and not self.logit_bias
            and not self.frequency_penalty
            and not self.presence_penalty
            and (self.repetition_penalty == 1.0 or self.repeat_last_n == 0)
        )

    def processors(self, prompt_tokens: int) -> list[LogitsProcessor]:
        """Fresh processors for one row whose prompt is `prompt_tokens` long."""
        out: list[LogitsProcessor] = []
        if self.logit_bias:
            ids = mx.array([t for t, _ in self.logit_bias], dtype=mx.int32)
            values = mx.array([b for _, b in self.logit_bias], dtype=mx.float32)
            out.append(lambda _, logits: add_bias(logits, ids, values))
        if self.repetition_penalty != 1.0 and self.repeat_last_n != 0:
            last, penalty = self.repeat_last_n, self.repetition_penalty
            out.append(lambda tokens, logits: repetition(logits, tokens[-last:] if last > 0 else tokens, penalty))
        if self.frequency_penalty or self.presence_penalty:
            frequency, presence = self.frequency_penalty, self.presence_penalty

            def penalize(tokens: mx.array, logits: mx.array) -> mx.array:
                if tokens.shape[0] <= prompt_tokens:  # nothing generated yet
                    return logits
                return frequency_presence(logits, tokens[prompt_tokens:], frequency, presence)

            out.append(penalize)
        if self.constraint is not None:
            out.append(GrammarProcessor(self.constraint, prompt_tokens))
        return out
