"""Settings for `gmlx serve`, resolved once: flag, then environment, then config file, then default.
A model's own settings are the server's with its preset's keys over them (`for_model`).

Each field is declared once, in `Settings`, with its default, converter, environment names (highest
priority first) and range check, so resolution, validation and `--print-config` share one table.
Every resolved value remembers its source, which `describe` shows beside it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from gmlx.capacity.bands import Thresholds
from gmlx.capacity.budget import default_prompt_cache_bytes, parse_bytes
from gmlx.capacity.kv_quant import BITS as _KV_BITS
from gmlx.capacity.kv_quant import GROUP_SIZES as _KV_GROUPS
from gmlx.capacity.kv_quant import SCHEME_CHOICES as _KV_SCHEMES
from gmlx.capacity.kv_quant import KVQuantSettings

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}
_LOG_LEVELS = ("debug", "info", "warning", "error", "critical")  # what both logging and uvicorn accept


class SettingsError(ValueError):
    """A setting that cannot be used; the message is one line naming the field, source and value."""


# Converters and checks raise ValueError with the tail of the message ("is not an integer").
Convert = Callable[[Any], Any]
Check = Callable[[Any], None]


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, str)):  # bool is an int subclass; YAML `yes` is not a count
        raise ValueError("is not an integer")
    try:
        return int(v)
    except ValueError:
        raise ValueError("is not an integer") from None


def _float(v: Any) -> float:
    try:
        if isinstance(v, bool) or not isinstance(v, (int, float, str)):
            raise ValueError
        f = float(v)
    except ValueError:
        raise ValueError("is not a number") from None
    if not math.isfinite(f):
        raise ValueError("is not a finite number")
    return f


def _bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    word = str(v).strip().lower() if isinstance(v, (str, int)) else None
    if word in _TRUE or word in _FALSE:
        return word in _TRUE
    raise ValueError("is not a boolean (use true/false, 1/0, yes/no or on/off)")


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError("is not a string")
    return v


def _lower(v: Any) -> str:
    return _str(v).strip().lower()


def _opt_str(v: Any) -> str | None:
    # An empty value (`--api-key ""`) explicitly means "none", so a flag can switch off an env key.
    return _str(v) or None


def _at_least(lo: float) -> Check:
    def check(v: Any) -> None:
        if v < lo:
            raise ValueError(f"must be >= {lo:g}")

    return check


def _above(lo: float) -> Check:
    def check(v: Any) -> None:
        if v <= lo:
            raise ValueError(f"must be > {lo:g}")

    return check


def _one_of(*choices: str) -> Check:
    def check(v: Any) -> None:
        if v not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")

    return check


def _bytes(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, str)):
        raise ValueError("is not a size (such as 64GiB or 512MiB)")
    return parse_bytes(str(v))


def _directory(v: Any) -> str | None:
    if not _str(v):  # empty means none, as for _opt_str
        return None
    path = Path(v).expanduser()
    if not path.is_dir():
        raise ValueError("is not a directory")
    return str(path)


_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600}


def _duration(v: Any) -> float:
    """Seconds, as a number or with a unit: 300, "300s", "10m", "1.5h"."""
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise ValueError("is not a duration (such as 300, 10m or 1h)")
    text = str(v).strip().lower()
    unit = text[-1] if text[-1:] in ("s", "m", "h") else ""
    try:
        seconds = _float(text[: len(text) - len(unit)]) * _DURATION_UNITS[unit]
    except ValueError:
        raise ValueError("is not a duration (such as 300, 10m or 1h)") from None
    return seconds


def _file(v: Any) -> str | None:
    if not _str(v):
        return None
    path = Path(v).expanduser()
    if not path.is_file():
        raise ValueError("is not a file")
    return str(path)


def _origins(v: Any) -> tuple[str, ...]:
    """Origins separated by commas or spaces, in one string (environment) or several (a repeated flag, a list)."""
    items = v if isinstance(v, (list, tuple)) else [v]
    return tuple(origin for item in items for origin in _str(item).replace(",", " ").split())


def _cors_origins(origins: tuple[str, ...]) -> None:
    """`*` alone, or origins as browsers send them: scheme://host[:port], no path, no trailing slash
    (`http://localhost:3000/` would never match, and the page would fail with no hint why)."""
    if "*" in origins and len(origins) > 1:
        raise ValueError("gives '*', which allows every origin, beside others: give it alone")
    for origin in origins:
        scheme, sep, rest = origin.partition("://")
        if origin != "*" and (not sep or scheme not in ("http", "https") or not rest or "/" in rest):
            raise ValueError(f"has {origin!r}, not an origin (scheme://host[:port], no path or trailing slash)")


def _int_in(*choices: int) -> Check:
    def check(v: Any) -> None:
        if v not in choices:
            raise ValueError(f"must be one of {', '.join(map(str, choices))}")

    return check


def _fraction(v: float) -> None:
    if not 0 <= v < 1:
        raise ValueError("must be at least 0 and below 1")


def _share(v: float) -> None:
    if not 0 < v <= 1:
        raise ValueError("must be above 0 and at most 1")


def _port(v: int) -> None:
    if not 0 <= v <= 65535:  # 0 asks the OS for a free port, which tests use
        raise ValueError("must be between 0 and 65535")


def _nonempty(v: str) -> None:
    if not v:
        raise ValueError("must not be empty")


@dataclass(frozen=True)
class _Spec:
    default: Any
    convert: Convert
    env: tuple[str, ...]
    check: Check | None


def _f(default: Any, convert: Convert, *env: str, check: Check | None = None) -> Any:
    return field(metadata={"spec": _Spec(default, convert, env, check)})


@dataclass(frozen=True)
class Settings:
    model: str | None = _f(None, _opt_str, "GMLX_MODEL")
    host: str = _f("127.0.0.1", _str, "GMLX_HOST", check=_nonempty)
    port: int = _f(8080, _int, "GMLX_PORT", "PORT", check=_port)
    api_key: str | None = _f(None, _opt_str, "GMLX_API_KEY")
    # Browser origins allowed to call the API (server/cors.py); empty: CORS off; ("*",): any.
    cors_origins: tuple[str, ...] = _f((), _origins, "GMLX_CORS_ORIGINS", check=_cors_origins)
    decode_batch: int = _f(8, _int, "GMLX_DECODE_BATCH", "MAX_CONCURRENCY", check=_at_least(1))
    # None until resolved; resolve_settings always stores an int (2 x decode_batch when unset).
    queue_size: int = _f(None, _int, "GMLX_QUEUE_SIZE", "QUEUE_SIZE", check=_at_least(0))
    queue_timeout: float = _f(120.0, _float, "GMLX_QUEUE_TIMEOUT", "QUEUE_TIMEOUT_S", check=_above(0))
    max_body_bytes: int = _f(4 * 1024 * 1024, _int, "GMLX_MAX_BODY_BYTES", check=_at_least(1))
    # Connections (gmlx.server.connections): how many may be open, and how long a client may take
    # to send a request's headers, then its body, and may stay idle between requests.
    max_connections: int = _f(1024, _int, "GMLX_MAX_CONNECTIONS", check=_at_least(1))
    header_timeout: float = _f(10.0, _float, "GMLX_HEADER_TIMEOUT", check=_above(0))
    body_timeout: float = _f(30.0, _float, "GMLX_BODY_TIMEOUT", check=_above(0))
    keep_alive_timeout: float = _f(5.0, _float, "GMLX_KEEP_ALIVE_TIMEOUT", check=_above(0))
    weights: str = _f("auto", _lower, "GMLX_WEIGHTS", check=_one_of("auto", "native", "float", "gguf"))
    prefill_step: int = _f(512, _int, "GMLX_PREFILL_STEP", check=_at_least(16))
    max_tokens_default: int = _f(512, _int, "GMLX_MAX_TOKENS", check=_at_least(1))
    log_input_text: bool = _f(False, _bool, "GMLX_LOG_INPUT_TEXT", "LOG_INPUT_TEXT")
    shutdown_timeout: float = _f(10.0, _float, "GMLX_SHUTDOWN_TIMEOUT", check=_at_least(0))
    log_level: str = _f("info", _lower, "GMLX_LOG_LEVEL", check=_one_of(*_LOG_LEVELS))
    # Models a request may name besides the positional one (server/residency.py): every GGUF in
    # models_dir by its file name, and the presets file's models by their ids, each with its own
    # settings; at most max_resident loaded at once (None: as many as memory holds), each unloaded
    # once idle for keep_alive seconds (None: kept until memory or max_resident needs its room).
    models_dir: str | None = _f(None, _directory, "GMLX_MODELS_DIR")
    models_preset: str | None = _f(None, _file, "GMLX_MODELS_PRESET")
    max_resident: int | None = _f(None, _int, "GMLX_MAX_RESIDENT", check=_at_least(1))
    keep_alive: float | None = _f(None, _duration, "GMLX_KEEP_ALIVE", check=_above(0))
    # The context window is the GGUF's trained one, or this when smaller (None: the GGUF's).
    max_kv_size: int | None = _f(None, _int, "GMLX_MAX_KV_SIZE", check=_at_least(1))
    # Capacity: the memory the table plans with (None: device or system memory) and what it keeps back.
    memory: int | None = _f(None, _bytes, "GMLX_MEMORY", check=_above(0))
    reserve_fraction: float = _f(0.10, _float, "GMLX_RESERVE_FRACTION", check=_fraction)
    reserve_floor: int = _f(512 * 2**20, _bytes, "GMLX_RESERVE_FLOOR")
    overcommit: bool = _f(False, _bool, "GMLX_OVERCOMMIT")
    # The prompt cache: its bound (None: a share of memory, see capacity.budget; 0: off), the
    # block its plain-attention hits are counted in, and how often a long prefill keeps a checkpoint.
    prompt_cache_bytes: int | None = _f(None, _bytes, "GMLX_PROMPT_CACHE_BYTES")
    prompt_cache_block: int = _f(16, _int, "GMLX_PROMPT_CACHE_BLOCK", check=_at_least(1))
    prompt_cache_checkpoint: int = _f(1024, _int, "GMLX_PROMPT_CACHE_CHECKPOINT", check=_at_least(16))
    # KV-cache quantization (gmlx.capacity.kv_quant): all unset means off.
    kv_bits: int | None = _f(None, _int, "GMLX_KV_BITS", check=_int_in(*_KV_BITS))
    kv_group_size: int | None = _f(None, _int, "GMLX_KV_GROUP_SIZE", check=_int_in(*_KV_GROUPS))
    kv_scheme: str | None = _f(None, _lower, "GMLX_KV_SCHEME", check=_one_of(*_KV_SCHEMES))
    kv_value_bits: int | None = _f(None, _int, "GMLX_KV_VALUE_BITS", check=_int_in(*_KV_BITS))
    kv_tail_tokens: int | None = _f(None, _int, "GMLX_KV_TAIL_TOKENS", check=_at_least(0))
    # Speculative decoding: a drafter GGUF with the served model's vocabulary, and drafts per round.
    draft: str | None = _f(None, _opt_str, "GMLX_DRAFT")
    num_draft: int = _f(3, _int, "GMLX_NUM_DRAFT", check=_at_least(1))
    # The memory governor: band thresholds as fractions of the budget (total less reserve) in use.
    governor: bool = _f(True, _bool, "GMLX_GOVERNOR")
    governor_yellow: float = _f(0.80, _float, "GMLX_GOVERNOR_YELLOW", check=_share)
    governor_orange: float = _f(0.90, _float, "GMLX_GOVERNOR_ORANGE", check=_share)
    governor_red: float = _f(0.97, _float, "GMLX_GOVERNOR_RED", check=_share)
    governor_hysteresis: float = _f(0.05, _float, "GMLX_GOVERNOR_HYSTERESIS", check=_fraction)
    governor_interval_s: float = _f(0.25, _float, "GMLX_GOVERNOR_INTERVAL_S", check=_above(0))
    sources: dict[str, str] = field(default_factory=dict)

    def kv_quant(self) -> KVQuantSettings:
        return KVQuantSettings(
            self.kv_bits, self.kv_group_size, self.kv_scheme, self.kv_value_bits, self.kv_tail_tokens
        )

    def prompt_cache_limit(self, memory: int) -> int:
        """The prompt cache's bound with `memory` to plan with: as set, or the default share."""
        return default_prompt_cache_bytes(memory) if self.prompt_cache_bytes is None else self.prompt_cache_bytes


