"""Each token's bytes, from the GGUF's own vocabulary: what the token adds to the output.

Decoding a token alone cannot give them: a byte-level or byte-fallback token may hold part of a
UTF-8 character, which a decoder turns into U+FFFD. OpenAI's logprobs report them as `bytes`.
"""

from __future__ import annotations

import re

from gmlx.gguf.header import GGUFHeader

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable character each byte is written as."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: b for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


_BYTE_LEVEL = _byte_level_alphabet()


def token_bytes(header: GGUFHeader) -> list[bytes]:
    """Every token's bytes, by id. SentencePiece ("llama") pieces write a space as U+2581 and a
    byte as `<0xNN>`; byte-level ("gpt2") pieces write each byte as one printable character.
    Control and added tokens (outside that alphabet) are their text."""
    pieces: list[str] = list(header.get("tokenizer.ggml.tokens"))
    if header.get("tokenizer.ggml.model") == "gpt2":
        return [bytes(_BYTE_LEVEL[c] for c in p) if all(c in _BYTE_LEVEL for c in p) else p.encode() for p in pieces]
    out = []
    for p in pieces:
        m = _BYTE_TOKEN.fullmatch(p)
        out.append(bytes([int(m.group(1), 16)]) if m else p.replace("\u2581", " ").encode())
    return out
