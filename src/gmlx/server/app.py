"""The Starlette app: its routes (the generation path is server/generation.py), the API key and /health."""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from gmlx.deployment import Deployment
from gmlx.gguf.header import GGUFError
from gmlx.server.admission import RETRY_AFTER_FULL_S
from gmlx.server.aliases import UnprefixedAliases
from gmlx.server.build import build_engine
from gmlx.server.capacity_routes import capacity_plan, estimate_route
from gmlx.server.cors import CORS
from gmlx.server.embeddings import embeddings
from gmlx.server.errors import APIError
from gmlx.server.generation import generate
from gmlx.server.http import ClientGone
from gmlx.server.memory_governor import Governor
from gmlx.server.messages import messages
from gmlx.server.metrics import snapshot
from gmlx.server.openapi import openapi_route
from gmlx.server.prometheus import content_type
from gmlx.server.residency import Build, Residency
from gmlx.server.responses import ResponseStore, responses
from gmlx.server.state import LOADING_RETRY_AFTER_S, ModelState, ServerState
from gmlx.server.system import models_dir_files, system_info
from gmlx.settings import Settings

log = logging.getLogger("gmlx.server")
OPEN_PATHS = frozenset({"/health", "/system"})


class APIKeyMiddleware:
    """Every route but the open ones needs the key, compared in constant time: as
    `Authorization: Bearer KEY`, or as `x-api-key: KEY`, which Anthropic's clients send."""

    def __init__(self, app: ASGIApp, key: str | None):
        self.app = app
        self.key = key.encode() if key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.key is None or scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = [_token(k, v) for k, v in scope["headers"] if k in (b"authorization", b"x-api-key")]
        if len(given) > 1:  # which one counts would be the server's guess, and proxies guess differently
            err = APIError(400, f"send the key once, not in {len(given)} headers", "invalid_request")
            return await err.response()(scope, receive, send)
        if not hmac.compare_digest(given[0] if given else b"", self.key):
            err = APIError(401, "a valid API key is required: Authorization: Bearer KEY", "invalid_api_key")
            return await err.response()(scope, receive, send)
        await self.app(scope, receive, send)


def _token(header: bytes, value: bytes) -> bytes:
    """The key a header gives: x-api-key's value, or Authorization's after its scheme, which is
    case-insensitive (RFC 9110: `bearer KEY` is `Bearer KEY`); b"" for another scheme."""
    if header == b"x-api-key":
        return value
    scheme, _, token = value.partition(b" ")
    return token.strip(b" ") if scheme.lower() == b"bearer" else b""


async def chat_completions(request: Request) -> Response:
    return await generate(request, chat=True)


async def completions(request: Request) -> Response:
    return await generate(request, chat=False)


async def models(request: Request) -> Response:
    """Every model a request may name: resident, loading, or on disk (the models directory's
    files, and presets), with its status."""
    state: ServerState = request.app.state.gmlx
    if state.residency is not None:
        for model_id in models_dir_files(state.settings.models_dir):
            if model_id not in state.models:
                state.residency.discover(model_id)  # a file added since start is listed too
    return JSONResponse({"object": "list", "data": [_model_entry(state, m) for m in state.models.values()]})


async def model_retrieve(request: Request) -> Response:
    """GET /v1/models/{id}: the openai client's `models.retrieve`; an unknown id is a 404 `model_not_found`."""
    state: ServerState = request.app.state.gmlx
    return JSONResponse(_model_entry(state, state.find(request.path_params["model_id"])))


async def model_load(request: Request) -> Response:
    """POST /v1/models/{id}/load: resident on return, or 503 `model_unavailable` saying why not."""
    state: ServerState = request.app.state.gmlx
    m = state.find(request.path_params["model_id"])
    assert state.residency is not None
    await state.residency.ensure(m)
    engine = m.engine
    if engine is not None:
        await asyncio.to_thread(engine.ready.wait)
    if not m.ready:
        raise APIError(
            503,
            f"model {m.model_id!r} failed to load: {m.load_error}",
            "model_unavailable",
            retry_after=LOADING_RETRY_AFTER_S,
        )
    return JSONResponse(_model_entry(state, m))


