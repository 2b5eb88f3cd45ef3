"""Every `/v1/...` route also answers without the prefix, as llama-server serves them.

A client whose base URL lacks `/v1` (llama.cpp's own test suite, many local-LLM front ends) calls
`/chat/completions`, `/models`, `/models/{id}`. Rather than a second handler or a second route per
path, the path is rewritten before routing: one that no route claims as it is but `/v1` + it does
is routed as the latter. A path that is a route of its own keeps it (`/metrics` is the routers'
Prometheus text, not `/v1/metrics`), and one that neither form matches stays a 404 naming what the
client sent. `/openapi.json` lists the `/v1` forms and states the rule once (server/openapi.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Receive, Scope, Send

PREFIX = "/v1"


class UnprefixedAliases:
    """Routes `/X` as `/v1/X` when only the latter is a route (its method need not match: a wrong
    one then gets the route's 405, which says what is allowed)."""

    def __init__(self, app: ASGIApp, routes: Sequence[BaseRoute]):
        self.app = app
        self.routes = routes

    def _claimed(self, scope: Scope) -> bool:
        return any(route.matches(scope)[0] != Match.NONE for route in self.routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not scope["path"].startswith(PREFIX + "/") and not self._claimed(scope):
            aliased = {**scope, "path": PREFIX + scope["path"]}
            if self._claimed(aliased):
                scope = aliased
        await self.app(scope, receive, send)
