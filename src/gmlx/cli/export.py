"""`gmlx export`: write the loaded GGUF as an mlx_lm model directory (for mlx_lm.load or mlx_lm.server)."""

from __future__ import annotations

from pathlib import Path

import typer

from gmlx.cli.common import (
    JSON_OPT,
    MODEL_ARG,
    console,
    fail,
    human_bytes,
    model_errors,
    model_path,
    print_json,
)
from gmlx.cli.run import load_progress

OUT_ARG = typer.Argument(..., help="Directory to write (created if missing).", show_default=False)


def export_command(
    model: str = MODEL_ARG,
    out_dir: Path = OUT_ARG,
    weights: str = typer.Option("float", help="float (float32, what gmlx runs on CPU) or native (MLX quantized)."),
    json_out: bool = JSON_OPT,
) -> None:
    """Export a GGUF model to an MLX model directory: config, safetensors, tokenizer and chat template."""
    if weights not in ("native", "float"):
        fail(f"--weights must be native or float, not {weights!r}", 2)
    path = model_path(model)
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
