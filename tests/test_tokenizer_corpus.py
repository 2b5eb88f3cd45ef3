"""llama.cpp's own tokenizer corpus: every vocabulary its test-tokenizer-0 checks, every case.

The corpus ships in the llama-cpp-python sdist (vendor/llama.cpp/models/ggml-vocab-*.gguf with
.inp/.out files); `gmlx.llama_sdist.vocab_corpus` downloads it with pip once and caches it. Each
.inp holds texts separated by "\\n__ggml_vocab_test__\\n", the .out one line of token ids per text,
which llama.cpp produced with add_special=false (no BOS/EOS) and parse_special=false.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from gmlx.gguf.header import GGUFError, read_header
from gmlx.gguf.splits import SPLITS, SPM_STYLE_BPE
from gmlx.gguf.tokenizer import build_backend, load_tokenizer
from gmlx.llama_sdist import LLAMA_CPP_PYTHON, vocab_corpus

pytestmark = pytest.mark.slow  # downloads the sdist (75 MB) on first run; CI runs it

# The vocabularies of llama-cpp-python 0.3.36, by the kind llama.cpp gives them.
WITH_CASES = [
    "command-r",
    "deepseek-coder",
    "deepseek-llm",
    "falcon",
    "gemma-4",
    "gpt-2",
    "llama-bpe",
    "llama-spm",
    "mpt",
    "phi-3",
    "qwen2",
    "qwen35",
    "refact",
    "starcoder",
]
WITHOUT_CASES = ["aquila", "baichuan", "gpt-neox"]  # no .inp/.out: round-tripped over the others' texts
REFUSED = {"bert-bge": "'bert'", "nomic-bert-moe": "'t5'"}  # WordPiece and Unigram models
SEP = b"\n__ggml_vocab_test__\n"
# llama.cpp's ids under one name of every distinct split, on two of the corpus's vocabularies
# (regenerate: python -m bench.llamacpp_splits).
SPLIT_CASES = json.loads((Path(__file__).parent / "data" / "llamacpp_splits.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def corpus() -> Path:
    return vocab_corpus()


@pytest.fixture(scope="module")
def tokenizers(corpus: Path, tmp_path_factory: pytest.TempPathFactory):
    """Each vocabulary's TokenizerWrapper, loaded once (the 256k ones take seconds)."""
    cache, loaded = tmp_path_factory.mktemp("tokcache"), {}

    def get(name: str):
        if name not in loaded:
            loaded[name] = load_tokenizer(read_header(corpus / f"ggml-vocab-{name}.gguf"), cache)
        return loaded[name]

    return get


def read_cases(corpus: Path, name: str) -> list[tuple[str, list[int]]]:
    """(text, llama.cpp's ids) pairs, split as test-tokenizer-0.cpp splits them."""
    raw = (corpus / f"ggml-vocab-{name}.gguf.inp").read_bytes()
    texts, pos = [], 0
    while pos < len(raw):
        end = raw.find(SEP, pos)
        end = len(raw) if end < 0 else end
        texts.append(raw[pos:end].decode("utf-8"))
        pos = end + len(SEP)
    outs = (corpus / f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8").splitlines()
    assert len(texts) == len(outs) > 10
    return [(text, [int(i) for i in out.split()]) for text, out in zip(texts, outs)]


def all_texts(corpus: Path) -> list[str]:
    return sorted({text for name in WITH_CASES for text, _ in read_cases(corpus, name)})


def test_corpus_holds_the_expected_vocabularies(corpus: Path) -> None:
    """A newer sdist with vocabularies this test does not know must fail here, not pass unchecked."""
    names = {p.name.removeprefix("ggml-vocab-").removesuffix(".gguf") for p in corpus.glob("ggml-vocab-*.gguf")}
    assert names == {*WITH_CASES, *WITHOUT_CASES, *REFUSED}, f"llama-cpp-python {LLAMA_CPP_PYTHON}"
    with_cases = {p.name.removeprefix("ggml-vocab-").removesuffix(".gguf.inp") for p in corpus.glob("*.inp")}
    assert with_cases == {*WITH_CASES, "bert-bge"}


@pytest.mark.parametrize("name", WITH_CASES)
def test_tokenizes_as_llama_cpp(name: str, corpus: Path, tokenizers) -> None:
    tok = tokenizers(name)
    cases = read_cases(corpus, name)
    wrong = [(text, ids, got) for text, ids in cases if (got := tok.encode(text, add_special_tokens=False)) != ids]
    assert not wrong, f"{name}: {len(wrong)} of {len(cases)} cases differ, first {wrong[0]}"


def streamed(tok, ids: list[int]) -> str:
    """The text gmlx's streaming detokenizer (TokenizerWrapper.detokenizer) yields, one token at a time."""
    detok = tok.detokenizer
    for i in ids:
        detok.add_token(i)
    detok.finalize()
    return detok.text


@pytest.mark.parametrize("name", WITH_CASES + WITHOUT_CASES)
def test_decode_and_stream_round_trip(name: str, corpus: Path, tokenizers) -> None:
    """Over every text of the corpus: decode(encode(s)) == s, the BOS included where the file adds
    one (SentencePiece's added leading space is removed again by the decoder, as llama.cpp's
    detokenizer removes it at a document start); and streaming the ids without special tokens
    yields s too, so it equals decoding the whole sequence. llama.cpp itself would not round-trip
    every text in the vocabularies it marks clean_spaces (gpt-2, falcon, starcoder, ...): it drops
    the space before "?" or "'s". gmlx applies no such cleanup, so text reads as the model wrote it."""
    tok = tokenizers(name)
    for text in all_texts(corpus):
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special_tokens=True) == text, (name, text, ids)
        plain = tok.encode(text, add_special_tokens=False)
        assert streamed(tok, plain) == tok.decode(plain) == text, (name, text, plain)


