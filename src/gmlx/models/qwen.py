"""Qwen 2/2.5 (biased QKV) and Qwen 3 (QK norms); llama.cpp keeps their rotate-half RoPE."""

from __future__ import annotations

from gmlx.models.architecture import Architecture


class Qwen2(Architecture):
    gguf_name = "qwen2"
    model_type = "qwen2"


class Qwen3(Architecture):
    gguf_name = "qwen3"
    model_type = "qwen3"
