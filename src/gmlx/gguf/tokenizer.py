"""Build a HuggingFace fast tokenizer from a GGUF file's own vocabulary, without torch.

The aim is llama.cpp's tokenization, token for token, since that is what the GGUF was
converted and tested against:

- "llama" vocabularies (SentencePiece) are tokenized by llama.cpp as BPE over characters
  where the pair to merge next is the one whose merged piece has the highest score (ties:
  leftmost), with `<0xNN>` byte fallback for characters outside the vocabulary. A `tokenizers`
  BPE model whose merges are ranked by the merged piece's score does the same.
- "gpt2" vocabularies are byte-level BPE with explicit merges, over the pieces the regexes of
  `tokenizer.ggml.pre` cut (gmlx.gguf.splits); "gemma4" ones are the same BPE over UTF-8 with
  spaces as "▁". A pre-tokenizer gmlx cannot reproduce is refused, never guessed.
- In both, llama.cpp cuts control and user-defined tokens (Gemma's "\\n", runs of spaces,
  HTML tags) out of the text before the model sees it; they become added tokens here.

The built `tokenizer.json` is cached on disk, keyed by file identity, since deriving merges
for a 262k vocabulary takes seconds and loading the saved JSON takes about one.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from gmlx.gguf.chat_templates import chat_template_for
from gmlx.gguf.header import GGUFError, GGUFHeader
from gmlx.gguf.splits import CUSTOM_SPLIT, SPLITS, SPM_STYLE_BPE, Split
from gmlx.paths import cache_dir as default_cache_dir

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

# Bump when the built tokenizer would change for the same file, to invalidate old caches.
_BUILD_VERSION = 2

# llama.cpp's token types (gguf.TokenType) that decide how a token is matched.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4

# Tokens that close a chat turn in some family's template; generation must stop on them.
END_OF_TURN_TOKENS = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>")

_SPECIAL_IDS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


_built_ahead: dict[Path, TokenizerWrapper] = {}  # by cache file: prebuild_tokenizer's, each taken once
_built_ahead_lock = threading.Lock()


def prebuild_tokenizer(header: GGUFHeader, cache_dir: Path | None = None) -> None:
    """Build the file's tokenizer now, for the next load_tokenizer of that file to take (once: a
    fast tokenizer must not be shared across threads). `gmlx serve` does this before its port
    opens: tokenizers reads the saved JSON holding the GIL (2.5 s for Gemma's 262k vocabulary on
    these machines), which on the loading thread leaves every /health poll unanswered meanwhile."""
    built = _build_wrapper(header, cache_dir)
    with _built_ahead_lock:
        _built_ahead[_cache_path(header, cache_dir or default_cache_dir())] = built


def load_tokenizer(header: GGUFHeader, cache_dir: Path | None = None) -> TokenizerWrapper:
    """The file's tokenizer as an mlx_lm `TokenizerWrapper`, built once and then read from cache
    (or the one prebuild_tokenizer built ahead)."""
    with _built_ahead_lock:
        ahead = _built_ahead.pop(_cache_path(header, cache_dir or default_cache_dir()), None)
    return ahead if ahead is not None else _build_wrapper(header, cache_dir)


def _build_wrapper(header: GGUFHeader, cache_dir: Path | None) -> TokenizerWrapper:
    # Imported here: mlx_lm imports mlx, which platform.py must be able to precede (BLAS preload).
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from transformers import PreTrainedTokenizerFast

    from gmlx.gguf.detokenizer import BPEDetokenizer, SPMDetokenizer

    kind, _ = _kind_and_split(header)  # refused before any cache is read or written
    path = _cache_path(header, cache_dir or default_cache_dir())
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        build_backend(header).save(str(tmp))
        os.replace(tmp, path)  # atomic, so a concurrent start never reads half a file
    # Loading from the file, not from a Tokenizer object, spares transformers a deep copy (seconds).
    hf = PreTrainedTokenizerFast(tokenizer_file=str(path))
    backend = hf.backend_tokenizer

    def token(key: str) -> str | None:
        token_id = header.get(f"tokenizer.ggml.{key}")
        return backend.id_to_token(int(token_id)) if token_id is not None else None

    specials = {str(t.content) for t in backend.get_added_tokens_decoder().values()}
    hf.add_special_tokens({name: t for name, key in _SPECIAL_IDS.items() if (t := token(key)) is not None})
    hf.chat_template = chat_template_for(header, specials)
    eos_ids = [
        int(i)
        for k in ("eos_token_id", "eot_token_id", "eom_token_id")
        if (i := header.get(f"tokenizer.ggml.{k}")) is not None
    ]
    eos_ids += [i for t in END_OF_TURN_TOKENS if (i := backend.token_to_id(t)) is not None]
    if kind == "gpt2" and not _spm_style(header):
        detokenizer = BPEDetokenizer
    elif kind != "llama":  # SentencePiece-style BPE keeps every space it decodes
        detokenizer = partial(SPMDetokenizer, trim_space=False)
    else:  # it trims a document's first space; gmlx.gguf.detokenizer keeps it where text continues
        detokenizer = partial(SPMDetokenizer, trim_space=_add_space_prefix(header))
    return TokenizerWrapper(hf, detokenizer, eos_token_ids=eos_ids)


def check_tokenizer(header: GGUFHeader) -> None:
    """Raise a one-line GGUFError now (headers only) if the file's tokenizer is one gmlx would refuse."""
    _kind_and_split(header)


