"""POST /v1/messages: Anthropic's Messages API, translated onto the chat path, so harnesses built
for it run on gmlx.

The body becomes a chat body: `system` a system message, text blocks content, an assistant's
`tool_use` blocks its tool_calls, a user's `tool_result` blocks tool messages (before its text, as
Anthropic orders them), `tools` (`input_schema`) and `tool_choice` (`any` is chat's `required`) chat's
shapes, `stop_sequences` `stop`. The chat answer, or its stream, is written back as a message with
text and tool_use blocks, or as Anthropic's events (`message_start`, `content_block_start`,
`content_block_delta`, `content_block_stop`, `message_delta`, `message_stop`). Errors keep the
OpenAI shape of every other route; Anthropic's clients read the status. A stop string ends the
turn as `end_turn`: the engine does not say which stop matched, so `stop_sequence` stays null.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gmlx.server import openai_api
from gmlx.server.errors import bad_request
from gmlx.server.fields import check_message_fields
from gmlx.server.generation import Generation, admit, complete, sse
from gmlx.server.http import read_json
from gmlx.server.state import ServerState

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
Messages = list[dict[str, Any]]


def _blocks(content: Any, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if isinstance(content, list) and all(isinstance(b, dict) for b in content):
        return content
    raise bad_request(f"{where}: content must be a string or a list of blocks", "messages")


def _text(blocks: list[dict], where: str) -> str:
    if not all(b.get("type") == "text" and isinstance(b.get("text"), str) for b in blocks):
        raise bad_request(f"{where}: only text blocks are supported here", "messages")
    return "".join(b["text"] for b in blocks)


# Each block kind a message may hold: its role, and its fields with what each must be.
_BLOCKS: dict[str, tuple[str | None, tuple[tuple[str, type, str], ...]]] = {
    "text": (None, (("text", str, "a string"),)),
    "tool_use": ("assistant", (("id", str, "a string"), ("input", dict, "an object"))),
    "tool_result": ("user", (("tool_use_id", str, "a string"), ("is_error", bool, "a boolean"))),
}
_OPTIONAL = {"input": {}, "is_error": False}  # fields a block may leave out


def _block_problem(block: dict, kind: Any, role: str) -> str | None:
    """What is wrong with a content block, naming the field, or None."""
    if not isinstance(kind, str) or kind not in _BLOCKS:  # a type may be any JSON
        return f"{kind!r} blocks are not supported (text, tool_use in assistant messages, tool_result in user ones)"
    only, fields = _BLOCKS[kind]
    if only is not None and role != only:
        return f"{kind} blocks belong in {only} messages, not {role} ones"
    for name, kind_of, what in fields:
        if not isinstance(block.get(name, _OPTIONAL.get(name)), kind_of):
            return f"a {kind} block's {name!r} must be {what}"
    return None


def _message(m: Any, i: int) -> Messages:
    where = f"messages[{i}]"
    role = m.get("role") if isinstance(m, dict) else None
    if role not in ("user", "assistant"):
        raise bad_request(f"{where}.role must be user or assistant", "messages")
    texts, calls, results = [], [], []
    for block in _blocks(m.get("content"), where):
        kind = block.get("type")
        if (problem := _block_problem(block, kind, role)) is not None:
            raise bad_request(f"{where}: {problem}", "messages")
        if kind == "text":
            texts.append(block["text"])
        elif kind == "tool_use":
            calls.append(
                {
                    "id": block["id"],
                    "type": "function",
                    "function": {"name": block.get("name"), "arguments": json.dumps(block.get("input", {}))},
                }
            )
        else:  # a tool_result
            output = _text(_blocks(block.get("content", ""), where), where)
            results.append(
                {
                    "role": "tool",
                    "tool_call_id": block["tool_use_id"],
                    "content": f"Error: {output}" if block.get("is_error") else output,
                }
            )
    if role == "user":
        return [*results, *([{"role": "user", "content": "".join(texts)}] if texts or not results else [])]
    out: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        out["tool_calls"] = calls
    return [out]


def _tools(tools: Any) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise bad_request("'tools' must be a list of objects", "tools")
    out = []
    for t in tools:
        if t.get("type") not in (None, "custom"):  # Anthropic's server tools (bash, web search, ...) run on its side
            raise bad_request(
                f"only custom tools are supported, not {t.get('type')!r}", "tools", code="unsupported_parameter"
            )
        fn = {"name": t.get("name"), "description": t.get("description"), "parameters": t.get("input_schema")}
        out.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
    return out


def _tool_choice(choice: Any) -> tuple[Any, bool | None]:
    """chat's tool_choice and parallel_tool_calls."""
    if choice is None:
        return None, None
    if not isinstance(choice, dict):
        raise bad_request("tool_choice must be an object", "tool_choice")
    disable = choice.get("disable_parallel_tool_use", False)
    if not isinstance(disable, bool):
        raise bad_request("tool_choice.disable_parallel_tool_use must be a boolean", "tool_choice")
    kind, parallel = choice.get("type"), False if disable else None
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise bad_request("tool_choice must be {type: auto | any | none} or {type: tool, name}", "tool_choice")


