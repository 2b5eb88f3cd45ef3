"""What the dashboard draws, as Rich renderables built from one `Poller`: shared by the Textual app
and by `gmlx top --once`, so the two always agree."""

from __future__ import annotations

import io
import time
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from gmlx.tui import format as f
from gmlx.tui.client import Poller, Status

BAND_STYLE = {"green": "bold green", "yellow": "bold yellow", "orange": "bold dark_orange", "red": "bold red"}
STATE_STYLE = {"queued": "yellow", "prefill": "cyan", "decode": "green"}
SORTS = ("queue", "elapsed", "tok/s", "id")
REQUEST_COLUMNS = ("id", "model", "state", "prompt", "gen/max", "elapsed", "queued", "TTFT", "tok/s", "cache", "spec")
BAR_WIDTH = 40


def section(p: Poller, name: str) -> dict[str, Any]:
    return f.dict_of(p.metrics.get(name))


def band_of(p: Poller) -> str | None:
    b = section(p, "governor").get("band")
    return b if isinstance(b, str) else None


def stale(p: Poller) -> bool:
    """A server that is down or refuses the key: what is still shown of it is from an earlier poll."""
    return p.status in (Status.DOWN, Status.AUTH)


def last_seen(p: Poller) -> str | None:
    """How long ago the last metrics came, while they are stale; None when fresh or there were none."""
    if not stale(p) or p.polled_at is None:
        return None
    return f"last seen {f.duration(time.monotonic() - p.polled_at)} ago"


def _aged(p: Poller, line: Text) -> Text:
    if stale(p):
        line.stylize("dim")
    return line


def server_line(p: Poller, paused: bool = False, live: bool = True) -> Text:
    sys = p.system
    line = Text.assemble((p.url, "bold"), "  ", _status(p))
    seen = last_seen(p)
    if seen:
        line.append(f"  {seen}", "bold yellow")
    if paused:
        line.append("  PAUSED", "bold magenta")
    facts = Text()
    for label, value in (
        ("model", sys.get("model")),
        ("version", sys.get("version")),
        ("state", sys.get("state")),
        ("up", f.duration(sys.get("uptime_s"))),
        ("device", sys.get("device")),
        ("compute", sys.get("compute_type")),
    ):
        facts.append(f"  {label} ", "dim").append(f.text(value))
    ready = p.ready.get("ready")
    if ready is not None:
        facts.append("  ready ", "dim").append("yes" if ready else f"no ({f.text(p.ready.get('reason'))})")
    if p.status is Status.DOWN:  # /system and /health are not fetched either: these are their last answers
        facts.stylize("dim")
    line.append_text(facts)
    if p.error:
        retry = f" (retry in {f.duration(p.delay)})" if live and p.status is Status.DOWN else ""
        line.append(f"\n{p.error}{retry}", "red")
    return line


def _status(p: Poller) -> Text:
    style = {Status.UP: "bold green", Status.DOWN: "bold white on red", Status.AUTH: "bold black on yellow"}
    return Text(f" {p.status.value.upper()} ", style.get(p.status, "dim"))


def band_line(p: Poller) -> Text:
    gov, mem = section(p, "governor"), section(p, "memory")
    band = band_of(p)
    line = Text("band ", "dim").append(f" {f.text(band).upper()} ", BAND_STYLE.get(band, "dim") + " reverse")
    limit = f.num(gov.get("limit_bytes")) or f.num(mem.get("budget_bytes"))
    active, cache = f.num(mem.get("active_bytes")), f.num(mem.get("cache_bytes"))
    used = f.num(gov.get("used_bytes"))
    line.append("  ").append_text(_bar(limit, used, active, cache, f.dict_of(gov.get("thresholds")), band))
    line.append(f"  used {f.size(used)} ({f.percent(gov.get('fraction'))}) of {f.size(limit)}")
    line.append(f"  budget {f.size(mem.get('budget_bytes'))}")
    line.append(f"  active {f.size(active)}  cache {f.size(cache)}  headroom {f.size(mem.get('headroom_bytes'))}")
    return _aged(p, line)


