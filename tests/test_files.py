"""What gmlx reads from files on disk: KV geometry from a GGUF header, the loader's window cap and
its errors, and the models directory that /system lists."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
from conftest import LiveServer

from gmlx.capacity.memory import kv_bytes, layer_bytes_per_token
from gmlx.gguf.header import read_header
from gmlx.models.loader import load


def write_header(path: Path, arch: str, n_layers: int, **extra: object) -> Path:
    """A header-only GGUF as llama.cpp's converter writes one: geometry keys, no tensors."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n_layers)
    w.add_context_length(8192)
    w.add_embedding_length(1024)
    w.add_feed_forward_length(4096)
    w.add_head_count(16)
    w.add_key_length(64)
    w.add_value_length(64)
    w.add_vocab_size(1000)
    for name, value in extra.items():
        getattr(w, f"add_{name}")(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_per_layer_kv_heads_from_a_file(tmp_path: Path) -> None:
    g = read_header(write_header(tmp_path / "m.gguf", "llama", 4, head_count_kv=[8, 8, 4, 2])).geometry
    assert g.n_kv_heads == (8, 8, 4, 2)
    assert [layer_bytes_per_token(g, i) for i in range(4)] == [8 * 128 * 2, 8 * 128 * 2, 4 * 128 * 2, 2 * 128 * 2]
    assert kv_bytes(g, 100) == (8 + 8 + 4 + 2) * 128 * 2 * 100
    uniform = read_header(write_header(tmp_path / "u.gguf", "llama", 3, head_count_kv=4)).geometry
    assert uniform.n_kv_heads == (4, 4, 4)


def test_mla_ranks_from_a_file(tmp_path: Path) -> None:
    path = write_header(
        tmp_path / "ds.gguf",
        "deepseek2",
        2,
        head_count_kv=16,
        kv_lora_rank=512,
        q_lora_rank=1536,
        rope_dimension_count=64,
    )
    g = read_header(path).geometry
    assert (g.kv_lora_rank, g.q_lora_rank, g.rope_dim) == (512, 1536, 64)
    # The compressed latent and the shared rotary key per token and layer; the 16 heads do not count.
    assert kv_bytes(g, 10) == 2 * (512 + 64) * 2 * 10


@pytest.mark.parametrize(
    ("pattern", "sliding"),
    [
        (None, (True,) * 5 + (False,) + (True,) * 5 + (False,)),  # gemma3's converter stores none: every 6th is global
        (4, (True, True, True, False) * 3),
        (
            [True, False, True, True, False, True, True, True, False, True, True, True],
            (True, False, True, True, False, True, True, True, False, True, True, True),
        ),
    ],
)
def test_sliding_window_pattern_from_a_file(tmp_path: Path, pattern: object, sliding: tuple[bool, ...]) -> None:
    extra = {"sliding_window": 512} | ({"sliding_window_pattern": pattern} if pattern is not None else {})
    g = read_header(write_header(tmp_path / "g.gguf", "gemma3", 12, head_count_kv=1, **extra)).geometry
    assert g.sliding_window == 512 and g.sliding_layers == sliding
    full, slide = sliding.count(False), sliding.count(True)
    assert kv_bytes(g, 2048) == (full * 2048 + slide * 512) * 128 * 2


def test_max_kv_size_caps_the_served_window(tiny_models: dict[str, Path]) -> None:
    path = tiny_models["llama"]  # trained window: 256
    assert load(path, "float").context_length == 256
    assert load(path, "float", max_kv_size=100).context_length == 100
    assert load(path, "float", max_kv_size=10**6).context_length == 256  # a cap, never a stretch


def test_system_lists_the_models_directory(tmp_path: Path) -> None:
    from tiny_models import write_model

    models = tmp_path / "models"
    models.mkdir()
    served = write_model(models / "served.gguf", "llama")
    (models / "b-other.gguf").write_bytes(b"x" * 300)
    (models / "a-other.gguf").write_bytes(b"x" * 100)
    (models / "notes.txt").write_text("not a model")
    (models / "folder.gguf").mkdir()
    with LiveServer(served, models_dir=str(models)) as server, server.client() as c:
        listed = c.get("/system").json()["models"]
    assert listed == {
        "active": "served",
        "loaded": ["served"],
        "available": [
            {"name": "served", "size_bytes": served.stat().st_size, "status": "loaded", "preset": False},
            {"name": "a-other", "size_bytes": 100, "status": "unloaded", "preset": False},
            {"name": "b-other", "size_bytes": 300, "status": "unloaded", "preset": False},
        ],
    }


def test_system_without_a_models_directory(live_server: LiveServer) -> None:
    with live_server.client() as c:
        models = c.get("/system").json()["models"]
    size = live_server.engine.loaded.header.path.stat().st_size
    assert models == {
        "active": live_server.model_id,
        "loaded": [live_server.model_id],
        "available": [{"name": live_server.model_id, "size_bytes": size, "status": "loaded", "preset": False}],
    }
