"""Tiny mixture-of-experts GGUFs (qwen2moe, qwen3moe, deepseek2) with random weights, laid out as llama.cpp's converter
writes them: each layer's experts merged into 3-D `ffn_*_exps` tensors, the router (`ffn_gate_inp`) and the
norms F32, every other matrix in `qtype`.

Random weights give flat next-token distributions whose top-1 flips on rounding noise, so the output head is
scaled up (OUTPUT_SCALE) until the top token stands clear. Routing has near-ties of its own: where a token's
k-th and (k+1)-th experts are within llama.cpp's rounding (its 8-bit activations move router log-probabilities by
~0.005 nats), the two sides pick different experts and the output jumps. SEED is one (of the first 12 tried) whose
reference sequences (bench/llamacpp_architectures.py's prompts and greedy tokens) route with every margin at or
above 0.014 nats, for both architectures. Deterministic by seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize
from tiny_quant import random_blocks
from tiny_vocab import TINY_VOCAB_SIZE, add_tiny_vocab

MOE_ARCHES = ("qwen2moe", "qwen3moe")
CONTEXT = 256
WEIGHT_SCALE = 0.05
OUTPUT_SCALE = 0.6  # the head's weights: logits with a spread of several nats (peaked, see above)
ROUTER_SCALE = 0.3
SEED = 9
# deepseek2's sigmoid router over grouped experts has more near-ties. Of seeds 0-7, the Q8_0 reference passes for 5
# and 7 (and 7's F32 copy meets a flip on llama.cpp's f16 KV cache); the others meet a routing flip on llama.cpp's
# side (KL up to 7 at a step) while their F32 copies agree with llama.cpp to KL < 1e-4: the mapping is right there
# too, and the flip is llama.cpp's 8-bit rounding.
DEEPSEEK2_SEED = 5
LEGACY_SEED = 7  # the same for the legacy attn_kv_b layout: of seeds 0, 5, 7 and 9, 7 passes


@dataclass(frozen=True)
class Size:
    """Q8_0 packs 32 weights a block, K-quants 256: keep every input width a multiple of 256.
    qwen2moe needs heads * head_dim == hidden (mlx_lm derives its head size so)."""

    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    experts: int = 8
    experts_used: int = 2
    expert_ff: int = 256
    shared_ff: int = 512
    layers: int = 2


TINY = Size()


class Tensors:
    """Adds seeded random tensors to a GGUFWriter: matrices quantized to `qtype` unless told otherwise."""

    def __init__(self, w: gguf.GGUFWriter, rng: np.random.Generator, qtype: Q):
        self.w, self.rng, self.qtype = w, rng, qtype

    def matrix(self, name: str, *shape: int, scale: float = WEIGHT_SCALE, kind: Q | None = None) -> None:
        kind = self.qtype if kind is None else kind
        data = (self.rng.standard_normal(shape) * scale).astype(np.float32)
        if kind == Q.F32:
            self.w.add_tensor(name, data)
            return
        try:
            blocks = quantize(data, kind)
        except NotImplementedError:  # gguf has no numpy quantizer for the K-quants
            blocks = random_blocks(kind, shape, self.rng)
        self.w.add_tensor(name, blocks, raw_dtype=kind)

    def vector(self, name: str, n: int, base: float = 1.0, spread: float = 0.05) -> None:
        self.w.add_tensor(name, (base + self.rng.standard_normal(n) * spread).astype(np.float32))


def _close(w: gguf.GGUFWriter, path: Path) -> Path:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_moe(
    path: Path,
    arch: str = "qwen3moe",
    qtype: Q = Q.Q8_0,
    seed: int = SEED,
    size: Size = TINY,
    expert_qtypes: tuple[Q, Q, Q] | None = None,
) -> Path:
    """`expert_qtypes`: the (gate, up, down) experts' types where they differ from `qtype` (as llama.cpp's
    K-quant mixes write them); a type gguf cannot quantize gets random valid blocks."""
    if arch not in MOE_ARCHES:
        raise ValueError(f"no tiny writer for {arch!r}")
    z = size
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(z.layers)
    w.add_context_length(CONTEXT)
    w.add_embedding_length(z.hidden)
    w.add_feed_forward_length(z.shared_ff)
    w.add_head_count(z.heads)
    w.add_head_count_kv(z.kv_heads)
    w.add_key_length(z.head_dim)
    w.add_value_length(z.head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_expert_count(z.experts)
    w.add_expert_used_count(z.experts_used)
    w.add_expert_feed_forward_length(z.expert_ff)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(z.shared_ff)
    add_tiny_vocab(w, "gpt2")
    vocab = TINY_VOCAB_SIZE["gpt2"]

    t = Tensors(w, rng, qtype)
    matrix, vector = t.matrix, t.vector

    matrix("token_embd.weight", vocab, z.hidden, scale=0.5)
    vector("output_norm.weight", z.hidden)
    matrix("output.weight", vocab, z.hidden, scale=OUTPUT_SCALE)
    q_out, kv_out = z.heads * z.head_dim, z.kv_heads * z.head_dim
    for i in range(z.layers):
        b = f"blk.{i}"
        vector(f"{b}.attn_norm.weight", z.hidden)
        matrix(f"{b}.attn_q.weight", q_out, z.hidden)
        matrix(f"{b}.attn_k.weight", kv_out, z.hidden)
        matrix(f"{b}.attn_v.weight", kv_out, z.hidden)
        matrix(f"{b}.attn_output.weight", z.hidden, q_out)
        if arch == "qwen2moe":
            for part, n in (("q", q_out), ("k", kv_out), ("v", kv_out)):
                vector(f"{b}.attn_{part}.bias", n, 0.0)
        else:
            vector(f"{b}.attn_q_norm.weight", z.head_dim)
            vector(f"{b}.attn_k_norm.weight", z.head_dim)
        vector(f"{b}.ffn_norm.weight", z.hidden)
        matrix(f"{b}.ffn_gate_inp.weight", z.experts, z.hidden, scale=ROUTER_SCALE, kind=Q.F32)
        gate_t, up_t, down_t = expert_qtypes or (qtype, qtype, qtype)
        matrix(f"{b}.ffn_gate_exps.weight", z.experts, z.expert_ff, z.hidden, kind=gate_t)
        matrix(f"{b}.ffn_up_exps.weight", z.experts, z.expert_ff, z.hidden, kind=up_t)
        matrix(f"{b}.ffn_down_exps.weight", z.experts, z.hidden, z.expert_ff, kind=down_t)
        if arch == "qwen2moe":
            vector(f"{b}.ffn_gate_inp_shexp.weight", z.hidden, 0.0, spread=0.1)  # 1-D, as llama.cpp reads it
            matrix(f"{b}.ffn_gate_shexp.weight", z.shared_ff, z.hidden)
            matrix(f"{b}.ffn_up_shexp.weight", z.shared_ff, z.hidden)
            matrix(f"{b}.ffn_down_shexp.weight", z.hidden, z.shared_ff)
    return _close(w, path)


@dataclass(frozen=True)
class MLA:
    """deepseek2's sizes: latent attention (every row width a multiple of Q8_0's 32) and grouped experts.
    q_lora 0: no query compression (V2-Lite), `attn_q`; groups 1: no expert groups."""

    hidden: int = 256
    heads: int = 4
    q_lora: int = 128
    kv_lora: int = 128
    qk_nope: int = 64
    rope: int = 32
    v_head: int = 64
    dense_ff: int = 512
    experts: int = 8
    experts_used: int = 2
    groups: int = 4
    groups_used: int = 2
    expert_ff: int = 256
    shared: int = 1
    layers: int = 3
    dense_layers: int = 1
    weights_scale: float = 2.5
    sigmoid: bool = True  # V3's gating with its exp_probs_b selection bias; else V2's softmax, unbiased
    normalize: bool = True  # the chosen experts' weights renormalized (V3's norm_topk_prob)
    legacy: bool = False  # older converters: one attn_kv_b, per-head key/value lengths, no `_mla` keys
    # sigmoid scores saturate (near-ties at 0 or 1) unless the router's logits stay within a few units
    router_scale: float = 0.1


# DeepSeek-V2-Lite's layout: no query compression, softmax gating, no groups, no renormalizing, no scale.
V2_LITE = MLA(q_lora=0, sigmoid=False, groups=1, normalize=False, weights_scale=1.0, router_scale=0.3)
# V3 as converters wrote it before the split of kv_b (early 2025 files)
V3_LEGACY = MLA(legacy=True)


def write_deepseek2(path: Path, qtype: Q = Q.Q8_0, seed: int = DEEPSEEK2_SEED, z: MLA = MLA()) -> Path:
    """DeepSeek V3-style, as llama.cpp's converter writes it: the latent's up-projection split into attn_k_b and
    attn_v_b (3-D, quantized), key/value lengths of the MQA view (kv_lora + rope, kv_lora) beside the `_mla` ones,
    sigmoid gating with the exp_probs_b selection bias, expert groups, a shared expert, a leading dense layer."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "deepseek2")
    w.add_name("tiny-deepseek2")
    w.add_block_count(z.layers)
    w.add_context_length(CONTEXT)
    w.add_embedding_length(z.hidden)
    w.add_feed_forward_length(z.dense_ff)
    w.add_head_count(z.heads)
    if z.legacy:
        w.add_head_count_kv(z.heads)
        w.add_key_length(z.qk_nope + z.rope)
        w.add_value_length(z.v_head)
    else:
        w.add_head_count_kv(1)
        w.add_key_length(z.kv_lora + z.rope)
        w.add_value_length(z.kv_lora)
        w.add_key_length_mla(z.qk_nope + z.rope)
        w.add_value_length_mla(z.v_head)
    w.add_rope_dimension_count(z.rope)
    w.add_q_lora_rank(z.q_lora)
    w.add_kv_lora_rank(z.kv_lora)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_leading_dense_block_count(z.dense_layers)
    w.add_expert_feed_forward_length(z.expert_ff)
    w.add_expert_count(z.experts)
    w.add_expert_used_count(z.experts_used)
    w.add_expert_shared_count(z.shared)
    w.add_expert_weights_scale(z.weights_scale)
    w.add_expert_weights_norm(z.normalize)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if z.sigmoid else gguf.ExpertGatingFuncType.SOFTMAX)
    if z.groups > 1:
        w.add_expert_group_count(z.groups)
        w.add_expert_group_used_count(z.groups_used)
    add_tiny_vocab(w, "gpt2")
    t = Tensors(w, rng, qtype)
    vocab = TINY_VOCAB_SIZE["gpt2"]

    t.matrix("token_embd.weight", vocab, z.hidden, scale=0.5)
    t.vector("output_norm.weight", z.hidden)
    t.matrix("output.weight", vocab, z.hidden, scale=OUTPUT_SCALE)
    for i in range(z.layers):
        b = f"blk.{i}"
        t.vector(f"{b}.attn_norm.weight", z.hidden)
        if z.q_lora:
            t.matrix(f"{b}.attn_q_a.weight", z.q_lora, z.hidden)
            t.vector(f"{b}.attn_q_a_norm.weight", z.q_lora)
            t.matrix(f"{b}.attn_q_b.weight", z.heads * (z.qk_nope + z.rope), z.q_lora, scale=0.1)
        else:
            t.matrix(f"{b}.attn_q.weight", z.heads * (z.qk_nope + z.rope), z.hidden)
        t.matrix(f"{b}.attn_kv_a_mqa.weight", z.kv_lora + z.rope, z.hidden)
        t.vector(f"{b}.attn_kv_a_norm.weight", z.kv_lora)
        if z.legacy:
            t.matrix(f"{b}.attn_kv_b.weight", z.heads * (z.qk_nope + z.v_head), z.kv_lora, scale=0.1)
        else:
            t.matrix(f"{b}.attn_k_b.weight", z.heads, z.kv_lora, z.qk_nope, scale=0.1)
            t.matrix(f"{b}.attn_v_b.weight", z.heads, z.v_head, z.kv_lora, scale=0.1)
        t.matrix(f"{b}.attn_output.weight", z.hidden, z.heads * z.v_head)
        t.vector(f"{b}.ffn_norm.weight", z.hidden)
        if i < z.dense_layers:
            t.matrix(f"{b}.ffn_gate.weight", z.dense_ff, z.hidden)
            t.matrix(f"{b}.ffn_up.weight", z.dense_ff, z.hidden)
            t.matrix(f"{b}.ffn_down.weight", z.hidden, z.dense_ff)
            continue
        t.matrix(f"{b}.ffn_gate_inp.weight", z.experts, z.hidden, scale=z.router_scale, kind=Q.F32)
        if z.sigmoid:
            t.vector(f"{b}.exp_probs_b.bias", z.experts, 0.0, spread=0.02)
        t.matrix(f"{b}.ffn_gate_exps.weight", z.experts, z.expert_ff, z.hidden)
        t.matrix(f"{b}.ffn_up_exps.weight", z.experts, z.expert_ff, z.hidden)
        t.matrix(f"{b}.ffn_down_exps.weight", z.experts, z.hidden, z.expert_ff)
        t.matrix(f"{b}.ffn_gate_shexp.weight", z.expert_ff * z.shared, z.hidden)
        t.matrix(f"{b}.ffn_up_shexp.weight", z.expert_ff * z.shared, z.hidden)
        t.matrix(f"{b}.ffn_down_shexp.weight", z.hidden, z.expert_ff * z.shared)
    return _close(w, path)
