"""What every command shares: model resolution, one-line errors, exit codes, JSON output."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

import gmlx
from gmlx import platform
from gmlx.cli.completions import complete_gguf
from gmlx.default_model import DefaultModelMissing, resolve_model
from gmlx.gguf.header import GGUFError

# Exit codes a script can act on (2 is typer's own, for a usage error).
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_MODEL = 3  # missing, not GGUF, truncated, or unsupported
EXIT_NO_DEFAULT_MODEL = 4  # no model given and the demo extra is not installed

console = Console()
err_console = Console(stderr=True)

MODEL_ARG = typer.Argument(
    None,
    help="A .gguf file; the embedded default model when omitted.",
    show_default=False,
    autocompletion=complete_gguf,
)
JSON_OPT = typer.Option(False, "--json", help="Print one JSON object instead of a table.")


def fail(message: str, code: int = EXIT_FAILED) -> NoReturn:
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def warn_if_slow_blas() -> None:
    if warning := platform.blas_warning(gmlx.BLAS):
        err_console.print(f"[yellow]warning:[/] {escape(warning)}", highlight=False)


@contextmanager
def model_errors() -> Iterator[None]:
    """Turn the errors a user can cause into one line and an exit code."""
    try:
        yield
    except DefaultModelMissing as e:
        fail(str(e), EXIT_NO_DEFAULT_MODEL)
    except (GGUFError, FileNotFoundError, IsADirectoryError, PermissionError) as e:
        fail(str(e), EXIT_BAD_MODEL)


def model_path(model: str | None) -> Path:
    with model_errors():
        return resolve_model(model)


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
