"""The `gmlx` command: thin typer commands over the modules below."""

from __future__ import annotations

import typer

import gmlx
from gmlx.cli import export, inspect, plan, run, serve, top

app = typer.Typer(
    name="gmlx",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
)


def _version(asked: bool) -> None:
    if asked:
        typer.echo(f"gmlx {gmlx.__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Serve GGUF language models on MLX, and say how much more work the server can take."""


app.command("inspect")(inspect.inspect_command)
app.command("plan")(plan.plan_command)
app.command("estimate")(plan.estimate_command)
app.command("run")(run.run_command)
app.command("serve")(serve.serve_command)
app.command("top")(top.top_command)
app.command("export")(export.export_command)
