"""GET /v1/capacity/plan and POST /v1/estimate (also `"dry_run": true` on chat and completions)."""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import threading
from typing import Any

import mlx.core as mx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gmlx.capacity.estimate import (
    estimate,
    estimate_embedding,
    estimate_embedding_not_loaded,
    estimate_not_loaded,
    fit_prefill,
)
from gmlx.capacity.plan import LiveState, plan
from gmlx.capacity.table import CapacityTable
from gmlx.engine.engine import Engine
from gmlx.engine.prompt_cache import MISS
from gmlx.gguf.header import GGUFError, read_header
from gmlx.gguf.tokenizer import load_tokenizer
from gmlx.server import embeddings, openai_api
from gmlx.server.errors import APIError, bad_request
from gmlx.server.http import read_json
from gmlx.server.state import ModelState, ServerState

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


def live_state(state: ServerState, m: ModelState) -> LiveState:
    """A model not loaded admits now when a request could load it now (it waits for the load, as
    /health?ready=1 reads it): a plan check that said otherwise would keep an idle server out forever."""
    not_ready = None
    if m.status == "unloaded":
        refusal = state.residency.outlook(m)[0] if state.residency is not None else None
        not_ready = f"model not loaded, nor loadable now: {refusal}" if refusal else None
    elif not m.ready:
        not_ready = "model loading"
    elif m.gate.closed:
        not_ready = "shutting down"
    return LiveState(m.settings.decode_batch, m.gate.running, m.gate.waiting, band=state.band, not_ready=not_ready)


def planned_table(state: ServerState, m: ModelState) -> CapacityTable:
    """The table `m` would build beside the models resident now, from its header (while it has
    none of its own: it is not resident, or still loading); a 404 when its file cannot be read."""
    assert state.residency is not None
    try:
        return m.deployment.planned_table(state.residency.others_bytes(m))[0]
    except (GGUFError, OSError) as e:
        raise _unreadable(m, e) from None


async def capacity_plan(request: Request) -> Response:
    """GET /v1/capacity/plan: for `model=` (the preloaded model without it)."""
    state: ServerState = request.app.state.gmlx
    width, depth = _positive_int(request, "width"), _positive_int(request, "depth")
    m = state.find(request.query_params.get("model"))
    table = m.table() or await asyncio.to_thread(planned_table, state, m)
    return JSONResponse(plan(table, width, depth, live_state(state, m), m.model_id, overcommit=m.settings.overcommit))


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


async def estimate_body(state: ServerState, body: Any, chat: bool | None = None) -> dict:
    """The estimate for a chat-completions body; renders the prompt exactly as a real request would,
    for a resident model or for one not loaded (from its header, never loading it). An embeddings
    body (`input`, no `messages`) gets the estimate of that request, and a completions body
    (`prompt`, no `messages`) that of its prompt. A generation route's dry run says which (`chat`):
    its body is read as that route reads it."""
    media: list[str] = []
    bare = isinstance(body, dict) and "messages" not in body
    if chat is None and bare and "input" in body:
        inputs = embeddings.parse_inputs(body)
        m = state.find(body.get("model"))
        if m.ready:
            out = await _served_embedding_estimate(m, inputs)
        else:
            out = await asyncio.to_thread(_not_loaded_embedding_estimate, state, m, inputs)
    else:
        chat = not (bare and "prompt" in body) if chat is None else chat
        media = media_parts(body) if chat else []
        p = openai_api.parse(_text_only(body) if media else body, chat=chat)
        m = state.find(p.model)
        m.check_choices(p.n)
        out = (
            await _served_estimate(state, m, p)
            if m.ready
            else await asyncio.to_thread(_not_loaded_estimate, state, m, p)
        )
    notes: list[str] = []
    if not m.ready:
        refusal = out.pop("refusal", None)
        evicts = ", ".join(out["evicts"]) or "nothing"
        loading = f"it cannot load now ({refusal})" if refusal else f"loading it would unload {evicts}"
        notes.append(
            f"{m.model_id!r} is not loaded: need_bytes and fits_drained are for it beside the models "
            f"resident now; {loading}; fits_now and est_ttft_s are null: it "
            "holds no memory now and has no measured prefill rate"
        )
    out["resident"] = m.ready
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


async def _served_estimate(state: ServerState, m: ModelState, p: openai_api.GenerationParams) -> dict:
    prompt_ids = await asyncio.to_thread(m.tokenize, p)
    engine = m.engine
    assert engine is not None and engine.loaded is not None
    measured = engine.measured
    out = estimate(
        engine.loaded.geometry,
        prompt_tokens=len(prompt_ids),
        max_tokens=p.max_tokens,
        first_step_s=1 / measured.decode_tok_s if measured else 0.0,
        choices=p.n,
        **_served_terms(m, p.n),
        **_batch(engine),
        **_prompt_cache_hit(engine, prompt_ids),
    )
    return {**out, "model": m.model_id}