async def model_unload(request: Request) -> Response:
    """POST /v1/models/{id}/unload: 404 when not loaded, 409 while it has work (docs/api.md)."""
    state: ServerState = request.app.state.gmlx
    m = state.find(request.path_params["model_id"])
    assert state.residency is not None
    await state.residency.unload(m)
    return JSONResponse(_model_entry(state, m))


def _model_entry(state: ServerState, m: ModelState) -> dict[str, Any]:
    d = m.deployment
    entry: dict[str, Any] = {
        "id": m.model_id,
        "object": "model",
        "created": _created(d, state.started_at),
        "owned_by": "gmlx",
        "status": m.status,
    }
    loaded = m.engine.loaded if m.engine is not None else None
    entry["context_length"] = loaded.context_length if loaded is not None else _planned_context(d)
    table = m.table()
    entry["max_context_at_width_1"] = table.max_context_at_width(1) if table else None
    if loaded is not None and (kv_quant := getattr(m.engine, "kv_quant", None)) is not None:
        entry["kv_quant"] = kv_quant.to_json()
    entry["preloaded"] = m is state.default
    entry["source"] = d.origin
    if m.load_error is not None:
        entry["load_error"] = m.load_error
    return entry


def _created(d: Deployment, started_at: float) -> int:
    """The file's modification time, steady across loads and unloads (the server's start when the
    file is gone: a loaded model serves on without it)."""
    try:
        return int(d.path.stat().st_mtime)
    except OSError:
        return int(started_at)


def _planned_context(d: Deployment) -> int | None:
    """A model not loaded: its window from its header (a harness sizes its prompts by it), or None
    while its file cannot be read (its load_error, or a load, says why)."""
    try:
        return d.context_length
    except (GGUFError, OSError):
        return None


async def health(request: Request) -> Response:
    """Ready while some model can take a request now; otherwise the reason of the preloaded model,
    or where it is not resident, of the first that is."""
    state: ServerState = request.app.state.gmlx
    body: dict[str, Any] = {"status": "healthy", "pid": os.getpid()}
    if request.query_params.get("ready") not in ("1", "true", "yes"):
        return JSONResponse(body)
    models = [state.default, *(m for m in state.resident() if m is not state.default)]
    reasons = [(m, _not_ready(state, m)) for m in models]
    if any(r is None for _, r in reasons):
        return JSONResponse({**body, "ready": True})
    reason, retry = next((r for m, r in reasons if m.engine is not None), reasons[0][1])  # type: ignore[misc]
    return JSONResponse(
        {**body, "ready": False, "reason": reason}, status_code=503, headers={"Retry-After": str(retry)}
    )


def _not_ready(state: ServerState, m: ModelState) -> tuple[str, int] | None:
    gate = m.gate
    if gate.closed:
        return "shutting_down", RETRY_AFTER_FULL_S
    if not m.ready and not state.cold:  # cold: every model unloaded, idle; a request loads it again
        return "loading", LOADING_RETRY_AFTER_S
    if state.band in ("orange", "red"):
        return "pressure", gate.retry_after(waiting=max(1, gate.waiting))
    if gate.waiting:
        return "queue", gate.retry_after()
    if gate.running >= gate.width:
        return "busy", gate.retry_after()
    return None


async def metrics_route(request: Request) -> Response:
    state: ServerState = request.app.state.gmlx
    fmt = request.query_params.get("format")
    if fmt not in (None, "json", "prometheus"):
        raise APIError(400, f"'format' must be json or prometheus, not {fmt!r}", "invalid_request", param="format")
    snap = snapshot(state)
    if fmt == "prometheus":
        accept = request.headers.get("accept")
        return Response(state.histograms.render(snap, accept=accept), media_type=content_type(accept))
    return JSONResponse(snap)


