"""Chat templates: the GGUF's own `tokenizer.chat_template`, else a standard one by family.

Many GGUF files (the default gemma3-270m among them) carry no template, and a model prompted
without its turn markers rambles. The fallbacks below are the families' documented formats,
written as Jinja for `apply_chat_template`. Templates that start with `bos_token` follow
the HF convention; mlx_lm then skips adding a second BOS when encoding.
"""

from __future__ import annotations

from collections.abc import Collection

from gmlx.gguf.header import GGUFHeader

# Gemma has no system role: the system message is folded into the first user turn.
GEMMA = (
    "{{ bos_token }}"
    "{% set system = messages[0]['content'] ~ '\n\n' if messages and messages[0]['role'] == 'system' else '' %}"
    "{% for m in (messages[1:] if system else messages) %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ (system if loop.first else '') ~ m['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

LLAMA3 = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

# Llama 2 / Mistral: [INST] turns, system message folded into the first user turn.
INST = (
    "{{ bos_token }}"
    "{% set system = messages[0]['content'] ~ '\n\n' if messages and messages[0]['role'] == 'system' else '' %}"
    "{% for m in (messages[1:] if system else messages) %}"
    "{% if m['role'] == 'user' %}[INST] {{ (system if loop.first else '') ~ m['content'] | trim }} [/INST]"
    "{% else %} {{ m['content'] | trim }}{{ eos_token }}{% endif %}"
    "{% endfor %}"
)

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_BY_ARCHITECTURE = {
    "gemma": GEMMA,
    "gemma2": GEMMA,
    "gemma3": GEMMA,
    "gemma3_text": GEMMA,
    "qwen2": CHATML,
    "qwen3": CHATML,
    "qwen2moe": CHATML,
    "qwen3moe": CHATML,
}


def chat_template_for(header: GGUFHeader, special_tokens: Collection[str] | None = None) -> str:
    """The file's template, else the family's. `special_tokens` (control and user-defined token
    strings) saves reading the whole vocabulary when the caller already has them."""
    if own := header.get("tokenizer.chat_template"):
        return str(own)
    if special_tokens is None:
        special_tokens = _special_tokens(header)
    arch = header.architecture
    if arch in _BY_ARCHITECTURE:
        return _BY_ARCHITECTURE[arch]
    if arch == "llama" or arch.startswith("mistral"):
        return LLAMA3 if "<|start_header_id|>" in special_tokens else INST
    # Unknown family: trust the turn markers the vocabulary has.
    if "<start_of_turn>" in special_tokens:
        return GEMMA
    if "<|start_header_id|>" in special_tokens:
        return LLAMA3
    return CHATML


def _special_tokens(header: GGUFHeader) -> set[str]:
    tokens = header.get("tokenizer.ggml.tokens") or []
    types = header.get("tokenizer.ggml.token_type")
    if types is None:
        return set(tokens)
    return {t for t, ty in zip(tokens, types) if int(ty) != 1}  # anything but NORMAL