def build_backend(header: GGUFHeader) -> Tokenizer:
    """A `tokenizers.Tokenizer` equivalent to llama.cpp's tokenizer for this file; raises GGUFError
    for a tokenizer or pre-tokenizer llama.cpp knows and gmlx does not."""
    kind, split = _kind_and_split(header)
    tokens: list[str] = list(header.get("tokenizer.ggml.tokens"))
    n = len(tokens)
    types = _ints(header.get("tokenizer.ggml.token_type"), n, _NORMAL)
    if split is not None:
        merges = [tuple(m.split(" ", 1)) for m in header.get("tokenizer.ggml.merges") or []]
        tok = _bpe(tokens, merges, split, _spm_style(header))
    else:
        scores = header.get("tokenizer.ggml.scores")
        tok = _sentencepiece(
            tokens,
            types,
            [float(s) for s in scores] if scores is not None else [0.0] * n,
            header.get("tokenizer.ggml.unknown_token_id"),
            _add_space_prefix(header),
        )

    # llama.cpp matches these whole before running the model over the text between them.
    rstrip = _rstripped(header, tokens, types)
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False, rstrip=t in rstrip)
            for t, ty in zip(tokens, types)
            if ty in (_CONTROL, _UNKNOWN)
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False, rstrip=t in rstrip)
            for t, ty in zip(tokens, types)
            if ty == _USER_DEFINED
        ]
    )

    bos, eos = header.get("tokenizer.ggml.bos_token_id"), header.get("tokenizer.ggml.eos_token_id")
    # llama.cpp adds BOS to SentencePiece vocabularies that do not say otherwise.
    add_bos = bool(header.get("tokenizer.ggml.add_bos_token", kind == "llama" or (split is not None and split.add_bos)))
    add_eos = bool(header.get("tokenizer.ggml.add_eos_token", False))
    first = [(tokens[bos], bos)] if add_bos and bos is not None else []
    last = [(tokens[eos], eos)] if add_eos and eos is not None else []
    single = [t for t, _ in first] + ["$A"] + [t for t, _ in last]
    pair = single + ["$B:1"] + [t + ":1" for t, _ in last]
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=first + last)
    return tok