def _bar(
    limit: float | None,
    used: float | None,
    active: float | None,
    cache: float | None,
    thresholds: dict,
    band: str | None,
) -> Text:
    """Active (solid), cache (shaded), the rest of what the governor counts (light), free (dots),
    with a tick where each band starts."""
    if not limit:
        return Text("[" + " " * BAR_WIDTH + "]", "dim")

    def cells(n: int | None) -> int:
        return 0 if n is None else max(0, min(BAR_WIDTH, round(n / limit * BAR_WIDTH)))

    a = cells(active)
    c = min(cells(cache), BAR_WIDTH - a)
    o = max(0, cells(used) - a - c)
    o = min(o, BAR_WIDTH - a - c)
    bar = Text("[")
    bar.append("█" * a, BAND_STYLE.get(band, "white")).append("▓" * c, "blue").append("▒" * o, "grey50")
    free = ["·"] * (BAR_WIDTH - a - c - o)
    styles = ["grey35"] * len(free)
    for name in ("yellow", "orange", "red"):
        at = f.num(thresholds.get(name))
        i = None if at is None else min(BAR_WIDTH - 1, int(at * BAR_WIDTH)) - (a + c + o)
        if i is not None and 0 <= i < len(free):
            free[i], styles[i] = "┃", BAND_STYLE[name]
    for ch, st in zip(free, styles):
        bar.append(ch, st)
    return bar.append("]")


def gpu_line(p: Poller) -> Text:
    gpus = p.system.get("gpu")
    if not isinstance(gpus, list) or not gpus:
        return Text("GPU telemetry unavailable", "dim")
    line = Text()
    for g in map(f.dict_of, gpus):
        util = f.num(g.get("utilization_pct"))
        temp, power = f.num(g.get("temperature_c")), f.num(g.get("power_w"))
        line.append(f"GPU{f.text(g.get('index'))} ", "bold").append(f"{f.text(g.get('name'))}  ")
        line.append(f"util {f.DASH if util is None else f'{util:.0f} %'}  ")
        line.append(f"mem {f.size(g.get('memory_used_bytes'))} / {f.size(g.get('memory_total_bytes'))}  ")
        line.append(
            f"{f.DASH if temp is None else f'{temp:.0f} °C'}  {f.DASH if power is None else f'{power:.0f} W'}   "
        )
    line.rstrip()
    if p.status is Status.DOWN:  # /system is not fetched either: this is its last answer
        line.stylize("dim")
    return line


def slots_line(p: Poller) -> Text:
    conc, queue = section(p, "concurrency"), section(p, "queue")
    line = Text("slots ", "dim").append(f"{f.text(conc.get('in_flight'))} / {f.text(conc.get('decode_batch'))}")
    waiting = f.num(queue.get("waiting"))
    line.append("   queue ", "dim").append(
        f"{f.text(queue.get('waiting'))} / {f.text(queue.get('cap'))}", "bold yellow" if waiting else ""
    )
    line.append("   ETA ", "dim").append(f.duration(queue.get("eta_s")))
    line.append("   rejections ", "dim").append(
        f.text(queue.get("rejections")), "bold red" if f.num(queue.get("rejections")) else ""
    )
    if queue.get("last_reject_reason"):
        line.append(f" (last: {f.text(queue['last_reject_reason'])})", "dim")
    return _aged(p, line)


def rates_line(p: Poller) -> Text:
    rates = section(p, "rates")
    line = Text.assemble(
        ("decode now ", "dim"),
        f.rate(rates.get("decode_tok_s")),
        ("  streams ", "dim"),
        f.text(rates.get("decode_streams")),
        ("   recent requests: prefill ", "dim"),
        f.rate(rates.get("prefill_tok_s_recent")),
        ("  decode ", "dim"),
        f.rate(rates.get("decode_tok_s_recent")),
        ("   lifetime decode ", "dim"),
        f.rate(rates.get("decode_tok_s_lifetime")),
        *_prompt_cache(section(p, "prompt_cache")),
    )
    return _aged(p, line)


def _prompt_cache(pc: dict) -> tuple[tuple[str, str] | str, ...]:
    if not pc.get("enabled"):
        return ()
    hit_rate = f.num(pc.get("hit_rate"))
    return (
        ("   prompt cache ", "dim"),
        f.DASH if hit_rate is None else f"{100 * hit_rate:.0f} % hits",
        ("  ", "dim"),
        f.size(pc.get("bytes")),
    )


