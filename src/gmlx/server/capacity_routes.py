"""GET /v1/capacity/plan and POST /v1/estimate (also `"dry_run": true` on chat completions)."""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import threading
from pathlib import Path
from typing import Any

import mlx.core as mx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gmlx import platform
from gmlx.capacity.estimate import estimate, estimate_not_loaded, fit_prefill
from gmlx.capacity.plan import LiveState, plan
from gmlx.capacity.table import header_table
from gmlx.engine.prompt_cache import MISS
from gmlx.gguf.header import GGUFError, GGUFHeader, read_header
from gmlx.gguf.tokenizer import load_tokenizer
from gmlx.kernels import fast as kernels_fast
from gmlx.models.weights_mode import choose_mode
from gmlx.server import openai_api
from gmlx.server.errors import APIError, bad_request
from gmlx.server.http import read_json
from gmlx.server.state import ServerState
from gmlx.server.system import models_dir_files

log = logging.getLogger("gmlx.capacity")
_READERS = 4  # other models' tokenizers kept in memory
_readers_lock = threading.Lock()
_MEDIA_PARTS = ("image_url", "input_image", "image", "input_audio", "audio", "video", "video_url", "file")


def _positive_int(request: Request, name: str) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        raise bad_request(f"'{name}' is required (a positive integer)", name)
    # Plain ASCII digits only: int() would also take " 7", "+7", "1_000" and other scripts' digits,
    # which the published schema (a decimal integer) does not; over 4300 digits it raises.
    if not re.fullmatch(r"-?[0-9]{1,100}", raw):
        raise bad_request(f"'{name}' must be an integer, not {raw[:40]!r}", name)
    value = int(raw)
    if value < 1:
        raise bad_request(f"'{name}' must be at least 1, not {value}", name)
    return value


def live_state(state: ServerState) -> LiveState:
    not_ready = "model loading" if not state.ready else "shutting down" if state.gate.closed else None
    return LiveState(
        state.settings.decode_batch, state.gate.running, state.gate.waiting, band=state.band, not_ready=not_ready
    )


async def capacity_plan(request: Request) -> Response:
    state: ServerState = request.app.state.gmlx
    width, depth = _positive_int(request, "width"), _positive_int(request, "depth")
    return JSONResponse(
        plan(state.table(), width, depth, live_state(state), state.model_id, overcommit=state.settings.overcommit)
    )


def _messages(body: Any) -> list:
    messages = body.get("messages") if isinstance(body, dict) else None
    return messages if isinstance(messages, list) else []  # anything else, parse() refuses with a 400


def media_parts(body: Any) -> list[str]:
    """The kinds of non-text content parts in a chat body's messages."""
    found = []
    for m in _messages(body):
        content = m.get("content") if isinstance(m, dict) else None
        for part in content if isinstance(content, list) else []:
            if isinstance(part, dict) and part.get("type") in _MEDIA_PARTS:
                found.append(part["type"])
    return found


def _text_only(body: dict) -> dict:
    """The body with media parts dropped, so its text can be rendered and counted."""
    messages = []
    for m in _messages(body):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            m = {**m, "content": [p for p in content if not (isinstance(p, dict) and p.get("type") in _MEDIA_PARTS)]}
        messages.append(m)
    return {**body, "messages": messages}


async def estimate_body(state: ServerState, body: Any) -> dict:
    """The estimate for a chat-completions body; renders the prompt exactly as a real request would,
    for the served model or for another in the models directory (from its header, never loading it)."""
    media = media_parts(body)
    p = openai_api.parse(_text_only(body) if media else body, chat=True)
    notes: list[str] = []
    if p.model is None or p.model == state.model_id:
        out = await _served_estimate(state, p)
    else:
        path = _models_dir_file(state, p.model)
        if path is None:
            state.check_model(p.model)  # neither served nor in the models directory: model_not_found
        assert path is not None
        out = await asyncio.to_thread(_not_loaded_estimate, state, path, p)
        notes.append(
            f"{p.model!r} is not loaded (this server serves {state.model_id!r} and does not switch "
            "models): need_bytes and fits_drained assume it served alone on this machine with this "
            "server's settings; fits_now and est_ttft_s are null: it holds no memory now and has no "
            "measured prefill rate"
        )
    if media:
        # Rendered (prompt_tokens counts the text) but not estimated: this engine is text-only.
        out.update(
            need_bytes=None, need_now_bytes=None, fits_now=None, fits_drained=None, est_ttft_s=None, estimated=False
        )
        notes.insert(
            0,
            f"not estimated: the body has {', '.join(sorted(set(media)))} content, "
            "which this text-only model does not take",
        )
    else:
        out["estimated"] = True
    return out | ({"note": "; ".join(notes)} if notes else {})


