"""CORS for browser clients: off unless `--cors-origins` names the origins (or `*`) allowed.

Starlette's CORSMiddleware does the protocol; it sits outside the API-key check, so a preflight
(OPTIONS with Access-Control-Request-Method, which a browser sends without the key) is answered
before the key is asked for, and an error answer (401, 503) still carries the headers that let the
page read it. An origin not listed sees the server as if CORS were off: no `Access-Control-*`
header, and its preflight goes on to the routes (a 401 or 405), which a browser treats as refused.
"""

from __future__ import annotations

from collections.abc import Sequence

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from gmlx.server.errors import APIError

# Headers a page may read beyond the safelisted ones: when to come back, and the request's id.
EXPOSED = ("Retry-After",)


class CORS(CORSMiddleware):
    def __init__(self, app: ASGIApp, origins: Sequence[str]):
        # Any request header may be asked for (the key, the openai SDK's x-stainless-*); no cookies:
        # the key is a header the page sets, not a credential the browser adds on its own.
        super().__init__(
            app,
            allow_origins=tuple(origins),
            allow_methods=("GET", "POST"),
            allow_headers=("*",),
            expose_headers=EXPOSED,
            allow_private_network=True,
        )

    def preflight_response(self, request_headers: Headers) -> Response:
        """Starlette's answer; a refusal (a method or header not allowed) in the OpenAI shape, as every
        other refusal is, with the headers Starlette gave it."""
        response = super().preflight_response(request_headers)
        if response.status_code < 400:
            return response
        why = bytes(response.body).decode().removeprefix("Disallowed CORS ")
        refused = APIError(400, f"CORS preflight refused: {why} not allowed", "cors_refused").response()
        refused.headers.update(
            {k: v for k, v in response.headers.items() if k.startswith("access-control-") or k == "vary"}
        )
        return refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        origin = Headers(scope=scope).get("origin") if scope["type"] == "http" else None
        if origin is None or not self.is_allowed_origin(origin):
            return await self.app(scope, receive, send)
        await super().__call__(scope, receive, send)
