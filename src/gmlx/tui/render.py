"""What the dashboard draws, as Rich renderables built from one `Poller`: shared by the Textual app
and by `gmlx top --once`, so the two always agree. Each figure has one source: token rates are the
growth of the server's totals (client.RATE_WINDOW_S), latency percentiles and counts are the
server's own. While a server is down or refuses the key, what is left of it is dimmed and nothing
instantaneous (readiness, rates, CPU use, the band's colour) is shown as if live."""

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
FINISH_STYLE = {"stop": "", "length": "", "tool_calls": "", "cancelled": "yellow"}  # any other reason: red
SORTS = ("queue", "elapsed", "tok/s", "id")
REQUEST_COLUMNS = (
    "id",
    "model",
    "state",
    "prompt",
    "gen/max",
    "ctx",
    "KV",
    "elapsed",
    "queued",
    "TTFT",
    "tok/s",
    "cache",
    "spec",
)
LATENCY_ROWS = (
    ("TTFT", "ttft_seconds"),
    ("inter-token", "inter_token_seconds"),
    ("end to end", "e2e_seconds"),
    ("queue wait", "queue_wait_seconds"),
)
ID_WIDTH = 12  # of the id past the server's own prefix (chatcmpl-, cmpl-): enough to find it in a log
ID_PREFIXES = ("chatcmpl-", "cmpl-")
WIDTH = 120  # the narrowest screen laid out without wrapping


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


def _facts(*pairs: tuple[str, RenderableType]) -> Text:
    line = Text()
    for label, value in pairs:
        if line:
            line.append("  ")
        line.append(f"{label} ", "dim").append_text(value if isinstance(value, Text) else Text(str(value)))
    return line


def server_line(p: Poller, paused: bool = False, live: bool = True) -> Text:
    """Two lines: who and how it is (status, model, readiness, uptime), then what it runs on; the
    error, when there is one, on a third."""
    sys = p.system
    line = Text.assemble((p.url, "bold"), "  ", _status(p))
    seen = last_seen(p)
    if seen:
        line.append(f"  {seen}", "bold yellow")
    if paused:
        line.append("  PAUSED", "bold magenta")
    ready = p.ready.get("ready")
    readiness = (
        Text(f.DASH)
        if ready is None or p.status is Status.DOWN  # no answer this time: not "yes" from before
        else Text("yes", "green")
        if ready
        else Text(f"no ({f.text(p.ready.get('reason'))})", "yellow")
    )
    first = _facts(("model", f.text(sys.get("model"))), ("ready", readiness), ("up", f.duration(sys.get("uptime_s"))))
    second = _facts(
        ("version", f.text(sys.get("version"))),
        ("device", f.text(sys.get("device"))),
        ("compute", f.text(sys.get("compute_type"))),
    )
    if p.status is Status.DOWN:  # /system and /health are not fetched either: these are their last answers
        first.stylize("dim")
        second.stylize("dim")
    line.append("  ").append_text(first).append("\n").append_text(second)
    if p.error:
        retry = f" (retry in {f.duration(p.delay)})" if live and p.status is Status.DOWN else ""
        line.append(f"\n{p.error}{retry}", "red")
    return line


def _status(p: Poller) -> Text:
    style = {Status.UP: "bold green", Status.DOWN: "bold white on red", Status.AUTH: "bold black on yellow"}
    return Text(f" {p.status.value.upper()} ", style.get(p.status, "dim"))


def models_line(p: Poller) -> Text | None:
    """One line per resident model, when the server has more than one (one model is the server line)."""
    models = [m for m in f.list_of(p.metrics.get("resident_models")) if isinstance(m, dict)]
    if len(models) < 2:
        return None
    line = Text()
    for m in models:
        line.append("\n" if line else "").append(f"{f.text(m.get('model'))} ", "bold")
        line.append_text(
            _facts(
                ("kind", f.text(m.get("kind"))),
                ("status", f.text(m.get("status"))),
                ("slots", f"{f.text(m.get('in_flight'))} / {f.text(m.get('decode_batch'))}"),
                ("weights", f"{f.text(m.get('weight_mode'))} {f.size(m.get('weight_bytes'))}"),
                ("context", f.tokens(m.get("context_length"))),
            )
        )
    return _aged(p, line)