async def _served_estimate(state: ServerState, p: openai_api.GenerationParams) -> dict:
    prompt_ids = await asyncio.to_thread(state.tokenize, p)
    loaded, table = state.engine.loaded, state.table()
    assert loaded is not None and table is not None
    budget = table.budget
    stats, measured = state.engine.stats, state.engine.measured
    prefill_rate = stats.prefill_tok_s() or (measured.prefill_tok_s if measured else None)
    cache = state.engine.prompt_cache
    free_now = budget.free_now_bytes(mx.get_active_memory(), cache.bytes if cache is not None else 0)
    out = estimate(
        loaded.geometry,
        prompt_tokens=len(prompt_ids),
        max_tokens=p.max_tokens,
        context_limit=loaded.context_length,
        prefill_bytes=budget.prefill_bytes,
        free_now_bytes=free_now,
        free_drained_bytes=budget.drained_bytes,
        prefill_tok_s=prefill_rate,
        prefill_fit=fit_prefill(list(stats.recent_prefills)),
        prefill_step=state.engine.prefill_step,
        queue_wait_s=queue_wait_s(state),
        first_step_s=1 / measured.decode_tok_s if measured else 0.0,
        kv=table.kv,
        **_batch(state),
        **_prompt_cache_hit(state, prompt_ids),
    )
    return {**out, "model": state.model_id}


def _models_dir_file(state: ServerState, model: str) -> Path | None:
    """The models directory's `<model>.gguf`, matched by listing (as /system lists it), so a name
    cannot reach outside the directory."""
    return models_dir_files(state.settings.models_dir).get(model)


@functools.lru_cache(maxsize=_READERS)
def _reader(path: str, mtime_ns: int, size: int) -> tuple[GGUFHeader, Any]:
    """A file's header and tokenizer, kept per file version: building a tokenizer takes seconds."""
    h = read_header(path)
    return h, load_tokenizer(h)


def _not_loaded_estimate(state: ServerState, path: Path, p: openai_api.GenerationParams) -> dict:
    """The estimate for a model that is not loaded: the table `gmlx estimate` builds for its header."""
    try:
        st = path.stat()
        with _readers_lock:  # one build per file; and fast tokenizers must not be shared across threads
            h, tokenizer = _reader(str(path), st.st_mtime_ns, st.st_size)
            ids = openai_api.prompt_token_ids(tokenizer, p, h.geometry.vocab_size)
    except (GGUFError, OSError) as e:
        log.warning("cannot estimate for %s: %s", path, e)
        raise APIError(404, f"model {p.model!r} in the models directory cannot be read", "model_not_found") from None
    s = state.settings
    table, _ = header_table(
        h,
        s,
        mode=choose_mode(s.weights, h),
        memory=s.memory or platform.total_memory_bytes(),
        fast_kernels=kernels_fast.installed(),
        host_memory=platform.backend() != "cuda",
    )
    return {
        **estimate_not_loaded(table, prompt_tokens=len(ids), max_tokens=p.max_tokens, free_now_bytes=None),
        "model": p.model,
    }


def _batch(state: ServerState) -> dict:
    """The requests holding a batch row now, and the deepest of them (what a joining row pads to)."""
    depths = [len(r.prompt_ids) + r.generated for r in state.engine.requests() if r.state in ("prefill", "decode")]
    return {"running": len(depths), "longest": max(depths, default=0)}


def _prompt_cache_hit(state: ServerState, prompt_ids: list[int]) -> dict:
    """What the prompt cache would give this prompt now (it is only looked at, not changed)."""
    cache = state.engine.prompt_cache
    hit = cache.peek(prompt_ids) if cache is not None else MISS
    return {"warm_tokens": hit.warm_tokens, "cache_tier": hit.tier}


def queue_wait_s(state: ServerState) -> float:
    """Expected wait for a slot: none when one is free and nobody queues, else the drain time
    of everyone ahead (the Retry-After arithmetic, unrounded)."""
    gate = state.gate
    if gate.running < gate.width and not gate.waiting:
        return 0.0
    stats = state.engine.stats
    mean, rate = stats.mean_generated(), stats.decode_tok_s_recent() or stats.decode_tok_s_lifetime()
    if not mean or not rate:
        return float(gate.retry_after())
    return round((gate.waiting + 1) * mean / rate, 3)


async def estimate_route(request: Request) -> Response:
    state: ServerState = request.app.state.gmlx
    state.require_ready()
    return JSONResponse(await estimate_body(state, await read_json(request, state)))
