"""llama.cpp's pre-tokenizers: how a byte-level BPE vocabulary's text is cut into pieces before merging.

`tokenizer.ggml.pre` names one; llama.cpp's src/llama-vocab.cpp maps several dozen names onto a
few dozen regex lists, which `gmlx.gguf.tokenizer` turns into `tokenizers` Split steps.
"""

from __future__ import annotations

from dataclasses import dataclass

# Pre-tokenizers (`tokenizer.ggml.pre`) as llama.cpp's llama-vocab.cpp applies them: a list of
# regexes, each splitting every piece the previous one left (matches and the text between them
# both become pieces), and whether a piece that is a token is taken whole, unmerged. The regexes
# are llama.cpp's adaptations (no inline flags, which its std::regex lacks), so they match what
# llama.cpp splits, not what the model's tokenizer.json says; tests/test_tokenizer_corpus.py
# checks them against llama.cpp's own corpus. gmlx.gguf.tokenizer refuses names not listed here.
_CONTRACTION = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_SPACES = r"\s*[\r\n]+|\s+(?!\S)|\s+"  # a run ending in newlines, else spaces before a word, else the rest


def _words(
    digits: str,
    letters: str = r"\p{L}",
    symbols: str = r"[^\s\p{L}\p{N}]+[\r\n]*",
    spaces: str = _SPACES,
    contraction: str = _CONTRACTION,
) -> str:
    """The Llama 3 / Qwen 2 shape: contractions, an optional non-letter then letters, `digits`
    numerals at a time, punctuation with trailing newlines, then whitespace."""
    head = f"{contraction}|" if contraction else ""
    return rf"{head}[^\r\n\p{{L}}\p{{N}}]?{letters}+|\p{{N}}{digits}| ?{symbols}|{spaces}"


# Cased words (Mistral's tekken, GPT-4o): capitals then lower-case, or capitals alone, where a
# letter outside ASCII counts as either case, as llama.cpp's ASCII-only lookaheads have it.
def _cased(tail: str, letter: str = r"\p{L}") -> str:
    upper, lower = rf"(?:(?={letter})[^a-z])", rf"(?:(?={letter})[^A-Z])"
    return rf"[^\r\n\p{{L}}\p{{N}}]?{upper}*{lower}+{tail}|[^\r\n\p{{L}}\p{{N}}]?{upper}+{lower}*{tail}"


