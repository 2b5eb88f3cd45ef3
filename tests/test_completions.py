"""completions/ holds what `python -m gmlx.cli.completions` writes; model arguments complete *.gguf."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gmlx.cli.completions import ROOT, SCRIPTS, complete_gguf, write


def test_checked_in_scripts_are_current(tmp_path: Path) -> None:
    for fresh in write(tmp_path):
        current = ROOT / fresh.name
        assert current.exists() and current.read_text() == fresh.read_text(), (
            f"{current} is stale: run `python -m gmlx.cli.completions`")
    assert sorted(p.name for p in ROOT.iterdir()) == sorted(SCRIPTS.values())


def test_model_arguments_complete_gguf_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "models").mkdir()
    for name in ("a.gguf", "b.txt", "models/c.gguf"):
        (tmp_path / name).touch()
    monkeypatch.chdir(tmp_path)
    assert complete_gguf("") == ["a.gguf", "models/"]
    assert complete_gguf("models/") == ["models/c.gguf"]


@pytest.mark.parametrize("command", ["inspect", "serve", "plan"])
def test_the_shell_callback_lists_gguf_files(tmp_path: Path, command: str) -> None:
    """What bash runs on <TAB>: `gmlx` itself, with the words typed so far in the environment."""
    for name in ("m.gguf", "notes.md"):
        (tmp_path / name).touch()
    env = {**os.environ, "_GMLX_COMPLETE": "complete_bash", "COMP_WORDS": f"gmlx {command} {tmp_path}/", "COMP_CWORD": "2"}
    out = subprocess.run([sys.executable, "-m", "gmlx"], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == [f"{tmp_path}/m.gguf"]
