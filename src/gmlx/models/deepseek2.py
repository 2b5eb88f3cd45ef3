"""DeepSeek V2/V3 (`deepseek2`: multi-head latent attention, shared and grouped experts, leading dense layers)
onto mlx_lm's deepseek_v3 class.

Newer llama.cpp converters split the latent's up-projection `kv_b` into `attn_k_b` ([n_head, kv_lora, qk_nope]
in MLX order) and `attn_v_b` ([n_head, v_head, kv_lora]), exactly mlx_lm's absorbed `embed_q` / `unembed_out`:
both sides cache one latent of kv_lora_rank plus the shared rotary key per token (gmlx.capacity counts so).
Older files hold only `attn_kv_b` ([n_head * (qk_nope + v_head), kv_lora]): it loads as one linear and is split
into the same two once its weights are in (llama.cpp then caches full keys and values; gmlx still the latent).

The router follows llama.cpp's build_moe_ffn rather than mlx_lm's (sigmoid only, masked groups set to 0): softmax
(V2) or sigmoid (V3) scores, the `exp_probs_b` bias for choosing only, groups ranked by their top-2 sum with the
others masked to -inf, then optional renormalization and `expert_weights_scale`.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.mla import MultiLinear

from gmlx.gguf.header import GGUFError, GGUFHeader
from gmlx.models.architecture import Architecture
from gmlx.models.moe import uniform

_GATING = {1: "softmax", 2: "sigmoid"}  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE
_MIN_WEIGHT_SUM = 6.103515625e-5  # llama.cpp clamps the renormalizing sum to the smallest f16 normal

_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",  # V2-Lite: no query compression
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_k_b": "self_attn.embed_q",
    "attn_v_b": "self_attn.unembed_out",
    "attn_kv_b": "self_attn.kv_b",  # not mlx_lm's kv_b_proj: its sanitize would split float weights only
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",  # the leading dense layers
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "exp_probs_b": "mlp.gate",  # exp_probs_b.bias -> mlp.gate.bias
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}


class Router(nn.Module):
    """llama.cpp's expert choice (build_moe_ffn) for DeepseekV3MoE: returns (expert ids, their weights)."""

    def __init__(
        self,
        n_expert: int,
        dims: int,
        top_k: int,
        gating: str,
        biased: bool,
        groups: int,
        groups_used: int,
        normalize: bool,
        scale: float,
    ):
        super().__init__()
        self.weight = mx.zeros((n_expert, dims))
        if biased:
            self.bias = mx.zeros((n_expert,))
        self.top_k, self.gating, self.groups, self.groups_used = top_k, gating, groups, groups_used
        self.normalize, self.scale = normalize, scale

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        logits = (x @ self.weight.T).astype(mx.float32)
        probs = mx.softmax(logits, axis=-1, precise=True) if self.gating == "softmax" else mx.sigmoid(logits)
        choice = probs + self.bias if "bias" in self else probs
        if self.groups > 1:
            grouped = mx.unflatten(choice, -1, (self.groups, -1))
            ranks = mx.topk(grouped, 2, axis=-1).sum(axis=-1, keepdims=True)
            dropped = self.groups - self.groups_used
            worst = mx.argpartition(ranks, kth=dropped - 1, axis=-2)[..., :dropped, :]
            choice = mx.flatten(mx.put_along_axis(grouped, worst, mx.array(-mx.inf), axis=-2), -2, -1)
        inds = mx.stop_gradient(mx.argpartition(-choice, kth=self.top_k - 1, axis=-1)[..., : self.top_k])
        weights = mx.take_along_axis(probs, inds, axis=-1)
        if self.normalize:
            weights = weights / mx.maximum(weights.sum(axis=-1, keepdims=True), _MIN_WEIGHT_SUM)
        return inds, weights * self.scale


