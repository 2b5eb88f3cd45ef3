"""`gmlx export`: mlx_lm.load on the exported directory gives the model gmlx loads."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from mlx_lm import load as mlx_lm_load
from tiny_models import ARCHES, write_model
from typer.testing import CliRunner

from gmlx.cli.main import app
from gmlx.models.export import export
from gmlx.models.loader import load

PROMPT = [2, 10, 20, 30, 40, 50]


def logits(model) -> np.ndarray:
    return np.array(model(mx.array([PROMPT]))[0].astype(mx.float32))


@pytest.mark.parametrize("arch", ARCHES)
def test_float_export_loads_in_mlx_lm_with_the_same_logits(
    tiny_models: dict[str, Path], arch: str, tmp_path: Path
) -> None:
    report = export(tiny_models[arch], tmp_path / arch, "float")
    assert report.mode == "float" and report.quantized_layers == 0
    model, tokenizer = mlx_lm_load(str(tmp_path / arch))
    ours = load(tiny_models[arch], "float")
    np.testing.assert_allclose(logits(model), logits(ours.model), rtol=1e-5, atol=1e-5)
    assert tokenizer.chat_template == ours.tokenizer.chat_template
    assert tokenizer.encode("hello world") == ours.tokenizer.encode("hello world")
    assert set(tokenizer.eos_token_ids) == set(ours.tokenizer.eos_token_ids)


def test_native_export_keeps_the_quantization_per_layer(tmp_path: Path) -> None:
    src = write_model(tmp_path / "q.gguf", "llama", qtype=Q.Q4_K, tied=False)
    export(src, tmp_path / "out", "native")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quantization"]["model.layers.0.self_attn.q_proj"] == {"group_size": 32, "bits": 4}
    model, _ = mlx_lm_load(str(tmp_path / "out"))
    np.testing.assert_allclose(logits(model), logits(load(src, "native").model), rtol=1e-5, atol=1e-5)


def test_cli_writes_the_directory(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["export", str(tiny_models["qwen3"]), str(tmp_path / "out"), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["weights"] == "float"
    assert {p.name for p in (tmp_path / "out").iterdir()} >= {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }


def test_the_out_dir_is_checked_before_the_model_loads(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """A file, a non-empty directory (another model's safetensors beside the export would be loaded
    with it) or a path that cannot be made: a one-line usage error, no traceback, before any load."""
    model = str(tiny_models["qwen3"])
    (tmp_path / "file").write_text("x")
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "config.json").write_text("{}")
    for out, says in (
        (tmp_path / "file", "is not a directory"),
        (tmp_path / "file" / "sub", "cannot create"),
        (tmp_path / "used", "is not empty"),
    ):
        result = CliRunner().invoke(app, ["export", model, str(out)])
        assert result.exit_code == 2 and says in result.output, result.output


def test_one_argument_is_the_directory_for_the_default_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gmlx.cli import export as cli_export

    asked = []

    def model_path(model: str | None) -> Path:  # no load: which model it would export is the question
        asked.append(model)
        raise SystemExit(0)

    monkeypatch.setattr(cli_export, "model_path", model_path)
    result = CliRunner().invoke(app, ["export", str(tmp_path / "out")])
    assert result.exit_code == 0 and asked == [None] and (tmp_path / "out").is_dir(), result.output


@pytest.mark.slow
def test_default_model_export_writes_about_the_sea(default_model: Path, tmp_path: Path) -> None:
    from mlx_lm import generate

    export(default_model, tmp_path / "out", "float")
    model, tokenizer = mlx_lm_load(str(tmp_path / "out"))
    prompt = tokenizer.encode("Here is a short poem about the sea:\n")
    text = generate(model, tokenizer, prompt, max_tokens=8)
    assert text.startswith("The sea is a beautiful place"), text
