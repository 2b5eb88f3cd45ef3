"""`gmlx top`: the Textual app driven by its pilot against real HTTP servers that answer recorded
snapshots, `--once` on a fixed snapshot, and one run against a real `gmlx serve` process."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import ServeProcess
from rich.text import Text
from textual.pilot import Pilot
from textual.widgets import DataTable, Sparkline, Static
from tiny_models import write_model
from typer.testing import CliRunner

from gmlx.cli.main import app as cli
from gmlx.tui import format as fmt
from gmlx.tui.app import HelpScreen, TopApp
from gmlx.tui.client import HISTORY_S, Poller, Status

DATA = Path(__file__).parent / "data" / "top"


class QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hangs up mid-answer (the dashboard quitting while a poll is in flight) is
        no error of the server's; anything else is printed as socketserver does."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class FakeServer:
    """A real HTTP server on loopback that answers /system, /v1/metrics and /health from a recorded
    snapshot; `use` swaps the snapshot, `stop` and `start` take it down and up on the same port."""

    def __init__(self, snapshot: str, key: str | None = None):
        self.key = key
        self.use(snapshot)
        self.port = 0
        self.start()

    def use(self, name: str) -> None:
        self.data = json.loads((DATA / f"{name}.json").read_text())

    def start(self) -> None:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?")[0]
                status, body = 200, {"system": fake.data["system"], "health": fake.data["health"]}.get(path.strip("/"))
                if path == "/health":
                    status = 200 if body.get("ready", True) else 503
                elif path == "/v1/metrics":
                    body = fake.data["metrics"]
                    if fake.key and self.headers.get("Authorization") != f"Bearer {fake.key}":
                        status, body = (
                            401,
                            {"error": {"message": "a valid API key is required", "code": "invalid_api_key"}},
                        )
                raw = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = QuietServer(("127.0.0.1", self.port), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


async def until(pilot: Pilot, predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if predicate():
            return
        await pilot.pause(0.02)
    raise AssertionError("condition not reached in time")


def shown(app: TopApp, widget: str) -> Text:
    content = app.query_one(f"#{widget}", Static).content
    assert isinstance(content, Text)
    return content


def column(app: TopApp, label: str) -> list[str]:
    table = app.query_one("#requests", DataTable)
    at = [str(c.label) for c in table.ordered_columns].index(label)
    return [str(table.get_row_at(i)[at]) for i in range(table.row_count)]


def states(app: TopApp) -> list[str]:
    return column(app, "state")


def ids(app: TopApp) -> list[str]:
    return column(app, "id")


def dimmed(line: Text) -> bool:
    """The whole line is drawn dim: what a stale section looks like."""
    return any(s.start == 0 and s.end >= len(line) and "dim" in str(s.style) for s in line.spans)


def band_style(app: TopApp) -> str:
    line = shown(app, "band")
    return next(str(span.style) for span in line.spans if "reverse" in str(span.style))


@pytest.mark.anyio
async def test_band_and_rows_follow_the_snapshot(fake: FakeServer) -> None:
    app = TopApp([fake.url], interval=0.05)
    async with app.run_test(size=(160, 45)) as pilot:
        await until(pilot, lambda: app.poller.status is Status.UP)
        assert "GREEN" in shown(app, "band").plain and "green" in band_style(app)
        assert "GPU telemetry unavailable" in shown(app, "host").plain
        assert "model tiny" in shown(app, "server").plain and "ready yes" in shown(app, "server").plain
        assert "up 1 h 02 m" in shown(app, "server").plain  # uptime_s 3725
        assert states(app) == []
        capacity = app.query_one("#capacity", DataTable)
        assert [capacity.get_row_at(i) for i in range(capacity.row_count)] == [
            ["1", "32,768"],
            ["2", "32,768"],
            ["4", "16,384"],
        ]

        fake.use("busy_yellow")
        await until(pilot, lambda: len(states(app)) == 4)
        assert "YELLOW" in shown(app, "band").plain and "yellow" in band_style(app)
        assert states(app) == ["queued", "decode", "prefill", "decode"]  # queued rows first
        row = app.query_one("#requests", DataTable).get_row_at(1)  # one model: no model column
        assert [str(c) for c in row] == [
            "a1",
            "decode",
            "1834",
            "212/4096",
            "6 %",  # 2046 of the 32,768-token window
            "-",  # this server reports no KV bytes per request
            "11.4s",
            "0.64s",
            "1.7s",
            "21.8",
            "block 1536",
            "62 %",
        ]
        assert "GPU0 NVIDIA H200" in shown(app, "host").plain
        slots = shown(app, "slots").plain
        assert "slots 3 / 4" in slots and "queue 1 / 16  ETA 5.0 s" in slots and "finished stop 3" in slots
        assert "ready no (queue)" in shown(app, "server").plain and "up 3 m 12 s" in shown(app, "server").plain
        band = shown(app, "band").plain  # used of the governor's limit, and the budget it is taken from
        assert "17.8 GiB of 21.2 GiB (84 %)" in band and "budget 23.5 GiB" in band and not dimmed(shown(app, "band"))

        fake.use("idle_green")
        await until(pilot, lambda: states(app) == [])
        assert "green" in band_style(app)


@pytest.mark.anyio
async def test_keys(fake: FakeServer) -> None:
    other = FakeServer("busy_yellow")
    app = TopApp([fake.url, other.url], interval=0.25)
    try:
        async with app.run_test(size=(160, 45)) as pilot:
            await until(pilot, lambda: all(p.status is Status.UP for p in app.pollers))
            fleet = app.query_one("#fleet", DataTable)
            assert fleet.display and fleet.row_count == 2 and states(app) == []
            await pilot.press("tab")  # the second server in detail
            assert app.selected == 1 and fleet.cursor_row == 1 and len(states(app)) == 4

            await pilot.press("s")  # by elapsed, longest first
            assert app.sort == "elapsed" and ids(app)[0] == "d4"
            await pilot.press("s", "s", "s")
            assert app.sort == "queue" and ids(app)[0] == "c3"

            await pilot.press("p")  # paused: a new snapshot is not drawn
            assert "PAUSED" in shown(app, "server").plain
            other.use("idle_green")
            await pilot.pause(0.3)
            assert len(states(app)) == 4
            await pilot.press("p")
            await until(pilot, lambda: states(app) == [])

            await pilot.press("question_mark")
            assert isinstance(app.screen, HelpScreen)
            await pilot.pause(0.3)  # polls land while the help is on top
            await pilot.press("escape")
            assert not isinstance(app.screen, HelpScreen)
            await pilot.press("tab")
            assert app.selected == 0
            await pilot.press("q")
        assert app.return_code == 0
    finally:
        other.stop()


@pytest.mark.anyio
async def test_down_and_401_are_drawn_and_recovered_from() -> None:
    server = FakeServer("busy_yellow", key="sekrit")
    app = TopApp([server.url], interval=0.5)
    try:
        async with app.run_test(size=(160, 45)) as pilot:
            await until(pilot, lambda: app.poller.status is Status.AUTH)
            line = shown(app, "server").plain
            assert "KEY NEEDED" in line and "--api-key" in line and "GMLX_API_KEY" in line
            assert "model tiny" in line  # /system is open
            assert states(app) == [] and "memory  -" in shown(app, "band").plain

            server.stop()
            await pilot.press("r")
            await until(pilot, lambda: app.poller.status is Status.DOWN)
            assert "DOWN" in shown(app, "server").plain and "ConnectError" in shown(app, "server").plain
            await until(pilot, lambda: app.poller.failures >= 3)  # backing off: 1 s, 2 s, 4 s ...
            assert app.poller.delay >= 4.0

            server.key = None
            server.start()
            await pilot.press("r")  # reconnect now, without waiting out the backoff
            await until(pilot, lambda: app.poller.status is Status.UP, timeout=1.0)
            assert "DOWN" not in shown(app, "server").plain and len(states(app)) == 4
    finally:
        server.stop()


@pytest.mark.anyio
async def test_stale_requests_are_cleared_and_marked() -> None:
    """Down, or refusing the key: the last requests are not shown as if live, the rest is dimmed and
    the screen says how old it is."""
    server = FakeServer("busy_yellow")
    app = TopApp([server.url], interval=0.5)
    try:
        async with app.run_test(size=(160, 45)) as pilot:
            await until(pilot, lambda: len(states(app)) == 4)
            requests = app.query_one("#requests", DataTable)
            assert requests.border_title == "requests (4, sorted by queue)"
            assert "last seen" not in shown(app, "server").plain

            server.stop()
            await pilot.press("r")
            await until(pilot, lambda: app.poller.status is Status.DOWN)
            assert states(app) == [] and str(requests.border_title).startswith("requests (cleared: down, last seen ")
            note = shown(app, "server").plain
            assert "last seen " in note and " ago" in note
            assert "YELLOW" in shown(app, "band").plain  # the last band is still there, dimmed
            assert all(dimmed(shown(app, name)) for name in ("band", "host", "slots", "rates"))
            assert str(app.query_one("#decode-label").content).startswith("decode tok/s  now -  peak ")
            await pilot.press("p")  # no polls while paused, and still the note counts on
            note = shown(app, "server").plain
            await until(pilot, lambda: shown(app, "server").plain != note, timeout=3)
            await pilot.press("p")

            server.key = "sekrit"
            server.start()
            await pilot.press("r")
            await until(pilot, lambda: app.poller.status is Status.AUTH)
            assert states(app) == [] and str(requests.border_title).startswith(
                "requests (cleared: key needed, last seen "
            )
            assert "last seen " in shown(app, "server").plain
    finally:
        server.stop()


@pytest.mark.anyio
async def test_poller_survives_odd_answers(fake: FakeServer) -> None:
    """Null sections, wrong types and unknown fields draw dashes; nothing raises."""
    from gmlx.tui.render import plain_text

    fake.data["metrics"] = {
        "server": {
            "concurrency": None,
            "queue": {"waiting": "x", "cap": None},
            "governor": {"band": ["?"]},
            "memory": 7,
            "capacity": None,
            "rates": {},
            "requests": [None, {"state": 3}],
        }
    }
    fake.data["system"] = ["not", "an", "object"]
    p = Poller(fake.url)
    await p.poll()
    await p.aclose()
    assert p.status is Status.UP
    text = plain_text([p])
    assert "memory  -" in text and "slots - / -" in text


@pytest.mark.anyio
async def test_a_restarted_server_shows_no_rate_from_before_it_went_down() -> None:
    """The decode rate shown as "now" is the last poll's: after a crash and a restart the old
    figure is history (the sparkline), not what the idle server does now."""
    from gmlx.tui.render import spark_label

    server = FakeServer("busy_yellow")
    totals = server.data["metrics"]["server"]["totals"]
    p = Poller(server.url, interval=0.01)  # a rate window of 0.1 s
    try:
        for _ in range(3):
            await p.poll()
            totals["generated_tokens"] += 50
            await asyncio.sleep(0.12)
        await p.poll()
        assert p.latest(p.history.decode) > 0 and "now -" not in spark_label(p, "decode")
        server.stop()
        await p.poll()
        assert p.status is Status.DOWN and p.latest(p.history.decode) is None
        totals["generated_tokens"] = 0  # a new process
        server.start()
        await p.poll()
        assert p.status is Status.UP and p.latest(p.history.decode) is None
        assert "now -" in spark_label(p, "decode") and "peak -" not in spark_label(p, "decode")
    finally:
        await p.aclose()
        server.stop()


def test_backoff_doubles_and_is_capped() -> None:
    p = Poller("http://127.0.0.1:1", interval=1.0)
    assert [p.delay for p.failures in range(7)] == [1, 2, 4, 8, 16, 30, 30]


def test_rates_line_shows_the_prompt_cache_when_it_runs() -> None:
    from gmlx.tui.render import rates_line

    p = Poller("http://127.0.0.1:1")
    p.metrics = {"rates": {}, "prompt_cache": {"enabled": True, "hit_rate": 0.75, "bytes": 12 * 2**20}}
    assert rates_line(p).plain.endswith("prompt cache 75 % hits  12.0 MiB")
    p.metrics["prompt_cache"] = {"enabled": False}
    assert "prompt cache" not in rates_line(p).plain


def test_human_numbers() -> None:
    assert (fmt.size(1.2 * 2**30), fmt.rate(41.26), fmt.duration(192), fmt.duration(0.4), fmt.tokens(32768)) == (
        "1.2 GiB",
        "41.3 tok/s",
        "3 m 12 s",
        "0.40 s",
        "32,768",
    )
    assert fmt.size(None) == fmt.rate("fast") == fmt.duration(True) == fmt.count(None) == "-"


def test_once_prints_a_fixed_snapshot(fake: FakeServer, snapshot: Any) -> None:
    fake.use("busy_yellow")
    result = CliRunner().invoke(cli, ["top", "--once", "--url", fake.url])
    assert result.exit_code == 0, result.output
    assert result.output.replace(fake.url, "http://server") == snapshot


def test_once_fails_when_a_server_is_unreachable(fake: FakeServer) -> None:
    result = CliRunner().invoke(cli, ["top", "--once", "--url", fake.url, "--url", "http://127.0.0.1:1"])
    assert result.exit_code == 1
    assert "ConnectError" in result.output and "fleet" in result.output


@pytest.fixture
def gmlx_serve(tmp_path: Path) -> Iterator[str]:
    """A real `gmlx serve` process on a tiny model with one decode slot, so a second request queues.
    Its context is long enough for requests that take a noticeable time to decode."""
    model = write_model(tmp_path / "tiny.gguf", "llama", context=2048)
    with ServeProcess(model, tmp_path / "serve.log", "--decode-batch", "1") as server:
        yield server.url


def test_real_server_rows_move_from_queued_to_decode(gmlx_serve: str) -> None:
    seen: dict[str, list[str]] = {}  # request id -> the states it was drawn in, in order
    waiting: set[str] = set()  # ids drawn queued while another row was drawn decoding

    async def watch() -> None:
        app = TopApp([gmlx_serve], interval=0.05)
        async with app.run_test(size=(160, 45)) as pilot, httpx.AsyncClient(base_url=gmlx_serve, timeout=60) as http:
            # The dashboard is live before the requests go: on a busy machine its first poll came
            # after the first request (about a second of decode) had ended, and it saw one row.
            await until(pilot, lambda: app.poller.status is Status.UP, timeout=30)
            body = {"prompt": "x", "max_tokens": 1200, "temperature": 0}
            sent = [asyncio.create_task(http.post("/v1/completions", json=body)) for _ in range(2)]
            while not all(t.done() for t in sent):
                await pilot.pause(0.02)
                drawn = dict(zip(ids(app), states(app)))
                for rid, state in drawn.items():
                    if seen.setdefault(rid, [state])[-1] != state:
                        seen[rid].append(state)
                if "decode" in drawn.values():
                    waiting.update(rid for rid, state in drawn.items() if state == "queued")
            assert all(t.result().status_code == 200 for t in sent)

    asyncio.run(watch())
    assert len(seen) == 2, seen
    # One holds the single slot while the other waits (the first may be drawn queued for a moment
    # before the engine takes it); the one that waited then decodes.
    assert len(waiting) == 1, (waiting, seen)
    [waited] = waiting
    assert "decode" in seen[waited][seen[waited].index("queued") :], seen


# Snapshot tests of the whole screen (pytest-textual-snapshot; the SVGs are in
# tests/__snapshots__/test_tui/). The fake servers' ports change every run and polling is timed, so
# before the screenshot `settle` waits for every server to answer, stops the poll loops, names each
# server with a fixed URL, puts a fixed history behind the sparklines and draws once.

SCREEN = (160, 45)
NARROW = (120, 40)  # the narrowest screen laid out without wrapping
HISTORIES = {  # (decode, prefill, queue depth) samples, oldest first
    "idle_green": ([0.0] * 40, [0.0] * 40, [0.0] * 40),
    "busy_yellow": (
        [float(20 + (i * 7) % 45) for i in range(40)],
        [float((i * 131) % 900) for i in range(40)],
        [float(min(i // 8, 3)) for i in range(40)],
    ),
}


def settle(app: TopApp, shown_as: list[tuple[str, str]]) -> Callable[[Pilot], Any]:
    """`run_before` for snap_compare: `shown_as` gives each poller's displayed URL and history."""

    async def run_before(pilot: Pilot) -> None:
        await until(pilot, lambda: all(p.status is Status.UP for p in app.pollers))
        app.dashboard.workers.cancel_group(app.dashboard, "poll")
        await pilot.pause()
        cells = app.query_one("#decode", Sparkline).size.width
        now = time.monotonic()
        for p, (url, history) in zip(app.pollers, shown_as, strict=True):
            p.url = url  # only what is drawn: the httpx client keeps its own base URL
            for series, values in zip((p.history.decode, p.history.prefill, p.history.queue), HISTORIES[history]):
                # one sample at the middle of each of the last cells, so the drawing does not depend
                # on the milliseconds between here and draw()
                at = [now - HISTORY_S + (cells - len(values) + i + 0.5) * HISTORY_S / cells for i in range(len(values))]
                series.clear()
                series.extend(zip(at, values))
                p.polled_at = at[-1]  # the latest sample is the last poll's: the figure "now"
        app.draw()
        await pilot.pause()

    return run_before


