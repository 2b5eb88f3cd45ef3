"""Qwen 2 MoE (with its gated shared expert) and Qwen 3 MoE, as llama.cpp's converter writes them.

The converter merges each layer's experts into 3-D tensors `ffn_{gate,up,down}_exps` ([n_expert, out, in] in
MLX order), which is exactly the stacked layout of mlx_lm's SwitchGLU, so they load without mlx_lm's per-expert
`sanitize`.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from gmlx.gguf.header import GGUFError, GGUFHeader
from gmlx.models.architecture import Architecture
from gmlx.models.names import BLOCK_NAMES

_EXPERT_NAMES = {
    "ffn_gate_inp": "mlp.gate",  # the router; llama.cpp's converter keeps it F32
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
}
_SHARED_NAMES = {
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}


def uniform(h: GGUFHeader, key: str, default: int | None = None) -> int:
    """An integer key that llama.cpp reads as one value or one per layer (gmlx needs it equal in every layer)."""
    value = h.arch_key(key, default)
    if value is None:
        raise GGUFError(f"{h.architecture}: {h.architecture}.{key} is missing")
    values = {int(v) for v in value} if isinstance(value, (list, tuple)) or hasattr(value, "shape") else {int(value)}
    if len(values) != 1:
        raise GGUFError(f"{h.architecture}: {key} differs between layers ({sorted(values)}), not supported")
    return values.pop()


def expert_args(h: GGUFHeader) -> dict[str, Any]:
    n_ff = h.geometry.n_ff
    used = uniform(h, "expert_used_count")
    return {
        "num_experts": uniform(h, "expert_count"),
        "num_experts_per_tok": used,
        # llama.cpp's fallback when the key is absent: the dense width shared among the used experts
        "moe_intermediate_size": uniform(h, "expert_feed_forward_length", n_ff // used if n_ff else None),
    }


class Qwen3Moe(Architecture):
    gguf_name = "qwen3moe"
    model_type = "qwen3_moe"
    block_names = {**BLOCK_NAMES, **_EXPERT_NAMES}

    def model_args(self, h: GGUFHeader) -> dict[str, Any]:
        args = {**super().model_args(h), **expert_args(h)}
        # Every layer is sparse in llama.cpp's graph, and it always renormalizes the top-k weights.
        args.update(decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
        args["intermediate_size"] = args["intermediate_size"] or args["moe_intermediate_size"]  # unused: no dense layer
        return args


class Qwen2Moe(Architecture):
    gguf_name = "qwen2moe"
    model_type = "qwen2_moe"
    block_names = {**BLOCK_NAMES, **_EXPERT_NAMES, **_SHARED_NAMES}

    def model_args(self, h: GGUFHeader) -> dict[str, Any]:
        g = h.geometry
        if "output.weight" not in h.tensors:
            raise GGUFError(f"{h.architecture}: no output.weight (llama.cpp and mlx_lm both need an untied head)")
        if g.key_length * g.n_heads != g.n_embd:
            raise GGUFError(
                f"{h.architecture}: head size {g.key_length} x {g.n_heads} heads != {g.n_embd} "
                "(mlx_lm's qwen2_moe derives the head size from the width)"
            )
        args = {**super().model_args(h), **expert_args(h)}
        # llama.cpp: the shared expert's width defaults to the dense width; softmax top-k weights, not renormalized.
        args["shared_expert_intermediate_size"] = uniform(h, "expert_shared_feed_forward_length", g.n_ff or None)
        return args

    def adjust(self, name: str, array: mx.array) -> mx.array:
        # The shared expert's gate is one row: llama.cpp stores it 1-D ({n_embd}), mlx_lm as a (1, n_embd) Linear.
        if name.endswith("ffn_gate_inp_shexp.weight") and array.ndim == 1:
            return array[None, :]
        return array
