"""OLMo 2: no norms before the blocks, RMS norms after them, and Q/K norms over the whole projection."""

from __future__ import annotations

from typing import Any

from gmlx.gguf.header import GGUFError, GGUFHeader
from gmlx.models.architecture import Architecture
from gmlx.models.names import BLOCK_NAMES


class Olmo2(Architecture):
    gguf_name = "olmo2"
    model_type = "olmo2"
    block_names = {
        **BLOCK_NAMES,
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    }

    def model_args(self, h: GGUFHeader) -> dict[str, Any]:
        # llama.cpp's converter writes Olmo 3 as olmo2 plus a sliding window, which mlx_lm's olmo2 lacks.
        if h.geometry.sliding_window:
            raise GGUFError(f"{h.architecture}: a sliding window (Olmo 3) is not supported: {h.path}")
        return super().model_args(h)