_SPECS: dict[str, _Spec] = {f.name: f.metadata["spec"] for f in fields(Settings) if "spec" in f.metadata}


def load_table(path: Path, where: str) -> dict[str, Any]:
    """A TOML or YAML file's top-level table (by its suffix); any problem is one SettingsError line."""
    if not path.is_file():
        raise SettingsError(f"{where}: file not found")
    try:
        if path.suffix.lower() in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        else:
            import tomllib

            data = tomllib.loads(path.read_text(encoding="utf-8"))
    except Exception as e:  # any parser's error becomes one line naming the file
        raise SettingsError(f"{where}: cannot parse: {' '.join(str(e).split())}") from None
    if data is None:  # an empty YAML file
        return {}
    if not isinstance(data, dict):
        raise SettingsError(f"{where}: expected a table of settings, got {type(data).__name__}")
    return data


# Flags whose setting has another name: a file may use either.
_FLAG_NAMES = {"max_tokens": "max_tokens_default"}


def setting_key(key: object) -> str:
    """A config or preset file's key as the setting it names: dashes or underscores, the flag's
    name or the setting's."""
    name = str(key).replace("-", "_")
    return _FLAG_NAMES.get(name, name)


def _load_config(path: Path) -> dict[str, Any]:
    where = f"config {path}"
    data = load_table(path, where)
    out = {setting_key(k): v for k, v in data.items()}
    if len(out) < len(data):
        raise SettingsError(f"{where}: a key is given twice (with dashes and underscores, or as flag and setting)")
    if unknown := sorted(k for k in data if setting_key(k) not in _SPECS):
        raise SettingsError(f"{where}: unknown key(s): {', '.join(map(str, unknown))}")
    return out


