"""`gmlx top`: the terminal dashboard over one server or a fleet. It knows servers only through HTTP."""

from __future__ import annotations

import asyncio
from pathlib import Path

import typer
from rich.markup import escape

from gmlx.cli.common import EXIT_FAILED, err_console
from gmlx.tui.client import Poller, Status
from gmlx.tui.fleet import Target, targets
from gmlx.tui.render import plain_text

DEFAULT_URL = "http://127.0.0.1:8080"


def top_command(
    url: list[str] = typer.Option(
        [DEFAULT_URL],
        "--url",  # noqa: B008
        help="A server to watch: URL, URL#KEY, or @FILE (a list of those, or an HAProxy "
        "configuration); repeat for a fleet.",
    ),
    api_key: str = typer.Option(
        None,
        "--api-key",
        envvar="GMLX_API_KEY",
        help="The API key of every server given without one (URL#KEY gives a server its own).",
        show_default=False,
    ),
    interval: float = typer.Option(1.0, "--interval", min=0.05, help="Seconds between polls."),
    screenshot_dir: Path = typer.Option(  # noqa: B008
        None,
        "--screenshot-dir",
        file_okay=False,
        help="Where the w key saves SVG screenshots (made if missing); the working directory if not given.",
        show_default=False,
    ),
    once: bool = typer.Option(
        False,
        "--once",
        help="Print one snapshot as plain text and exit; exit 1 when a server is unreachable or refuses the key.",
    ),
) -> None:
    """Watch servers: governor band, memory, queue, rates, capacity and every request in flight."""
    try:
        fleet = targets(url, api_key)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--url") from None
    if not once:
        from gmlx.tui.app import TopApp  # Textual loads only for the dashboard

        TopApp(fleet, interval=interval, screenshot_dir=screenshot_dir).run()
        return
    pollers = asyncio.run(_poll_once(fleet, interval))
    typer.echo(plain_text(pollers), nl=False)
    failed = [p for p in pollers if p.status is not Status.UP]
    for p in failed:
        err_console.print(
            f"[bold red]error:[/] {escape(p.url)}: {escape(p.error or '')}", highlight=False, soft_wrap=True
        )
    if failed:
        raise typer.Exit(EXIT_FAILED)


async def _poll_once(fleet: list[Target], interval: float) -> list[Poller]:
    pollers = [Poller(t.url, t.api_key, interval) for t in fleet]
    await asyncio.gather(*(p.poll() for p in pollers))
    for p in pollers:
        await p.aclose()
    return pollers