def chat_body(body: Any) -> dict:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    check_message_fields(body)
    for name in ("model", "max_tokens", "messages"):
        if body.get(name) is None:
            raise bad_request(f"'{name}' is required", name)
    messages = body["messages"]
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    if not isinstance(body.get("stop_sequences", []), (list, type(None))):
        raise bad_request("'stop_sequences' must be a list of strings", "stop_sequences")
    system = body.get("system")
    head = [] if system is None else [{"role": "system", "content": _text(_blocks(system, "system"), "system")}]
    choice, parallel = _tool_choice(body.get("tool_choice"))
    chat: dict[str, Any] = {
        "model": body["model"],
        "max_tokens": body["max_tokens"],
        "messages": head + [x for i, m in enumerate(messages) for x in _message(m, i)],
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "top_k": body.get("top_k"),
        "stop": body.get("stop_sequences"),
        "stream": body.get("stream"),
        "stream_options": {"include_usage": True} if body.get("stream") is True else None,
        "tools": _tools(body.get("tools")),
        "tool_choice": choice,
        "parallel_tool_calls": parallel,
    }
    return {k: v for k, v in chat.items() if v is not None}


def _usage(use: dict) -> dict:
    cached = use["prompt_tokens_details"]["cached_tokens"]
    return {
        "input_tokens": use["prompt_tokens"] - cached,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
        "output_tokens": use["completion_tokens"],
    }


def _tool_use(call: dict) -> dict:
    return {
        "type": "tool_use",
        "id": call["id"],
        "name": call["function"]["name"],
        "input": json.loads(call["function"]["arguments"] or "{}"),
    }


async def messages(request: Request) -> Response:
    arrived = time.monotonic()
    state: ServerState = request.app.state.gmlx
    body = await read_json(request, state)
    gen = await admit(request, state, openai_api.parse_chat_of(chat_body(body), {"stop": "stop_sequences"}), arrived)
    if isinstance(gen, Response):
        return gen
    mid = "msg_" + uuid.uuid4().hex[:24]
    if gen.p.stream:
        return sse(_events(gen, mid, gen.state.model_id))
    completion = await complete(request, gen)
    if isinstance(completion, Response):
        return completion
    choice = completion["choices"][0]
    message = choice["message"]
    content = [{"type": "text", "text": message["content"]}] if message["content"] else []
    content += [_tool_use(c) for c in message.get("tool_calls", [])]
    return JSONResponse(
        {
            "id": mid,
            "type": "message",
            "role": "assistant",
            "model": gen.state.model_id,
            "content": content,
            "stop_reason": _STOP_REASONS.get(choice["finish_reason"], "end_turn"),
            "stop_sequence": None,
            "usage": _usage(completion["usage"]),
        }
    )


async def _events(gen: Generation, mid: str, model: str) -> AsyncIterator[str]:
    """The chat stream's chunks rewritten as Anthropic's events: one content block at a time."""
    block: int | None = None  # the index of the open content block
    count, finish, usage = 0, "stop", None

    def event(kind: str, **data: Any) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"

    def start(content_block: dict) -> list[str]:
        nonlocal block, count
        out = stop()
        block, count = count, count + 1
        return [*out, event("content_block_start", index=block, content_block=content_block)]

    def stop() -> list[str]:
        nonlocal block
        if block is None:
            return []
        index, block = block, None
        return [event("content_block_stop", index=index)]

    prompt_tokens = len(gen.choices[0].req.prompt_ids)
    yield event(
        "message_start",
        message={
            "id": mid,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            # Before the prompt cache is read: message_delta's usage, cumulative, says what was cached.
            "usage": {
                "input_tokens": prompt_tokens,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
                "output_tokens": 0,
            },
        },
    )
    kind = None  # of the open block: text or tool_use
    async with contextlib.aclosing(gen.stream()) as chunks:  # closing this closes the chat stream: the row ends
        async for data in chunks:
            payload = data.removeprefix("data: ").strip()
            if payload == "[DONE]":
                break
            obj = json.loads(payload)
            if "error" in obj:
                yield event("error", error={"type": "api_error", "message": obj["error"]["message"]})
                return
            if not obj["choices"]:
                usage = _usage(obj["usage"])
                continue
            choice = obj["choices"][0]
            delta = choice["delta"]
            if delta.get("content"):
                if kind != "text":
                    for e in start({"type": "text", "text": ""}):
                        yield e
                    kind = "text"
                yield event("content_block_delta", index=block, delta={"type": "text_delta", "text": delta["content"]})
            for call in delta.get("tool_calls", []):
                if "id" in call:
                    opened = {"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": {}}
                    for e in start(opened):
                        yield e
                    kind = "tool_use"
                elif call["function"]["arguments"]:
                    yield event(
                        "content_block_delta",
                        index=block,
                        delta={"type": "input_json_delta", "partial_json": call["function"]["arguments"]},
                    )
            finish = choice["finish_reason"] or finish
    for e in stop():
        yield e
    yield event(
        "message_delta",
        delta={"stop_reason": _STOP_REASONS.get(finish, "end_turn"), "stop_sequence": None},
        usage=usage or {"output_tokens": 0},
    )
    yield event("message_stop")