def resolve_settings(
    flags: Mapping[str, Any], env: Mapping[str, str] | None = None, config: str | Path | None = None
) -> Settings:
    """Resolve every field. `flags` holds CLI values (None = not given); keys that are not fields are ignored."""
    env = os.environ if env is None else env
    config = config if config is not None else env.get("GMLX_CONFIG") or None
    cfg = _load_config(Path(config)) if config is not None else {}

    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name, spec in _SPECS.items():
        raw, source = None, "default"
        if flags.get(name) is not None:
            raw, source = flags[name], "flag"
        elif var := next((v for v in spec.env if env.get(v, "").strip()), None):  # empty env var = unset
            raw, source = env[var], f"env {var}"
        elif cfg.get(name) is not None:  # YAML `key:` (null) = unset
            raw, source = cfg[name], f"config {config}"
        values[name] = spec.default if source == "default" else _convert(name, raw, source)
        sources[name] = source
    return _combined(values, sources)


# What a preset may set for its model: what belongs to one model and its engine. The rest (the
# listener, keys, limits on connections, memory and the governor) is the server's, shared by all.
MODEL_KEYS = (
    "weights",
    "decode_batch",
    "queue_size",
    "queue_timeout",
    "prefill_step",
    "max_tokens_default",
    "max_kv_size",
    "prompt_cache_bytes",
    "prompt_cache_block",
    "prompt_cache_checkpoint",
    "kv_bits",
    "kv_group_size",
    "kv_scheme",
    "kv_value_bits",
    "kv_tail_tokens",
    "draft",
    "num_draft",
)


