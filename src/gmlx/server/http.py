"""Request bodies and client disconnects, for every route that reads or waits."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from typing import Any, TypeVar

from starlette.requests import Request

from gmlx.server.errors import APIError, bad_request

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def read_json(request: Request, limit: int) -> Any:
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > limit:
        raise APIError(413, f"the request body is over {limit} bytes", "request_too_large")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise APIError(413, f"the request body is over {limit} bytes", "request_too_large")
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None


async def until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and raising ClientGone) if the client goes away first."""
    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        # Work that finished despite the cancel (Python 3.11's wait_for can swallow one that
        # lands as its future completes) has a result the caller must own: a slot granted at
        # that moment is used, and freed, like any other rather than leaked.
        return await task
    except asyncio.CancelledError:
        raise ClientGone from None
