"""The memory budget: what is left for KV caches once weights, a reserve and one prefill are paid."""

from __future__ import annotations

import re
from dataclasses import dataclass

from gmlx.gguf.header import ModelGeometry

FLOAT32_BYTES = 4  # activations are float32 wherever the engine runs float weights or float32 scales
PROMPT_CACHE_SHARE = 16  # by default the prompt cache may hold 1/16 of memory...
PROMPT_CACHE_MAX_DEFAULT = 4 * 2**30  # ...and at most this much
# The process's memory outside MLX where no server has measured it (`gmlx plan` offline): what
# `gmlx serve` measured at its warm-up on Linux CPU with the default model (480 MiB), rounded up.
HOST_BYTES_ESTIMATE = 512 * 2**20


def default_prompt_cache_bytes(total_bytes: int) -> int:
    return min(PROMPT_CACHE_MAX_DEFAULT, total_bytes // PROMPT_CACHE_SHARE)


@dataclass(frozen=True)
class GovernorTerms:
    """What a server's memory governor counts that MLX's arithmetic leaves out, so that the
    capacity table admits no more than keeps its band at yellow at most (below orange, by the
    hysteresis)."""

    host_bytes: int  # the process's memory outside MLX: measured at a server's warm-up, else estimated
    ceiling: float  # the governor's orange threshold less its hysteresis, as a share of total less reserve


@dataclass(frozen=True)
class MemoryBudget:
    total_bytes: int  # device memory, or on CPU min(physical RAM, cgroup limit)
    weight_bytes: int  # resident weights as loaded, in the weight mode in use
    prefill_bytes: int  # what one prompt's prefill chunk holds besides its stream (see capacity_table)
    reserve_floor_bytes: int = 512 * 2**20
    reserve_fraction: float = 0.10
    prompt_cache_bytes: int = 0  # the prompt cache's bound: KV kept for reuse, not for running streams
    # What MLX's buffer cache holds while a batch's prefill chunk runs, once per batch (capacity_table).
    batch_bytes: int = 0
    # What a memory governor counts that MLX's arithmetic leaves out (GovernorTerms); 0 and 1
    # without one.
    host_bytes: int = 0  # the process's memory outside MLX
    ceiling: float = 1.0  # the share of usable_bytes the table fills: short of where orange starts
    # The weights of the other models resident beside this one: memory is shared, so a model's
    # table is built against what the others leave (server/residency.py).
    others_bytes: int = 0

    @property
    def reserve_bytes(self) -> int:
        return max(self.reserve_floor_bytes, int(self.reserve_fraction * self.total_bytes))

    @property
    def usable_bytes(self) -> int:
        """The governor's limit: total less the reserve."""
        return self.total_bytes - self.reserve_bytes

    @property
    def drained_bytes(self) -> int:
        """What one request may use once running requests finish: one prefill and its stream.
        The prompt cache may still hold up to its bound then, so it stays off, as in kv_bytes;
        under a governor, so does the process's memory outside MLX, and only up to the ceiling counts."""
        return (
            int(self.ceiling * self.usable_bytes)
            - self.weight_bytes
            - self.others_bytes
            - self.host_bytes
            - self.prompt_cache_bytes
        )

    def free_now_bytes(self, active_bytes: int, prompt_cache_held: int) -> int:
        """drained_bytes less what runs now: MLX's active memory holds the weights, the running
        streams and the prompt cache's entries, and the cache's bound is already off."""
        return self.drained_bytes + self.weight_bytes - active_bytes + min(prompt_cache_held, self.prompt_cache_bytes)

    @property
    def kv_bytes(self) -> int:
        """Room for one stream's KV cache (CapacityTable: each stream more brings its own prefill)."""
        return max(0, self.drained_bytes - self.batch_bytes - self.prefill_bytes)

    def to_json(self) -> dict:
        return {
            "total_bytes": self.total_bytes,
            "weight_bytes": self.weight_bytes,
            "reserve_bytes": self.reserve_bytes,
            "prefill_bytes": self.prefill_bytes,
            "batch_bytes": self.batch_bytes,
            "prompt_cache_bytes": self.prompt_cache_bytes,
            "host_bytes": self.host_bytes,
            "ceiling": self.ceiling,
            "other_models_bytes": self.others_bytes,
            "kv_bytes": self.kv_bytes,
        }


def prefill_working_bytes(
    g: ModelGeometry, chunk_tokens: int, context_tokens: int, tiled_attention: bool = False
) -> int:
    """An estimate of the float32 activations one prefill chunk holds at its peak.

    With C = min(chunk_tokens, context_tokens) tokens in the chunk and K keys it attends to
    (context_tokens, the most any chunk sees; min(context_tokens, window - 1 + C) when every
    layer slides), the working set is

        4 x ( C x (n_embd x 4 + n_ff x 3)     hidden states and MLP intermediates
            + n_heads x C x K                 attention scores of one layer
            + vocab_size )                    logits of the last position only

    Layers run one after another, so one layer's scores count, not all of them; mlx_lm
    evaluates only the cache during prefill, so the LM head runs for one position. With
    `tiled_attention` (gmlx's CPU kernels: flash attention over tiles of 128 keys) no layer's
    scores are ever whole, and the few hundred KB of tiles a thread holds are left out.
    """
    chunk = min(chunk_tokens, context_tokens)
    keys = context_tokens
    if g.sliding_window and g.sliding_layers and all(g.sliding_layers):
        keys = min(context_tokens, g.sliding_window - 1 + chunk)
    scores = 0 if tiled_attention else g.n_heads * chunk * keys
    elements = chunk * (g.n_embd * 4 + g.n_ff * 3) + scores + g.vocab_size
    return elements * FLOAT32_BYTES


# Bare letters and "iB" are binary (as `docker --memory 1g` reads them); "B" after a letter is decimal.
_UNITS = {
    "": 1,
    "b": 1,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """'64GiB', '512MiB', '8GB', '1.5G', '1048576' -> bytes."""
    match = _SIZE.fullmatch(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"not a memory size: {text!r} (write a number with an optional unit: B, K, M, G, T, "
            "KiB, MiB, GiB, TiB for powers of 1024, or KB, MB, GB, TB for powers of 1000)"
        )
    number = match.group(1)
    if number.isdigit():  # exact for plain integers of any size
        return int(number) * _UNITS[unit]
    return int(float(number) * _UNITS[unit])
