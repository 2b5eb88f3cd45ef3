"""The `gmlx top` screen: one server in detail, and in fleet mode a line per server above it."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.screen import ModalScreen
from textual.widgets import DataTable, Footer, Label, Sparkline, Static

from gmlx.tui import format as fmt
from gmlx.tui import render
from gmlx.tui.client import Poller
from gmlx.tui.fleet import Target, targets

HELP = """\
[b]gmlx top[/b]: polls /v1/metrics, /system and /health?ready=1 of each server.

  [b]q[/b]    quit
  [b]p[/b]    pause or resume polling
  [b]s[/b]    cycle the sort of the request table (queue, elapsed, tok/s, id)
  [b]r[/b]    reconnect now (skips the backoff after a failure)
  [b]tab[/b]  next server, when several --url are given (URL, URL#KEY, or @FILE: a list or an HAProxy config)
  [b]?[/b]    this help

The band is the memory governor's: [green]green[/], [yellow]yellow[/] (one admission at a time),
[dark_orange]orange[/] (admission held), [red]red[/] (streams stopped). The bar shows active memory (█),
cache (▓) and the rest the governor counts (▒) against its limit, with a tick where each band starts.
A server that needs a key: pass --api-key KEY or set GMLX_API_KEY. While a server is down or
refuses the key its request rows are cleared, the rest is dimmed and the top line says when it
last answered.

escape closes this help."""


class HelpScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,question_mark,q", "dismiss", "close")]
    DEFAULT_CSS = (
        "HelpScreen { align: center middle; } "
        "HelpScreen > Static { width: auto; padding: 1 2; border: round $accent; background: $panel; }"
    )

    def compose(self) -> ComposeResult:
        yield Static(HELP)


class TopApp(App[None]):
    TITLE = "gmlx top"
    CSS = """
    Static { height: auto; }
    #fleet { height: auto; max-height: 10; margin-bottom: 1; }
    #charts { height: 9; margin-top: 1; }
    #sparks { width: 1fr; }
    #sparks Label { color: $text-muted; }
    Sparkline { height: 2; margin-bottom: 0; }
    #capacity { width: 30; height: 9; margin-left: 2; }
    #requests { height: 1fr; margin-top: 1; border: round $primary-darken-2; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "quit", "quit"),
        Binding("p", "pause", "pause"),
        Binding("s", "sort", "sort"),
        Binding("r", "reconnect", "reconnect"),
        Binding("tab", "next_server", "next server", priority=True),
        Binding("question_mark", "help", "help", key_display="?"),
    ]

    @staticmethod
    def SPARKS(p: Poller) -> tuple[tuple[str, str, deque[float], Callable[[Any], str]], ...]:
        h = p.history
        return (
            ("decode", "decode", h.decode, fmt.rate),
            ("prefill", "prefill", h.prefill, fmt.rate),
            ("queue", "queue depth", h.queue, fmt.count),
        )

    def __init__(self, urls: Sequence[str | Target], api_key: str | None = None, interval: float = 1.0):
        """`urls`: as `gmlx top --url` takes them (URL, URL#KEY, @FILE; gmlx.tui.fleet)."""
        super().__init__()
        self.pollers = [Poller(t.url, t.api_key, interval) for t in targets(urls, api_key)]
        self.selected = 0
        self.paused = False
        self.sort = render.SORTS[0]
        self._wake = [asyncio.Event() for _ in self.pollers]

    @property
    def poller(self) -> Poller:
        return self.pollers[self.selected]

    def compose(self) -> ComposeResult:
        fleet: DataTable[object] = DataTable(id="fleet", cursor_type="row")
        fleet.display = len(self.pollers) > 1
        yield fleet
        for name in ("server", "band", "gpu", "slots", "rates"):
            yield Static(id=name)
        with Horizontal(id="charts"):
            with Vertical(id="sparks"):
                for name, *_ in self.SPARKS(self.poller):
                    yield Label(id=f"{name}-label")
                    yield Sparkline([], id=name)
            yield DataTable(id="capacity", show_cursor=False)
        yield DataTable(id="requests", show_cursor=False)
        yield Footer()

    def on_mount(self) -> None:
        self.dashboard = self.screen  # draw() queries it, not whichever screen (help) is on top
        self.dashboard.query_one("#fleet", DataTable).add_columns(*render.FLEET_COLUMNS)
        self.dashboard.query_one("#capacity", DataTable).add_columns("width", "max context")
        self.dashboard.query_one("#requests", DataTable).add_columns(*render.REQUEST_COLUMNS)
        self.draw()
        for i in range(len(self.pollers)):
            self.dashboard.run_worker(self._poll_loop(i), group="poll")  # stops with the screen
        self.set_interval(1.0, self._age)

    def _age(self) -> None:
        """Between the backed-off retries of a server that is down, keep its "last seen" counting."""
        if render.stale(self.poller):
            with contextlib.suppress(NoMatches):
                self.draw(self.selected)

    async def on_unmount(self) -> None:
        for p in self.pollers:
            await p.aclose()

    async def _poll_loop(self, i: int) -> None:
        p, wake = self.pollers[i], self._wake[i]
        while True:
            if not self.paused:
                await p.poll()
                try:
                    self.draw(i)
                except NoMatches:  # the app closed while this poll was in flight: its widgets are gone
                    return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), p.delay)
            wake.clear()

    def draw(self, changed: int | None = None) -> None:
        """Redraw the fleet table, and the detail when `changed` is the selected server (or None)."""
        q = self.dashboard.query_one
        fleet = q("#fleet", DataTable)
        if fleet.display:
            fleet.clear()
            for p in self.pollers:
                fleet.add_row(*render.fleet_row(p))
            fleet.move_cursor(row=self.selected)
        if changed not in (None, self.selected):
            return
        p = self.poller
        q("#server", Static).update(render.server_line(p, self.paused))
        q("#band", Static).update(render.band_line(p))
        q("#gpu", Static).update(render.gpu_line(p))
        q("#slots", Static).update(render.slots_line(p))
        q("#rates", Static).update(render.rates_line(p))
        for name, label, data, show in self.SPARKS(p):
            q(f"#{name}", Sparkline).data = list(data)
            now = data[-1] if data and not render.stale(p) else None
            q(f"#{name}-label", Label).update(f"{label}  now {show(now)}  peak {show(max(data) if data else None)}")
        capacity = q("#capacity", DataTable)
        capacity.clear()
        capacity.add_rows(render.capacity_rows(p))
        requests = q("#requests", DataTable)
        requests.clear()
        for _, cells in render.request_rows(p, self.sort):
            requests.add_row(*cells)
        requests.border_title = render.requests_title(p, self.sort, requests.row_count)

    def action_pause(self) -> None:
        self.paused = not self.paused
        if not self.paused:
            self.action_reconnect()
        self.draw()

    def action_sort(self) -> None:
        self.sort = render.SORTS[(render.SORTS.index(self.sort) + 1) % len(render.SORTS)]
        self.draw()

    def action_reconnect(self) -> None:
        for wake in self._wake:
            wake.set()

    def action_next_server(self) -> None:
        self.selected = (self.selected + 1) % len(self.pollers)
        self.draw()

    def action_help(self) -> None:
        self.push_screen(HelpScreen())
