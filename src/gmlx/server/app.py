"""The Starlette app: OpenAI routes, the admission gate, the API key and /health."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from gmlx.engine.engine import Chunk, Engine, Event, Failed, Finished
from gmlx.engine.engine import Request as EngineRequest
from gmlx.engine.logprobs import TokenLogprob
from gmlx.server import logprobs, openai_api
from gmlx.server.admission import RETRY_AFTER_FULL_S, Slot
from gmlx.server.capacity_routes import capacity_plan, estimate_body, estimate_route
from gmlx.server.errors import APIError
from gmlx.server.governor import Governor
from gmlx.server.http import ClientGone, read_json, relay, unless_disconnected
from gmlx.server.metrics import snapshot
from gmlx.server.openapi import openapi_route
from gmlx.server.settings import Settings
from gmlx.server.state import LOADING_RETRY_AFTER_S, QueuedRow, ServerState
from gmlx.server.system import system_info

log = logging.getLogger("gmlx.server")
OPEN_PATHS = frozenset({"/health", "/system"})


class APIKeyMiddleware:
    """Every route but the open ones needs `Authorization: Bearer KEY`, compared in constant time."""

    def __init__(self, app: ASGIApp, key: str | None):
        self.app = app
        self.expected = f"Bearer {key}".encode() if key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.expected is None or scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = [v for k, v in scope["headers"] if k == b"authorization"]
        if len(given) > 1:  # which one counts would be the server's guess, and proxies guess differently
            err = APIError(400, f"send one Authorization header, not {len(given)}", "invalid_request")
            return await err.response()(scope, receive, send)
        if not hmac.compare_digest(given[0] if given else b"", self.expected):
            err = APIError(401, "a valid API key is required: Authorization: Bearer KEY", "invalid_api_key")
            return await err.response()(scope, receive, send)
        await self.app(scope, receive, send)


def _log_end(state: ServerState, req: EngineRequest, end: Finished | Failed | None, prompt: Any, text: str) -> None:
    """The one line per request, however it ended: finished, cancelled, failed (finish=error:CODE) or
    left by its client (finish=client_gone); the prompt and output only with LOG_INPUT_TEXT."""
    if isinstance(end, Finished):
        state.histograms.observe_ttft(end.ttft_s)
        generated, ttft, rate, finish = end.completion_tokens, end.ttft_s, end.decode_tok_s, end.finish_reason
    else:  # the engine's live figures for a request that did not finish
        generated, ttft, rate = req.generated, req.ttft_s, req.decode_tok_s()
        finish = "client_gone" if end is None else f"error:{end.code}"
    log.info("%s prompt=%d generated=%d ttft=%s decode=%s tok/s finish=%s", req.id, len(req.prompt_ids), generated,
             "-" if ttft is None else f"{ttft:.3f}s", "-" if rate is None else f"{rate:.1f}", finish)
    if state.settings.log_input_text:
        log.info("%s input=%s output=%s", req.id, json.dumps(prompt, ensure_ascii=False), json.dumps(text, ensure_ascii=False))


async def generate(request: Request, chat: bool) -> Response:
    state: ServerState = request.app.state.gmlx
    state.require_ready()
    body = await read_json(request, state)
    if chat and isinstance(body, dict) and body.get("dry_run") is True:
        return JSONResponse(await estimate_body(state, body))
    p = openai_api.parse(body, chat)
    state.check_model(p.model)
    if p.sampling.top_k >= state.engine.loaded.geometry.vocab_size:  # type: ignore[union-attr]
        p = replace(p, sampling=replace(p.sampling, top_k=0))  # keeping every token is no top-k (mlx_lm refuses it)
    prompt_ids, anchor = await asyncio.to_thread(state.tokenize_with_anchor, p)
    context = state.engine.loaded.context_length  # type: ignore[union-attr]
    if len(prompt_ids) >= context:
        raise APIError(400, f"the prompt has {len(prompt_ids)} tokens; the context window holds {context}",
                       "context_length_exceeded", param="messages" if chat else "prompt")
    max_tokens = min(p.max_tokens or state.settings.max_tokens_default, context - len(prompt_ids))

    rid = openai_api.new_id(chat)
    if await request.is_disconnected():  # gone while its prompt was tokenized: no queue place, no rejection
        log.info("%s prompt=%d generated=0 finish=client_gone (before the queue)", rid, len(prompt_ids))
        return Response(status_code=499)
    state.queued[rid] = QueuedRow(rid, len(prompt_ids), max_tokens)
    try:
        await unless_disconnected(request, state.gate.acquire())
    except ClientGone:
        log.info("%s prompt=%d generated=0 finish=client_gone (while queued)", rid, len(prompt_ids))
        return Response(status_code=499)
    except APIError as e:
        log.info("%s prompt=%d generated=0 finish=rejected:%s", rid, len(prompt_ids), e.code)
        raise
    finally:
        del state.queued[rid]

    events: asyncio.Queue[Event] = asyncio.Queue()
    slot = Slot(state.gate)

    def deliver(e: Event) -> None:  # on the loop; the slot frees when the engine lets go of it
        events.put_nowait(e)
        if isinstance(e, (Finished, Failed)):
            slot.release()

    to_loop = relay(asyncio.get_running_loop())  # a step's events for every stream: one loop wake-up
    req = EngineRequest(rid, prompt_ids, max_tokens, p.sampling, p.stop,
                        emit=lambda e: to_loop.call(deliver, e), anchor_tokens=anchor, logprobs=p.logprobs)
    state.engine.submit(req)
    prompt_for_log = p.messages if chat else p.prompt
    if p.stream:
        return StreamingResponse(_sse(state, p, req, slot, events, prompt_for_log), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        text, scored, end = await unless_disconnected(request, _collect(events))
    except ClientGone:
        state.engine.cancel(rid)
        slot.release()
        _log_end(state, req, None, prompt_for_log, "")
        return Response(status_code=499)
    _log_end(state, req, end, prompt_for_log, text)
    if isinstance(end, Failed):
        # Stopped to relieve memory is the server's load, not its fault: 503, try again later.
        pressure = end.code == "memory_pressure"
        raise APIError(503 if pressure else 500, end.message, end.code,
                       retry_after=state.gate.retry_after() if pressure else None)
    if end.finish_reason == "cancelled":
        raise APIError(503, "the server is shutting down", "shutting_down", retry_after=RETRY_AFTER_FULL_S)
    use = openai_api.usage(end.prompt_tokens, end.completion_tokens, end.cached_tokens)
    return JSONResponse(openai_api.completion(p, rid, state.model_id, text, end.finish_reason, use,
                                              logprobs.shape(p.chat, scored, state.token_bytes())))


async def _collect(events: asyncio.Queue[Event]) -> tuple[str, list[TokenLogprob] | None, Finished | Failed]:
    parts, scored = [], None
    while isinstance(e := await events.get(), Chunk):
        parts.append(e.text)
        if e.logprobs is not None:
            scored = (scored or []) + e.logprobs
    return "".join(parts), scored, e


def _sse_data(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _sse(state: ServerState, p: openai_api.GenerationParams, req: EngineRequest, slot: Slot,
               events: asyncio.Queue[Event], prompt_for_log: Any) -> AsyncIterator[str]:
    model, rid, parts, ended = state.model_id, req.id, [], False
    try:
        if p.chat:
            yield _sse_data(openai_api.chunk(p, rid, model, role=True))
        offset = 0  # where the next chunk's text starts, for the completions API's text_offset
        while isinstance(e := await events.get(), Chunk):
            parts.append(e.text)
            shaped = logprobs.shape(p.chat, e.logprobs, state.token_bytes(), offset)
            yield _sse_data(openai_api.chunk(p, rid, model, text=e.text, logprobs=shaped))
            offset += len(e.text)
        ended = True
        _log_end(state, req, e, prompt_for_log, "".join(parts))
        if isinstance(e, Failed) or e.finish_reason == "cancelled":
            message, code = (e.message, e.code) if isinstance(e, Failed) else ("the server is shutting down", "shutting_down")
            yield _sse_data({"error": {"message": message, "type": "server_error", "code": code}})
        else:
            yield _sse_data(openai_api.chunk(p, rid, model, finish=e.finish_reason))
            if p.include_usage:
                yield _sse_data(openai_api.chunk(p, rid, model, use=openai_api.usage(e.prompt_tokens, e.completion_tokens, e.cached_tokens)))
        yield "data: [DONE]\n\n"
    finally:
        if not ended:  # the client went away mid-stream: the engine drops the request within one step
            state.engine.cancel(rid)
            slot.release()
            _log_end(state, req, None, prompt_for_log, "".join(parts))


async def chat_completions(request: Request) -> Response:
    return await generate(request, chat=True)


async def completions(request: Request) -> Response:
    return await generate(request, chat=False)


async def models(request: Request) -> Response:
    state: ServerState = request.app.state.gmlx
    state.require_ready()
    entry: dict[str, Any] = {"id": state.model_id, "object": "model", "created": int(state.started_at), "owned_by": "gmlx"}
    if (loaded := state.engine.loaded) is not None:
        entry["context_length"] = loaded.context_length
    table = state.table()
    entry["max_context_at_width_1"] = table.max_context_at_width(1) if table else None
    if loaded is not None and (kv_quant := getattr(state.engine, "kv_quant", None)) is not None:
        entry["kv_quant"] = kv_quant.to_json()
    return JSONResponse({"object": "list", "data": [entry]})


async def health(request: Request) -> Response:
    state: ServerState = request.app.state.gmlx
    body: dict[str, Any] = {"status": "healthy", "pid": os.getpid()}
    if request.query_params.get("ready") not in ("1", "true", "yes"):
        return JSONResponse(body)
    gate = state.gate
    reason, retry = None, 0
    if not state.ready:
        reason, retry = "loading", LOADING_RETRY_AFTER_S
    elif gate.closed:
        reason, retry = "shutting_down", RETRY_AFTER_FULL_S
    elif state.band in ("orange", "red"):
        reason, retry = "pressure", gate.retry_after(waiting=max(1, gate.waiting))
    elif gate.waiting:
        reason, retry = "queue", gate.retry_after()
    elif gate.running >= gate.width:
        reason, retry = "busy", gate.retry_after(waiting=1)
    if reason is None:
        return JSONResponse({**body, "ready": True})
    return JSONResponse({**body, "ready": False, "reason": reason}, status_code=503, headers={"Retry-After": str(retry)})


async def metrics_route(request: Request) -> Response:
    state: ServerState = request.app.state.gmlx
    fmt = request.query_params.get("format")
    if fmt not in (None, "json", "prometheus"):
        raise APIError(400, f"'format' must be json or prometheus, not {fmt!r}", "invalid_request", param="format")
    snap = snapshot(state)
    if fmt == "prometheus":
        return Response(state.histograms.render(snap), media_type=CONTENT_TYPE_LATEST)
    return JSONResponse(snap)


async def system_route(request: Request) -> Response:
    return JSONResponse(system_info(request.app.state.gmlx))


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    log.info("%s %s -> %d %s", request.method, request.url.path, exc.status, exc.code)
    return exc.response()


async def _client_gone(request: Request, exc: Exception) -> Response:
    log.info("%s %s -> client_gone (mid-upload)", request.method, request.url.path)
    return Response(status_code=499)  # nobody reads it: the code the log and the metrics would use


async def _internal_error(request: Request, exc: Exception) -> Response:
    # Starlette logs the traceback after this answer; the client gets the OpenAI shape, not plain text.
    return APIError(500, "internal server error", "internal_error").response()


async def _not_found(request: Request, exc: Exception) -> Response:
    status = getattr(exc, "status_code", 404)
    code = "not_found" if status == 404 else "method_not_allowed"
    response = APIError(status, f"{request.method} {request.url.path}: {code.replace('_', ' ')}", code,
                        type_="invalid_request_error" if status == 405 else None).response()
    response.headers.update(getattr(exc, "headers", None) or {})  # a 405 says what is allowed (Allow)
    return response


def create_app(settings: Settings, engine: Engine, model_id: str) -> Starlette:
    state = ServerState(settings, engine, model_id)
    engine.on_token_gap = state.histograms.observe_gap  # on the engine thread; prometheus_client locks
    governor = state.governor = Governor(state)  # disabled by GMLX_GOVERNOR=0, but still reports so

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if not settings.api_key:
            log.warning("no API key set: every route is open (set --api-key or GMLX_API_KEY)")
        governor.start()
        yield
        governor.stop()
        engine.stop(settings.shutdown_timeout)

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/v1/capacity/plan", capacity_plan, methods=["GET"]),
        Route("/v1/estimate", estimate_route, methods=["POST"]),
        Route("/v1/metrics", metrics_route, methods=["GET"]),
        Route("/system", system_route, methods=["GET"]),
        Route("/openapi.json", openapi_route, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={APIError: _api_error, ClientGone: _client_gone, 404: _not_found,
                                        405: _not_found, Exception: _internal_error})
    app.state.gmlx = state
    app.add_middleware(APIKeyMiddleware, key=settings.api_key)
    return app
