"""Tiny random-weight GGUFs of the dense architectures, as llama.cpp's converter writes them, for
the llama.cpp logit references (tests/reference_architectures.py lists them, one entry each).

Each file is the same bytes on every run (a fixed seed, gguf's own numpy Q8_0 quantizer): the
reference stores their hash. Matrices are Q8_0, which llama.cpp, gmlx's gguf kernels and MLX's
8-bit affine `native` mode all run (or F32, for the tight float-mode check); norms, biases and RoPE
factors are F32, as the converter writes them.

Random tiny models give a flat next-token distribution where top-1 flips on rounding noise. Here
the final norm's weight is large, so that the logits spread over about LOGIT_SPREAD nats: the top-1
token then leads its second by a nat or more at most steps. Not at all of them: the top two of
random logits are sometimes close whatever their scale, and llama.cpp's 8-bit activations move its
log-probabilities by up to about 0.5 nats, so tests/test_architectures.py treats a lead under 0.5 nats
(0.05 for F32 files) as a tie (the generator prints the smallest lead it met).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize
from tiny_vocab import TINY_VOCAB_SIZE, add_tiny_vocab

HIDDEN, FF, CONTEXT = 256, 512, 512
LOGIT_SPREAD = 8.0  # standard deviation of the logits, in nats


@dataclass(frozen=True)
class Spec:
    """What a dense architecture's GGUF holds, beyond the llama layout every one starts from."""

    arch: str  # general.architecture
    vocab: str = "gpt2"  # tiny_vocab kind
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    tied: bool = False
    rope_base: float = 10000.0
    qkv_bias: bool = False
    qk_norm: str | None = None  # "head": one weight per head_dim (qwen3, gemma); "full": over the projection (olmo2)
    pre_norms: bool = True  # attn_norm / ffn_norm before each block (olmo2 has none)
    post_norms: bool = False  # post_attention_norm / post_ffw_norm after each block (gemma2/3, olmo2)
    fused: bool = False  # phi3: attn_qkv and a gate|up ffn_up
    rope_freqs: bool = False  # Llama 3.x: per-frequency factors as the converter computes them
    embed_scale: float = 0.1  # token_embd's spread (gemma's is divided by the sqrt(n_embd) it multiplies by)
    keys: dict[str, float | int | bool] = field(default_factory=dict)  # `{arch}.key` -> value
    name: str = ""  # general.name (tiny-<arch> when empty)


