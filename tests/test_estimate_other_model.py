"""POST /v1/estimate (and dry_run) for a model in the models directory that is not loaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import LiveServer, invoke_json
from tiny_models import write_model

pytestmark = pytest.mark.usefixtures("no_settings_env")  # the CLI reads GMLX_* settings
MEMORY = 4 * 2**30
BODY = {
    "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}],
    "max_tokens": 100,
}


@pytest.fixture
def models_dir(tmp_path: Path) -> Path:
    """A models directory holding a second tiny model, shaped unlike the served one (another
    architecture and tokenizer, twice the KV heads, a 4096-token window)."""
    folder = tmp_path / "models"
    folder.mkdir()
    write_model(folder / "other.gguf", "qwen3", context=4096, kv_heads=4)
    return folder


@pytest.mark.parametrize("max_kv_size", [None, 300])
def test_estimate_for_a_model_not_loaded_matches_offline(
    tiny_models: dict[str, Path], models_dir: Path, tmp_path: Path, max_kv_size: int | None
) -> None:
    (tmp_path / "request.json").write_text(json.dumps(BODY))
    cap = () if max_kv_size is None else ("--max-kv-size", max_kv_size)
    offline = invoke_json(
        "estimate",
        models_dir / "other.gguf",
        "--body",
        tmp_path / "request.json",
        "--memory",
        MEMORY,
        "--weights",
        "float",
        *cap,
    )["estimate"]
    with (
        LiveServer(
            tiny_models["llama"], memory=MEMORY, models_dir=str(models_dir), max_kv_size=max_kv_size, governor=False
        ) as server,
        server.client() as c,
    ):
        other = c.post("/v1/estimate", json={**BODY, "model": "other"}).json()
        dry = c.post("/v1/chat/completions", json={**BODY, "model": "other", "dry_run": True}).json()
        served = c.post("/v1/estimate", json=BODY).json()
        named = c.post("/v1/estimate", json={**BODY, "model": server.model_id}).json()
        table, growth = server.model.table(), server.model.prefill_growth()
        measured = round(growth.unplanned * table.prefill_step)
    assert other["resident"] is False and other["model"] == "other" and other["estimated"] is True
    assert other["context_limit"] == (4096 if max_kv_size is None else max_kv_size)
    for key in (
        "prompt_tokens",
        "warm_tokens",
        "cache_tier",
        "need_bytes",
        "fits_drained",
        "context_ok",
        "context_limit",
        "est_ttft_s",
        "resident",
        "model",
    ):
        assert other[key] == offline[key], key
    assert other["fits_now"] is None and other["est_ttft_s"] is None and other["cache_tier"] == "miss"
    assert "not loaded" in other["note"] and "would unload nothing" in other["note"]
    assert other["loadable"] is True and other["evicts"] == []
    assert dry == other
    # The served model answers as before: its own window and tokenizer, resident, no note.
    assert served["resident"] is True and served["context_limit"] == min(256, max_kv_size or 256)
    assert served["model"] == server.model_id and "note" not in served
    # The other model keeps twice the KV heads; the served one's need adds what its warm-up measured.
    assert served["need_bytes"] - measured < other["need_bytes"]
    for key in ("prompt_tokens", "need_bytes", "context_limit", "resident", "model"):
        assert named[key] == served[key], key


def test_a_models_directory_file_is_estimated_and_served_by_its_id(
    tiny_models: dict[str, Path], models_dir: Path, tmp_path: Path
) -> None:
    write_model(tmp_path / "outside.gguf", "llama")
    (models_dir / "broken.gguf").write_bytes(b"GGUF" + b"\0" * 40)
    ask = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    with (
        LiveServer(tiny_models["llama"], memory=MEMORY, models_dir=str(models_dir), governor=False) as server,
        server.client() as c,
    ):
        real = c.post("/v1/chat/completions", json={**ask, "model": "other"})
        unknown = c.post("/v1/estimate", json={**ask, "model": "nowhere"})
        unknown_dry = c.post("/v1/chat/completions", json={**ask, "model": "nowhere", "dry_run": True})
        outside = c.post("/v1/estimate", json={**ask, "model": "../outside"})
        broken = c.post("/v1/estimate", json={**ask, "model": "broken"})
        before = c.post("/v1/estimate", json={**ask, "model": "other"}).json()
        # Once unloaded, a file replaced in place is read again, not answered from the cached tokenizer.
        assert c.post("/v1/models/other/unload").json()["status"] == "unloaded"
        write_model(models_dir / "other.gguf", "llama", context=1024)
        after = c.post("/v1/estimate", json={**ask, "model": "other"}).json()
    assert real.status_code == 200 and real.json()["model"] == "other"  # it loads on demand
    for r in (unknown, unknown_dry, outside, broken):
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    assert "cannot be read" in broken.json()["error"]["message"]
    assert before["context_limit"] == 4096 and after["context_limit"] == 1024
