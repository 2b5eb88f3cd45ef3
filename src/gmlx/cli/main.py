"""The `gmlx` command: thin typer commands over the modules below."""

from __future__ import annotations

import typer

from gmlx.cli import export, inspect, plan, run, serve, top

app = typer.Typer(
    name="gmlx",
    help="Serve GGUF language models on MLX, and say how much more work the server can take.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
)
app.command("inspect")(inspect.inspect_command)
app.command("plan")(plan.plan_command)
app.command("estimate")(plan.estimate_command)
app.command("run")(run.run_command)
app.command("serve")(serve.serve_command)
app.command("top")(top.top_command)
app.command("export")(export.export_command)
