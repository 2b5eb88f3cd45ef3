"""Shell completion: `*.gguf` paths for model arguments, and the checked-in scripts in completions/.

Regenerate the scripts with `python -m gmlx.cli.completions` (tests/test_completions.py fails when
they are stale)."""

from __future__ import annotations

import glob
import os
import sys
from pathlib import Path

from gmlx import upstream

# Where each shell looks for a completion script, by name.
SCRIPTS = {"bash": "gmlx.bash", "zsh": "_gmlx", "fish": "gmlx.fish"}
ROOT = Path(__file__).resolve().parents[3] / "completions"


def complete_gguf(incomplete: str) -> list[str]:
    """Directories (to descend into) and `*.gguf` files that start with what was typed."""
    matches = sorted(glob.glob(os.path.expanduser(incomplete) + "*"))
    return [m + "/" if os.path.isdir(m) else m for m in matches if os.path.isdir(m) or m.endswith(".gguf")]


def script(shell: str) -> str:
    """The script `gmlx --show-completion` prints under `shell`: it calls back into `gmlx` with
    `_GMLX_COMPLETE=complete_<shell>`, so completions follow the typer app (typer has no public
    way to ask for another shell's script than the one it detects)."""
    text = upstream.completion_script("gmlx", "_GMLX_COMPLETE", shell) + "\n"
    if shell == "bash":  # a directory completed alone is one to type on into: no space after its slash
        text = text.replace(
            "    return 0\n",
            "    [[ ${#COMPREPLY[@]} -eq 1 && ${COMPREPLY[0]} == */ ]] && compopt -o nospace\n    return 0\n",
            1,
        )
    return text


def write(root: Path = ROOT) -> list[Path]:
    root.mkdir(exist_ok=True)
    paths = [root / name for name in SCRIPTS.values()]
    for shell, path in zip(SCRIPTS, paths):
        path.write_text(script(shell))
    return paths


if __name__ == "__main__":
    for path in write(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT):
        print(path)
