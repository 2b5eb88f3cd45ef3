"""Small GGUF vocabularies for test fixtures, in the two shapes llama.cpp writes.

`add_tiny_vocab(writer, kind)` writes the tokenizer keys; a tiny model fixture then uses
`TINY_VOCAB_SIZE[kind]` as its vocab_size (the embedding's row count). llama.cpp's token ids
for these vocabularies are saved in data/tiny_llamacpp_tokens.json: changing a vocabulary
here means regenerating them.
"""

from __future__ import annotations

import gguf

# llama.cpp token types.
NORMAL, CONTROL, USER_DEFINED, BYTE = 1, 3, 4, 6

# SentencePiece pieces: "▁" marks a word start. Every prefix of each word is a piece too,
# so that score-ranked merging can build each word from its characters.
_SPM_WORDS = [
    "▁hello",
    "▁world",
    "▁the",
    "▁capital",
    "▁of",
    "▁France",
    "▁is",
    "▁Paris",
    "▁chat",
    "▁model",
    "▁user",
    "ing",
    "▁a",
    "er",
]
_SPM_CONTROL = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
_SPM_USER = ["\n", "\n\n", "  "]  # Gemma cuts these out of the text before merging

_BPE_MERGES = [
    ("Ġ", "t"),
    ("h", "e"),
    ("Ġt", "he"),
    ("Ġ", "w"),
    ("o", "r"),
    ("Ġw", "or"),
    ("l", "d"),
    ("Ġwor", "ld"),
    ("i", "n"),
    ("in", "g"),
    ("H", "e"),
    ("l", "l"),
    ("He", "ll"),
    ("Hell", "o"),
]
_BPE_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_alphabet() -> list[str]:
    """GPT-2's printable spelling of the 256 byte values, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelled, extra = {}, 0
    for b in range(256):
        if b in printable:
            spelled[b] = chr(b)
        else:
            spelled[b] = chr(256 + extra)
            extra += 1
    return [spelled[b] for b in range(256)]


def spm_vocab() -> tuple[list[str], list[float], list[int]]:
    tokens = _SPM_CONTROL + _SPM_USER + [f"<0x{b:02X}>" for b in range(256)]
    types = [CONTROL] * len(_SPM_CONTROL) + [USER_DEFINED] * len(_SPM_USER) + [BYTE] * 256
    # Characters first, then longer prefixes: a plausible merge order (dict keeps first occurrence).
    chars = [c for word in _SPM_WORDS for c in word]
    prefixes = [word[:n] for word in _SPM_WORDS for n in range(2, len(word) + 1)]
    pieces = list(dict.fromkeys(chars + prefixes))
    tokens += pieces
    types += [NORMAL] * len(pieces)
    scores = [-1000.0] * (len(_SPM_CONTROL) + len(_SPM_USER)) + [0.0] * 256 + [-float(i) for i in range(len(pieces))]
    return tokens, scores, types


def bpe_vocab() -> tuple[list[str], list[str], list[int]]:
    tokens = byte_alphabet() + [a + b for a, b in _BPE_MERGES] + _BPE_SPECIAL
    types = [NORMAL] * (len(tokens) - len(_BPE_SPECIAL)) + [CONTROL] * len(_BPE_SPECIAL)
    return tokens, [f"{a} {b}" for a, b in _BPE_MERGES], types


TINY_VOCAB_SIZE = {"llama": len(spm_vocab()[0]), "gpt2": len(bpe_vocab()[0])}


def add_tiny_vocab(writer: gguf.GGUFWriter, kind: str, space_prefix: bool = False) -> None:
    """Write a `kind` ("llama": Gemma-style SentencePiece, "gpt2": Qwen-style byte-level BPE) vocabulary.
    `space_prefix`: a "llama" one adds a space before the text, as Llama 2's does (Gemma's does not)."""
    if kind == "llama":
        tokens, scores, types = spm_vocab()
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_bos_token_id(tokens.index("<bos>"))
        writer.add_eos_token_id(tokens.index("<eos>"))
        writer.add_unk_token_id(tokens.index("<unk>"))
        writer.add_pad_token_id(tokens.index("<pad>"))
        writer.add_add_bos_token(True)
        writer.add_add_eos_token(False)
        writer.add_add_space_prefix(space_prefix)
    elif kind == "gpt2":
        tokens, merges, types = bpe_vocab()
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        writer.add_bos_token_id(tokens.index("<|endoftext|>"))
        writer.add_eos_token_id(tokens.index("<|endoftext|>"))
        writer.add_pad_token_id(tokens.index("<|endoftext|>"))
        writer.add_add_bos_token(False)
    else:
        raise ValueError(f"unknown tiny vocabulary kind {kind!r}")