def band_line(p: Poller, width: int = WIDTH) -> Text:
    """The band over the memory bar and what it sums, then the figures it is drawn from."""
    gov, mem = section(p, "governor"), section(p, "memory")
    band = band_of(p)
    style = BAND_STYLE.get(band, "dim") + " reverse" if not stale(p) else "dim reverse"  # no live colour
    limit = f.num(gov.get("limit_bytes")) or f.num(mem.get("budget_bytes"))
    active, cache = f.num(mem.get("active_bytes")), f.num(mem.get("cache_bytes"))
    used = f.num(gov.get("used_bytes"))
    summary = f"  {f.size(used)} of {f.size(limit)} ({f.percent(gov.get('fraction'))})"
    chip = f" {f.text(band).upper()} "
    bar_width = max(20, width - len("memory ") - len(chip) - 3 - len(summary))
    line = Text("memory ", "dim").append(chip, style).append(" ")
    thresholds = f.dict_of(gov.get("thresholds"))
    line.append_text(_bar(bar_width, limit, used, active, cache, thresholds, None if stale(p) else band))
    line.append(summary)
    line.append("\n").append_text(
        _facts(
            ("active", f.size(active)),
            ("cache", f.size(cache)),
            ("headroom", f.size(mem.get("headroom_bytes"))),
            ("budget", f.size(mem.get("budget_bytes"))),
            ("RSS", f.size(f.dict_of(p.system.get("host")).get("process_rss_bytes") or mem.get("process_rss_bytes"))),
        )
    )
    return _aged(p, line)


EIGHTHS = " ▏▎▍▌▋▊▉"


