"""completions/ holds what `python -m gmlx.cli.completions` writes; model arguments complete *.gguf."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gmlx.cli.completions import ROOT, SCRIPTS, complete_gguf, write


def test_checked_in_scripts_are_current(tmp_path: Path) -> None:
    for fresh in write(tmp_path):
        current = ROOT / fresh.name
        assert current.exists() and current.read_text() == fresh.read_text(), (
            f"{current} is stale: run `python -m gmlx.cli.completions`"
        )
    assert sorted(p.name for p in ROOT.iterdir()) == sorted(SCRIPTS.values())


def test_model_arguments_complete_gguf_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "models").mkdir()
    for name in ("a.gguf", "b.txt", "models/c.gguf"):
        (tmp_path / name).touch()
    monkeypatch.chdir(tmp_path)
    assert complete_gguf("") == ["a.gguf", "models/"]
    assert complete_gguf("models/") == ["models/c.gguf"]


def _bash(line: str) -> dict[str, str]:
    return {"_GMLX_COMPLETE": "complete_bash", "COMP_WORDS": line, "COMP_CWORD": str(len(line.split()) - 1)}


def _zsh(line: str) -> dict[str, str]:
    return {"_GMLX_COMPLETE": "complete_zsh", "_TYPER_COMPLETE_ARGS": line}


def _fish(line: str) -> dict[str, str]:
    return {"_GMLX_COMPLETE": "complete_fish", "_TYPER_COMPLETE_FISH_ACTION": "get-args", "_TYPER_COMPLETE_ARGS": line}


def _candidates(shell: str, out: str) -> list[str]:
    """What the shell offers from the callback's answer: bash and fish read one per line; zsh evals
    `_arguments '*: :(("a" "b"))'`, and `_files` (every file) when gmlx offers nothing."""
    if shell == "zsh":
        assert out.startswith("_arguments "), out
        return re.findall(r'"((?:[^"]|"")*)"', out)
    return out.split()


SHELLS = {"bash": _bash, "zsh": _zsh, "fish": _fish}


@pytest.mark.parametrize("shell", SHELLS)
@pytest.mark.parametrize("command", ["inspect", "serve", "plan"])
def test_the_shell_callback_lists_gguf_files(tmp_path: Path, command: str, shell: str) -> None:
    """What each shell's script runs on <TAB>: `gmlx` itself, with the words typed so far in the environment."""
    for name in ("m.gguf", "notes.md"):
        (tmp_path / name).touch()
    env = {**os.environ, **SHELLS[shell](f"gmlx {command} {tmp_path}/")}
    out = subprocess.run([sys.executable, "-m", "gmlx"], env=env, capture_output=True, text=True, check=True).stdout
    assert _candidates(shell, out) == [f"{tmp_path}/m.gguf"]
    if shell == "fish":  # the script's --condition: exit 0 makes fish offer these instead of every file
        env["_TYPER_COMPLETE_FISH_ACTION"] = "is-args"
        assert subprocess.run([sys.executable, "-m", "gmlx"], env=env, capture_output=True).returncode == 0