class DeepSeek2(Architecture):
    gguf_name = "deepseek2"
    model_type = "deepseek_v3"
    block_names = _NAMES

    def model_args(self, h: GGUFHeader) -> dict[str, Any]:
        g = h.geometry
        rope = uniform(h, "rope.dimension_count")
        # The split layout's key/value lengths describe its MQA view; the per-head ones are the `_mla` keys.
        key_mla = int(h.arch_key("attention.key_length_mla", 0)) or g.key_length
        v_head = int(h.arch_key("attention.value_length_mla", 0)) or g.value_length
        n_ff_exp = uniform(h, "expert_feed_forward_length")
        return {
            "model_type": self.model_type,
            "vocab_size": h.tensors["token_embd.weight"].shape[-1],
            "hidden_size": g.n_embd,
            "intermediate_size": g.n_ff,
            "moe_intermediate_size": n_ff_exp,
            "num_hidden_layers": g.n_layers,
            "num_attention_heads": g.n_heads,
            "num_key_value_heads": g.n_heads,
            "n_shared_experts": int(h.arch_key("expert_shared_count", 0)) or None,
            "n_routed_experts": uniform(h, "expert_count"),
            "num_experts_per_tok": uniform(h, "expert_used_count"),
            "kv_lora_rank": uniform(h, "attention.kv_lora_rank"),
            "q_lora_rank": g.q_lora_rank or None,  # V2-Lite: 0, a plain attn_q
            "qk_rope_head_dim": rope,
            "qk_nope_head_dim": key_mla - rope,
            "v_head_dim": v_head,
            "first_k_dense_replace": int(h.arch_key("leading_dense_block_count", 0)),
            "moe_layer_freq": 1,
            "max_position_embeddings": g.context_length,
            "rms_norm_eps": g.norm_eps,
            "rope_theta": g.rope_theta,
            "rope_scaling": yarn_scaling(h),
        }

    def prepare(self, model: nn.Module, h: GGUFHeader) -> None:
        gating = _GATING.get(int(h.arch_key("expert_gating_func", 1)))
        if gating is None:
            raise GGUFError(
                f"{h.architecture}: expert_gating_func {h.arch_key('expert_gating_func')} is not supported "
                f"(supported: {', '.join(f'{k} ({v})' for k, v in _GATING.items())})"
            )
        args = model.args
        for i, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            for norm in ("q_a_layernorm", "kv_a_layernorm"):  # mlx_lm fixes 1e-6; llama.cpp uses the file's eps
                if norm in attn:
                    attn[norm].eps = h.geometry.norm_eps
            if _legacy(h):  # kv_b until finish() splits it
                attn.kv_b = nn.Linear(
                    args.kv_lora_rank, args.num_attention_heads * (args.qk_nope_head_dim + args.v_head_dim), bias=False
                )
                del attn["embed_q"], attn["unembed_out"]
            if "switch_mlp" not in layer.mlp:
                continue
            layer.mlp.gate = Router(
                args.n_routed_experts,
                args.hidden_size,
                args.num_experts_per_tok,
                gating,
                biased=f"blk.{i}.exp_probs_b.bias" in h.tensors,
                groups=int(h.arch_key("expert_group_count", 1) or 1),
                groups_used=int(h.arch_key("expert_group_used_count", 1) or 1),
                normalize=bool(h.arch_key("expert_weights_norm", False)),
                scale=float(h.arch_key("expert_weights_scale", 0.0)) or 1.0,
            )

    def finish(self, model: nn.Module, h: GGUFHeader, arrays: dict[str, mx.array]) -> None:
        if not _legacy(h):
            return
        args = model.args
        for layer in model.model.layers:
            attn = layer.self_attn
            kv_b = attn.kv_b
            w = float_weight(kv_b).reshape(args.num_attention_heads, args.qk_nope_head_dim + args.v_head_dim, -1)
            embed_q = MultiLinear(args.qk_nope_head_dim, args.kv_lora_rank, args.num_attention_heads)
            unembed_out = MultiLinear(args.kv_lora_rank, args.v_head_dim, args.num_attention_heads)
            embed_q.weight = mx.contiguous(w[:, : args.qk_nope_head_dim, :].swapaxes(-1, -2))
            unembed_out.weight = mx.contiguous(w[:, args.qk_nope_head_dim :, :])
            if isinstance(kv_b, nn.QuantizedLinear):  # native mode: keep them quantized as the file was
                embed_q = embed_q.to_quantized(kv_b.group_size, kv_b.bits)
                unembed_out = unembed_out.to_quantized(kv_b.group_size, kv_b.bits)
            attn.embed_q, attn.unembed_out = embed_q, unembed_out
            del attn["kv_b"]


def _legacy(h: GGUFHeader) -> bool:
    return "blk.0.attn_k_b.weight" not in h.tensors and "blk.0.attn_kv_b.weight" in h.tensors


def float_weight(linear: nn.Module) -> mx.array:
    """A linear's weight as float32 (out, in), whichever form the weight mode gave it."""
    from gmlx.kernels import GGUFLinear, dequant_rows

    if isinstance(linear, GGUFLinear):
        return dequant_rows(linear.weight, linear.ggml_type, linear.in_features)
    if isinstance(linear, nn.QuantizedLinear):
        return mx.dequantize(linear.weight, linear.scales, linear.biases, linear.group_size, linear.bits)
    return linear.weight


def yarn_scaling(h: GGUFHeader) -> dict[str, Any] | None:
    """llama.cpp's YaRN keys as mlx_lm's deepseek_v3 reads them (the converter writes 0.1 * mscale_all_dim)."""
    kind = h.arch_key("rope.scaling.type")
    if not kind or kind == "none":
        return None
    if kind != "yarn":
        raise GGUFError(f"{h.architecture}: rope scaling {kind!r} is not supported (only yarn)")
    mscale = float(h.arch_key("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
    return {
        "type": "yarn",
        "factor": float(h.arch_key("rope.scaling.factor")),
        "original_max_position_embeddings": int(h.arch_key("rope.scaling.original_context_length")),
        "beta_fast": float(h.arch_key("rope.scaling.yarn_beta_fast", 32.0)),
        "beta_slow": float(h.arch_key("rope.scaling.yarn_beta_slow", 1.0)),
        "mscale": mscale,
        "mscale_all_dim": mscale,
    }
