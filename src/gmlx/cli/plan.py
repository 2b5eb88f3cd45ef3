"""`gmlx plan` and `gmlx estimate`: the capacity answers, offline from a GGUF header, or from a server."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import typer
from rich.table import Table

from gmlx import platform
from gmlx.capacity.estimate import estimate_embedding_not_loaded, estimate_not_loaded
from gmlx.capacity.plan import LiveState, plan
from gmlx.capacity.table import CapacityTable, attention_in_tiles, kv_float
from gmlx.cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    JSON_OPT,
    MODEL_ARG,
    console,
    fail,
    human_bytes,
    print_json,
)
from gmlx.default_model import DefaultModelMissing, resolve_model
from gmlx.deployment import Deployment
from gmlx.gguf.header import GGUFError, GGUFHeader
from gmlx.settings import Settings, SettingsError, resolve_settings

EXIT_ERROR = 2  # plan and estimate promise a script 2 on any error, a bad model file included
_HTTP_TIMEOUT_S = 60

URL_OPT = typer.Option(None, "--url", help="Ask the server at this URL instead of reading the model file.")
API_KEY_OPT = typer.Option(None, "--api-key", envvar="GMLX_API_KEY", help="The server's API key, for --url.")
MEMORY_OPT = typer.Option(
    None, "--memory", help="Memory to plan with, such as 64GiB.  [default: this machine's]", show_default=False
)
BODY_OPT = typer.Option(
    None, "--body", help="A chat-completions or embeddings request body (JSON file).", show_default=False
)
WEIGHTS_OPT = typer.Option(
    None, help="Weight mode to assume: auto, gguf, native or float.  [default: auto]", show_default=False
)
KV_BITS_OPT = typer.Option(
    None, "--kv-bits", help="KV cache quantization to assume: 2, 4 or 8 bits.", show_default=False
)
KV_GROUP_OPT = typer.Option(None, "--kv-group-size", help="KV quantization group: 32, 64 or 128.", show_default=False)
KV_SCHEME_OPT = typer.Option(None, "--kv-scheme", help="uniform, kvarn or auto.", show_default=False)
KV_VALUE_BITS_OPT = typer.Option(None, "--kv-value-bits", help="kvarn: bits of the values.", show_default=False)
KV_TAIL_OPT = typer.Option(None, "--kv-tail-tokens", help="kvarn: newest tokens kept in float.", show_default=False)
MAX_KV_OPT = typer.Option(
    None,
    "--max-kv-size",
    min=1,
    help="Cap the context window, as `gmlx serve --max-kv-size` does.  [default: the GGUF's trained window]",
    show_default=False,
)
BESIDE_OPT = typer.Option(
    None,
    "--beside",
    help="A model resident beside it (repeat for more): its weights come off the budget, as in a server "
    "serving several models.",
    show_default=False,
)
CONFIG_OPT = typer.Option(
    None,
    "--config",
    help="The settings file gmlx serve reads (TOML or YAML; GMLX_CONFIG), so the answer is for its settings.",
    show_default=False,
)
# The table's own fields in the capacity section of /v1/metrics (the rest is warm-up measurement).
_TABLE_KEYS = ("kv_format", "budget", "decode_batch", "context_length", "prefill_step", "headline", "widths", "depths")


@dataclass(frozen=True)
class Offline:
    path: Path
    header: GGUFHeader
    table: CapacityTable
    assumptions: dict[str, Any]


@contextmanager
def errors() -> Iterator[None]:
    """Every error a user can cause, as one line and exit 2."""
    try:
        yield
    except (DefaultModelMissing, GGUFError, SettingsError, OSError, ValueError) as e:  # JSON's and UTF-8's too
        fail(" ".join(str(e).split()), EXIT_ERROR)


def _from(s: Settings, name: str) -> str:
    source = s.sources[name]
    return "--" + name.replace("_", "-") if source == "flag" else source


def offline(
    model: str | None,
    memory: str | None,
    weights: str | None,
    decode_batch: int | None = None,
    prefill_step: int | None = None,
    kv_flags: dict[str, Any] | None = None,
    max_kv_size: int | None = None,
    beside: list[str] | None = None,
    config: Path | None = None,
) -> Offline:
    """The table `gmlx serve` would build for this model, from its header and the server's own
    settings, with the models of `beside` resident next to it (their weights off its budget)."""
    flags = {
        "model": model,
        "memory": memory,
        "weights": weights,
        "decode_batch": decode_batch,
        "prefill_step": prefill_step,
        "max_kv_size": max_kv_size,
        **(kv_flags or {}),
    }
    with errors():
        s = resolve_settings(flags, config=config)
        path = resolve_model(s.model)
        d = Deployment(path.stem, path, s)
        others = [Deployment(p.stem, p, s) for p in map(resolve_model, beside or [])]
        others_bytes = sum(o.planned_weight_bytes for o in others)
        h, mode = d.header, d.mode
    total = d.memory
    table, kv_plan = d.planned_table(others_bytes)
    tiled = attention_in_tiles(_fast_kernels(), kv_plan)
    if s.memory is not None:
        memory_from = _from(s, "memory")
    elif platform.backend() == "cuda":
        memory_from = "device memory"
    else:
        memory_from = "system memory (RAM, or the cgroup limit when smaller)"
    weights_from = _from(s, "weights") + (f": auto picks {mode} on {platform.backend()}" if s.weights == "auto" else "")
    assumptions = {
        "source": "offline",
        "model": str(path),
        "memory_bytes": {"value": total, "from": memory_from},
        "weights": {"value": mode, "from": weights_from, "resident_bytes": table.budget.weight_bytes},
        "kv_format": {
            "value": table.kv.describe(),
            "from": kv_float(_fast_kernels())[1],
            "element_bytes": table.kv.element_bytes(),
            **({"kv_quant": kv_plan.to_json()} if kv_plan is not None else {}),
        },
        "decode_batch": {"value": s.decode_batch, "from": _from(s, "decode_batch")},
        "prompt_cache_bytes": {"value": s.prompt_cache_limit(total), "from": _from(s, "prompt_cache_bytes")},
        "prefill_step": {"value": s.prefill_step, "from": _from(s, "prefill_step")},
        "prefill_bytes": {
            "value": table.budget.prefill_bytes,
            "from": "one chunk's activations"
            + (", attention in tiles (gmlx's CPU kernels)" if tiled else " and one layer's attention scores")
            + ", derived (a server measures a chunk at start and sets more aside where it holds more)",
        },
        "reserve_bytes": {
            "value": table.budget.reserve_bytes,
            "from": f"max({human_bytes(s.reserve_floor)}, {s.reserve_fraction:g} x memory)",
        },
        "context_length": {"value": table.context_length, "from": _window_from(s, h.geometry.context_length)},
        "host_bytes": {
            "value": table.budget.host_bytes,
            "from": "the process's memory outside MLX, as a server measures it (estimated offline)"
            if table.budget.host_bytes
            else "not counted (no governor, or CUDA)",
        },
        "ceiling": {
            "value": table.budget.ceiling,
            "from": "the governor's orange threshold less its hysteresis"
            if s.governor
            else "no governor: the whole budget",
        },
        "other_models_bytes": {
            "value": others_bytes,
            "from": f"the weights of {', '.join(o.model_id for o in others)} beside it (--beside)"
            if others
            else "no other model resident",
        },
    }
    return Offline(path, h, table, assumptions)


def _fast_kernels() -> bool:
    """Whether the server would run attention in gmlx's CPU kernels (off on a GPU backend)."""
    from gmlx.kernels import fast  # imports mlx: after the platform's bring-up

    return fast.enabled()