class Tiny:
    """One GGUF being written: the writer, the seeded generator, and helpers for each tensor kind."""

    MATRIX_SCALE = 0.05

    def __init__(self, path: Path, arch: str, seed: int, qtype: Q = Q.Q8_0):
        self.path, self.rng, self.qtype = path, np.random.default_rng(seed), qtype
        self.w = gguf.GGUFWriter(str(path), arch)

    def matrix(self, name: str, rows: int, cols: int, scale: float = MATRIX_SCALE) -> None:
        data = (self.rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        if self.qtype == Q.F32:
            self.w.add_tensor(name, data)
        else:
            self.w.add_tensor(name, quantize(data, self.qtype), raw_dtype=self.qtype)

    def vector(self, name: str, size: int, base: float = 1.0, spread: float = 0.05) -> None:
        self.w.add_tensor(name, (base + self.rng.standard_normal(size) * spread).astype(np.float32))

    def close(self) -> Path:
        self.w.write_header_to_file()
        self.w.write_kv_data_to_file()
        self.w.write_tensors_to_file()
        self.w.close()
        return self.path


def llama3_rope_factors(
    head_dim: int, base: float, factor: float = 8.0, low: float = 1.0, high: float = 4.0, original_context: int = 64
) -> np.ndarray:
    """Llama 3.1's frequency factors as llama.cpp's converter writes them (`rope_freqs.weight`); the tiny
    original context makes all three bands (kept, divided by `factor`, smoothed) occur at head_dim 64."""
    freqs = base ** -(np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / freqs
    smooth = (original_context / wavelen - low) / (high - low)
    out = np.where(
        wavelen < original_context / high,
        1.0,
        np.where(wavelen > original_context / low, factor, 1 / ((1 - smooth) / factor + smooth)),
    )
    return out.astype(np.float32)


def write(
    path: Path, spec: Spec, seed: int = 0, extra: Callable[[Tiny], None] | None = None, qtype: Q = Q.Q8_0
) -> Path:
    """`qtype`: the matrices' type (Q8_0 or F32). `extra` adds what no reference file has (a test's odd
    tensor or key) before the file is closed."""
    t = Tiny(path, spec.arch, seed, qtype)
    w = t.w
    w.add_name(spec.name or f"tiny-{spec.arch}")
    w.add_block_count(spec.layers)
    w.add_context_length(CONTEXT)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FF)
    w.add_head_count(spec.heads)
    w.add_head_count_kv(spec.kv_heads)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_rope_dimension_count(spec.head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(spec.rope_base)
    for key, value in spec.keys.items():
        full = f"{spec.arch}.{key}"
        if isinstance(value, bool):
            w.add_bool(full, value)
        elif isinstance(value, int):
            w.add_uint32(full, value)
        else:
            w.add_float32(full, value)
    add_tiny_vocab(w, spec.vocab)
    vocab = TINY_VOCAB_SIZE[spec.vocab]

    t.matrix("token_embd.weight", vocab, HIDDEN, scale=spec.embed_scale)
    # logits = output_norm * normalized h (elements ~1) . an output row: spread = gain * sqrt(HIDDEN) * row scale
    gain = LOGIT_SPREAD / (np.sqrt(HIDDEN) * (spec.embed_scale if spec.tied else Tiny.MATRIX_SCALE))
    gain *= float(spec.keys.get("logit_scale", 1.0))  # granite divides its logits by that
    t.vector("output_norm.weight", HIDDEN, gain, spread=gain / 10)
    if not spec.tied:
        t.matrix("output.weight", vocab, HIDDEN)
    if spec.rope_freqs:
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(spec.head_dim, spec.rope_base))
    q_out, kv_out = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    for i in range(spec.layers):
        b = f"blk.{i}"
        if spec.pre_norms:
            t.vector(f"{b}.attn_norm.weight", HIDDEN)
        if spec.fused:
            t.matrix(f"{b}.attn_qkv.weight", q_out + 2 * kv_out, HIDDEN)
        else:
            t.matrix(f"{b}.attn_q.weight", q_out, HIDDEN)
            t.matrix(f"{b}.attn_k.weight", kv_out, HIDDEN)
            t.matrix(f"{b}.attn_v.weight", kv_out, HIDDEN)
        if spec.qkv_bias:
            for part, size in (("q", q_out), ("k", kv_out), ("v", kv_out)):
                t.vector(f"{b}.attn_{part}.bias", size, 0.0, spread=0.2)
        if spec.qk_norm == "head":
            t.vector(f"{b}.attn_q_norm.weight", spec.head_dim)
            t.vector(f"{b}.attn_k_norm.weight", spec.head_dim)
        elif spec.qk_norm == "full":
            t.vector(f"{b}.attn_q_norm.weight", q_out)
            t.vector(f"{b}.attn_k_norm.weight", kv_out)
        t.matrix(f"{b}.attn_output.weight", HIDDEN, q_out)
        if spec.post_norms:
            t.vector(f"{b}.post_attention_norm.weight", HIDDEN)
        if spec.pre_norms:
            t.vector(f"{b}.ffn_norm.weight", HIDDEN)
        if spec.fused:
            t.matrix(f"{b}.ffn_up.weight", 2 * FF, HIDDEN)
        else:
            t.matrix(f"{b}.ffn_gate.weight", FF, HIDDEN)
            t.matrix(f"{b}.ffn_up.weight", FF, HIDDEN)
        t.matrix(f"{b}.ffn_down.weight", HIDDEN, FF)
        if spec.post_norms:
            t.vector(f"{b}.post_ffw_norm.weight", HIDDEN)
    if extra is not None:
        extra(t)
    return t.close()


# Llama 3.2-style: GQA, untied output, rope_freqs (llama.cpp reads only that tensor for Llama 3 scaling: the
# converter writes no rope.scaling keys for rope_type llama3).
LLAMA3 = Spec("llama", vocab="llama", rope_base=500000.0, rope_freqs=True)
# Mistral 7B / Nemo: llama.cpp's converter writes MistralForCausalLM as `llama` (its `mistral3` is for the
# checkpoints with llama_4_scaling). Nemo's head_dim (128) is not n_embd / n_head; llama ignores sliding_window.
MISTRAL = Spec("llama", vocab="llama", heads=4, kv_heads=1, head_dim=128, rope_base=1000000.0)
QWEN2 = Spec("qwen2", qkv_bias=True, tied=True, rope_base=1000000.0)
QWEN3 = Spec("qwen3", qk_norm="head", tied=True, rope_base=1000000.0)
# Phi-3 mini: fused attn_qkv and gate|up ffn_up; the converter writes a sliding_window llama.cpp ignores. Not
# named "phi3": llama.cpp then looks up Phi-3's own special tokens, which the tiny vocabulary lacks.
PHI3 = Spec(
    "phi3",
    vocab="llama",
    kv_heads=4,
    fused=True,
    name="tiny-phi-mini",
    keys={"attention.sliding_window": 32, "rope.scaling.original_context_length": 256},
)
GEMMA_EMBED = 0.1 / np.sqrt(HIDDEN)
# Gemma 2: sliding window on even layers (llama.cpp's default pattern 2), soft-capped attention and logits
# (the real final cap, which bends these logits' top; a small attention cap, for these small attention scores).
GEMMA2 = Spec(
    "gemma2",
    vocab="llama",
    layers=4,
    tied=True,
    post_norms=True,
    embed_scale=GEMMA_EMBED,
    keys={"attention.sliding_window": 32, "attn_logit_softcapping": 3.0, "final_logit_softcapping": 30.0},
)
# Gemma 3: five sliding layers in six; global RoPE base 1e6 as Gemma 3's, the sliding layers' 10,000 (hard-coded
# by llama.cpp).
GEMMA3 = Spec(
    "gemma3",
    vocab="llama",
    layers=6,
    tied=True,
    qk_norm="head",
    post_norms=True,
    embed_scale=GEMMA_EMBED,
    rope_base=1000000.0,
    keys={"attention.sliding_window": 32},
)
# Granite 3: its four multipliers (the embedding's offset by a smaller embedding, so that layers still matter;
# the attention scale twice 1/sqrt(head_dim), not Granite's 1/head_dim, which leaves these tiny models' attention
# uniform and blind to positions); untied, else the input token's own embedding, 12x larger, dominates its logit.
GRANITE = Spec(
    "granite",
    embed_scale=0.1 / 12,
    rope_base=10000000.0,
    keys={"embedding_scale": 12.0, "residual_scale": 0.5, "attention.scale": 0.25, "logit_scale": 8.0},
)
# OLMo 2: post-norms only, Q/K norms over the whole projection, untied output (llama.cpp requires it).
OLMO2 = Spec("olmo2", pre_norms=False, post_norms=True, qk_norm="full", rope_base=500000.0)
# SmolLM3: llama with no RoPE on layers 3, 7, ... (8 layers: two of them).
SMOLLM3 = Spec("smollm3", layers=8, tied=True, rope_base=5000000.0)