_LLAMA3 = [_words("{1,3}")]
_QWEN2 = [_words("")]
_STARCODER = [r"\p{N}", _GPT2]
_BLOOM = [r" ?[^(\s|.,!?…。，、।۔،)]+"]
_GPT4O = [_cased(f"{_CONTRACTION}?") + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|" + _SPACES]
# Han, Hiragana and Katakana; DeepSeek V3's and Hunyuan's words may start with one ASCII punctuation mark.
_CJK_KANA = r"[\x{4E00}-\x{9FA5}\x{3040}-\x{309F}\x{30A0}-\x{30FF}]+"
_PUNCT_WORDS = r"[!-/:-@\[-`{-~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+"
_DEEPSEEK3 = [r"\p{N}{1,3}", _CJK_KANA, _PUNCT_WORDS + r"[\r\n]*|" + _SPACES]
_NEWLINES = [r"[^\n]+|\n+"]  # SentencePiece-style BPE: only newline runs are cut out


@dataclass(frozen=True)
class Split:
    regexes: list[str]
    ignore_merges: bool = False  # a piece that is a token is taken whole
    add_bos: bool = False  # llama.cpp's default where the file has no tokenizer.ggml.add_bos_token


SPLITS: dict[str, Split] = {}


def _pre(names: str, regexes: list[str], ignore_merges: bool = False, add_bos: bool = False) -> None:
    for name in names.split():
        SPLITS[name] = Split(regexes, ignore_merges, add_bos)


# llama.cpp's own default, for files without the key and for "default".
_pre("default", [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"])
_pre("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano", _LLAMA3, True, True)
_pre("dbrx smaug-bpe chatglm-bpe", _LLAMA3)
_pre("glm4 glm5", _LLAMA3, True)
_pre("minicpm5", [r"\p{N}{1,3}", _words("+")], True)
_pre(
    "jais-2",
    [
        _words(
            "{1,3}",
            spaces=r"\s*[\r\n]+|"
            + "|".join(rf"\s{{{n}}}(?!\S)" for n in ("512", "256", "128", "64", "32", "16", "8", "4", "1,2"))
            + r"|\s{1}",
        )
    ],
)
_pre(
    "deepseek-llm",
    [
        r"[\r\n]",
        # Unicode's cased letters, which DeepSeek's tokenizer.json lists range by range.
        r"\s?[\p{Lu}\p{Ll}\p{Lt}]+",
        r"\s?[!-/:-~\x{FF01}-\x{FF0F}\x{FF1A}-\x{FF5E}\x{2018}-\x{201F}\x{3000}-\x{3002}]+",
        r"\s+\z",
        r"[\x{4E00}-\x{9FA5}\x{0800}-\x{4E00}\x{AC00}-\x{D7FF}]+",
        r"\p{N}+",
    ],
)
_pre(
    "deepseek-coder",
    [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[\x{4E00}-\x{9FA5}\x{0800}-\x{4E00}\x{AC00}-\x{D7FF}]+", r"\p{N}"],
)
_pre("deepseek-v3 hunyuan-dense joyai-llm hy_v4", _DEEPSEEK3)
_pre("spark2_5", [r"\p{N}{1,3}", _CJK_KANA, _PUNCT_WORDS + r"|[\r\n]|\s+(?!\S)|\s+", r"\p{N}"])
_pre("falcon", [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]"])
_pre("starcoder refact command-r smollm codeshell exaone minerva-7b mellum2", _STARCODER)
_pre(
    "gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert jina-v1-en "
    "jina-v2-code roberta-bpe exaone4 mpt olmo jais trillion granite-docling",
    [_GPT2],
)
_pre("qwen2 deepseek-r1-qwen kormo f2llmv2 megrez stablelm2 hunyuan solar-open grok-2", _QWEN2)
_pre("qwen35", [_words("", letters=r"[\p{L}\p{M}]", symbols=r"[^\s\p{L}\p{M}\p{N}]+[\r\n]*")])
_pre("ufakzeka", [_words("", contraction="")])
_pre("seed-coder", [_words("{1}", symbols=r"[^\s\p{L}\p{N}\r\n]+")])
_pre(
    "bailingmoe bailingmoe2 llada-moe",
    [_words("", spaces=r"\s*[\r\n]|\s+(?!\S)|\s+", contraction="'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])")],
)
_pre(
    "exaone-moe",
    [
        _words(
            "",
            letters=r"(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)",
            symbols=r"[^\s\p{L}\p{N}]+[\r\n/]?",
            spaces=r"\s*[\r\n]|\s+(?!\S)|\s+",
        )
    ],
)
_pre("laguna", [*_NEWLINES, *_QWEN2])
_pre("poro-chat bloom gpt3-finnish", _BLOOM)
_pre("viking", [*_BLOOM, r"\p{N}"])
_pre("tekken", [_cased("") + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|" + _SPACES], True, True)
_pre("gpt-4o llama4 kanana2 talkie minimax-m2", _GPT4O)
_pre(
    "granite-embed-multi-97m",
    [_cased(f"{_CONTRACTION}?", r"[\p{L}\p{M}]") + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|" + _SPACES],
    True,
)
_pre(
    "youtu",
    [
        r"[\x{AC00}-\x{D7A3}\x{3131}-\x{318E}]+|[\x{FF01}\x{2026}\x{201C}\x{201D}\x{2018}\x{2019}\x{2014}\x{FF1A}"
        r"\x{FF1B}\x{FF0C}\x{3001}-\x{303F}\x{FE30}-\x{FE4F}]+|[\x{3105}-\x{312F}]+|" + _CJK_KANA,
        # Its cased words ([\p{Lu}...]*[\p{Ll}...]+) are letters or marks alone: llama.cpp reads every
        # \p{L...} class as "a letter", so "YouTube" stays one word.
        r"[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+" + f"{_CONTRACTION}?" + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|" + _SPACES,
    ],
    True,
)
_pre(
    "chameleon",
    [
        r"<sentinel:[0-9]+>",
        "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
        r"([\t\n]|    |  )",
        r"\p{N}",
        r"[\p{P}!-/:-@\[-`{-~]",
        _GPT2,
    ],
    add_bos=True,
)
# Digit runs in threes from the right. llama.cpp's code for AFMoE (and Tiny Aya) cuts a run of
# \p{N} after its leading 1-2 digits and every third one after, leaving the text before the run
# on its first piece; SuperBPE's std::regex cuts where a multiple of three ASCII digits ends the
# piece. Both as the pieces between such cuts, one character at least.
_AFMOE_DIGITS = r"[\s\S](?:(?!(?<=\p{N})(?:\p{N}{3})*(?!\p{N}))[\s\S])*"
_SUPERBPE_DIGITS = r"[\s\S](?:(?!(?:[0-9]{3})+(?![0-9]))[\s\S])*"
# CJK, kana, Thai, Lao, Khmer, Myanmar and Hangul runs, as AFMoE's tokenizer.json lists them.
_AFMOE_SCRIPTS = (
    r"[\x{4E00}-\x{9FFF}\x{3400}-\x{4DBF}\x{8C48}-\x{FAFF}\x{3040}-\x{309F}\x{30A0}-\x{30FF}"
    r"\x{FF65}-\x{FF9F}\x{2F00}-\x{2FDF}\x{0E40}-\x{0E7F}\x{0E80}-\x{0EFF}\x{1780}-\x{17FF}"
    r"\x{1000}-\x{109F}\x{AA60}-\x{AA7F}\x{A9E0}-\x{A9FF}\x{AC00}-\x{D7AF}\x{1100}-\x{11FF}]+"
)
_pre("afmoe", [_AFMOE_DIGITS, _AFMOE_SCRIPTS, _PUNCT_WORDS + r"[\r\n]*|" + _SPACES])
# Tiny Aya's GPT-4o-style cased words are, as in youtu, letters or marks alone.
_pre(
    "tiny_aya cohere2moe",
    [
        _AFMOE_DIGITS,
        r"[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+" + f"{_CONTRACTION}?" + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|" + _SPACES,
    ],
)
_pre("superbpe", [r"\p{N}+", _SUPERBPE_DIGITS])
# Pre-tokenizers whose split llama.cpp computes with code of its own, which gmlx does not reproduce.
CUSTOM_SPLIT = {"kimi-k2"}
# SentencePiece-style BPE (Gemma 4): spaces become "▁", the text is UTF-8, not GPT-2's byte alphabet.
SPM_STYLE_BPE = {"gemma4", "granite-embed-multi-311m", "sarvam-moe"}
_pre(" ".join(SPM_STYLE_BPE), _NEWLINES)