def _sentencepiece(
    tokens: list[str], types: list[int], scores: list[float], unk_id: int | None, space_prefix: bool
) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    # Only normal pieces take part in merging: control and user-defined tokens are cut out
    # of the text first, and byte tokens are reached by fallback, never by merging.
    mergeable = {t for t, ty in zip(tokens, types) if ty == _NORMAL}
    ranked = []
    for i, piece in enumerate(tokens):
        if piece not in mergeable or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], i, cut, left, right))
    # Highest score merges first, as in llama.cpp's priority queue; the id breaks score ties
    # between pieces, the cut keeps one piece's alternative splits in a stable order.
    ranked.sort()
    merges = [(left, right) for *_, left, right in ranked]
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    tok = Tokenizer(models.BPE(vocab, merges, unk_token=unk, byte_fallback=True, fuse_unk=True))
    steps = [normalizers.Replace(" ", "\u2581")]
    if space_prefix:
        steps.insert(0, normalizers.Prepend("\u2581"))
    tok.normalizer = normalizers.Sequence(steps)
    dec = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if space_prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(dec)
    return tok


def _bpe(tokens: list[str], merges: list[tuple[str, ...]], split: Split, spm_style: bool) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    # SentencePiece-style BPE falls back to <0xNN> byte tokens where a piece is no token.
    tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=split.ignore_merges, byte_fallback=spm_style))
    steps = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in split.regexes]
    if spm_style:
        tok.normalizer = normalizers.Replace(" ", "\u2581")
        tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [*steps, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        tok.decoder = decoders.ByteLevel()
    return tok


def _rstripped(header: GGUFHeader, tokens: list[str], types: list[int]) -> set[str]:
    """The tokens after which llama.cpp drops the whitespace: Phi-3's special ones, for a file whose
    general.name says Phi-3 (llama.cpp's own test): no newline token follows "<|user|>"."""
    name = str(header.get("general.name") or "").lower()
    if "phi-3" not in name and "phi3" not in name:
        return set()
    special = {t for t, ty in zip(tokens, types) if ty in (_CONTROL, _UNKNOWN, _USER_DEFINED)}
    return (special | {"</s>"}) - {"<unk>", "<s>", "<|endoftext|>"}


def _kind_and_split(header: GGUFHeader) -> tuple[str, Split | None]:
    """The tokenizer model and, for BPE, its split; raises a one-line GGUFError for what gmlx cannot
    tokenize as llama.cpp does."""
    kind = header.get("tokenizer.ggml.model")
    if kind not in ("llama", "gpt2", "gemma4"):
        raise GGUFError(
            f"unsupported tokenizer model tokenizer.ggml.model={kind!r} "
            f"(gmlx reads 'llama', 'gpt2' and 'gemma4'): {header.path}"
        )
    if kind == "llama":
        return kind, None  # llama.cpp ignores tokenizer.ggml.pre for SentencePiece
    pre = _pre_name(header)
    if pre in CUSTOM_SPLIT:
        raise GGUFError(
            f"unsupported pre-tokenizer tokenizer.ggml.pre={pre!r}: llama.cpp splits its text with "
            f"code of its own, which gmlx does not reproduce: {header.path}"
        )
    if pre not in SPLITS:
        raise GGUFError(
            f"unknown pre-tokenizer tokenizer.ggml.pre={pre!r} (gmlx splits text as llama.cpp does "
            f"for {len(SPLITS)} known names, and does not guess): {header.path}"
        )
    return kind, SPLITS[pre]


def _pre_name(header: GGUFHeader) -> str:
    # Gemma 4's model name implies its split; files without the key get llama.cpp's default.
    return (
        "gemma4"
        if header.get("tokenizer.ggml.model") == "gemma4"
        else str(header.get("tokenizer.ggml.pre") or "default")
    )


def _spm_style(header: GGUFHeader) -> bool:
    return _pre_name(header) in SPM_STYLE_BPE


def _add_space_prefix(header: GGUFHeader) -> bool:
    return bool(header.get("tokenizer.ggml.add_space_prefix", True))


def _ints(values: Sequence | None, n: int, default: int) -> list[int]:
    return [int(v) for v in values] if values is not None else [default] * n


def _cache_path(header: GGUFHeader, root: Path) -> Path:
    """One cache file per (file, size, mtime): a rewritten GGUF gets a fresh tokenizer."""
    st = header.path.stat()
    ident = f"{_BUILD_VERSION}|{header.path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    return root / "tokenizers" / f"{hashlib.sha256(ident.encode()).hexdigest()[:24]}.json"
