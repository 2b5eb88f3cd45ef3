"""Tiny GGUF models with random weights, written the way llama.cpp's converter writes them."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from tiny_quant import tensor_bytes
from tiny_vocab import TINY_VOCAB_SIZE, add_tiny_vocab

ARCHES = ("llama", "qwen2", "qwen3", "gemma3")
VOCAB_KIND = {"llama": "llama", "gemma3": "llama", "qwen2": "gpt2", "qwen3": "gpt2"}
# K-quants pack 256 weights a block, so every matrix's input width is a multiple of 256.
HIDDEN, FF, HEADS, KV_HEADS, HEAD_DIM = 256, 512, 4, 2, 64
CONTEXT = 256


def _layers(arch: str) -> int:
    return 6 if arch == "gemma3" else 2  # gemma3 needs one full-attention layer per 6


def write_model(
    path: Path,
    arch: str = "llama",
    qtype: Q = Q.F32,
    tied: bool = True,
    seed: int = 0,
    context: int = CONTEXT,
    heads: int = HEADS,
    kv_heads: int = KV_HEADS,
    head_dim: int = HEAD_DIM,
    chat_template: str | None = None,
    space_prefix: bool = False,
) -> Path:
    """`kv_heads` and `head_dim` size the KV cache per token; `heads` must be a multiple
    of `kv_heads`, and a K-quant needs `heads * head_dim` a multiple of 256. Without a
    `chat_template` the file carries none (gmlx falls back to the family's). `space_prefix`: a
    SentencePiece vocabulary that adds a space before the text (tiny_vocab.add_tiny_vocab)."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    n_layers = _layers(arch)
    w.add_block_count(n_layers)
    w.add_context_length(context)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FF)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    if arch == "gemma3":
        w.add_sliding_window(64)
    add_tiny_vocab(w, VOCAB_KIND[arch], space_prefix)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    vocab = TINY_VOCAB_SIZE[VOCAB_KIND[arch]]

    def matrix(name: str, rows: int, cols: int, scale: float = 0.05) -> None:
        data = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        if qtype == Q.F32:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, tensor_bytes(qtype, (rows, cols), rng), raw_dtype=qtype)

    def vector(name: str, size: int, base: float = 1.0) -> None:
        w.add_tensor(name, (base + rng.standard_normal(size) * 0.05).astype(np.float32))

    norm_base = 1.0  # gemma's converter folds mlx_lm's "+1" into its norms; a weight near 1 works for all
    matrix("token_embd.weight", vocab, HIDDEN, scale=0.1)
    vector("output_norm.weight", HIDDEN, norm_base)
    if not tied:
        matrix("output.weight", vocab, HIDDEN)
    q_out, kv_out = heads * head_dim, kv_heads * head_dim
    for i in range(n_layers):
        b = f"blk.{i}"
        vector(f"{b}.attn_norm.weight", HIDDEN, norm_base)
        matrix(f"{b}.attn_q.weight", q_out, HIDDEN)
        matrix(f"{b}.attn_k.weight", kv_out, HIDDEN)
        matrix(f"{b}.attn_v.weight", kv_out, HIDDEN)
        matrix(f"{b}.attn_output.weight", HIDDEN, q_out)
        vector(f"{b}.ffn_norm.weight", HIDDEN, norm_base)
        matrix(f"{b}.ffn_gate.weight", FF, HIDDEN)
        matrix(f"{b}.ffn_up.weight", FF, HIDDEN)
        matrix(f"{b}.ffn_down.weight", HIDDEN, FF)
        if arch == "qwen2":
            for part, size in (("q", q_out), ("k", kv_out), ("v", kv_out)):
                vector(f"{b}.attn_{part}.bias", size, 0.0)
        if arch in ("qwen3", "gemma3"):
            vector(f"{b}.attn_q_norm.weight", head_dim, norm_base)
            vector(f"{b}.attn_k_norm.weight", head_dim, norm_base)
        if arch == "gemma3":
            vector(f"{b}.post_attention_norm.weight", HIDDEN, norm_base)
            vector(f"{b}.post_ffw_norm.weight", HIDDEN, norm_base)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