def for_model(s: Settings, overrides: Mapping[str, Any], source: str) -> Settings:
    """A model's settings: the server's `s` with a preset's `overrides` over them, each checked as
    a flag is; a decode batch of its own brings its own default queue size."""
    if unknown := sorted(k for k in overrides if k not in MODEL_KEYS):
        raise SettingsError(
            f"{source}: not a per-model setting: {', '.join(unknown)} (one of: {', '.join(MODEL_KEYS)})"
        )
    values = {name: getattr(s, name) for name in _SPECS}
    sources = dict(s.sources)
    for name, raw in overrides.items():
        values[name], sources[name] = _convert(name, raw, source), source
    if "decode_batch" in overrides and "queue_size" not in overrides and sources["queue_size"].startswith("default"):
        values["queue_size"] = None
    return _combined(values, sources)


def _convert(name: str, raw: Any, source: str) -> Any:
    spec = _SPECS[name]
    try:
        value = spec.convert(raw)
        if spec.check is not None and value is not None:
            spec.check(value)
    except ValueError as e:
        raise SettingsError(f"{name}: {raw!r} from {source} {e}") from None
    return value


def _combined(values: dict[str, Any], sources: dict[str, str]) -> Settings:
    """Settings from checked values, once the checks that span fields pass."""
    try:  # the governor's own checks, so a bad combination is a settings error, not a traceback at start
        Thresholds(*(values[f"governor_{b}"] for b in ("yellow", "orange", "red", "hysteresis")))
    except ValueError as e:
        raise SettingsError(str(e)) from None
    try:
        KVQuantSettings(
            values["kv_bits"],
            values["kv_group_size"],
            values["kv_scheme"],
            values["kv_value_bits"],
            values["kv_tail_tokens"],
        ).check()
    except ValueError as e:
        raise SettingsError(str(e)) from None
    if values["queue_size"] is None:
        values["queue_size"] = 2 * values["decode_batch"]
        sources["queue_size"] = "default (2 x decode_batch)"
    return Settings(**values, sources=sources)


def _show(name: str, value: Any) -> str:
    if name == "api_key":  # never in clear: --print-config output ends up in logs and bug reports
        return f"set ({len(value)} chars)" if value else "not set"
    if value is None:
        return "not set"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return ", ".join(value) or "not set"
    return str(value)


def describe(settings: Settings) -> list[tuple[str, str, str]]:
    """(name, shown value, source) for every field, in declaration order, api_key masked."""
    return [(name, _show(name, getattr(settings, name)), settings.sources.get(name, "default")) for name in _SPECS]


def to_json(settings: Settings) -> dict[str, dict[str, Any]]:
    """Every field as {"value", "source"}, the value as JSON has it (null when unset, a list for
    several), api_key masked as describe() does."""

    def plain(name: str, value: Any) -> Any:
        if name == "api_key":
            return _show(name, value)
        if isinstance(value, tuple):
            return list(value)
        return value if value is None or isinstance(value, (bool, int, float)) else str(value)

    return {
        name: {"value": plain(name, getattr(settings, name)), "source": settings.sources.get(name, "default")}
        for name in _SPECS
    }