def test_user_defined_tokens_stream_as_their_text(tokenizers) -> None:
    """DeepSeek's vocabularies hold user-defined tokens spelled as bytes of GPT-2's alphabet ("õ",
    "÷", ...): llama.cpp cuts them out of the text and decodes them as that text, and so does the
    streamed text gmlx serves (transformers' decode would give U+FFFD)."""
    tok = tokenizers("deepseek-coder")
    ids = tok.encode("informações ÷ 2", add_special_tokens=False)
    assert tok.convert_tokens_to_ids("õ") in ids
    assert streamed(tok, ids) == "informações ÷ 2"


@pytest.mark.parametrize("name", SPLIT_CASES["splits"])
def test_split_matches_llama_cpp(name: str, corpus: Path) -> None:
    """The splits the corpus's own vocabularies do not use, checked on gpt-2's and qwen2's tokens and
    merges renamed to each: the same ids as llama.cpp for every text."""
    k = SPLIT_CASES["splits"].index(name)
    for base in SPLIT_CASES["bases"]:
        header = read_header(corpus / f"ggml-vocab-{base}.gguf")
        tok = build_backend(dataclasses.replace(header, metadata={**header.metadata, "tokenizer.ggml.pre": name}))
        cases = [c for c in SPLIT_CASES["cases"] if c["base"] == base]
        got = tok.encode_batch([c["text"] for c in cases], add_special_tokens=False)
        wrong = [
            (c["text"], c["variants"][c["split_variant"][k]], g.ids)
            for c, g in zip(cases, got)
            if g.ids != c["variants"][c["split_variant"][k]]
        ]
        assert not wrong, f"{name} on {base}: {len(wrong)} of {len(cases)} differ, first {wrong[0]}"


def test_split_cases_cover_every_split() -> None:
    """A split added to gmlx.gguf.splits without llama.cpp's ids for it fails here."""

    def key(name: str) -> tuple:
        return tuple(SPLITS[name].regexes), SPLITS[name].ignore_merges

    assert {key(n) for n in SPLIT_CASES["splits"]} == {key(n) for n in SPLITS if n not in SPM_STYLE_BPE}


# llama-tokenize (llama-cpp-python 0.3.36) on the phi-3 vocabulary, special tokens parsed, BOS added.
PHI3_CHAT = {
    "<|user|>\nHi there<|end|>\n<|assistant|>\n": [1, 32010, 6324, 727, 32007, 32001],
    "<|system|>\n  Be brief.<|end|>\n<|user|> \n\tHi <|end|>\n<|assistant|>": [
        1,
        32006,
        1522,
        11473,
        29889,
        32007,
        32010,
        6324,
        29871,
        32007,
        32001,
    ],
    "<s> Hello</s>  x<|endoftext|> y<unk> z": [1, 1, 29871, 15043, 2, 921, 32000, 29871, 343, 0, 29871, 503],
}


def test_phi3_special_tokens_drop_the_whitespace_after_them(tokenizers) -> None:
    """llama.cpp strips the whitespace after Phi-3's special tokens (not after <s>, <unk>,
    <|endoftext|>), which changes every chat prompt: the newline after "<|user|>" is no token."""
    tok = tokenizers("phi-3")
    assert {text: tok.encode(text) for text in PHI3_CHAT} == PHI3_CHAT


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_other_tokenizer_models_are_refused(name: str, corpus: Path, tmp_path: Path) -> None:
    with pytest.raises(GGUFError) as err:
        load_tokenizer(read_header(corpus / f"ggml-vocab-{name}.gguf"), tmp_path)
    message = str(err.value)
    assert f"tokenizer.ggml.model={REFUSED[name]}" in message and "\n" not in message
    assert not (tmp_path / "tokenizers").exists()  # refused before anything is built
