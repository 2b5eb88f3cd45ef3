"""The `gmlx top` screen: one server in detail, and in fleet mode a line per server above it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.screen import ModalScreen
from textual.widgets import DataTable, Footer, Label, Sparkline, Static

from gmlx.tui import render
from gmlx.tui.client import HISTORY_S, RATE_WINDOW_S, Poller, window
from gmlx.tui.fleet import Target, targets

HELP = """\
[b]gmlx top[/b]: polls /v1/metrics, /system and /health?ready=1 of each server.

  [b]q[/b]    quit
  [b]p[/b]    pause or resume polling
  [b]s[/b]    cycle the sort of the request table (queue, elapsed, tok/s, id)
  [b]r[/b]    reconnect now (skips the backoff after a failure)
  [b]w[/b]    save an SVG screenshot (into --screenshot-dir, else the working directory)
  [b]tab[/b]  next server, when several --url are given
  [b]?[/b]    this help

The band is the memory governor's: [green]green[/], [yellow]yellow[/] (one admission at a time),
[dark_orange]orange[/] (admission held), [red]red[/] (streams stopped). The bar shows active memory (█),
cache (▓) and the rest the governor counts (▒) against its limit, with a tick where each band starts.
Token rates are all streams together, the growth of the server's totals over 10 s; the sparklines
span the last 5 minutes. Latency percentiles, finish reasons and rejections are the server's own.
A server that needs a key: --url URL#KEY, a fleet file of such lines (@FILE), or --api-key KEY
(GMLX_API_KEY) for every server given without one. While a server is down or refuses the key its
request rows are cleared, the rest is dimmed and the top line says when it last answered.

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
    Static { height: auto; text-wrap: nowrap; text-overflow: ellipsis; }
    #fleet { height: auto; max-height: 10; margin-bottom: 1; }
    #charts { height: 10; margin-top: 1; }
    #sparks { width: 1fr; }
    #sparks Label { color: $text-muted; }
    #axis { color: $text-muted; }
    Sparkline { height: 2; margin-bottom: 0; }
    #latency { width: 44; margin-left: 2; }
    #capacity { width: 24; height: 10; margin-left: 2; }
    #requests { height: 1fr; margin-top: 1; border: round $primary-darken-2; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "quit", "quit"),
        Binding("p", "pause", "pause"),
        Binding("s", "sort", "sort"),
        Binding("r", "reconnect", "reconnect"),
        Binding("w", "screenshot", "screenshot"),
        Binding("tab", "next_server", "next server", priority=True),
        Binding("question_mark", "help", "help", key_display="?"),
    ]
    SPARKS = ("decode", "prefill", "queue")
    LINES = ("server", "models", "band", "host", "slots", "rates")

    def __init__(
        self,
        urls: Sequence[str | Target],
        api_key: str | None = None,
        interval: float = 1.0,
        screenshot_dir: Path | None = None,
    ):
        """`urls`: as `gmlx top --url` takes them (URL, URL#KEY, @FILE; gmlx.tui.fleet)."""
        super().__init__()
        self.pollers = [Poller(t.url, t.api_key, interval) for t in targets(urls, api_key)]
        self.selected = 0
        self.paused = False
        self.sort = render.SORTS[0]
        self.screenshot_dir = screenshot_dir or Path.cwd()
        self._wake = [asyncio.Event() for _ in self.pollers]
        self._drawn: dict[str, object] = {}  # what each widget shows now, to skip redrawing the same

    @property
    def poller(self) -> Poller:
        return self.pollers[self.selected]

    def compose(self) -> ComposeResult:
        fleet: DataTable[object] = DataTable(id="fleet", cursor_type="row")
        fleet.display = len(self.pollers) > 1
        yield fleet
        for name in self.LINES:
            yield Static(id=name)
        with Horizontal(id="charts"):
            with Vertical(id="sparks"):
                for name in self.SPARKS:
                    yield Label(id=f"{name}-label")
                    yield Sparkline([], id=name)
                yield Static(id="axis")
            yield Static(id="latency")
            yield DataTable(id="capacity", show_cursor=False)
        yield DataTable(id="requests", show_cursor=False)
        yield Footer()

    def on_mount(self) -> None:
        self.dashboard = self.screen  # draw() queries it, not whichever screen (help) is on top
        self.dashboard.query_one("#fleet", DataTable).add_columns(*render.FLEET_COLUMNS)
        self.dashboard.query_one("#capacity", DataTable).add_columns("width", "max context")
        self.draw()
        for i in range(len(self.pollers)):
            self.dashboard.run_worker(self._poll_loop(i), group="poll")  # stops with the screen
        self.set_interval(1.0, self._age)

    def on_resize(self) -> None:
        with contextlib.suppress(NoMatches, AttributeError):  # before on_mount there is nothing to redraw
            self.draw(self.selected)

    def _age(self) -> None:
        """Between the backed-off retries of a server that is down, keep its "last seen" counting and
        its sparklines sliding on."""
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
        """Redraw the fleet table, and the detail when `changed` is the selected server (or None).
        A widget whose content is what it already shows is left alone: each update costs Textual a
        layout pass, most of what `gmlx top` spends."""
        q = self.dashboard.query_one
        fleet = q("#fleet", DataTable)
        if fleet.display and self._changed("fleet", ([render.fleet_row(p) for p in self.pollers], self.selected)):
            fleet.clear()
            for p in self.pollers:
                fleet.add_row(*render.fleet_row(p))
            fleet.move_cursor(row=self.selected)
        if changed not in (None, self.selected):
            return
        p, width = self.poller, max(render.WIDTH, self.size.width)
        models = render.models_line(p)
        q("#models", Static).display = models is not None
        for name, content in (
            ("server", render.server_line(p, self.paused)),
            ("models", models or ""),
            ("band", render.band_line(p, width)),
            ("host", render.host_line(p, width)),
            ("slots", render.slots_line(p)),
            ("rates", render.rates_line(p)),
        ):
            if self._changed(name, content):
                q(f"#{name}", Static).update(content)
        now = time.monotonic()
        cells = q("#decode", Sparkline).size.width or 60
        for name in self.SPARKS:
            q(f"#{name}", Sparkline).data = window(getattr(p.history, name), now, cells)
            if self._changed(f"{name}-label", label := render.spark_label(p, name)):
                q(f"#{name}-label", Label).update(label)
        if self._changed("axis", cells):
            q("#axis", Static).update(_axis(cells))
        if self._changed("latency", (p.metrics.get("latency"), render.stale(p))):
            q("#latency", Static).update(render.latency_table(p))
        if self._changed("capacity", rows := render.capacity_rows(p)):
            capacity = q("#capacity", DataTable)
            capacity.clear()
            capacity.add_rows(rows)
        requests = q("#requests", DataTable)
        columns = render.request_columns(p)
        if self._changed("columns", columns):
            requests.clear(columns=True)
            requests.add_columns(*columns)
        if self._changed("requests", (columns, request_rows := render.request_rows(p, self.sort))):
            requests.clear()
            for _, cells_ in request_rows:
                requests.add_row(*cells_)
        requests.border_title = render.requests_title(p, self.sort, requests.row_count)

    def _changed(self, key: str, value: object) -> bool:
        """Whether `value` differs from what was drawn under `key` last, remembering it."""
        if key in self._drawn and self._drawn[key] == value:
            return False
        self._drawn[key] = value
        return True

    def deliver_screenshot(
        self, filename: str | None = None, path: str | None = None, time_format: str | None = None
    ) -> str | None:
        """Into `path` or --screenshot-dir (made if missing), for the `w` key and the palette alike;
        Textual's own default, ~/Downloads, may not exist."""
        folder = Path(path) if path else self.screenshot_dir
        try:
            folder.mkdir(parents=True, exist_ok=True)
            saved = self.save_screenshot(filename, str(folder), time_format)
        except OSError as e:
            self.notify(f"screenshot not saved: {e.strerror or e}", severity="error")
            return None
        self.notify(f"screenshot saved: {saved}")
        return saved

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

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """`tab` only where there is a next server (the footer leaves it out otherwise)."""
        return action != "next_server" or len(self.pollers) > 1

    def action_next_server(self) -> None:
        self.selected = (self.selected + 1) % len(self.pollers)
        self.draw()

    def action_help(self) -> None:
        self.push_screen(HelpScreen())


def _axis(cells: int) -> Text:
    """The sparklines' time axis (HISTORY_S back at the left edge, now at the right) and what the
    rates are."""
    left, right = f"└ {HISTORY_S / 60:g} min ago", "now ┘"
    mid = f"all streams, {RATE_WINDOW_S:g} s means"
    gap = cells - len(left) - len(mid) - len(right)
    if gap < 4:
        mid, gap = "", max(1, cells - len(left) - len(right))
    return Text(left + " " * (gap // 2) + mid + " " * (gap - gap // 2) + right)
