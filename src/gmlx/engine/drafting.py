"""The drafter of speculative decoding: whether a model may draft for another, and loading both.

A drafter proposes token ids that the served model checks, so both must mean the same thing by
every id: the same vocabulary (size, and the same piece at each id) and the same special tokens.
`check_drafter_files` asks this of the two GGUF headers alone (no weights read, under a second
for a 262k vocabulary), so `gmlx serve --draft` refuses a wrong drafter before it listens;
`check_drafter` asks it again of the loaded tokenizers.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from gmlx.gguf.header import (
    GGUFError,
    GGUFHeader,
    LazyArray,
    ModelGeometry,
)

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

_SPECIAL_KEYS = ("bos_token_id", "eos_token_id", "eot_token_id", "eom_token_id")


class IncompatibleDrafter(GGUFError):
    """A drafter whose token ids do not mean what the served model's do (a one-line message).

    A GGUFError, so the CLI's `model_errors()` turns it into one line and EXIT_BAD_MODEL."""


def _fail(model: str, draft: str, why: str) -> IncompatibleDrafter:
    return IncompatibleDrafter(f"draft model {draft} cannot draft for {model}: {why}")


def _first_difference(a: Sequence[Any], b: Sequence[Any], ids: Sequence[int]) -> int | None:
    return next((i for i, x, y in zip(ids, a, b) if x != y), None)


def _raw_strings(header: GGUFHeader, key: str) -> bytes | None:
    """The bytes of a large string array as stored (length-prefixed), or None when not lazy.
    Comparing these first spares decoding two 262k-entry vocabularies when they match."""
    ref = header.metadata.get(key)
    if not isinstance(ref, LazyArray) or ref.item_type != 8:  # 8: GGUF string
        return None
    buf, pos, unpack = header._buffer(), ref.offset, struct.unpack_from
    try:
        for _ in range(ref.count):
            pos += 8 + unpack("<Q", buf, pos)[0]
    except struct.error:
        raise GGUFError(f"truncated GGUF header: {header.path}") from None
    return bytes(buf[ref.offset : pos])


def check_drafter_files(header: GGUFHeader, draft_header: GGUFHeader) -> None:
    """Raise IncompatibleDrafter unless the two files share one vocabulary, token for token."""
    from gmlx.models.loader import architecture_for

    model, draft = header.path.name, draft_header.path.name
    architecture_for(draft_header)  # a drafter gmlx cannot load fails here, with the loader's words
    kinds = header.get("tokenizer.ggml.model"), draft_header.get("tokenizer.ggml.model")
    if kinds[0] != kinds[1]:
        raise _fail(model, draft, f"tokenizer {kinds[1]!r} differs from the served model's {kinds[0]!r}")
    sizes = header.geometry.vocab_size, draft_header.geometry.vocab_size
    if sizes[0] != sizes[1]:
        raise _fail(model, draft, f"vocabulary of {sizes[1]} tokens differs from the served model's {sizes[0]}")
    raw = _raw_strings(header, "tokenizer.ggml.tokens")
    same = raw is not None and raw == _raw_strings(draft_header, "tokenizer.ggml.tokens")
    tokens = [] if same else header.get("tokenizer.ggml.tokens") or []
    draft_tokens = [] if same else draft_header.get("tokenizer.ggml.tokens") or []
    if len(tokens) != len(draft_tokens):
        raise _fail(model, draft, f"{len(draft_tokens)} token strings differ from the served model's {len(tokens)}")
    if (i := _first_difference(tokens, draft_tokens, range(len(tokens)))) is not None:
        raise _fail(model, draft, f"token {i} is {draft_tokens[i]!r}, the served model's is {tokens[i]!r}")
    for key in _SPECIAL_KEYS:
        a, b = header.get(f"tokenizer.ggml.{key}"), draft_header.get(f"tokenizer.ggml.{key}")
        if a != b:
            raise _fail(
                model, draft, f"{key.removesuffix('_token_id')} token id {b} differs from the served model's {a}"
            )


def _vocab_len(tokenizer: Any) -> int:
    """Tokens including added ones; `len()` of the HF tokenizer inside mlx_lm's wrapper is cheap,
    where `get_vocab()` builds a dict of the whole vocabulary."""
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    try:
        return len(inner)
    except TypeError:
        return len(inner.get_vocab())


def _sample_ids(n: int) -> list[int]:
    """Ids to compare between two loaded tokenizers: the first and last few hundred, and a stride."""
    return sorted({*range(min(n, 512)), *range(max(0, n - 256), n), *range(0, n, max(1, n // 1024))})


def check_drafter(
    tokenizer: TokenizerWrapper,
    draft_tokenizer: TokenizerWrapper,
    geometry: ModelGeometry,
    draft_geometry: ModelGeometry,
) -> None:
    """Raise IncompatibleDrafter (a ValueError) unless the loaded drafter shares the served model's
    vocabulary: its size, the piece at a sample of ids, and the bos and eos tokens."""
    model, draft = geometry.name, draft_geometry.name
    if geometry.vocab_size != draft_geometry.vocab_size:
        raise _fail(
            model,
            draft,
            f"vocabulary of {draft_geometry.vocab_size} tokens differs from the served model's {geometry.vocab_size}",
        )
    sizes = _vocab_len(tokenizer), _vocab_len(draft_tokenizer)
    if sizes[0] != sizes[1]:
        raise _fail(model, draft, f"tokenizer of {sizes[1]} tokens differs from the served model's {sizes[0]}")
    ids = _sample_ids(min(sizes[0], geometry.vocab_size))
    pieces, draft_pieces = tokenizer.convert_ids_to_tokens(ids), draft_tokenizer.convert_ids_to_tokens(ids)
    if (i := _first_difference(pieces, draft_pieces, ids)) is not None:
        j = ids.index(i)
        raise _fail(model, draft, f"token {i} is {draft_pieces[j]!r}, the served model's is {pieces[j]!r}")
    if tokenizer.bos_token_id != draft_tokenizer.bos_token_id:
        raise _fail(
            model,
            draft,
            f"bos token id {draft_tokenizer.bos_token_id} differs from the served model's {tokenizer.bos_token_id}",
        )
    eos, draft_eos = set(tokenizer.eos_token_ids), set(draft_tokenizer.eos_token_ids)
    if eos != draft_eos:
        raise _fail(model, draft, f"eos token ids {sorted(draft_eos)} differ from the served model's {sorted(eos)}")
