"""GGUF tensor names -> mlx_lm parameter names, shared by the architectures."""

from __future__ import annotations

import re

# Per-block names common to llama.cpp's converters; an architecture overrides a few.
BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)$")


def mlx_name(gguf_module: str, block_names: dict[str, str]) -> str | None:
    """`blk.3.attn_q` -> `model.layers.3.self_attn.q_proj`; None for a name with no home."""
    if gguf_module in TOP_NAMES:
        return TOP_NAMES[gguf_module]
    m = _BLOCK.match(gguf_module)
    if m and m.group(2) in block_names:
        return f"model.layers.{m.group(1)}.{block_names[m.group(2)]}"
    return None