def _bar(
    width: int,
    limit: float | None,
    used: float | None,
    active: float | None,
    cache: float | None,
    thresholds: dict,
    band: str | None,
) -> Text:
    """Active (solid, to an eighth of a cell, so a few per cent still shows), cache (shaded), the
    rest of what the governor counts (light), free (dots), with a tick where each band starts."""
    if not limit:
        return Text("[" + " " * width + "]", "dim")

    def eighths(n: float | None) -> int:
        return 0 if not n else max(1, min(8 * width, round(n / limit * 8 * width)))

    a8 = eighths(active)
    a, part = divmod(a8, 8)
    solid = "█" * a + (EIGHTHS[part] if part else "")
    c = min(-(-eighths(cache) // 8), width - len(solid))
    o = max(0, min(-(-eighths(used) // 8) - len(solid) - c, width - len(solid) - c))
    bar = Text("[")
    bar.append(solid, BAND_STYLE.get(band, "white")).append("▓" * c, "blue").append("▒" * o, "grey50")
    start = len(solid) + c + o
    free = ["·"] * (width - start)
    styles = ["grey35"] * len(free)
    for name in ("yellow", "orange", "red"):
        at = f.num(thresholds.get(name))
        i = None if at is None else min(width - 1, int(at * width)) - start
        if i is not None and 0 <= i < len(free):
            free[i], styles[i] = "┃", BAND_STYLE[name]
    for ch, st in zip(free, styles):
        bar.append(ch, st)
    return bar.append("]")


def host_line(p: Poller, width: int = WIDTH) -> Text:
    """NVML's figures per GPU; on a host without them, CPU use per core (/system → host)."""
    gpus = p.system.get("gpu")
    if isinstance(gpus, list) and gpus:
        return _aged(p, _gpus(gpus)) if p.status is Status.DOWN else _gpus(gpus)
    host = f.dict_of(p.system.get("host"))
    cores = [f.num(c) for c in f.list_of(host.get("cpu_pct_per_core"))]
    if p.status is Status.DOWN or not cores or None in cores:  # nothing measured now
        why = "GPU telemetry unavailable; CPU use " + ("not measured yet" if p.status is Status.UP else f.DASH)
        return Text(why, "dim")
    known = [c for c in cores if c is not None]
    process = f.num(host.get("process_cpu_pct"))
    line = Text("CPU ", "bold").append(f"{sum(known) / len(known):.0f} % of {len(known)} cores")
    line.append("   server ", "dim").append(f.DASH if process is None else f"{process:.0f} %")
    line.append("   (no GPU telemetry)", "dim")
    return line.append("\n").append_text(_core_bars(known, width))


def _core_bars(cores: list[float], width: int) -> Text:
    """A bar per core, four rows at most; past that a level glyph per core, like a compact htop."""
    cell = 26  # "12 [██████···········  42%]" and a gap
    per_row = max(1, width // cell)
    out = Text()
    if len(cores) > 4 * per_row:
        levels = "▁▂▃▄▅▆▇█"
        for i, pct in enumerate(cores):
            if i and i % (width - 4) == 0:
                out.append("\n")
            out.append(levels[min(7, int(pct / 100 * 8))], _load_style(pct))
        return out
    label = len(str(len(cores) - 1))
    for i, pct in enumerate(cores):
        if i:
            out.append("\n" if i % per_row == 0 else " ")
        inner = cell - label - 9
        filled = min(inner, round(pct / 100 * inner))
        out.append(f"{i:>{label}} [", "dim").append("█" * filled, _load_style(pct)).append(
            "·" * (inner - filled), "grey35"
        )
        out.append(f"{pct:4.0f}%", "dim").append("]", "dim")
    return out


def _load_style(pct: float) -> str:
    return "red" if pct >= 90 else "yellow" if pct >= 60 else "green"


def _gpus(gpus: list) -> Text:
    line = Text()
    for g in map(f.dict_of, gpus):
        util = f.num(g.get("utilization_pct"))
        temp, power = f.num(g.get("temperature_c")), f.num(g.get("power_w"))
        line.append("\n" if line else "").append(f"GPU{f.text(g.get('index'))} ", "bold")
        line.append(f"{f.text(g.get('name'))}  ")
        line.append(f"util {f.DASH if util is None else f'{util:.0f} %'}  ")
        line.append(f"mem {f.size(g.get('memory_used_bytes'))} / {f.size(g.get('memory_total_bytes'))}  ")
        line.append(f"{f.DASH if temp is None else f'{temp:.0f} °C'}  {f.DASH if power is None else f'{power:.0f} W'}")
    return line


def slots_line(p: Poller) -> Text:
    """Slots and the queue, then what became of the requests: finish reasons and rejections."""
    conc, queue, rates = section(p, "concurrency"), section(p, "queue"), section(p, "rates")
    waiting = f.num(queue.get("waiting"))
    line = Text("slots ", "dim").append(f"{f.text(conc.get('in_flight'))} / {f.text(conc.get('decode_batch'))}")
    line.append(f" ({f.text(rates.get('decode_streams'))} decoding)", "dim")
    line.append("   queue ", "dim").append(
        f"{f.text(queue.get('waiting'))} / {f.text(queue.get('cap'))}", "bold yellow" if waiting else ""
    )
    if waiting:  # eta_s is the Retry-After a rejected request would get: a wait only when one waits
        line.append("  ETA ", "dim").append(f.duration(queue.get("eta_s")))
    line.append("\nfinished ", "dim").append_text(_counts(section(p, "totals").get("requests_finished"), FINISH_STYLE))
    line.append("   rejected ", "dim").append_text(_counts(queue.get("rejections_by_reason"), {}))
    return _aged(p, line)


def _counts(by_reason: Any, plain: dict[str, str]) -> Text:
    """reason count pairs, largest first; a reason not in `plain` (an error) in red when non-zero."""
    pairs = [(str(k), n) for k, v in f.dict_of(by_reason).items() if (n := f.num(v)) is not None]
    if not pairs:
        return Text("none" if isinstance(by_reason, dict) else f.DASH)
    out = Text()
    for reason, n in sorted(pairs, key=lambda kv: -kv[1]):
        out.append("  " if out else "").append(f"{reason} ", "dim")
        out.append(f.count(n), plain.get(reason, "bold red") if n else "")
    return out


def rates_line(p: Poller) -> Text:
    """The server's means per request: each stream on its own, so not comparable with the sparklines'
    aggregate rates. The prompt cache's hit rate."""
    rates = section(p, "rates")
    line = _facts(
        ("per request, recent: prefill", f.rate(rates.get("prefill_tok_s_recent"))),
        ("decode", f.rate(rates.get("decode_tok_s_recent"))),
        ("lifetime", f.rate(rates.get("decode_tok_s_lifetime"))),
    )
    pc = section(p, "prompt_cache")
    if pc.get("enabled"):
        hit_rate = f.num(pc.get("hit_rate"))
        line.append("   prompt cache ", "dim").append(f.DASH if hit_rate is None else f"{100 * hit_rate:.0f} % hits")
        line.append("  ").append(f.size(pc.get("bytes")))
    return _aged(p, line)


def spark_label(p: Poller, name: str) -> str:
    """The sparkline's name, its figure now (none while stale) and its peak over the window. Rates
    are all streams together, each a mean over RATE_WINDOW_S (the axis line says so)."""
    h = p.history
    series, what, show = {
        "decode": (h.decode, "decode tok/s", _rate),
        "prefill": (h.prefill, "prefill tok/s", _rate),
        "queue": (h.queue, "queue depth", f.count),
    }[name]
    now = p.latest(series)
    peak = max((v for _, v in series), default=None)
    return f"{what}  now {show(now)}  peak {show(peak)}"


def _rate(x: Any) -> str:
    n = f.num(x)
    return f.DASH if n is None else f"{n:.1f}"


def latency_table(p: Poller) -> Table:
    """The server's own percentiles (server.latency) over its window; dashes where it has none."""
    lat = section(p, "latency")
    window = f.num(lat.get("window_s"))
    title = "latency" + (f", last {f.duration(window)}" if window else "")
    table = Table("", "n", "p50", "p95", "p99", title=title, title_justify="left", box=None, pad_edge=False)
    for label, key in LATENCY_ROWS:
        s = f.dict_of(lat.get(key))
        cells = [f.count(s.get("count"))] + [f.latency(s.get(q)) for q in ("p50", "p95", "p99")]
        table.add_row(label, *(Text(c, "dim") if stale(p) else c for c in cells))
    return table


def capacity_rows(p: Poller) -> list[tuple[str, str]]:
    widths = f.dict_of(section(p, "capacity").get("widths"))
    rows = [(w, c) for w, c in widths.items() if str(w).isdigit()]
    return [(w, f.tokens(c)) for w, c in sorted(rows, key=lambda wc: int(wc[0]))]


def request_columns(p: Poller) -> tuple[str, ...]:
    """The model column only where the server has more than one model."""
    models = {r.get("model") for r in f.list_of(p.metrics.get("requests")) if isinstance(r, dict)}
    many = len(f.list_of(p.metrics.get("resident_models"))) > 1 or len(models) > 1
    return REQUEST_COLUMNS if many else tuple(c for c in REQUEST_COLUMNS if c != "model")


def request_rows(p: Poller, sort: str = "queue") -> list[tuple[str, tuple[RenderableType, ...]]]:
    """(id, cells) per request in `request_columns(p)` order, sorted by `sort` (one of SORTS); none
    while stale, since those requests may have finished or died with the server."""
    if stale(p):
        return []
    rows = [r for r in f.list_of(p.metrics.get("requests")) if isinstance(r, dict)]
    key = {
        "queue": lambda r: r.get("state") != "queued",
        "elapsed": lambda r: -(f.num(r.get("elapsed_s")) or 0),
        "tok/s": lambda r: -(f.num(r.get("decode_tok_s")) or 0),
        "id": lambda r: str(r.get("id")),
    }[sort]
    keep = request_columns(p)
    contexts = _contexts(p)
    out = []
    for r in sorted(rows, key=key):
        cells = _cells(r, contexts.get(r.get("model"), contexts.get(None)))
        out.append((str(r.get("id")), tuple(c for name, c in zip(REQUEST_COLUMNS, cells) if name in keep)))
    return out


def _contexts(p: Poller) -> dict[Any, float | None]:
    """Each resident model's context window, and under None the capacity table's."""
    out: dict[Any, float | None] = {None: f.num(section(p, "capacity").get("context_length"))}
    for m in f.list_of(p.metrics.get("resident_models")):
        if isinstance(m, dict):
            out[m.get("model")] = f.num(m.get("context_length"))
    return out


def _cells(r: dict, context: float | None) -> tuple[RenderableType, ...]:
    cache, spec = r.get("cache"), r.get("speculative")
    tier = f.DASH if not isinstance(cache, dict) else f"{f.text(cache.get('tier'))} {f.count(cache.get('warm_tokens'))}"
    accept = f.percent(spec.get("accept_rate")) if isinstance(spec, dict) else f.DASH
    state = f.text(r.get("state"))
    prompt, generated = f.num(r.get("prompt_tokens")), f.num(r.get("generated"))
    used = None if prompt is None or not context else (prompt + (generated or 0)) / context
    return (
        short_id(f.text(r.get("id"))),
        f.text(r.get("model")),
        Text(state, STATE_STYLE.get(state, "")),
        f.count(prompt),
        f"{f.count(generated)}/{f.count(r.get('max_tokens'))}",
        f.percent(used),
        f.short_size(r.get("kv_bytes")),
        f.short_duration(r.get("elapsed_s")),
        f.short_duration(r.get("queued_s")),
        f.short_duration(r.get("ttft_s")),
        _rate(r.get("decode_tok_s")),
        tier,
        accept,
    )


def short_id(rid: str) -> str:
    for prefix in ID_PREFIXES:
        rid = rid.removeprefix(prefix)
    return rid if len(rid) <= ID_WIDTH else rid[: ID_WIDTH - 1] + "…"


def requests_title(p: Poller, sort: str, shown: int) -> str:
    if stale(p):
        return f"requests (cleared: {p.status.value}" + (f", {seen})" if (seen := last_seen(p)) else ")")
    return f"requests ({shown}, sorted by {sort})"


FLEET_COLUMNS = ("server", "status", "model", "band", "slots", "queue", "decode tok/s", "requests")


def fleet_row(p: Poller) -> tuple[RenderableType, ...]:
    conc, band = section(p, "concurrency"), band_of(p)
    old = stale(p)

    def cell(s: str, style: str = "") -> Text:
        return Text(s, "dim" if old else style)

    models = [f.text(m.get("model")) for m in f.list_of(p.metrics.get("resident_models")) if isinstance(m, dict)]
    return (
        p.url,
        _status(p),
        cell(", ".join(models) if len(models) > 1 else f.text(p.system.get("model"))),
        cell(f.text(band), BAND_STYLE.get(band, "dim")),
        cell(f"{f.text(conc.get('in_flight'))} / {f.text(conc.get('decode_batch'))}"),
        cell(f"{f.text(conc.get('waiting'))} / {f.text(conc.get('queue_cap'))}"),
        cell(_rate(p.latest(p.history.decode))),  # the detail's decode figure: one source
        f.DASH if old else f.text(len(f.list_of(p.metrics.get("requests")))),
    )


def snapshot(p: Poller, width: int = 160) -> Group:
    """One server as plain renderables (no sparklines): what `--once` prints."""
    if p.status is Status.DOWN:
        return Group(server_line(p, live=False))
    capacity = Table("width", "max context", title="capacity", title_justify="left", box=None)
    for row in capacity_rows(p):
        capacity.add_row(*row)
    requests = Table(*request_columns(p), title="requests", title_justify="left", box=None)
    for _, cells in request_rows(p):
        requests.add_row(*cells)
    parts: list[RenderableType] = [server_line(p, live=False)]
    models = models_line(p)
    if models is not None:
        parts.append(models)
    parts += [band_line(p, width), host_line(p, width), slots_line(p), rates_line(p), Text()]
    return Group(*parts, latency_table(p), Text(), capacity, Text(), requests)


def plain_text(pollers: list[Poller], width: int = 160) -> str:
    out = io.StringIO()
    console = Console(file=out, width=width, color_system=None, force_terminal=False)
    if len(pollers) > 1:
        fleet = Table(*FLEET_COLUMNS, title="fleet", title_justify="left", box=None)
        for p in pollers:
            fleet.add_row(*fleet_row(p))
        console.print(fleet, Text())
    for p in pollers:
        console.print(snapshot(p, width), Text())
    return "\n".join(line.rstrip() for line in out.getvalue().splitlines()).rstrip() + "\n"
