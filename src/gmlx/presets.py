"""The models file of `gmlx serve --models-preset`: each model an id, a GGUF path and any of its
own settings (`settings.MODEL_KEYS`), in TOML or YAML:

    [models.qwen3-8b]
    path = "~/models/Qwen3-8B-Q4_K_M.gguf"   # relative paths start at this file's folder
    decode_batch = 4
    max-kv-size = 32768
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gmlx.settings import MODEL_KEYS, SettingsError, load_table, setting_key


@dataclass(frozen=True)
class Preset:
    id: str
    path: Path
    settings: dict[str, Any] = field(default_factory=dict)  # the keys it sets, underscored


def load_presets(path: str | Path) -> dict[str, Preset]:
    """Every preset in the file, by id; any mistake is a SettingsError of one line naming it."""
    path = Path(path)
    where = f"models preset {path}"
    data = load_table(path, where)
    if set(data) - {"models"} or not isinstance(data.get("models"), dict) or not data["models"]:
        raise SettingsError(f"{where}: expected a [models.ID] table for each model, and nothing else")
    presets = {}
    for model_id, entry in data["models"].items():
        at = f"{where}: model {model_id!r}"
        if not isinstance(entry, dict):
            raise SettingsError(f"{at}: expected a table with a path and settings")
        keys = {setting_key(k): v for k, v in entry.items()}
        if len(keys) < len(entry):
            raise SettingsError(f"{at}: a key is given twice (with dashes and underscores, or as flag and setting)")
        if not isinstance(model_id, str) or not model_id or "/" in model_id:  # one segment of /v1/models/{id}
            raise SettingsError(f"{at}: an id must be a non-empty string and hold no '/'")
        raw = keys.pop("path", None)
        if not isinstance(raw, str) or not raw:
            raise SettingsError(f"{at}: 'path' (the GGUF file) is required")
        gguf = (path.parent / Path(raw).expanduser()).resolve()
        if not gguf.is_file():
            raise SettingsError(f"{at}: path {raw!r} is not a file")
        if unknown := sorted(k for k in keys if k not in MODEL_KEYS):
            raise SettingsError(
                f"{at}: unknown key(s): {', '.join(unknown)} (per-model settings: {', '.join(MODEL_KEYS)})"
            )
        presets[model_id] = Preset(model_id, gguf, keys)
    return presets
