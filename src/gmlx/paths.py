"""Where gmlx keeps what it builds once: the assembled default model, tokenizer caches."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`$GMLX_CACHE_DIR`, else `$XDG_CACHE_HOME/gmlx`, else `~/.cache/gmlx`."""
    if env := os.environ.get("GMLX_CACHE_DIR"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "gmlx"
