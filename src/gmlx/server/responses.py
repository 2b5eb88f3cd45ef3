"""POST /v1/responses: OpenAI's Responses API, translated onto the chat path.

The body becomes a chat body (input items to messages, `instructions` to a system message first,
function tools and `tool_choice` to chat's shapes, `text.format` to `response_format`), which
`openai_api.parse` validates and `generation.admit` runs as any chat request: tool calls, structured
output, admission and the prompt cache are the chat route's. The chat answer, or its stream of
chunks, is then written back as a Response object, or as the Responses event stream
(`response.created`, `response.output_item.added`, `response.output_text.delta`, ...,
`response.completed`). An answer stored (`store`, true by default) can be continued with
`previous_response_id`: the server keeps the conversation of its last `STORE_SIZE` stored answers
in memory, and replays it as the next prompt's head, which the prompt cache already holds.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gmlx.server import openai_api
from gmlx.server.errors import bad_request
from gmlx.server.fields import check_response_fields
from gmlx.server.generation import admit, complete, sse
from gmlx.server.http import read_json
from gmlx.server.state import ServerState

STORE_SIZE = 256
_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text")
# Fields passed on to the chat body as they are, by their names there.
_FIELDS = (
    ("model", "model"),
    ("max_output_tokens", "max_completion_tokens"),
    ("temperature", "temperature"),
    ("top_p", "top_p"),
    ("stream", "stream"),
    ("parallel_tool_calls", "parallel_tool_calls"),
)
# What the chat body's checks name, as the Responses body calls it.
_CHAT_NAMES = {to: name for name, to in _FIELDS if to != name} | {"response_format": "text.format", "messages": "input"}
Messages = list[dict[str, Any]]


class ResponseStore:
    """The conversations of the last stored answers, by response id (on the event loop only)."""

    def __init__(self, size: int = STORE_SIZE):
        self.size, self._items = size, OrderedDict[str, Messages]()

    def get(self, rid: str) -> Messages:
        if rid not in self._items:
            raise bad_request(
                f"previous response {rid!r} is not stored here (the server keeps its last {self.size})",
                "previous_response_id",
                code="previous_response_not_found",
            )
        self._items.move_to_end(rid)
        return self._items[rid]

    def put(self, rid: str, messages: Messages) -> None:
        self._items[rid] = messages
        while len(self._items) > self.size:
            self._items.popitem(last=False)


def _text(content: Any, where: str) -> str:
    """A message's or a tool output's text: a string, or its input_text/output_text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(c, dict) for c in content):
        if kinds := [c.get("type") for c in content if c.get("type") not in _TEXT_PARTS]:  # a type may be any JSON
            raise bad_request(f"{where}: only text content is supported, not {kinds[0]!r}", "input")
        if not all(isinstance(c.get("text"), str) for c in content):
            raise bad_request(f"{where}: each text part needs a string 'text'", "input")
        return "".join(c["text"] for c in content)
    raise bad_request(f"{where}: content must be a string or a list of text parts", "input")


def _messages(value: Any) -> Messages:
    """`input` as chat messages: a string is one user message; items are messages, function calls
    (an assistant's tool_calls, consecutive calls in one message) and function call outputs."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad_request("'input' must be a string or a non-empty list of items", "input")
    out: Messages = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if (problem := _item_problem(item)) is not None:
            raise bad_request(f"{where}: {problem}", "input")
        kind = item.get("type", "message")
        if kind == "message":
            out.append({"role": item["role"], "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:  # a function_call_output
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text(item.get("output"), where)})
    return out


# The fields each item kind needs as strings (`arguments` is the call's JSON text, as OpenAI sends it).
_ITEM_STRINGS = {"message": (), "function_call": ("call_id", "name", "arguments"), "function_call_output": ("call_id",)}


def _item_problem(item: Any) -> str | None:
    """What is wrong with an `input` item, naming the field, or None."""
    if not isinstance(item, dict):
        return f"an item must be an object (a message, function_call or function_call_output), not {item!r:.40}"
    kind = item.get("type", "message")
    if not isinstance(kind, str) or kind not in _ITEM_STRINGS:  # a type may be any JSON
        return f"{kind!r} items are not supported (a message, function_call or function_call_output)"
    if kind == "message" and item.get("role") not in _ROLES:
        return f"a message's role must be one of {', '.join(_ROLES)}, not {item.get('role')!r:.40}"
    missing = [k for k in _ITEM_STRINGS[kind] if not isinstance(item.get(k), str)]
    return f"a {kind} needs {missing[0]!r} as a string" if missing else None


def _tools(tools: Any) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise bad_request("'tools' must be a list of objects", "tools")
    out = []
    for t in tools:
        if t.get("type") != "function":
            raise bad_request(
                f"only function tools are supported, not {t.get('type')!r}", "tools", code="unsupported_parameter"
            )
        out.append(
            {
                "type": "function",
                "function": {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None},
            }
        )
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad_request("tool_choice must be none, auto, required or {type: function, name}", "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(text: Any) -> dict | None:
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"} or text.get("verbosity") is not None:
        raise bad_request("'text' takes only 'format' (verbosity is not supported)", "text")
    fmt = text.get("format")
    if isinstance(fmt, dict) and not (
        isinstance(fmt.get("name", ""), str)
        and isinstance(fmt.get("schema", {}), dict)
        and isinstance(fmt.get("strict", False), (bool, type(None)))
    ):
        raise bad_request("text.format: 'name' is a string, 'schema' an object, 'strict' a boolean", "text")
    if fmt is None or not isinstance(fmt, dict) or fmt.get("type") in ("text", "json_object"):
        return fmt
    spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": fmt.get("type"), "json_schema": spec}


def chat_body(body: Any, store: ResponseStore) -> tuple[dict, Messages]:
    """The chat body a Responses body asks for, and the conversation it continues plus its input
    (what is stored with its answer). `instructions` lead the prompt but are not stored, as OpenAI
    does not carry them over to a response that follows."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    check_response_fields(body)
    if "input" not in body:
        raise bad_request("'input' is required", "input")
    if not isinstance(body.get("store"), (bool, type(None))):
        raise bad_request("'store' must be a boolean", "store")
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise bad_request("'previous_response_id' must be a string", "previous_response_id")
    conversation = [*(store.get(previous) if previous else []), *_messages(body["input"])]
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("'instructions' must be a string", "instructions")
    chat: dict[str, Any] = {
        "messages": ([{"role": "system", "content": instructions}] if instructions else []) + conversation,
        "stream_options": {"include_usage": True} if body.get("stream") is True else None,
    }
    for name, to in _FIELDS:
        chat[to] = body.get(name)
    chat["tools"], chat["response_format"] = _tools(body.get("tools")), _response_format(body.get("text"))
    chat["tool_choice"] = _tool_choice(body.get("tool_choice"))
    return {k: v for k, v in chat.items() if v is not None}, conversation