def _window_from(s: Settings, trained: int) -> str:
    if s.max_kv_size is None:
        return "the GGUF header"
    if s.max_kv_size < trained:
        return f"{_from(s, 'max_kv_size')}, below the GGUF's {trained}"
    return f"the GGUF header ({_from(s, 'max_kv_size')} {s.max_kv_size} is not smaller)"


def ask_server(method: str, url: str, route: str, api_key: str | None, **kw: Any) -> dict[str, Any]:
    """One JSON answer from a running server; any failure is one line and exit 2."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.request(method, url.rstrip("/") + route, headers=headers, timeout=_HTTP_TIMEOUT_S, **kw)
        answer = r.json()
    except (httpx.HTTPError, httpx.InvalidURL) as e:
        fail(f"cannot reach {url}: {' '.join(str(e).split())}", EXIT_ERROR)
    except ValueError:
        fail(f"{url}{route} answered {r.status_code} without JSON", EXIT_ERROR)
    if r.status_code != 200 or not isinstance(answer, dict):
        error = answer.get("error") if isinstance(answer, dict) else None
        message = error.get("message") if isinstance(error, dict) else json.dumps(answer)
        fail(f"{url}{route} answered {r.status_code}: {message}", EXIT_ERROR)
    return answer


def _kv_flags(
    bits: int | None, group: int | None, scheme: str | None, value_bits: int | None, tail: int | None
) -> dict[str, Any]:
    """The KV quantization flags, by the setting each gives."""
    names = ("kv_bits", "kv_group_size", "kv_scheme", "kv_value_bits", "kv_tail_tokens")
    return dict(zip(names, (bits, group, scheme, value_bits, tail), strict=True))


def _offline_only(url: str | None, flags: dict[str, Any], kv_flags: dict[str, Any]) -> None:
    """With --url the server's own settings answer, so a flag that shapes only the offline answer
    is a usage error rather than silently ignored; `flags` maps each such flag's name to its value."""
    named = flags | {"--" + k.replace("_", "-"): v for k, v in kv_flags.items()}
    given = [name for name, value in named.items() if value not in (None, [])]
    if url and given:
        fail(f"{', '.join(given)}: offline only; with --url the server's own settings answer", EXIT_ERROR)