def test_screen_idle_green(fake: FakeServer, snap_compare: Any) -> None:
    app = TopApp([fake.url], interval=0.05)
    assert snap_compare(app, terminal_size=SCREEN, run_before=settle(app, [("http://gpu-a:8080", "idle_green")]))


def test_screen_busy_yellow_with_a_queue(fake: FakeServer, snap_compare: Any) -> None:
    fake.use("busy_yellow")
    app = TopApp([fake.url], interval=0.05)
    assert snap_compare(app, terminal_size=SCREEN, run_before=settle(app, [("http://gpu-b:8080", "busy_yellow")]))


def test_screen_cpu_host_with_two_models_at_120x40(snap_compare: Any) -> None:
    """The narrowest layout: CPU bars in place of GPU telemetry, a line per resident model, the
    model column, the server's latency percentiles and finish counts."""
    server = FakeServer("busy_cpu")
    try:
        app = TopApp([server.url], interval=0.05)
        assert snap_compare(app, terminal_size=NARROW, run_before=settle(app, [("http://cpu-a:8080", "busy_yellow")]))
    finally:
        server.stop()


def test_screen_fleet_of_two(fake: FakeServer, snap_compare: Any) -> None:
    """The idle server and a busy one, with the busy one in detail after `tab`."""
    other = FakeServer("busy_yellow")
    try:
        app = TopApp([fake.url, other.url], interval=0.05)
        shown_as = [("http://gpu-a:8080", "idle_green"), ("http://gpu-b:8080", "busy_yellow")]
        assert snap_compare(app, press=["tab"], terminal_size=SCREEN, run_before=settle(app, shown_as))
    finally:
        other.stop()
