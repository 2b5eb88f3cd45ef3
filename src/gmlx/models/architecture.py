"""What every architecture module provides: GGUF keys -> mlx_lm ModelArgs, GGUF names -> mlx_lm names."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from gmlx.gguf.header import GGUFError, GGUFHeader
from gmlx.models.names import BLOCK_NAMES, mlx_name


class Architecture:
    """Defaults fit llama.cpp's llama-family converters; subclasses override what differs."""

    gguf_name: str  # general.architecture
    model_type: str  # module under mlx_lm.models
    block_names: dict[str, str] = BLOCK_NAMES

    @property
    def module(self) -> str:
        """The module whose ModelArgs and Model the loader builds (gmlx's own where mlx_lm's lacks something)."""
        return f"mlx_lm.models.{self.model_type}"

    def model_args(self, h: GGUFHeader) -> dict[str, Any]:
        g = h.geometry
        if len(set(g.n_kv_heads)) > 1:
            raise GGUFError(f"{h.architecture}: a different KV head count per layer is not supported")
        return {
            "model_type": self.model_type,
            "hidden_size": g.n_embd,
            "num_hidden_layers": g.n_layers,
            "intermediate_size": g.n_ff,
            "num_attention_heads": g.n_heads,
            "num_key_value_heads": g.n_kv_heads[0],
            "head_dim": g.key_length,
            "rms_norm_eps": g.norm_eps,
            "vocab_size": h.tensors["token_embd.weight"].shape[-1],
            "max_position_embeddings": g.context_length,
            "rope_theta": g.rope_theta,
            "rope_scaling": rope_scaling(h),
            "tie_word_embeddings": "output.weight" not in h.tensors,
        }

    def mlx_name(self, gguf_module: str) -> str | None:
        return mlx_name(gguf_module, self.block_names)

    def prepare(self, model: nn.Module, h: GGUFHeader) -> None:
        """Change the model mlx_lm built before any weight goes in (modules ModelArgs cannot express)."""

    def adjust(self, name: str, array: mx.array) -> mx.array:
        """Fix a float tensor whose convention differs between llama.cpp and mlx_lm."""
        return array

    def finish(self, model: nn.Module, h: GGUFHeader, arrays: dict[str, mx.array]) -> None:
        """Last changes once weights are in (for what ModelArgs cannot express)."""

    def export_blocker(self, h: GGUFHeader) -> str | None:
        """Why `mlx_lm.load` of an exported directory would not rebuild this model (None: it would)."""
        return None


def rope_scaling(h: GGUFHeader) -> dict[str, Any] | None:
    kind = h.arch_key("rope.scaling.type")
    factor = h.arch_key("rope.scaling.factor")
    if not kind or kind == "none" or not factor:
        return None
    scaling: dict[str, Any] = {"type": kind, "rope_type": kind, "factor": float(factor)}
    if original := h.arch_key("rope.scaling.original_context_length"):
        scaling["original_max_position_embeddings"] = int(original)
    return scaling