async def router_metrics(request: Request) -> Response:
    """GET /metrics: the Prometheus text of /v1/metrics?format=prometheus plus the vLLM series routers read.
    Their model_name is the preloaded model's id whatever is resident: one series a server, whose
    identity a router's or an autoscaler's query keeps while models load and unload."""
    state: ServerState = request.app.state.gmlx
    accept = request.headers.get("accept")
    text = state.histograms.render(snapshot(state), router=state.default.model_id, accept=accept)
    return Response(text, media_type=content_type(accept))


async def system_route(request: Request) -> Response:
    return JSONResponse(system_info(request.app.state.gmlx))


def _logged_path(request: Request) -> str:
    """The path with its control characters escaped: a client's ESC or NUL must not reach a terminal
    that tails the log."""
    path = request.url.path
    return path if path.isprintable() else repr(path)[1:-1]


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    log.info("%s %s -> %d %s", request.method, _logged_path(request), exc.status, exc.code)
    return exc.response()


async def _client_gone(request: Request, exc: Exception) -> Response:
    log.info("%s %s -> client_gone (mid-upload)", request.method, _logged_path(request))
    return Response(status_code=499)  # nobody reads it: the code the log and the metrics would use


async def _internal_error(request: Request, exc: Exception) -> Response:
    # Starlette logs the traceback after this answer; the client gets the OpenAI shape, not plain text.
    return APIError(500, "internal server error", "internal_error").response()


async def _not_found(request: Request, exc: Exception) -> Response:
    status = getattr(exc, "status_code", 404)
    code = "not_found" if status == 404 else "method_not_allowed"
    response = APIError(
        status,
        f"{request.method} {request.url.path}: {code.replace('_', ' ')}",
        code,
        type_="invalid_request_error" if status == 405 else None,
    ).response()
    response.headers.update(getattr(exc, "headers", None) or {})  # a 405 says what is allowed (Allow)
    return response


def create_app(settings: Settings, served: dict[str, Deployment], build: Build = build_engine) -> Starlette:
    """The app for the models it serves, by id, the preloaded one first; `build` makes a model's engine
    (the tests' scripted engines plug in here). The preloaded model's engine is built, and starts
    loading at `state.residency.preload()`."""
    state = ServerState(settings, {})
    state.models = {mid: ModelState(d, state.histograms) for mid, d in served.items()}

    def publish_band(band: str) -> None:  # on the governor's thread; readers take the latest
        state.band = band

    residency = state.residency = Residency(state, build, admits=lambda m: governor.admits(m))
    # Disabled by GMLX_GOVERNOR=0, but still reports so.
    governor = state.governor = Governor(settings, state.budget_table, state.resident, publish_band, residency.relieve)
    residency.prepare()

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if not settings.api_key:
            log.warning("no API key set: every route is open (set --api-key or GMLX_API_KEY)")
        residency.start()
        governor.start()
        yield
        governor.stop()
        residency.stop(settings.shutdown_timeout)

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model_id}", model_retrieve, methods=["GET"]),
        Route("/v1/models/{model_id}/load", model_load, methods=["POST"]),
        Route("/v1/models/{model_id}/unload", model_unload, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/v1/capacity/plan", capacity_plan, methods=["GET"]),
        Route("/v1/estimate", estimate_route, methods=["POST"]),
        Route("/v1/metrics", metrics_route, methods=["GET"]),
        Route("/metrics", router_metrics, methods=["GET"]),
        Route("/system", system_route, methods=["GET"]),
        Route("/openapi.json", openapi_route, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={
            APIError: _api_error,
            ClientGone: _client_gone,
            404: _not_found,
            405: _not_found,
            Exception: _internal_error,
        },
    )
    app.state.gmlx = state
    app.state.responses = ResponseStore()  # what previous_response_id can name (server/responses.py)
    app.add_middleware(APIKeyMiddleware, key=settings.api_key)
    app.add_middleware(UnprefixedAliases, routes=routes)
    if settings.cors_origins:  # outermost: a preflight is answered before the key is asked for
        app.add_middleware(CORS, origins=settings.cors_origins)
    return app
