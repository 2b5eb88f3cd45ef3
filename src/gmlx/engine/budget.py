"""How many prompt tokens each engine step prefills, per prompt (docs/ARCHITECTURE.md, decision 21).

mlx_lm's BatchGenerator runs one decode step for the decoding rows, then one chunk of every
prompt being prefilled, `prefill_step_size` tokens a row padded to the longest. Left at one
size, a few long prompts stop every stream for seconds. The engine sets the size before each
step:

- with no stream decoding, `max_tokens` a prompt, as mlx_lm would (the capacity table's
  fan-out peak is measured for that: capacity/table.py);
- with streams decoding, what fits in `share` of a decode step's time, from the measured time
  of a decode step and of a prefilled token beside one, shared among the prompts, so no
  stream's gap between two tokens grows past about (1 + share) times its usual, and a short
  prompt arriving beside a long one ends in its first steps.
"""

from __future__ import annotations

from dataclasses import dataclass

_SMOOTHING = 0.3  # weight of each new measurement in the moving averages


def _moving(old: float | None, new: float) -> float:
    return new if old is None else old + _SMOOTHING * (new - old)


@dataclass
class PrefillBudget:
    max_tokens: int  # each prompt's tokens a step with nothing decoding: the engine's prefill_step
    share: float = 0.7  # a decoding step's prefill takes at most this many decode steps' time
    # The least a prompt advances a step, so a long one always moves. A chunk beside decoding is a
    # forward pass of its own: beside 6 streams of the default model on 2 cores it added ~30 ms
    # (1.5 decode steps) whatever its size, and ~1.2 ms a token. At 16 tokens two thirds of a
    # stream's wait went to that fixed part; 32 halved a 2,000-token prompt's steps for 20 % more
    # wait a step (bench_gaps: p99 over median 1.66-1.99 against 1.93-2.53; decision 21).
    floor: int = 32
    # A step's chunk is cut to what the prompt ending soonest has left, so the others are not
    # padded past it (upstream.own_steps), but not below this. Beside 6 streams, a 16-token prompt
    # ending beside a 2,000-token one made a step of two rows padded to 32 at a least of 32, of
    # 17 at 16: in three alternate `bench_gaps` runs each, p99 over median 1.92-2.08 against 2.20-2.27.
    least_chunk: int = 16
    # Seconds of a step that only decodes, and of one prompt token prefilled beside decoding
    # (the engine seeds both from its warm-up).
    decode_s: float | None = None
    token_s: float | None = None

    def chunk(self, decoding: int, prefilling: int) -> int:
        """Tokens each prompt being prefilled takes this step."""
        if not decoding or self.decode_s is None or not self.token_s:
            return self.max_tokens
        budget = min(self.max_tokens, round(self.share * self.decode_s / self.token_s))
        return max(self.floor, min(self.max_tokens, budget // max(1, prefilling)))

    def observe(self, decoded: int, prompt_tokens: int, seconds: float) -> None:
        """Learn from a step that sampled `decoded` tokens and prefilled `prompt_tokens` in `seconds`."""
        if prompt_tokens == 0:
            if decoded:
                self.decode_s = _moving(self.decode_s, seconds)
        elif decoded and self.decode_s is not None:  # a prefill-only step says nothing of the share
            # What the prompt tokens added to a decode step (never less than a tenth of it:
            # a noisy step must not make prefill look free).
            extra = max(seconds - self.decode_s, 0.1 * self.decode_s)
            self.token_s = _moving(self.token_s, extra / prompt_tokens)
