"""Streaming detokenizers for generated text that continues a prompt.

mlx_lm's streaming detokenizers drop the first token's leading space, as decoding a whole
document does for a SentencePiece vocabulary that adds a space prefix. Generated text is no
document start: it follows the prompt, so `" Paris"` after "The capital of France is" keeps
its space, as in llama.cpp and in decoding the prompt and the completion together. Imported
lazily (mlx_lm imports mlx, which platform.py must be able to precede).
"""

from __future__ import annotations

from collections.abc import Sequence

from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, StreamingDetokenizer, TokenizerWrapper


class BPEDetokenizer(BPEStreamingDetokenizer):
    """mlx_lm's byte-level detokenizer without its leading-space trim: a byte-level vocabulary
    decodes a leading space like any other (its decoder strips nothing)."""

    trim_space = False

    def _maybe_trim_space(self, current_text: str) -> str:
        return current_text


def continuation_detokenizer(tokenizer: TokenizerWrapper, prompt_ids: Sequence[int]) -> StreamingDetokenizer:
    """A fresh streaming detokenizer for the tokens generated after `prompt_ids`: their text is
    what decoding prompt and completion together adds to the prompt's own text. Only where the
    prompt has no text (special tokens alone) is the completion a document start."""
    detok = tokenizer.detokenizer
    if detok.trim_space and _has_text(tokenizer, prompt_ids):
        detok.trim_space = False  # an attribute of this copy only
    return detok


def _has_text(tokenizer: TokenizerWrapper, prompt_ids: Sequence[int]) -> bool:
    skipped = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}  # what skip_special_tokens leaves out
    return any(t not in skipped for t in prompt_ids)  # stops at the first text token, near the start
