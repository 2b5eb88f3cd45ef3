"""KV-cache quantization: which scheme, which layers, and how honest a verdict (no MLX here).

The settings (`--kv-bits`, `--kv-group-size`, `--kv-scheme`, `--kv-value-bits`,
`--kv-tail-tokens`) become a `KVQuantPlan`: the scheme, its widths, how many layers store a
quantized cache, and verdicts (docs/ARCHITECTURE.md, "Contract"): `full`, `partial`, `dropped`, with a reason for any
but `full`. `plan.to_json()` is the `kv_quant` object of GET /v1/models; `plan.kv_format()` is
the `KVFormat` that capacity plans with; gmlx.engine.kv_cache builds the caches from the plan.

- `uniform`: keys and values at `bits` (mlx_lm-style quantized attention).
- `kvarn`: keys at `bits`, values at `value_bits`, the newest `tail_tokens` also kept in float.
- Nothing set: no plan (the cache stays float, and /v1/models has no `kv_quant`).
- Bits or a group size but no scheme, or `--kv-scheme auto`: gmlx picks a scheme from the model
  and the memory budget, and says why in `auto`.
"""

from __future__ import annotations

from dataclasses import dataclass

from gmlx.capacity.memory import KVFormat, layer_window
from gmlx.gguf.header import ModelGeometry

SCHEMES = ("uniform", "kvarn")
SCHEME_CHOICES = (*SCHEMES, "auto")
BITS = (2, 4, 8)
GROUP_SIZES = (32, 64, 128)
# 8-bit keys by default: 4-bit keys broke gemma3-270m's greedy output (3-39% of tokens matched
# float), 8 bits kept 82-91% under either scheme (tests/test_kv_quant.py).
DEFAULT_BITS = {"uniform": 8, "kvarn": 8}  # kvarn: the key width
DEFAULT_VALUE_BITS = 4
DEFAULT_TAIL_TOKENS = 128
DEFAULT_GROUP_SIZE = 64

FULL, PARTIAL, DROPPED = "full", "partial", "dropped"


@dataclass(frozen=True)
class KVQuantSettings:
    """What the user set; None where unset."""

    bits: int | None = None
    group_size: int | None = None
    scheme: str | None = None  # "uniform", "kvarn", "auto" or None
    value_bits: int | None = None
    tail_tokens: int | None = None

    @property
    def enabled(self) -> bool:
        return any(v is not None for v in (self.bits, self.group_size, self.scheme, self.value_bits, self.tail_tokens))

    def check(self) -> None:
        """Raise ValueError naming the first setting that cannot be used."""
        if self.scheme is not None and self.scheme not in SCHEME_CHOICES:
            raise ValueError(f"kv scheme must be one of {', '.join(SCHEME_CHOICES)}, not {self.scheme!r}")
        for name, bits in (("kv bits", self.bits), ("kv value bits", self.value_bits)):
            if bits is not None and bits not in BITS:
                raise ValueError(f"{name} must be one of {', '.join(map(str, BITS))}, not {bits}")
        if self.group_size is not None and self.group_size not in GROUP_SIZES:
            raise ValueError(f"kv group size must be one of {', '.join(map(str, GROUP_SIZES))}, not {self.group_size}")
        if self.tail_tokens is not None and self.tail_tokens < 0:
            raise ValueError(f"kv tail tokens must be >= 0, not {self.tail_tokens}")
        if self.scheme == "uniform" and (self.value_bits is not None or self.tail_tokens is not None):
            raise ValueError("kv value bits and kv tail tokens belong to the kvarn scheme, not uniform")


@dataclass(frozen=True)
class KVQuantPlan:
    scheme: str
    bits: int
    group_size: int
    layers_quantized: int
    layers_fp16: int
    verdict: str
    reason: str | None = None
    verdict_batched: str = FULL  # the same as `verdict` here: batched and speculative streams keep the format
    value_bits: int | None = None  # kvarn only
    tail_tokens: int | None = None  # kvarn only
    auto: str | None = None  # why gmlx picked the scheme; None when the user named it

    @property
    def quantizes(self) -> bool:
        """Whether one stream's caches are quantized at all (the engine's caches follow this)."""
        return self.verdict != DROPPED

    @property
    def scores_whole(self) -> bool:
        """Whether attention over these caches holds a layer's whole scores: a uniform cache
        exposes `bits`, so mlx_lm attends through its quantized matmuls, never in tiles."""
        return self.quantizes and self.scheme == "uniform"

    def kv_format(self, float_bytes: int) -> KVFormat:
        """The format capacity plans with: float when the verdict is dropped."""
        if not self.quantizes:
            return KVFormat(float_bytes=float_bytes)
        return KVFormat(
            bits=self.bits,
            group_size=self.group_size,
            float_bytes=float_bytes,
            value_bits=self.value_bits,
            tail_tokens=self.tail_tokens or 0,
        )

    def to_json(self) -> dict:
        """The `kv_quant` object (docs/ARCHITECTURE.md, "Contract")."""
        out: dict = {
            "scheme": self.scheme,
            "bits": self.bits,
            "group_size": self.group_size,
            "layers_quantized": self.layers_quantized,
            "layers_fp16": self.layers_fp16,
            "verdict": self.verdict,
        }
        if self.reason is not None:
            out["reason"] = self.reason
        out["verdict_batched"] = self.verdict_batched
        if self.scheme == "kvarn":
            out["value_bits"], out["tail_tokens"] = self.value_bits, self.tail_tokens
        if self.auto is not None:
            out["auto"] = self.auto
        return out


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def choose_scheme(
    g: ModelGeometry, *, streams: int, context_length: int, float_bytes: int, kv_budget_bytes: int | None
) -> tuple[str, str]:
    """(scheme, why) for `auto`. uniform 8-bit where it is enough: on the default model it kept
    greedy output about as close to float as kvarn K8/V4, and its quantized attention is faster.
    kvarn where even 8-bit uniform leaves the decode batch short of the context: 4-bit values
    take 22% less. (A drafter changes nothing: the engine's speculative lane trims quantized
    caches as exactly as float ones, so no scheme has to fall back to float when batched.)"""
    if kv_budget_bytes is None:
        return "uniform", "no memory budget known: uniform 8-bit, as close to float as kvarn and faster"
    full = [i for i in range(g.n_layers) if layer_window(g, i) is None]
    per_token = sum(g.n_kv_heads[i] * (g.key_length + g.value_length) for i in full)
    uniform8 = streams * context_length * per_token * (1 + 2 * float_bytes / DEFAULT_GROUP_SIZE)
    what = f"{streams} streams of {context_length} tokens"
    if uniform8 > kv_budget_bytes:
        return "kvarn", (
            f"8-bit uniform KV for {what} needs {_gib(uniform8)}, more than the "
            f"{_gib(kv_budget_bytes)} budget: kvarn's 4-bit values fit more"
        )
    return "uniform", (
        f"8-bit uniform KV for {what} ({_gib(uniform8)}) fits the {_gib(kv_budget_bytes)} "
        "budget: uniform, as close to float as kvarn and faster"
    )