def capacity_rows(p: Poller) -> list[tuple[str, str]]:
    widths = f.dict_of(section(p, "capacity").get("widths"))
    rows = [(w, c) for w, c in widths.items() if str(w).isdigit()]
    return [(w, f.tokens(c)) for w, c in sorted(rows, key=lambda wc: int(wc[0]))]


def request_rows(p: Poller, sort: str = "queue") -> list[tuple[str, tuple[RenderableType, ...]]]:
    """(id, cells) per request, ordered by `sort` (one of SORTS); none while stale, since those
    requests may have finished or died with the server."""
    if stale(p):
        return []
    rows = [r for r in f.list_of(p.metrics.get("requests")) if isinstance(r, dict)]
    key = {
        "queue": lambda r: r.get("state") != "queued",
        "elapsed": lambda r: -(f.num(r.get("elapsed_s")) or 0),
        "tok/s": lambda r: -(f.num(r.get("decode_tok_s")) or 0),
        "id": lambda r: str(r.get("id")),
    }[sort]
    return [(str(r.get("id")), _cells(r)) for r in sorted(rows, key=key)]


def _cells(r: dict) -> tuple[RenderableType, ...]:
    cache, spec = r.get("cache"), r.get("speculative")
    tier = f.DASH if not isinstance(cache, dict) else f"{f.text(cache.get('tier'))} {f.count(cache.get('warm_tokens'))}"
    accept = f.percent(spec.get("accept_rate")) if isinstance(spec, dict) else f.DASH
    state = f.text(r.get("state"))
    return (
        f.text(r.get("id")),
        f.text(r.get("model")),
        Text(state, STATE_STYLE.get(state, "")),
        f.count(r.get("prompt_tokens")),
        f"{f.count(r.get('generated'))} / {f.count(r.get('max_tokens'))}",
        f.duration(r.get("elapsed_s")),
        f.duration(r.get("queued_s")),
        f.duration(r.get("ttft_s")),
        f.rate(r.get("decode_tok_s")),
        tier,
        accept,
    )


def requests_title(p: Poller, sort: str, shown: int) -> str:
    if stale(p):
        return f"requests (cleared: {p.status.value}" + (f", {seen})" if (seen := last_seen(p)) else ")")
    return f"requests ({shown}, sorted by {sort})"


FLEET_COLUMNS = ("server", "status", "model", "band", "slots", "queue", "decode", "requests")


def fleet_row(p: Poller) -> tuple[RenderableType, ...]:
    conc, band = section(p, "concurrency"), band_of(p)
    old = stale(p)

    def cell(s: str, style: str = "") -> Text:
        return Text(s, "dim" if old else style)

    return (
        p.url,
        _status(p),
        cell(f.text(p.system.get("model"))),
        cell(f.text(band), BAND_STYLE.get(band, "dim")),
        cell(f"{f.text(conc.get('in_flight'))} / {f.text(conc.get('decode_batch'))}"),
        cell(f"{f.text(conc.get('waiting'))} / {f.text(conc.get('queue_cap'))}"),
        cell(f.rate(section(p, "rates").get("decode_tok_s"))),
        f.DASH if old else f.text(len(f.list_of(p.metrics.get("requests")))),
    )


def snapshot(p: Poller) -> Group:
    """One server as plain renderables (no sparklines): what `--once` prints."""
    if p.status is Status.DOWN:
        return Group(server_line(p, live=False))
    capacity = Table("width", "max context", title="capacity", title_justify="left", box=None)
    for row in capacity_rows(p):
        capacity.add_row(*row)
    requests = Table(*REQUEST_COLUMNS, title="requests", title_justify="left", box=None)
    for _, cells in request_rows(p):
        requests.add_row(*cells)
    return Group(
        server_line(p, live=False),
        band_line(p),
        gpu_line(p),
        slots_line(p),
        rates_line(p),
        Text(),
        capacity,
        Text(),
        requests,
    )


def plain_text(pollers: list[Poller], width: int = 160) -> str:
    out = io.StringIO()
    console = Console(file=out, width=width, color_system=None, force_terminal=False)
    if len(pollers) > 1:
        fleet = Table(*FLEET_COLUMNS, title="fleet", title_justify="left", box=None)
        for p in pollers:
            fleet.add_row(*fleet_row(p))
        console.print(fleet, Text())
    for p in pollers:
        console.print(snapshot(p), Text())
    return "\n".join(line.rstrip() for line in out.getvalue().splitlines()).rstrip() + "\n"
