"""Request bodies and client disconnects, for every route that reads or waits."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import weakref
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from starlette.requests import ClientDisconnect, Request

from gmlx.server.errors import APIError, bad_request

if TYPE_CHECKING:
    from gmlx.server.state import ServerState

T = TypeVar("T")
log = logging.getLogger("gmlx.server")
MAX_JSON_DEPTH = 64  # far beyond any OpenAI body (a tool's JSON schema included), far below the stack


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def read_json(request: Request, state: ServerState) -> Any:
    """The body as JSON, or a 4xx: over the size limit (413), not all sent within the body timeout
    (408), not JSON, nested deeper than MAX_JSON_DEPTH or holding a lone UTF-16 surrogate (400,
    which no tokenizer can encode). Raises ClientGone when the client leaves mid-upload."""
    limit, timeout = state.settings.max_body_bytes, state.settings.body_timeout
    length = request.headers.get("content-length")
    too_large = APIError(413, f"the request body is over {limit} bytes", "request_too_large", close=True)
    if length and length.isdigit() and int(length) > limit:
        raise too_large
    body = bytearray()
    try:
        async with asyncio.timeout(timeout):
            async for part in request.stream():
                body += part
                if len(body) > limit:
                    raise too_large
    except TimeoutError:
        state.connections.body_timeouts += 1
        raise APIError(
            408, f"the request body did not arrive within {timeout:g} s", "body_timeout", close=True
        ) from None
    except ClientDisconnect:
        raise ClientGone from None
    try:
        value = json.loads(body)
    except RecursionError:  # deeper than the parser's own limit
        raise _too_deep() from None
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    _check_plain(value)
    return value


def _too_deep() -> APIError:
    return bad_request(f"the request body is nested deeper than {MAX_JSON_DEPTH} levels")


def _check_plain(value: Any) -> None:
    """Refuse nesting deeper than MAX_JSON_DEPTH and strings (keys too) that are not valid Unicode:
    JSON's `\\ud800` escape decodes to a lone surrogate, which no tokenizer or encoder takes. Iterative,
    so no depth can exhaust the stack."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, str):
            if not v.isascii():
                try:
                    v.encode()
                except UnicodeEncodeError:
                    raise bad_request(
                        "the request body holds a string that is not valid Unicode (a lone UTF-16 surrogate)"
                    ) from None
        elif isinstance(v, (list, dict)):
            if depth > MAX_JSON_DEPTH:
                raise _too_deep()
            stack.extend((x, depth + 1) for x in v)  # a list's items, or a dict's keys
            if isinstance(v, dict):
                stack.extend((x, depth + 1) for x in v.values())


async def until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T], abandon: Callable[[T], None] | None = None) -> T:
    """Await `work`, cancelling it (and raising ClientGone) if the client goes away first. When the
    caller is cancelled itself, the work is too, and a result it still yields goes to `abandon`:
    nobody else will own it (a slot granted in that moment would otherwise be held for good)."""
    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        give_up(task, abandon)
        raise
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


def give_up(task: asyncio.Future[T], abandon: Callable[[T], None] | None = None) -> None:
    """Cancel work nobody will await. What it yields anyway (it was done, or finished as the cancel
    landed) goes to `abandon`; its error is retrieved, so none is logged as never retrieved."""

    def settle(t: asyncio.Future[T]) -> None:
        if not t.cancelled() and t.exception() is None and abandon is not None:
            abandon(t.result())

    task.add_done_callback(settle)
    task.cancel()


class Relay:
    """Calls made from another thread, run on one event loop in the order they were made, with one
    loop wake-up per burst: a decode step emits a token for every stream at once, and waking the
    loop for each (a self-pipe write and a loop pass apiece) costs CPU the model's kernels need."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[Callable[[Any], None], Any]] = []

    def call(self, fn: Callable[[Any], None], arg: Any) -> None:
        """Run fn(arg) on the loop soon; thread-safe. Raises RuntimeError once the loop is closed."""
        with self._lock:
            self._pending.append((fn, arg))
            if len(self._pending) > 1:  # a wake-up is already on its way: it runs this call too
                return
        try:
            self._loop.call_soon_threadsafe(self._run)
        except RuntimeError:  # the loop is closed: nothing will run these
            with self._lock:
                self._pending.clear()
            raise

    def _run(self) -> None:
        with self._lock:
            calls, self._pending = self._pending, []
        for fn, arg in calls:
            try:
                fn(arg)
            except Exception:  # one failing callback must not drop the others' events
                log.exception("a relayed call failed")


_relays: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Relay] = weakref.WeakKeyDictionary()


def relay(loop: asyncio.AbstractEventLoop) -> Relay:
    """The loop's one Relay (call on the loop), so every stream's events share its wake-ups."""
    if (r := _relays.get(loop)) is None:
        r = _relays[loop] = Relay(loop)
    return r