def _drop_reason(g: ModelGeometry, group_size: int) -> str | None:
    if g.kv_lora_rank:
        return "the model caches a compressed MLA latent, which gmlx does not quantize"
    for name, width in (("key", g.key_length), ("value", g.value_length)):
        if width % group_size:
            return f"{name} head width {width} is not a multiple of group size {group_size}"
    if all(layer_window(g, i) is not None for i in range(g.n_layers)):
        return f"every layer slides (window {g.sliding_window}), and sliding layers keep a float cache"
    return None


def plan_kv_quant(
    s: KVQuantSettings,
    g: ModelGeometry,
    *,
    streams: int = 1,
    context_length: int | None = None,
    float_bytes: int = 2,
    kv_budget_bytes: int | None = None,
) -> KVQuantPlan | None:
    """The plan for model `g` under settings `s`; None when KV quantization is off.

    `streams`, `context_length`, `float_bytes` and `kv_budget_bytes` (memory left for KV once
    weights and reserve are counted) feed only the `auto` choice."""
    if not s.enabled:
        return None
    s.check()
    window = g.context_length if context_length is None else min(context_length, g.context_length)
    auto = None
    scheme = s.scheme
    if scheme in (None, "auto"):
        if s.value_bits is not None or s.tail_tokens is not None:
            scheme, auto = "kvarn", "kv value bits or tail tokens were set, and only kvarn has them"
        else:
            scheme, auto = choose_scheme(
                g, streams=streams, context_length=window, float_bytes=float_bytes, kv_budget_bytes=kv_budget_bytes
            )
    bits = s.bits if s.bits is not None else DEFAULT_BITS[scheme]
    group_size = s.group_size if s.group_size is not None else DEFAULT_GROUP_SIZE
    value_bits = tail_tokens = None
    if scheme == "kvarn":
        value_bits = s.value_bits if s.value_bits is not None else min(bits, DEFAULT_VALUE_BITS)
        tail_tokens = s.tail_tokens if s.tail_tokens is not None else DEFAULT_TAIL_TOKENS

    n = g.n_layers
    sliding = sum(1 for i in range(n) if layer_window(g, i) is not None)
    if (why := _drop_reason(g, group_size)) is not None:
        quantized, verdict, reason = 0, DROPPED, why
    elif sliding:
        quantized, verdict = n - sliding, PARTIAL
        reason = (
            f"{sliding} of {n} layers slide (window {g.sliding_window}) and keep a float cache: "
            "it stops at the window, so quantizing it would save a constant, not a share of the context"
        )
    else:
        quantized, verdict, reason = n, FULL, None
    if tail_tokens and verdict != DROPPED and tail_tokens >= window:
        verdict = DROPPED
        quantized = 0
        reason = f"the float tail of {tail_tokens} tokens covers the whole {window}-token context"

    return KVQuantPlan(
        scheme, bits, group_size, quantized, n - quantized, verdict, reason, verdict, value_bits, tail_tokens, auto
    )


def server_plan(
    s: KVQuantSettings,
    g: ModelGeometry,
    *,
    memory: int,
    weight_bytes: int,
    reserve_fraction: float,
    reserve_floor: int,
    prompt_cache_bytes: int = 0,
    streams: int = 1,
    context_length: int | None = None,
    float_bytes: int = 4,
) -> KVQuantPlan | None:
    """`plan_kv_quant` with the budget a server plans with (weights, reserve and prompt cache
    taken off `memory`). float_bytes 4: the engine computes in float32 (as gmlx.cli.plan assumes)."""
    from gmlx.capacity.budget import MemoryBudget

    budget = MemoryBudget(memory, weight_bytes, 0, reserve_floor, reserve_fraction, prompt_cache_bytes)
    return plan_kv_quant(
        s, g, streams=streams, context_length=context_length, float_bytes=float_bytes, kv_budget_bytes=budget.kv_bytes
    )