def _server_assumptions(url: str) -> dict[str, Any]:
    return {"source": "server", "url": url}


def _show(title: str, rows: list[tuple[str, ...]]) -> None:
    table = Table(title=title, title_justify="left", title_style="bold", show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    for row in rows:
        table.add_row(*row)
    console.print(table)


def _value(v: Any) -> str:
    return "-" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def _show_assumptions(assumptions: dict[str, Any]) -> None:
    if assumptions["source"] == "server":
        console.print(f"figures from the server at {assumptions['url']}", highlight=False)
        return
    rows = [("model", assumptions["model"], "")]
    for key, a in assumptions.items():
        if not isinstance(a, dict):
            continue
        shown = human_bytes(a["value"]) if key.endswith("_bytes") and a["value"] is not None else _value(a["value"])
        if "resident_bytes" in a:
            shown += f", {human_bytes(a['resident_bytes'])} resident"
        rows.append((key, shown, f"[dim]{a['from']}[/]"))
    _show("assumptions", rows)


def _finish(title: str, answer: dict[str, Any], assumptions: dict[str, Any], json_out: bool, ok: bool) -> NoReturn:
    if json_out:
        print_json({title: answer, "assumptions": assumptions})
    else:
        _show(
            title,
            [(k, human_bytes(v) if k.endswith("_bytes") and v is not None else _value(v)) for k, v in answer.items()],
        )
        console.print()
        _show_assumptions(assumptions)
    raise typer.Exit(EXIT_OK if ok else EXIT_FAILED)


def _show_table(table: dict[str, Any]) -> None:
    """A table as CapacityTable.to_json gives it, so an offline and a served one print alike."""
    b = table["budget"]
    console.print(f"{table['headline']}\n", highlight=False)
    usable = f"(memory {human_bytes(b['total_bytes'])} - reserve {human_bytes(b['reserve_bytes'])})"
    if b.get("ceiling", 1) != 1:
        usable += f" x {b['ceiling']:g} (orange less hysteresis)"
    console.print(
        f"{usable} - weights {human_bytes(b['weight_bytes'])} - outside MLX {human_bytes(b.get('host_bytes', 0))}"
        f" - prompt cache {human_bytes(b['prompt_cache_bytes'])} - prefill {human_bytes(b['prefill_bytes'])}"
        f" - batch {human_bytes(b.get('batch_bytes', 0))} = KV {human_bytes(b['kv_bytes'])} for one stream "
        f"({table['kv_format']['describe']}); each stream more brings its own prefill\n",
        highlight=False,
    )
    widths = Table("width", "max context", box=None, pad_edge=False)
    for w, c in table["widths"].items():
        widths.add_row(w, str(c))
    depths = Table("depth", "max width", box=None, pad_edge=False)
    for d, w in table["depths"].items():
        depths.add_row(d, str(w))
    console.print(widths, "", depths)


def served_table(url: str, api_key: str | None, model_id: str | None = None) -> dict[str, Any]:
    """The capacity table a running server holds for `model_id` (default: its preloaded model),
    from its /v1/metrics: the capacity section, or that model's among the resident models."""
    server = ask_server("GET", url, "/v1/metrics", api_key).get("server")
    server = server if isinstance(server, dict) else {}
    capacity = server.get("capacity")
    if model_id is not None:
        resident = {m.get("model"): m for m in server.get("resident_models") or [] if isinstance(m, dict)}
        if model_id not in resident:
            fail(
                f"{model_id!r} is not loaded at {url}, so it has no table there "
                "(--width and --depth ask for its plan, which a model not loaded gets from its header)",
                EXIT_ERROR,
            )
        capacity = resident[model_id].get("capacity")
    if not isinstance(capacity, dict) or any(capacity.get(k) is None for k in _TABLE_KEYS):
        fail(f"the server at {url} has no capacity table yet (is its model still loading?)", EXIT_ERROR)
    return {k: capacity[k] for k in _TABLE_KEYS}


def plan_command(
    model: str = MODEL_ARG,
    width: int = typer.Option(None, "--width", min=1, help="Streams to run together.", show_default=False),
    depth: int = typer.Option(None, "--depth", min=1, help="Tokens in each stream.", show_default=False),
    memory: str = MEMORY_OPT,
    weights: str = WEIGHTS_OPT,
    decode_batch: int = typer.Option(
        None, "--decode-batch", help="Streams the server decodes together.  [default: 8]", show_default=False
    ),
    prefill_step: int = typer.Option(
        None, "--prefill-step", help="Prompt tokens per prefill chunk.  [default: 512]", show_default=False
    ),
    whole_table: bool = typer.Option(False, "--table", help="Show the whole table: widths x depths."),
    kv_bits: int = KV_BITS_OPT,
    kv_group_size: int = KV_GROUP_OPT,
    kv_scheme: str = KV_SCHEME_OPT,
    kv_value_bits: int = KV_VALUE_BITS_OPT,
    kv_tail_tokens: int = KV_TAIL_OPT,
    max_kv_size: int = MAX_KV_OPT,
    beside: list[str] = BESIDE_OPT,
    config: Path = CONFIG_OPT,
    json_out: bool = JSON_OPT,
    url: str = URL_OPT,
    api_key: str = API_KEY_OPT,
    model_id: str = typer.Option(
        None, "--model", help="With --url: the model to plan for.  [default: the preloaded one]", show_default=False
    ),
) -> None:
    """Can W streams of D tokens fit, and start now? Exit 0 if ok, 1 if not, 2 on error."""
    kv_flags = _kv_flags(kv_bits, kv_group_size, kv_scheme, kv_value_bits, kv_tail_tokens)
    offline_flags = {"MODEL": model, "--memory": memory, "--weights": weights, "--decode-batch": decode_batch}
    offline_flags |= {"--prefill-step": prefill_step, "--max-kv-size": max_kv_size, "--beside": beside}
    offline_flags |= {"--config": config}
    _offline_only(url, offline_flags, kv_flags)
    if model_id is not None and not url:
        fail("--model names a model a server serves, with --url; offline, give its file as MODEL", EXIT_ERROR)
    if whole_table and (width is not None or depth is not None):
        fail("--table shows every width and depth: give it without --width and --depth", EXIT_ERROR)
    if whole_table:
        if url:
            table, assumptions = served_table(url, api_key, model_id), _server_assumptions(url)
        else:
            o = offline(model, memory, weights, decode_batch, prefill_step, kv_flags, max_kv_size, beside, config)
            table, assumptions = o.table.to_json(), o.assumptions
        if json_out:
            print_json({"table": table, "assumptions": assumptions})
        else:
            _show_table(table)
            console.print()
            _show_assumptions(assumptions)
        return
    if width is None or depth is None:
        fail("--width and --depth are required (or --table for the whole table)", EXIT_ERROR)
    if url:
        params = {"width": width, "depth": depth} | ({"model": model_id} if model_id else {})
        answer = ask_server("GET", url, "/v1/capacity/plan", api_key, params=params)
        assumptions = _server_assumptions(url)
    else:
        o = offline(model, memory, weights, decode_batch, prefill_step, kv_flags, max_kv_size, beside, config)
        # Offline nothing runs: no stream in flight, none waiting, no governor, so admit_now follows memory alone.
        live = LiveState(o.table.decode_batch, in_flight=0, waiting=0, band=None)
        answer, assumptions = plan(o.table, width, depth, live, model=o.path.stem), o.assumptions
    _finish("plan", answer, assumptions, json_out, ok=answer.get("ok") is not False)


def _request_body(body_file: Path | None, prompt: str | None, max_tokens: int | None) -> dict[str, Any]:
    """The body to estimate (chat completions, completions or embeddings): the file's, or one user message;
    --max-tokens overrides."""
    if (body_file is None) == (prompt is None):
        fail("give exactly one of --body and --prompt", EXIT_ERROR)
    if body_file is not None:
        try:
            body = json.loads(body_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:  # unreadable, not UTF-8, or not JSON: say which file
            fail(f"{body_file}: {' '.join(str(e).split())}", EXIT_ERROR)
        if not isinstance(body, dict):
            fail(f"{body_file}: the request body must be a JSON object", EXIT_ERROR)
    else:
        body = {"messages": [{"role": "user", "content": prompt}]}
    if max_tokens is not None:
        body = {k: v for k, v in body.items() if k != "max_completion_tokens"} | {"max_tokens": max_tokens}
    return body


def _estimate_offline(o: Offline, body: dict[str, Any]) -> dict[str, Any]:
    """The server's estimate for this body, with nothing running and no measured prefill rate."""
    # Imported here: the tokenizer and the request parser pull in mlx_lm, transformers and starlette.
    from gmlx.gguf.tokenizer import load_tokenizer
    from gmlx.server import embeddings, openai_api
    from gmlx.server.errors import APIError

    free = o.table.budget.drained_bytes  # nothing runs, so free now is free once drained
    vocab_size = o.header.geometry.vocab_size
    try:
        with errors():
            if "input" in body and "messages" not in body:  # an embeddings body, as the route tells them apart
                inputs = embeddings.input_ids(load_tokenizer(o.header), vocab_size, embeddings.parse_inputs(body))
                out = estimate_embedding_not_loaded(o.table, input_tokens=[len(i) for i in inputs], free_now_bytes=free)
            else:  # a completions body (`prompt`, no `messages`) as the route tells it from chat's
                p = openai_api.parse(body, chat=not ("prompt" in body and "messages" not in body))
                if p.n > o.table.decode_batch:  # as the server refuses it: its choices decode side by side
                    fail(f"'n' must be at most {o.table.decode_batch}, the decode batch", EXIT_ERROR)
                ids = openai_api.prompt_token_ids(load_tokenizer(o.header), p, vocab_size)
                out = estimate_not_loaded(
                    o.table, prompt_tokens=len(ids), max_tokens=p.max_tokens, free_now_bytes=free, choices=p.n
                )
    except APIError as e:
        fail(e.message, EXIT_ERROR)
    return {**out, "model": o.path.stem}


def estimate_command(
    model: str = MODEL_ARG,
    body_file: Path = BODY_OPT,
    prompt: str = typer.Option(None, "--prompt", help="One user message, instead of --body.", show_default=False),
    max_tokens: int = typer.Option(
        None, "--max-tokens", min=1, help="Tokens to generate (overrides the body's).", show_default=False
    ),
    memory: str = MEMORY_OPT,
    weights: str = WEIGHTS_OPT,
    kv_bits: int = KV_BITS_OPT,
    kv_group_size: int = KV_GROUP_OPT,
    kv_scheme: str = KV_SCHEME_OPT,
    kv_value_bits: int = KV_VALUE_BITS_OPT,
    kv_tail_tokens: int = KV_TAIL_OPT,
    max_kv_size: int = MAX_KV_OPT,
    config: Path = CONFIG_OPT,
    json_out: bool = JSON_OPT,
    url: str = URL_OPT,
    api_key: str = API_KEY_OPT,
) -> None:
    """Would one request fit: its prompt tokens, memory need and context. Exit 0 if it fits, 1 if not, 2 on error."""
    body = _request_body(body_file, prompt, max_tokens)
    kv_flags = _kv_flags(kv_bits, kv_group_size, kv_scheme, kv_value_bits, kv_tail_tokens)
    offline_flags = {"MODEL": model, "--memory": memory, "--weights": weights, "--max-kv-size": max_kv_size}
    _offline_only(url, offline_flags | {"--config": config}, kv_flags)
    if url:
        answer, assumptions = ask_server("POST", url, "/v1/estimate", api_key, json=body), _server_assumptions(url)
    else:
        o = offline(model, memory, weights, kv_flags=kv_flags, max_kv_size=max_kv_size, config=config)
        answer = _estimate_offline(o, body)
        assumptions = {
            **o.assumptions,
            "prefill_tok_s": {
                "value": None,
                "from": "offline there is no measured prefill rate, so est_ttft_s is null",
            },
        }
    _finish("estimate", answer, assumptions, json_out, ok=answer["context_ok"] and answer["fits_drained"] is not False)
