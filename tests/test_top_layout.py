"""`gmlx top`, second pass (issue 24): one figure per rate from one source, nothing live-looking from a
server that is down, a layout that fits 120x40, a screenshot key, CPU use per core on a CPU host,
the server's latency percentiles and finish counts, sparklines over a fixed time axis."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console
from rich.text import Text
from test_tui import FakeServer, column, shown, until
from textual.widgets import DataTable, Sparkline, Static

from gmlx.tui import render
from gmlx.tui.app import TopApp
from gmlx.tui.client import HISTORY_S, RATE_WINDOW_S, History, Poller, Status, window
from gmlx.tui.render import plain_text


def polled(name: str) -> Poller:
    """A Poller that has the fixture's answers, as after one poll."""
    data = json.loads((Path(__file__).parent / "data" / "top" / f"{name}.json").read_text())
    p = Poller("http://server")
    p.system, p.ready, p.metrics = data["system"], data["health"], data["metrics"]["server"]
    p.status = Status.UP
    return p


def test_prefill_in_chunks_is_not_drawn_as_bursts() -> None:
    """The engine adds a prefill chunk's tokens when the chunk ends: 1,000 tokens every 10 s is
    100 tok/s, not a 1,000 tok/s peak between two polls a second apart."""
    p = Poller("http://server")
    p.status = Status.UP
    for t in range(41):
        p.metrics = {"totals": {"prompt_tokens": 1000 * (t // 10), "generated_tokens": 20 * t}}
        p._sample(float(t))
    late = [v for t, v in p.history.prefill if t >= 20]
    assert max(late) <= 200 and 80 <= sum(late) / len(late) <= 120
    assert all(v == pytest.approx(20) for t, v in p.history.decode)
    assert min(t for t, _ in p.history.decode) == RATE_WINDOW_S  # no rate from a shorter span


def test_one_decode_figure_everywhere() -> None:
    """The detail, the fleet row and the sparkline show the one aggregate rate from the totals; the
    server's per-request means are named as such, and nothing shows a second "decode now"."""
    p = polled("busy_yellow")
    for t in range(11):
        p.metrics["totals"]["generated_tokens"] = 900 + 30 * t
        p.polled_at = float(t)  # as poll() does
        p._sample(p.polled_at)
    text = plain_text([p, polled("idle_green")])
    assert "41.3" not in text  # rates.decode_tok_s: a window the client does not know
    assert "per request, recent: prefill 612.0 tok/s  decode 21.8 tok/s  lifetime 22.4 tok/s" in text
    assert str(render.fleet_row(p)[6]) == "30.0" and render.spark_label(p, "decode").startswith(
        "decode tok/s  now 30.0"
    )


def test_eta_only_while_something_waits() -> None:
    p = polled("idle_green")
    p.metrics["queue"]["eta_s"] = 5
    assert "ETA" not in render.slots_line(p).plain
    p.metrics["queue"]["waiting"] = 2
    assert "ETA 5.0 s" in render.slots_line(p).plain


@pytest.mark.anyio
async def test_a_down_server_shows_nothing_as_live() -> None:
    server, other = FakeServer("idle_green"), FakeServer("idle_green")
    app = TopApp([server.url, other.url], interval=0.05)
    try:
        async with app.run_test(size=(160, 45)) as pilot:
            await until(pilot, lambda: len(app.poller.history.decode) > 2)
            assert "ready yes" in shown(app, "server").plain
            server.stop()
            await pilot.press("r")
            await until(pilot, lambda: app.poller.status is Status.DOWN)
            line = shown(app, "server").plain
            assert "ready yes" not in line and "ready -" in line
            band = shown(app, "band")
            assert "GREEN" in band.plain and not any("green" in str(s.style) for s in band.spans)
            fleet = app.query_one("#fleet", DataTable)
            assert [str(c) for c in fleet.get_row_at(0)][6] == "-" and [str(c) for c in fleet.get_row_at(1)][6] != "-"
            assert str(app.query_one("#decode-label").content).startswith("decode tok/s  now -")
    finally:
        server.stop()
        other.stop()


@pytest.mark.anyio
async def test_servers_with_different_keys_are_watched_together() -> None:
    a, b = FakeServer("idle_green", key="alpha"), FakeServer("busy_yellow", key="beta")
    app = TopApp([f"{a.url}#alpha", f"{b.url}#beta"], api_key="neither", interval=0.05)
    try:
        async with app.run_test(size=(160, 45)) as pilot:
            await until(pilot, lambda: all(p.status is Status.UP for p in app.pollers))
    finally:
        a.stop()
        b.stop()


def _lines(app: TopApp) -> list[str]:
    out = []
    for static in app.query(Static):
        if static.display and isinstance(static.content, Text):
            out += static.content.plain.split("\n")
    return out


@pytest.mark.parametrize("size", [(120, 40), (160, 45)])
@pytest.mark.anyio
async def test_the_layout_fits_without_wrapping(size: tuple[int, int]) -> None:
    """Every line fits the width, down with its "last seen" note too; the request table needs no
    horizontal scroll; the memory bar uses the width there is."""
    server = FakeServer("busy_cpu")
    app = TopApp([server.url], interval=0.05)
    try:
        async with app.run_test(size=size) as pilot:
            await until(pilot, lambda: len(column(app, "id")) == 4)
            table = app.query_one("#requests", DataTable)
            assert table.virtual_size.width <= table.scrollable_content_region.width
            assert all(len(line) <= size[0] for line in _lines(app)), [ln for ln in _lines(app) if len(ln) > size[0]]
            bar = next(line for line in _lines(app) if line.startswith("memory"))
            assert len(bar) >= size[0] - 12  # the bar takes the room above 120 columns
            server.stop()
            await pilot.press("r")
            await until(pilot, lambda: app.poller.status is Status.DOWN)
            await until(pilot, lambda: "last seen" in shown(app, "server").plain)
            assert all(len(line) <= size[0] for line in _lines(app))
    finally:
        server.stop()


def test_a_few_per_cent_of_memory_still_shows() -> None:
    """3 % of the limit: more than a cell of the bar, to an eighth of one."""
    p = polled("busy_cpu")
    bar = render.band_line(p, 120).plain.split("[")[1].split("]")[0]
    solid = bar.rstrip("·┃").replace("▓", "")
    assert len(solid) >= 2 and solid[-1] in render.EIGHTHS + "█"


def test_request_rows_short_ids_model_column_context_and_kv() -> None:
    many = polled("busy_cpu")
    assert "model" in render.request_columns(many)
    rows = dict(render.request_rows(many))
    cells = dict(zip(render.request_columns(many), rows["chatcmpl-3f9a1c27b0d84e55a1c2d3e4"], strict=True))
    assert cells["id"] == "3f9a1c27b0d…" and cells["model"] == "qwen3-4b-q4"
    assert cells["ctx"] == "6 %" and cells["KV"] == "288M"
    gemma = dict(zip(render.request_columns(many), rows["cmpl-c5d1e9f0a7b64c2d8e9f0a1b"], strict=True))
    assert gemma["ctx"] == "22 %"  # its own model's 8,192-token window
    one = polled("busy_yellow")
    assert "model" not in render.request_columns(one)


def test_a_line_per_resident_model_when_there_are_several() -> None:
    lines = render.models_line(polled("busy_cpu")).plain.split("\n")
    assert len(lines) == 2 and lines[1].startswith("gemma-3-1b kind chat  status ready  slots 1 / 2")
    assert render.models_line(polled("busy_yellow")) is None


def test_cpu_host_shows_cores_and_rss_gpu_host_nvml() -> None:
    cpu = render.host_line(polled("busy_cpu"), 120).plain.split("\n")
    assert cpu[0].startswith("CPU 51 % of 8 cores   server 402 %")
    assert len(cpu) == 3 and cpu[1].startswith("0 [████████████████  97%] 1 [██") and "7 [" in cpu[2]
    assert "RSS 4.7 GiB" in render.band_line(polled("busy_cpu")).plain
    gpu = render.host_line(polled("busy_yellow")).plain
    assert gpu.startswith("GPU0 NVIDIA H200  util 87 %") and "CPU" not in gpu
    many = polled("busy_cpu")
    many.system["host"]["cpu_pct_per_core"] = [50.0] * 96
    compact = render.host_line(many, 120).plain.split("\n")
    assert len(compact) == 2 and set(compact[1]) == {"▅"}  # a glyph per core past four rows of bars


def test_latency_and_finish_counts_are_the_servers() -> None:
    console = Console(width=60, color_system=None)
    with console.capture() as cap:
        console.print(render.latency_table(polled("busy_cpu")))
    table = cap.get()
    assert "latency, last 5 m 00 s" in table
    assert [ln.split() for ln in table.splitlines() if ln.startswith("TTFT") or ln.startswith("inter")] == [
        ["TTFT", "51", "412", "ms", "1.7", "s", "2.9", "s"],
        ["inter-token", "4210", "23", "ms", "41", "ms", "62", "ms"],
    ]
    with console.capture() as cap:
        console.print(render.latency_table(polled("busy_yellow")))  # no latency section yet: dashes
    assert cap.get().splitlines()[2].split() == ["TTFT", "-", "-", "-", "-"]
    slots = render.slots_line(polled("busy_cpu"))
    assert "finished stop 41  length 7  cancelled 2  error 1   rejected queue_full 2  queue_timeout 1" in slots.plain
    error = slots.plain.index("error 1") + len("error ")
    assert any("red" in str(s.style) and s.start <= error < s.end for s in slots.spans)


def test_sparklines_span_a_fixed_time() -> None:
    """Ten seconds of history is the right edge of a five-minute axis, not the whole width."""
    h = History()
    for t in range(10):
        h.add(h.decode, 1000.0 + t, 5.0)
    cells = window(h.decode, 1009.0, 60)
    assert len(cells) == 60 and cells[-1] == 5.0 and not any(cells[:-2])
    h.add(h.decode, 1000.0 + HISTORY_S + 20, 1.0)
    assert min(t for t, _ in h.decode) >= 1020.0  # older than the window: dropped


@pytest.mark.anyio
async def test_sparkline_data_is_one_value_per_cell(fake: FakeServer) -> None:
    app = TopApp([fake.url], interval=0.05)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: len(app.poller.history.decode) > 2)
        app.draw()
        spark = app.query_one("#decode", Sparkline)
        assert len(spark.data) == spark.size.width
        assert "5 min ago" in str(app.query_one("#axis", Static).content)


@pytest.mark.anyio
async def test_the_w_key_saves_a_screenshot(fake: FakeServer, tmp_path: Path) -> None:
    shots = tmp_path / "not" / "there"
    app = TopApp([fake.url], interval=0.05, screenshot_dir=shots)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.poller.status is Status.UP)
        await pilot.press("w")
        await until(pilot, lambda: len(list(shots.glob("*.svg"))) == 1)
        app.deliver_screenshot()  # what the command palette's "Screenshot" calls
        await until(pilot, lambda: len(list(shots.glob("*.svg"))) == 2)
    assert next(shots.glob("*.svg")).read_text().startswith("<svg")


@pytest.mark.anyio
async def test_tab_is_offered_only_with_a_fleet(fake: FakeServer) -> None:
    for urls, offered in (([fake.url], False), ([fake.url, fake.url], True)):
        app = TopApp(urls, interval=0.05)
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.pause()
            keys = [str(k.description) for k in app.query("FooterKey")]
            assert ("next server" in keys) is offered and "screenshot" in keys
