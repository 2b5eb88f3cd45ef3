"""Settings resolution: precedence, aliases, config files, validation and masking."""

from __future__ import annotations

from pathlib import Path

import pytest

from gmlx.settings import Settings, SettingsError, describe, resolve_settings


def resolve(flags: dict | None = None, env: dict | None = None, config: str | Path | None = None) -> Settings:
    return resolve_settings(flags or {}, env=env or {}, config=config)


def toml(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "gmlx.toml"
    p.write_text(text)
    return p


def test_defaults():
    s = resolve()
    assert (s.model, s.host, s.port, s.api_key) == (None, "127.0.0.1", 8080, None)
    assert (s.decode_batch, s.queue_size, s.queue_timeout) == (8, 16, 120.0)
    assert (s.max_body_bytes, s.weights, s.prefill_step, s.max_tokens_default) == (4194304, "auto", 512, 512)
    assert (s.log_input_text, s.shutdown_timeout, s.log_level) == (False, 10.0, "info")
    assert s.sources["port"] == "default"
    assert set(s.sources) == {name for name, _, _ in describe(s)}


def test_precedence_flag_env_config_default(tmp_path):
    cfg = toml(tmp_path, 'port = 7000\nhost = "0.0.0.0"\nqueue_timeout = 30\nweights = "float"\n')
    env = {"GMLX_PORT": "7001", "GMLX_HOST": "10.0.0.1", "GMLX_QUEUE_TIMEOUT": "45.5"}
    s = resolve({"port": 7002, "host": None}, env, cfg)
    assert (s.port, s.sources["port"]) == (7002, "flag")
    assert (s.host, s.sources["host"]) == ("10.0.0.1", "env GMLX_HOST")  # None flag = not given
    assert (s.queue_timeout, s.sources["queue_timeout"]) == (45.5, "env GMLX_QUEUE_TIMEOUT")
    assert (s.weights, s.sources["weights"]) == ("float", f"config {cfg}")
    assert (s.prefill_step, s.sources["prefill_step"]) == (512, "default")


def test_empty_env_var_is_unset(tmp_path):
    s = resolve(env={"GMLX_PORT": "", "PORT": "9000"}, config=toml(tmp_path, "port = 7000\n"))
    assert (s.port, s.sources["port"]) == (9000, "env PORT")


def test_max_concurrency_alias_and_priority():
    s = resolve(env={"MAX_CONCURRENCY": "3"})
    assert (s.decode_batch, s.sources["decode_batch"]) == (3, "env MAX_CONCURRENCY")
    s = resolve(env={"MAX_CONCURRENCY": "3", "GMLX_DECODE_BATCH": "5"})
    assert (s.decode_batch, s.sources["decode_batch"]) == (5, "env GMLX_DECODE_BATCH")
    s = resolve({"decode_batch": 2}, env={"MAX_CONCURRENCY": "3", "GMLX_DECODE_BATCH": "5"})
    assert (s.decode_batch, s.sources["decode_batch"]) == (2, "flag")


def test_queue_size_follows_decode_batch():
    s = resolve(env={"MAX_CONCURRENCY": "3"})
    assert (s.queue_size, s.sources["queue_size"]) == (6, "default (2 x decode_batch)")
    s = resolve({"decode_batch": 4}, env={"QUEUE_SIZE": "0"})
    assert (s.queue_size, s.sources["queue_size"]) == (0, "env QUEUE_SIZE")
    assert ("queue_size", "0", "env QUEUE_SIZE") in describe(s)


def test_spec_aliases():
    s = resolve(env={"QUEUE_TIMEOUT_S": "5", "LOG_INPUT_TEXT": "true", "PORT": "9"})
    assert (s.queue_timeout, s.log_input_text, s.port) == (5.0, True, 9)


def test_toml_config_with_dashed_keys(tmp_path):
    cfg = toml(tmp_path, 'decode-batch = 2\nmax_body_bytes = 1024\nlog-input-text = true\nmodel = "m.gguf"\n')
    s = resolve(config=cfg)
    assert (s.decode_batch, s.queue_size, s.max_body_bytes, s.log_input_text, s.model) == (2, 4, 1024, True, "m.gguf")
    assert s.sources["decode_batch"] == f"config {cfg}"


def test_a_file_may_name_a_setting_by_its_flag(tmp_path):
    """`--max-tokens` sets max_tokens_default: a config file or a preset may say either."""
    from gmlx.presets import load_presets

    assert resolve(config=toml(tmp_path, "max-tokens = 64\n")).max_tokens_default == 64
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    presets = tmp_path / "presets.toml"
    presets.write_text(f'[models.short]\npath = "{model}"\nmax_tokens = 16\n')
    assert load_presets(presets)["short"].settings == {"max_tokens_default": 16}
    with pytest.raises(SettingsError, match="given twice"):
        resolve(config=toml(tmp_path, "max_tokens = 1\nmax_tokens_default = 2\n"))


def test_yaml_config(tmp_path):
    for suffix in (".yaml", ".yml"):
        cfg = tmp_path / f"gmlx{suffix}"
        cfg.write_text("port: 8181\nqueue-size: 3\nqueue_timeout: 2.5\nlog_input_text: yes\napi_key:\n")
        s = resolve(config=cfg)
        assert (s.port, s.queue_size, s.queue_timeout, s.log_input_text, s.api_key) == (8181, 3, 2.5, True, None)
        assert s.sources["api_key"] == "default"  # YAML null = not given


def test_config_path_from_env(tmp_path):
    cfg = toml(tmp_path, "port = 7000\n")
    assert resolve(env={"GMLX_CONFIG": str(cfg)}).port == 7000
    assert resolve(env={"GMLX_CONFIG": str(tmp_path / "other.toml")}, config=cfg).port == 7000  # argument wins


def test_unknown_config_keys(tmp_path):
    with pytest.raises(SettingsError, match=r"unknown key\(s\): bogus, max_concurrency") as e:
        resolve(config=toml(tmp_path, "port = 1\nbogus = 2\nmax_concurrency = 3\n"))
    assert str(tmp_path) in str(e.value)


@pytest.mark.parametrize(
    "text, match",
    [
        ("", "file not found"),
        ("port = \n", "cannot parse"),
    ],
)
def test_config_file_errors(tmp_path, text, match):
    path = tmp_path / "missing.toml" if not text else toml(tmp_path, text)
    with pytest.raises(SettingsError, match=match):
        resolve(config=path)


@pytest.mark.parametrize(
    "flags, env, message",
    [
        ({}, {"MAX_CONCURRENCY": "abc"}, "decode_batch: 'abc' from env MAX_CONCURRENCY is not an integer"),
        ({}, {"GMLX_DECODE_BATCH": "0"}, "decode_batch: '0' from env GMLX_DECODE_BATCH must be >= 1"),
        ({"queue_size": -1}, {}, "queue_size: -1 from flag must be >= 0"),
        ({}, {"QUEUE_TIMEOUT_S": "0"}, "queue_timeout: '0' from env QUEUE_TIMEOUT_S must be > 0"),
        ({}, {"GMLX_QUEUE_TIMEOUT": "soon"}, "queue_timeout: 'soon' from env GMLX_QUEUE_TIMEOUT is not a number"),
        ({"weights": "q4"}, {}, "weights: 'q4' from flag must be one of auto, native, float"),
        ({"prefill_step": 8}, {}, "prefill_step: 8 from flag must be >= 16"),
        ({}, {"PORT": "70000"}, "port: '70000' from env PORT must be between 0 and 65535"),
        ({}, {"GMLX_MEMORY": "0"}, "memory: '0' from env GMLX_MEMORY must be > 0"),  # not the machine's instead
        ({}, {"GMLX_LOG_LEVEL": "loud"}, "log_level: 'loud' from env GMLX_LOG_LEVEL must be one of"),
        ({}, {"GMLX_GOVERNOR_ORANGE": "0.7"}, "governor thresholds must rise"),
        ({}, {"GMLX_GOVERNOR_YELLOW": "0.01"}, "governor hysteresis 0.05 must be at least 0 and below yellow"),
    ],
)
def test_bad_values_name_field_and_source(flags, env, message):
    with pytest.raises(SettingsError) as e:
        resolve(flags, env)
    assert str(e.value).startswith(message)
    assert "\n" not in str(e.value)


def test_bad_config_value_names_config(tmp_path):
    cfg = toml(tmp_path, "decode_batch = true\n")  # a TOML bool is not a count
    with pytest.raises(SettingsError, match=rf"^decode_batch: True from config {cfg} is not an integer$"):
        resolve(config=cfg)


def test_api_key_masked():
    s = resolve(env={"GMLX_API_KEY": "sekrit-123"})
    assert s.api_key == "sekrit-123"
    rows = {name: (shown, source) for name, shown, source in describe(s)}
    assert rows["api_key"] == ("set (10 chars)", "env GMLX_API_KEY")
    assert all("sekrit" not in shown for _, shown, _ in describe(s))
    assert dict((n, v) for n, v, _ in describe(resolve()))["api_key"] == "not set"
    off = resolve({"api_key": ""}, env={"GMLX_API_KEY": "sekrit-123"})  # an empty flag switches auth off
    assert (off.api_key, off.sources["api_key"]) == (None, "flag")


@pytest.mark.parametrize(
    "word, value",
    [
        ("true", True),
        ("TRUE", True),
        ("1", True),
        ("yes", True),
        ("On", True),
        ("false", False),
        ("0", False),
        ("no", False),
        ("OFF", False),
    ],
)
def test_log_input_text_parsing(word, value):
    s = resolve(env={"LOG_INPUT_TEXT": word})
    assert (s.log_input_text, s.sources["log_input_text"]) == (value, "env LOG_INPUT_TEXT")


def test_log_input_text_rejects_other_words():
    with pytest.raises(SettingsError, match=r"^log_input_text: 'maybe' from env LOG_INPUT_TEXT is not a boolean"):
        resolve(env={"LOG_INPUT_TEXT": "maybe"})
    assert resolve({"log_input_text": False}, env={"GMLX_LOG_INPUT_TEXT": "1"}).log_input_text is False


def test_describe_shows_every_field_with_source():
    s = resolve({"decode_batch": 3}, env={"GMLX_LOG_LEVEL": "DEBUG"})
    rows = describe(s)
    assert rows[0] == ("model", "not set", "default")
    assert ("decode_batch", "3", "flag") in rows
    assert ("queue_size", "6", "default (2 x decode_batch)") in rows
    assert ("log_level", "debug", "env GMLX_LOG_LEVEL") in rows
    assert ("log_input_text", "false", "default") in rows
    assert all(isinstance(v, str) for row in rows for v in row)


def test_max_kv_size_flag_env_config(tmp_path):
    assert resolve().max_kv_size is None
    cfg = toml(tmp_path, "max-kv-size = 8192\n")
    assert (resolve(config=cfg).max_kv_size, resolve(config=cfg).sources["max_kv_size"]) == (8192, f"config {cfg}")
    s = resolve(env={"GMLX_MAX_KV_SIZE": "4096"}, config=cfg)
    assert (s.max_kv_size, s.sources["max_kv_size"]) == (4096, "env GMLX_MAX_KV_SIZE")
    assert resolve({"max_kv_size": 2048}, env={"GMLX_MAX_KV_SIZE": "4096"}).max_kv_size == 2048
    with pytest.raises(SettingsError, match=r"^max_kv_size: '0' from env GMLX_MAX_KV_SIZE must be >= 1$"):
        resolve(env={"GMLX_MAX_KV_SIZE": "0"})


def test_models_dir(tmp_path, monkeypatch):
    s = resolve(env={"GMLX_MODELS_DIR": str(tmp_path)})
    assert (s.models_dir, s.sources["models_dir"]) == (str(tmp_path), "env GMLX_MODELS_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve({"models_dir": "~"}).models_dir == str(tmp_path)
    assert resolve({"models_dir": ""}, env={"GMLX_MODELS_DIR": str(tmp_path)}).models_dir is None  # empty flag: none
    (tmp_path / "file.gguf").write_bytes(b"")
    for missing in (tmp_path / "nope", tmp_path / "file.gguf"):
        with pytest.raises(SettingsError, match=rf"^models_dir: '{missing}' from flag is not a directory$"):
            resolve({"models_dir": str(missing)})


def test_serve_flags_reach_print_config(tmp_path):
    import json

    from typer.testing import CliRunner

    from gmlx.cli.main import app

    r = CliRunner().invoke(
        app,
        ["serve", "--max-kv-size", "4096", "--models-dir", str(tmp_path), "--print-config", "--json"],
        env={k: "" for k in ("GMLX_MAX_KV_SIZE", "GMLX_MODELS_DIR", "GMLX_CONFIG")},
    )
    assert r.exit_code == 0, r.output
    shown = json.loads(r.stdout)
    assert shown["max_kv_size"] == {"value": 4096, "source": "flag"}
    assert shown["models_dir"] == {"value": str(tmp_path), "source": "flag"}
