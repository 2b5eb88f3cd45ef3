"""`gmlx export`: write the loaded GGUF as an mlx_lm model directory (for mlx_lm.load or mlx_lm.server)."""

from __future__ import annotations

from pathlib import Path

import typer

from gmlx.cli.common import (
    JSON_OPT,
    console,
    fail,
    human_bytes,
    model_errors,
    model_path,
    print_json,
)
from gmlx.cli.completions import complete_gguf
from gmlx.cli.run import load_progress

FIRST_ARG = typer.Argument(
    ...,
    help="A .gguf file, then the directory; the directory alone exports the default model.",
    show_default=False,
    autocompletion=complete_gguf,
)
OUT_ARG = typer.Argument(None, help="Directory to write: new, or empty (created if missing).", show_default=False)


def export_command(
    model: str = FIRST_ARG,
    out_dir: Path | None = OUT_ARG,
    weights: str = typer.Option("float", help="float (float32, what gmlx runs on CPU) or native (MLX quantized)."),
    json_out: bool = JSON_OPT,
) -> None:
    """Export a GGUF model to an MLX model directory: config, safetensors, tokenizer and chat template.
    `gmlx export [MODEL] OUT_DIR`."""
    if weights not in ("native", "float"):
        fail(f"--weights must be native or float, not {weights!r}", 2)
    if out_dir is None:  # one argument: the directory, for the default model
        model, out_dir = "", Path(model)
    _check_out_dir(out_dir)  # before the model loads: a mistake here costs nothing
    path = model_path(model or None)
    from gmlx.models.export import export

    with model_errors(), load_progress() as step:
        report = export(path, out_dir, weights, progress=step)  # type: ignore[arg-type]
    if json_out:
        print_json(
            {
                "model": str(path),
                "out_dir": str(report.out_dir),
                "weights": report.mode,
                "weight_bytes": report.weight_bytes,
                "quantized_layers": report.quantized_layers,
            }
        )
        return
    console.print(
        f"wrote {report.out_dir} ({report.mode} weights, {human_bytes(report.weight_bytes)}); "
        f"load it with mlx_lm.load({str(report.out_dir)!r})",
        highlight=False,
    )


def _check_out_dir(out: Path) -> None:
    """A directory that is new, or empty: files of another model beside the export would be read as
    its own (mlx_lm.load takes every safetensors file there). Created here, so that a path it cannot
    be made at is a usage error now."""
    if out.exists() and not out.is_dir():
        fail(f"{out} exists and is not a directory", 2)
    if out.is_dir() and any(out.iterdir()):
        fail(f"{out} is not empty: export into a new or empty directory", 2)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        fail(f"cannot create {out}: {e.strerror or e}", 2)
