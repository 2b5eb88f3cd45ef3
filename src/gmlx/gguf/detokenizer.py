"""Streaming detokenizers for generated text that continues a prompt.

mlx_lm's streaming detokenizers drop the first token's leading space, as decoding a whole
document does for a SentencePiece vocabulary that adds a space prefix. Generated text is no
document start: it follows the prompt, so `" Paris"` after "The capital of France is" keeps
its space, as in llama.cpp and in decoding the prompt and the completion together. Imported
lazily (mlx_lm imports mlx, which platform.py must be able to precede).
"""

from __future__ import annotations

import codecs
import functools
from collections.abc import Sequence

from mlx_lm.tokenizer_utils import (
    SPMStreamingDetokenizer,
    StreamingDetokenizer,
    TokenizerWrapper,
)
from transformers import PreTrainedTokenizerFast


class BPEDetokenizer(StreamingDetokenizer):
    """Byte-level BPE text, one token at a time, spelled as llama.cpp's detokenizer spells it: a
    vocabulary token's characters stand for bytes (GPT-2's alphabet), an added token (control or
    user-defined) is its own text, and bytes are held back only while a UTF-8 character is
    incomplete. mlx_lm's own would drop the leading space, turn byte 0 into "Ā" and decode
    DeepSeek's user-defined "õ" as a byte."""

    trim_space = False  # a byte-level vocabulary decodes a leading space like any other

    def __init__(self, tokenizer: PreTrainedTokenizerFast) -> None:
        added = set(tokenizer.added_tokens_decoder)
        # The backend's vocabulary, inverted: a second faster than convert_ids_to_tokens for 256k tokens.
        pieces = {i: t for t, i in tokenizer.backend_tokenizer.get_vocab(with_added_tokens=True).items()}
        self.tokenmap = [
            b"" if (piece := pieces.get(i)) is None else piece.encode() if i in added else _bytes(piece)
            for i in range(len(tokenizer))
        ]
        self.reset()

    def reset(self) -> None:
        self.offset = 0
        self.text = ""
        self.tokens = []
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")  # a fresh one per copy

    def add_token(self, token: int) -> None:
        self.tokens.append(token)
        # A model whose output rows outnumber the vocabulary (padding) may pick an id without text.
        self.text += self._utf8.decode(self.tokenmap[token] if token < len(self.tokenmap) else b"")

    def finalize(self) -> None:
        self.text += self._utf8.decode(b"", final=True)


class SPMDetokenizer(SPMStreamingDetokenizer):
    """mlx_lm's SentencePiece detokenizer, trimming at most the document's first space: its own
    trims again while the text is still empty, so " (" (tokens "▁" and "▁(") came out as "("."""

    def reset(self) -> None:
        super().reset()
        self._started = False

    def _try_flush(self, force: bool = False) -> None:
        text = self._unflushed.replace(self._sep, b" ").decode("utf-8", "replace")
        if not force and text.endswith("\ufffd"):
            return  # an incomplete character: wait for its next bytes
        if self.trim_space and not self._started and text.startswith(" "):
            text = text[1:]
        self._started = self._started or bool(self._unflushed)
        self.text += text
        self._unflushed = b""


def _bytes(piece: str) -> bytes:
    table = _byte_table()
    try:  # a str.translate onto code points 0-255 is ten times faster than a loop over characters
        return piece.translate(_fast_table()).encode("latin-1")
    except UnicodeEncodeError:  # a character outside the alphabet stands for its UTF-8, as in mlx_lm
        return b"".join(bytes([table[ord(c)]]) if ord(c) in table else c.encode() for c in piece)


@functools.cache
def _byte_table() -> dict[int, int]:
    """GPT-2's printable spelling of bytes, inverted: printable bytes stand for themselves, the
    others for code points 256 onwards, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = (b for b in range(256) if b not in printable)
    return {**{b: b for b in printable}, **{256 + n: b for n, b in enumerate(others)}}


@functools.cache
def _fast_table() -> dict[int, int]:
    # Code points below 256 outside the alphabet go above 255, so that latin-1 refuses them.
    return {**{c: 0xFFFF for c in range(256)}, **_byte_table()}


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