class _Answer:
    """A Response object being built: its fixed fields from the request, its output items as they come."""

    def __init__(self, body: dict, model: str):
        self.id, self.created_at = "resp_" + uuid.uuid4().hex[:24], int(time.time())
        self.body, self.model = body, model
        self.output: list[dict] = []
        self.text, self.calls = "", []  # the answer as chat's assistant message, to store
        self.usage: dict | None = None

    def to_json(self, status: str, error: dict | None = None) -> dict:
        b = self.body
        fmt = (b.get("text") or {}).get("format") or {"type": "text"}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.model,
            "output": self.output,
            "usage": self.usage,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.get("instructions"),
            "max_output_tokens": b.get("max_output_tokens"),
            "temperature": b.get("temperature", 1.0),
            "top_p": b.get("top_p", 1.0),
            "tools": b.get("tools") or [],
            "tool_choice": b.get("tool_choice", "auto"),
            "parallel_tool_calls": b.get("parallel_tool_calls", True),
            "previous_response_id": b.get("previous_response_id"),
            "text": {"format": fmt},
            "metadata": b.get("metadata") or {},
            "store": b.get("store") is not False,
            "truncation": "disabled",
        }

    def message(self, text: str, cut: bool = False) -> dict:
        """The assistant's text as an output item; `cut` by max_output_tokens, it is incomplete, as the response is."""
        item = {
            "type": "message",
            "id": "msg_" + uuid.uuid4().hex[:24],
            "status": "incomplete" if cut else "completed",
            "role": "assistant",
            "content": [_part(text)],
        }
        self.text += text
        return item

    def call(self, call: dict, status: str = "completed") -> dict:
        fn = call["function"]
        self.calls.append({"id": call["id"], "type": "function", "function": dict(fn)})
        return {
            "type": "function_call",
            "id": "fc_" + uuid.uuid4().hex[:24],
            "call_id": call["id"],
            "name": fn["name"],
            "arguments": fn["arguments"],
            "status": status,
        }

    def set_usage(self, use: dict) -> None:
        self.usage = {
            "input_tokens": use["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": use["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": use["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": use["total_tokens"],
        }

    def keep(self, store: ResponseStore, conversation: Messages) -> None:
        if self.body.get("store") is not False:
            answer: dict[str, Any] = {"role": "assistant", "content": self.text}
            if self.calls:
                answer["tool_calls"] = self.calls
            store.put(self.id, [*conversation, answer])


def _part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


async def responses(request: Request) -> Response:
    arrived = time.monotonic()
    state: ServerState = request.app.state.gmlx
    store: ResponseStore = request.app.state.responses
    body = await read_json(request, state)
    chat, conversation = chat_body(body, store)
    gen = await admit(request, state, openai_api.parse_chat_of(chat, _CHAT_NAMES), arrived)
    if isinstance(gen, Response):
        return gen
    answer = _Answer(body, gen.state.model_id)
    if gen.p.stream:
        return sse(_events(gen.stream(), answer, store, conversation))
    completion = await complete(request, gen)
    if isinstance(completion, Response):
        return completion
    choice = completion["choices"][0]
    message = choice["message"]
    cut = choice["finish_reason"] == "length"
    calls = message.get("tool_calls") or []
    if message["content"] or not calls:  # an answer with no call always has its message
        answer.output.append(answer.message(message["content"] or "", cut and not calls))
    answer.output.extend(answer.call(c) for c in calls)
    answer.set_usage(completion["usage"])
    answer.keep(store, conversation)
    return JSONResponse(answer.to_json("incomplete" if choice["finish_reason"] == "length" else "completed"))


async def _events(
    chunks: AsyncIterator[str], answer: _Answer, store: ResponseStore, conversation: Messages
) -> AsyncIterator[str]:
    """The chat stream's chunks rewritten as Responses events: each output item opened, its text or
    arguments streamed, and closed before the next one opens; then the whole response."""
    sequence = 0
    open_item: dict | None = None  # the message or function call being streamed
    finish = "stop"

    def event(kind: str, **data: Any) -> str:
        nonlocal sequence
        sequence += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': sequence - 1, **data})}\n\n"

    def close() -> list[str]:
        nonlocal open_item
        if open_item is None:
            return []
        item, index, open_item = open_item, len(answer.output), None
        if item["type"] == "message":
            done = answer.message(item["text"], finish == "length")  # "stop" until the last chunk
            done["id"] = item["id"]
            out = [
                event(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=item["text"],
                    logprobs=[],
                ),
                event(
                    "response.content_part.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=_part(item["text"]),
                ),
            ]
        else:
            done = answer.call(item["call"])
            done["id"] = item["id"]
            out = [
                event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=done["name"],
                    arguments=done["arguments"],
                )
            ]
        answer.output.append(done)
        return [*out, event("response.output_item.done", output_index=index, item=done)]

    yield event("response.created", response=answer.to_json("in_progress"))
    yield event("response.in_progress", response=answer.to_json("in_progress"))
    async with contextlib.aclosing(chunks):  # closing this stream closes the chat one: the engine drops the row
        async for data in chunks:
            payload = data.removeprefix("data: ").strip()
            if payload == "[DONE]":
                break
            obj = json.loads(payload)
            if "error" in obj:
                for e in close():
                    yield e
                yield event("response.failed", response=answer.to_json("failed", error=obj["error"]))
                return
            if not obj["choices"]:
                answer.set_usage(obj["usage"])
                continue
            choice = obj["choices"][0]
            delta = choice["delta"]
            index = len(answer.output)
            if delta.get("content"):
                if open_item is not None and open_item["type"] != "message":
                    for e in close():
                        yield e
                    index = len(answer.output)
                if open_item is None:
                    open_item = {"type": "message", "id": "msg_" + uuid.uuid4().hex[:24], "text": ""}
                    shell = {
                        "type": "message",
                        "id": open_item["id"],
                        "status": "in_progress",
                        "role": "assistant",
                        "content": [],
                    }
                    yield event("response.output_item.added", output_index=index, item=shell)
                    yield event(
                        "response.content_part.added",
                        item_id=open_item["id"],
                        output_index=index,
                        content_index=0,
                        part=_part(""),
                    )
                open_item["text"] += delta["content"]
                yield event(
                    "response.output_text.delta",
                    item_id=open_item["id"],
                    output_index=index,
                    content_index=0,
                    delta=delta["content"],
                    logprobs=[],
                )
            for call in delta.get("tool_calls", []):
                if "id" in call:  # a new call: its id and name, its arguments follow
                    for e in close():
                        yield e
                    index = len(answer.output)
                    open_item = {
                        "type": "function_call",
                        "id": "fc_" + uuid.uuid4().hex[:24],
                        "call": {"id": call["id"], "function": {"name": call["function"]["name"], "arguments": ""}},
                    }
                    shell = {
                        "type": "function_call",
                        "id": open_item["id"],
                        "call_id": call["id"],
                        "name": call["function"]["name"],
                        "arguments": "",
                        "status": "in_progress",
                    }
                    yield event("response.output_item.added", output_index=index, item=shell)
                elif open_item is not None and open_item["type"] == "function_call":
                    piece = call["function"]["arguments"]
                    open_item["call"]["function"]["arguments"] += piece
                    yield event(
                        "response.function_call_arguments.delta",
                        item_id=open_item["id"],
                        output_index=index,
                        delta=piece,
                    )
            finish = choice["finish_reason"] or finish
    for e in close():
        yield e
    if not answer.output:  # nothing was said: the empty message the unstreamed answer has too
        item = answer.message("")
        yield event("response.output_item.added", output_index=0, item=item | {"status": "in_progress", "content": []})
        answer.output.append(item)
        yield event("response.output_item.done", output_index=0, item=item)
    answer.keep(store, conversation)
    status = "incomplete" if finish == "length" else "completed"
    yield event(f"response.{status}", response=answer.to_json(status))
