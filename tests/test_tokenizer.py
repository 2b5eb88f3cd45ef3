"""The GGUF tokenizer: built from the file's vocabulary, cached, and exact against llama.cpp."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
from tiny_vocab import TINY_VOCAB_SIZE, add_tiny_vocab

from gmlx.gguf import tokenizer as tokmod
from gmlx.gguf.chat_templates import CHATML, GEMMA, INST, LLAMA3, chat_template_for
from gmlx.gguf.header import read_header
from gmlx.gguf.tokenizer import load_tokenizer

DATA = Path(__file__).parent / "data"
REFERENCE = DATA / "gemma3_270m_llamacpp_tokens.json"
TINY_REFERENCE = DATA / "tiny_llamacpp_tokens.json"  # regenerate if tiny_vocab.py changes
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]


def write_vocab(path: Path, arch: str, kind: str, chat_template: str | None = None, eot: int | None = None) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    add_tiny_vocab(writer, kind)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    if eot is not None:
        writer.add_eot_token_id(eot)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def load_tiny(tmp_path: Path, arch: str, kind: str):
    return load_tokenizer(read_header(write_vocab(tmp_path / f"{kind}.gguf", arch, kind)), tmp_path / "cache")


@pytest.fixture
def spm(tmp_path):
    return load_tiny(tmp_path, "gemma3", "llama")


@pytest.fixture
def bpe(tmp_path):
    return load_tiny(tmp_path, "qwen2", "gpt2")


@pytest.fixture(params=["llama", "gpt2"])
def tiny(request, tmp_path):
    kind = request.param
    return kind, load_tiny(tmp_path, {"llama": "gemma3", "gpt2": "qwen2"}[kind], kind)


TEXTS = ["hello world", "The capital of France is Paris\n\nhello  the", "Hello world 日本 🤖!", "  leading", ""]


@pytest.mark.parametrize("text", TEXTS)
def test_roundtrip(tiny, text):
    kind, tok = tiny
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert all(0 <= i < len(tok) for i in ids)
    # The streaming detokenizer mlx_lm uses while generating agrees with decode.
    detok = tok.detokenizer
    detok.reset()
    for i in ids:
        detok.add_token(i)
    detok.finalize()
    # Byte-level text keeps its leading space, as decode does (mlx_lm's own detokenizer drops it).
    assert detok.text == text


def test_vocab_size_matches_fixture(tiny):
    kind, tok = tiny
    assert len(tok) == TINY_VOCAB_SIZE[kind]


def test_spm_pieces_and_bos(spm):
    tok = spm
    ids = tok.encode("hello world")
    assert ids[0] == tok.bos_token_id == 2
    # No space prefix (add_space_prefix false): "hello" at the start is spelled out, "▁world" is whole.
    assert tok.convert_ids_to_tokens(ids[1:]) == ["h", "e", "l", "l", "o", "▁world"]
    # Characters outside the vocabulary fall back to bytes; "\n\n" and "  " are cut out whole.
    assert tok.convert_ids_to_tokens(tok.encode("é\n\n  ", add_special_tokens=False)) == ["<0xC3>", "<0xA9>", "\n\n", "  "]


def test_bpe_merges_and_no_bos(bpe):
    tok = bpe
    assert tok.convert_ids_to_tokens(tok.encode("Hello world the")) == ["Hello", "Ġworld", "Ġthe"]
    assert tok.encode("<|im_start|>user") == [tok.convert_tokens_to_ids("<|im_start|>"), *tok.encode("user")]


def test_eos_ids_include_end_of_turn(tiny):
    kind, tok = tiny
    turn_end = "<end_of_turn>" if kind == "llama" else "<|im_end|>"
    assert tok.eos_token_id in tok.eos_token_ids
    assert tok.convert_tokens_to_ids(turn_end) in tok.eos_token_ids


def test_eot_key_joins_eos_ids(tmp_path):
    tok = load_tokenizer(read_header(write_vocab(tmp_path / "eot.gguf", "gemma3", "llama", eot=4)), tmp_path / "cache")
    assert {1, 4, 5} <= tok.eos_token_ids


def test_chat_template_gemma(spm):
    tok = spm
    text = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
                    "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
    ids = tok.apply_chat_template(CHAT[1:2], add_generation_prompt=True)
    assert ids[:2] == [2, tok.convert_tokens_to_ids("<start_of_turn>")] and ids.count(2) == 1


def test_chat_template_chatml(bpe):
    tok = bpe
    text = tok.apply_chat_template(CHAT[:2], add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_chat_template_llama_families(tmp_path):
    from jinja2 import Template

    header = read_header(write_vocab(tmp_path / "llama.gguf", "llama", "llama"))
    assert chat_template_for(header) == INST
    assert chat_template_for(header, {"<|start_header_id|>"}) == LLAMA3
    assert chat_template_for(read_header(write_vocab(tmp_path / "q3.gguf", "qwen3", "gpt2"))) == CHATML
    assert chat_template_for(read_header(write_vocab(tmp_path / "g2.gguf", "gemma2", "llama"))) == GEMMA
    render = dict(bos_token="<s>", eos_token="</s>", add_generation_prompt=True)
    assert Template(INST).render(messages=CHAT, **render) == "<s>[INST] Be brief.\n\nHi [/INST] Hello.</s>[INST] Bye [/INST]"
    assert Template(LLAMA3).render(messages=CHAT[1:2], **render) == (
        "<s><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")


def test_file_template_wins(tmp_path):
    own = "{% for m in messages %}{{ m['content'] }}|{% endfor %}"
    header = read_header(write_vocab(tmp_path / "own.gguf", "gemma3", "llama", chat_template=own))
    tok = load_tokenizer(header, tmp_path / "cache")
    assert tok.apply_chat_template(CHAT[1:2], tokenize=False) == "Hi|"


def test_cache_is_written_and_reused(tmp_path, monkeypatch):
    header = read_header(write_vocab(tmp_path / "v.gguf", "gemma3", "llama"))
    calls = []
    build = tokmod.build_backend
    monkeypatch.setattr(tokmod, "build_backend", lambda h: calls.append(h) or build(h))
    first = load_tokenizer(header, tmp_path / "cache")
    cached = list((tmp_path / "cache" / "tokenizers").glob("*.json"))
    assert len(cached) == 1 and len(calls) == 1
    second = load_tokenizer(header, tmp_path / "cache")
    assert len(calls) == 1  # read from the cache, not rebuilt
    assert second.encode("hello the world") == first.encode("hello the world")
    # A changed file (new mtime/size) gets a fresh build under a new key.
    write_vocab(tmp_path / "v.gguf", "gemma3", "llama", chat_template="x")
    load_tokenizer(read_header(tmp_path / "v.gguf"), tmp_path / "cache")
    assert len(calls) == 2 and len(list((tmp_path / "cache" / "tokenizers").glob("*.json"))) == 2


def test_default_cache_dir_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("GMLX_CACHE_DIR", str(tmp_path / "env-cache"))
    load_tokenizer(read_header(write_vocab(tmp_path / "v.gguf", "qwen2", "gpt2")))
    assert list((tmp_path / "env-cache" / "tokenizers").glob("*.json"))


def test_tiny_vocab_matches_llama_cpp(tiny):
    kind, tok = tiny
    cases = json.loads(TINY_REFERENCE.read_text(encoding="utf-8"))[kind]
    assert [tok.encode(c["text"]) for c in cases] == [c["ids"] for c in cases]


@pytest.mark.slow
def test_default_model_matches_llama_cpp(default_model, tmp_path_factory):
    """Token ids llama-tokenize gave for the same strings, hand-picked and 500 seeded random ones
    (regenerate with `python -m bench.llamacpp_tokens`), with and without the BOS."""
    reference = json.loads(REFERENCE.read_text(encoding="utf-8"))
    cases = reference["cases"]
    assert reference["random"] >= 500 and len(cases) == reference["kept"] + reference["random"]
    tok = load_tokenizer(read_header(default_model), tmp_path_factory.mktemp("tokcache"))
    assert tok.bos_token_id == 2 and tok.pad_token_id == 0 and {1, 106} <= tok.eos_token_ids
    assert all(case["ids"][:1] == [tok.bos_token_id] for case in cases)
    mismatched = [case["text"] for case in cases if tok.encode(case["text"]) != case["ids"]]
    assert not mismatched, f"{len(mismatched)} of {len(cases)} differ, first: {mismatched[0]!r}"
    # add_bos off: the same ids without the BOS.
    no_bos = [case["text"] for case in cases if tok.encode(case["text"], add_special_tokens=False) != case["ids"][1:]]
    assert not no_bos, f"{len(no_bos)} of {len(cases)} differ without BOS, first: {no_bos[0]!r}"
