"""gguf/header.py: the header parsed directly, and each malformed file refused in one line."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from tiny_models import CONTEXT, HEAD_DIM, HEADS, HIDDEN, KV_HEADS, write_model

from gmlx.gguf.header import GGUFError, read_header


def test_metadata_tensors_and_geometry_are_read(tmp_path: Path) -> None:
    h = read_header(write_model(tmp_path / "m.gguf", "llama"))
    assert h.architecture == "llama" and h.version == 3
    assert h.get("general.name") == "tiny-llama" and h.get("absent", 7) == 7
    g = h.geometry
    assert (g.n_embd, g.n_heads, g.n_kv_heads[0], g.key_length, g.context_length) == (
        HIDDEN,
        HEADS,
        KV_HEADS,
        HEAD_DIM,
        CONTEXT,
    )
    emb = h.tensors["token_embd.weight"]
    assert emb.shape[0] == HIDDEN and emb.type_name == "F32" and emb.nbytes == emb.n_elements * 4
    assert all(t.offset >= h.data_offset for t in h.tensors.values())


def test_a_vocab_only_file_is_read(tmp_path: Path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "v.gguf"), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "a"])
    for write in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file):
        write()
    w.close()
    h = read_header(tmp_path / "v.gguf")
    assert h.tensors == {} and list(h.get("tokenizer.ggml.tokens")) == ["<unk>", "a"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "not a GGUF file (only 0 bytes)"),
        (b"GGML" + bytes(40), "bad magic"),
        (b"GGUF" + struct.pack("<IQQ", 9, 0, 0), "unsupported GGUF version 9"),
        (b"GGUF" + struct.pack("<IQQ", 3, 10**7, 0), "corrupt GGUF header"),
    ],
)
def test_a_malformed_file_is_refused_in_one_line(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(GGUFError) as e:
        read_header(path)
    assert message in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)


def test_a_truncated_file_is_refused(tmp_path: Path) -> None:
    path = write_model(tmp_path / "m.gguf", "llama")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1024])
    with pytest.raises(GGUFError, match="truncated GGUF"):
        read_header(path)


def test_a_missing_path_or_a_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match="no such file"):
        read_header(tmp_path / "nope.gguf")
    with pytest.raises(GGUFError, match="not a file"):
        read_header(tmp_path)


def test_arrays_are_read_lazily_and_in_full(tmp_path: Path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "a.gguf"), "llama")
    w.add_array("test.scores", [float(i) for i in range(5000)])
    for write in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file):
        write()
    w.close()
    h = read_header(tmp_path / "a.gguf")
    assert np.allclose(np.asarray(h.get("test.scores")), np.arange(5000))
