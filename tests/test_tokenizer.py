"""The GGUF tokenizer: built from the file's vocabulary, cached, and exact against llama.cpp."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
import tiny_models
from tiny_vocab import TINY_VOCAB_SIZE, add_tiny_vocab

from gmlx.cli.common import EXIT_BAD_MODEL
from gmlx.gguf import tokenizer as tokmod
from gmlx.gguf.chat_templates import CHATML, GEMMA, INST, LLAMA3, chat_template_for
from gmlx.gguf.header import GGUFError, read_header
from gmlx.gguf.tokenizer import build_backend, load_tokenizer

DATA = Path(__file__).parent / "data"
REFERENCE = DATA / "gemma3_270m_llamacpp_tokens.json"
TINY_REFERENCE = DATA / "tiny_llamacpp_tokens.json"  # regenerate if tiny_vocab.py changes
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Bye"},
]


_NO_KEY = object()


def write_vocab(
    path: Path, arch: str, kind: str, chat_template: str | None = None, eot: int | None = None, pre: object = None
) -> Path:
    """`pre`: a `tokenizer.ggml.pre` in place of the tiny vocabulary's own, or _NO_KEY for none."""
    writer = gguf.GGUFWriter(str(path), arch)
    add_tiny_vocab(writer, kind)
    if pre is _NO_KEY:
        del writer.kv_data[0]["tokenizer.ggml.pre"]
    elif pre is not None:
        writer.kv_data[0].pop("tokenizer.ggml.pre")
        writer.add_tokenizer_pre(str(pre))
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
    _, tok = tiny
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
    assert tok.convert_ids_to_tokens(tok.encode("é\n\n  ", add_special_tokens=False)) == [
        "<0xC3>",
        "<0xA9>",
        "\n\n",
        "  ",
    ]


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
    assert text == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
    )
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
    render = {"bos_token": "<s>", "eos_token": "</s>", "add_generation_prompt": True}
    assert (
        Template(INST).render(messages=CHAT, **render)
        == "<s>[INST] Be brief.\n\nHi [/INST] Hello.</s>[INST] Bye [/INST]"
    )
    assert Template(LLAMA3).render(messages=CHAT[1:2], **render) == (
        "<s><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )


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


def test_a_tokenizer_built_ahead_is_taken_once(tmp_path):
    """`gmlx serve` builds the preloaded model's tokenizer before its port opens; the load takes that
    one, and the next load of the file builds its own (fast tokenizers are not shared across threads)."""
    header = read_header(write_vocab(tmp_path / "v.gguf", "gemma3", "llama"))
    tokmod.prebuild_tokenizer(header, tmp_path / "cache")
    ahead = tokmod._built_ahead[tokmod._cache_path(header, tmp_path / "cache")]
    assert load_tokenizer(header, tmp_path / "cache") is ahead
    again = load_tokenizer(header, tmp_path / "cache")
    assert again is not ahead and again.encode("hello the world") == ahead.encode("hello the world")
    assert not tokmod._built_ahead


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


@pytest.mark.parametrize(("pre", "why"), [("martian-bpe", "unknown pre-tokenizer"), ("kimi-k2", "code of its own")])
def test_unknown_pre_tokenizer_is_refused(tmp_path, pre, why):
    """No silent fallback to GPT-2's split: the file is refused at load, naming the value."""
    header = read_header(write_vocab(tmp_path / "v.gguf", "qwen2", "gpt2", pre=pre))
    with pytest.raises(GGUFError) as err:
        load_tokenizer(header, tmp_path / "cache")
    message = str(err.value)
    assert f"tokenizer.ggml.pre={pre!r}" in message and why in message and "\n" not in message
    assert not (tmp_path / "cache").exists()


def test_missing_pre_tokenizer_is_llama_cpps_default(tmp_path):
    """Old files without the key split as llama.cpp's default does: numbers three digits at a time,
    punctuation runs apart from the words they touch (GPT-2's own split keeps " 3333" and "!?x" whole)."""
    backend = build_backend(read_header(write_vocab(tmp_path / "v.gguf", "qwen2", "gpt2", pre=_NO_KEY)))
    pieces = [p for p, _ in backend.pre_tokenizer.pre_tokenize_str("a 3333 !?x")]
    assert pieces == ["a", "Ġ", "333", "3", "Ġ", "!?", "x"]


def test_byte_zero_streams_as_itself(bpe):
    """mlx_lm's byte-level detokenizer turns byte 0 into "Ā"; gmlx's streams the byte."""
    ids = bpe.encode("a\x00b\x00", add_special_tokens=False)
    detok = bpe.detokenizer
    for i in ids:
        detok.add_token(i)
    detok.finalize()
    assert detok.text == bpe.decode(ids) == "a\x00b\x00"


def _model_with_pre(path: Path, pre: str, monkeypatch) -> Path:
    """A tiny qwen3 model whose vocabulary names pre-tokenizer `pre`."""
    original = tiny_models.add_tiny_vocab

    def add(writer, kind, space_prefix=False):
        original(writer, kind, space_prefix)
        writer.kv_data[0].pop("tokenizer.ggml.pre")
        writer.add_tokenizer_pre(pre)

    monkeypatch.setattr(tiny_models, "add_tiny_vocab", add)
    return tiny_models.write_model(path, "qwen3")


def test_cli_refuses_unknown_pre_tokenizer(tmp_path, monkeypatch):
    """`gmlx run` and `gmlx serve` exit 3 with one line naming the value (serve before it listens)."""
    from typer.testing import CliRunner

    from gmlx.cli.main import app

    model = _model_with_pre(tmp_path / "martian.gguf", "martian-bpe", monkeypatch)
    r = CliRunner().invoke(app, ["run", str(model), "--prompt", "hi", "-n", "2"])
    assert r.exit_code == EXIT_BAD_MODEL and len(r.stderr.strip().splitlines()) == 1
    assert "tokenizer.ggml.pre='martian-bpe'" in r.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run(
        [sys.executable, "-m", "gmlx", "serve", str(model), "--port", str(port)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == EXIT_BAD_MODEL and "tokenizer.ggml.pre='martian-bpe'" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