def _served_terms(m: ModelState, slots: int = 1) -> dict[str, Any]:
    """What an estimate on the resident model reads from its table and its engine's measurements,
    for a request of `slots` rows (choices)."""
    engine, table = m.engine, m.table()
    assert engine is not None and engine.loaded is not None and table is not None
    budget, stats, measured, cache = table.budget, engine.stats, engine.measured, engine.prompt_cache
    return {
        "context_limit": engine.loaded.context_length,
        "prefill_bytes": budget.prefill_bytes,
        "free_now_bytes": budget.free_now_bytes(mx.get_active_memory(), cache.bytes if cache is not None else 0),
        "free_drained_bytes": budget.drained_bytes,
        "prefill_tok_s": stats.prefill_tok_s() or (measured.prefill_tok_s if measured else None),
        "prefill_fit": fit_prefill(list(stats.recent_prefills)),
        "prefill_step": engine.prefill_step,
        "queue_wait_s": queue_wait_s(m, slots),
        "kv": table.kv,
    }


@functools.lru_cache(maxsize=_READERS)
def _reader(path: str, mtime_ns: int, size: int) -> Any:
    """A file's tokenizer, kept per file version: building one takes seconds."""
    return load_tokenizer(read_header(path))


def _file_tokenizer(m: ModelState) -> tuple[Any, int]:
    """The tokenizer and vocabulary size of a model not loaded, from its file (the caller holds
    `_readers_lock`); a 404 when the file cannot be read."""
    path = m.deployment.path
    try:
        st = path.stat()
        return _reader(str(path), st.st_mtime_ns, st.st_size), m.deployment.header.geometry.vocab_size
    except (GGUFError, OSError) as e:
        raise _unreadable(m, e) from None


def _unreadable(m: ModelState, e: Exception) -> APIError:
    """What a capacity route answers for a model whose file cannot be read (its path stays in the log)."""
    log.warning("cannot plan or estimate for %s: %s", m.deployment.path, e)
    return APIError(404, f"model {m.model_id!r} in the models directory cannot be read", "model_not_found")


def _not_loaded_estimate(state: ServerState, m: ModelState, p: openai_api.GenerationParams) -> dict:
    """The estimate for a model that is not loaded (_beside)."""
    with _readers_lock:  # one build per file; and fast tokenizers must not be shared across threads
        tokenizer, vocab_size = _file_tokenizer(m)
        ids = openai_api.prompt_token_ids(tokenizer, p, vocab_size)
    table, load = _beside(state, m)
    out = estimate_not_loaded(table, prompt_tokens=len(ids), max_tokens=p.max_tokens, free_now_bytes=None, choices=p.n)
    return out | load


def _not_loaded_embedding_estimate(state: ServerState, m: ModelState, inputs: list[str | list[int]]) -> dict:
    with _readers_lock:
        ids = embeddings.input_ids(*_file_tokenizer(m), inputs)
    table, load = _beside(state, m)
    return estimate_embedding_not_loaded(table, input_tokens=[len(i) for i in ids], free_now_bytes=None) | load


def _beside(state: ServerState, m: ModelState) -> tuple[CapacityTable, dict]:
    """The table a model not loaded would build beside the resident models, and what its load
    would do: whether it can load now, and the idle models it would unload first."""
    assert state.residency is not None
    try:
        refusal, leaving = state.residency.outlook(m)
        table = m.deployment.planned_table(state.residency.others_bytes(m, leaving))[0]
    except (GGUFError, OSError) as e:
        raise _unreadable(m, e) from None
    return table, {"model": m.model_id, "loadable": refusal is None, "evicts": [r.model_id for r in leaving]} | (
        {"refusal": refusal} if refusal else {}
    )


async def _served_embedding_estimate(m: ModelState, inputs: list[str | list[int]]) -> dict:
    engine = m.engine
    assert engine is not None and engine.loaded is not None
    loaded = engine.loaded

    def tokenized() -> list[list[int]]:  # off the loop, as the route's own
        with m.tokenizer_lock:
            return embeddings.input_ids(loaded.tokenizer, loaded.geometry.vocab_size, inputs)

    ids = await asyncio.to_thread(tokenized)
    return {
        **estimate_embedding(loaded.geometry, input_tokens=[len(i) for i in ids], **_served_terms(m)),
        "model": m.model_id,
    }


def _batch(engine: Engine) -> dict:
    """The requests holding a batch row now, and the deepest of them (what a joining row pads to)."""
    depths = [len(r.prompt_ids) + r.generated for r in engine.requests() if r.state in ("prefill", "decode")]
    return {"running": len(depths), "longest": max(depths, default=0)}


def _prompt_cache_hit(engine: Engine, prompt_ids: list[int]) -> dict:
    """What the prompt cache would give this prompt now (it is only looked at, not changed)."""
    cache = engine.prompt_cache
    hit = cache.peek(prompt_ids) if cache is not None else MISS
    return {"warm_tokens": hit.warm_tokens, "cache_tier": hit.tier}


def queue_wait_s(m: ModelState, slots: int = 1) -> float:
    """Expected wait for `slots` slots together: none when they are free and nobody queues, else
    the time for everyone ahead and the running requests it lacks slots for to finish (the
    Retry-After arithmetic, unrounded)."""
    gate = m.gate
    if gate.running + slots <= gate.width and not gate.waiting:
        return 0.0
    ahead = gate.waiting + max(1, gate.running + slots - gate.width)
    mean, rate = m.drain_rate()
    if not mean or not rate:
        return float(gate.retry_after(waiting=ahead))
    return round(ahead * mean / rate, 3)


async def estimate_route(request: Request) -> Response:
    state: ServerState = request.app.state.gmlx
    return JSONResponse(await estimate_body(state, await read_json(request, state)))
