"""Tool calls out of the model's text: the formats common chat templates teach, parsed as the
text streams, and the JSON Schema that forces a call when `tool_choice` requires one.

A call is only emitted once its JSON is complete and well formed; anything that looked like a
call but does not parse stays in the content, so a model's malformed call is never an error.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gmlx.server.tool_prompt import ToolSpec

_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class CallFormat:
    """How a template's model writes its calls: after one of `opens`, up to `close` (or, without
    one, to the end of the JSON value that follows); `bare_json`: a call may also be a JSON object
    at the very start of the output, with no marker (Llama 3.x)."""

    name: str
    opens: tuple[str, ...] = ()
    close: str | None = None
    bare_json: bool = False


HERMES = CallFormat("hermes", ("<tool_call>",), "</tool_call>")  # Hermes, Qwen 2.5/3, and gmlx's fallback
LLAMA3 = CallFormat("llama3", ("<|python_tag|>",), bare_json=True)
MISTRAL = CallFormat("mistral", ("[TOOL_CALLS]",))
FORCED = CallFormat("forced")  # constrained decoding: the whole output is the call's JSON, no markers


def call_format(template: str | None) -> CallFormat:
    """The format the template's own tool section asks for; the fallback's (Hermes) otherwise."""
    t = template or ""
    if "[TOOL_CALLS]" in t:
        return MISTRAL
    if "<tool_call>" in t:
        return HERMES
    if "<|python_tag|>" in t or ('"parameters"' in t and "<|start_header_id|>" in t):
        return LLAMA3
    return HERMES


def _arguments(value: Any) -> str | None:
    """The arguments as JSON text of an object; some models write them as a string of JSON."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):  # RecursionError: JSON nested past Python's limit
            return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def _call(obj: Any, names: frozenset[str]) -> ToolCall | None:
    """A call to a declared function (a call to anything else is not one), with its arguments:
    Hermes' and OpenAI's "arguments", or Llama's "parameters"."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in names:
        return None
    key = "arguments" if "arguments" in obj else "parameters"
    arguments = _arguments(obj.get(key))
    return ToolCall(obj["name"], arguments) if arguments is not None else None


def parse_calls(body: str, names: frozenset[str]) -> list[ToolCall] | None:
    """The calls one section holds (an object, or a list of them), or None if it is not calls."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    items = value if isinstance(value, list) else [value]
    calls = [_call(item, names) for item in items]
    return calls if calls and all(c is not None for c in calls) else None  # type: ignore[return-value]


def _json_end(text: str) -> int | None:
    """Where the JSON value at the start of text (after whitespace) ends; None while incomplete
    or malformed (the caller tells them apart at the end of the output)."""
    start = len(text) - len(text.lstrip())
    try:
        return _DECODER.raw_decode(text, start)[1]
    except (ValueError, RecursionError):
        return None


def _held_suffix(text: str, markers: tuple[str, ...]) -> int:
    """How many trailing characters of text could be the start of a marker (held back)."""
    for n in range(min(len(text), max((len(m) for m in markers), default=0) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0


_CALL_KEYS = ('"name"', '"type"')  # a bare-JSON call opens with one of these keys


def _bare_call_start(text: str) -> bool | None:
    """Whether text (no leading whitespace) opens a bare-JSON call: True, False, or None (too short to say)."""
    if not text.startswith("{"):
        return False
    key = text[1:].lstrip()
    if any(key.startswith(k) for k in _CALL_KEYS):
        return True
    return None if any(k.startswith(key) for k in _CALL_KEYS) else False


Piece = str | ToolCall  # a stretch of content, or a whole call


class ToolCallParser:
    """Feeds on the output as it streams and gives back content and calls, holding back only text
    that may still turn out to be (the start of) a call. Fed whole or in any pieces, it gives the
    same content and calls; whitespace next to a call is dropped, as is leading whitespace."""

    def __init__(self, fmt: CallFormat, names: frozenset[str], parallel: bool = True):
        self.fmt, self.names, self.parallel = fmt, names, parallel
        self.calls: list[ToolCall] = []
        self._buf = ""  # text not yet given out
        self._marker: str | None = None  # the marker that opened the call section _buf holds, if any
        self._at_start = True  # a bare-JSON call may open here
        self._ws = ""  # whitespace held until text follows it
        self._content = False  # whether any content has been given out

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole output (to a fresh parser): its content, None when it is only calls, and its calls."""
        pieces = self.feed(text) + self.close()
        content = "".join(p for p in pieces if isinstance(p, str))
        return (content or None) if self.calls else content, self.calls

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        return self._drain(final=False)

    def close(self) -> list[Piece]:
        out = self._drain(final=True)
        if self._ws and not self.calls:
            out.append(self._ws)
        return out

    def _drain(self, final: bool) -> list[Piece]:
        out: list[Piece] = []
        if self.fmt is FORCED:
            self._forced_calls(out)
            return out
        while self._buf or (final and self._marker is not None):
            if self._marker is not None:
                if not self._end_section(out, final):
                    break
            elif not self._open_section(out, final):
                break
        return out

    def _forced_calls(self, out: list[Piece]) -> None:
        """The grammar made the output a call, or an array of calls: each goes out once its JSON
        is complete. What max_tokens cut off is dropped, not made content: it is the grammar's
        JSON, not the model's text, and the finish reason says `length`."""
        buf = self._buf.lstrip()
        if not self._at_start:  # inside the array: a call follows a comma
            buf = buf.removeprefix(",").lstrip()
        elif buf.startswith("["):
            self._at_start, buf = False, buf[1:].lstrip()
        while buf.startswith("{"):
            try:
                value, end = _DECODER.raw_decode(buf)
            except (ValueError, RecursionError):  # not complete yet
                break
            if (call := _call(value, self.names)) is not None:
                self.calls.append(call)
                out.append(call)
            buf = buf[end:].lstrip().removeprefix(",").lstrip()
        self._buf = buf

    def _open_section(self, out: list[Piece], final: bool) -> bool:
        """Give out text up to the next call section and open it; False when nothing more can be decided."""
        buf = self._buf
        if self.fmt.bare_json and self._at_start:
            stripped = buf.lstrip()
            if self.calls:  # Llama: calls one after another, bare or after a `;`
                stripped = stripped.removeprefix(";").lstrip()
            starts = _bare_call_start(stripped) if stripped else None
            if starts is None and not final:
                return False
            self._at_start = False
            if starts:
                self._marker, self._buf = buf[: len(buf) - len(stripped)], stripped
                return True
        found = [(i, m) for m in self.fmt.opens if (i := buf.find(m)) >= 0]
        if found:
            i, marker = min(found)
            self._text(out, buf[:i])
            self._marker, self._buf = marker, buf[i + len(marker) :]
            return True
        keep = 0 if final else _held_suffix(buf, self.fmt.opens)
        self._text(out, buf[: len(buf) - keep])
        self._buf = buf[len(buf) - keep :]
        return False

    def _end_section(self, out: list[Piece], final: bool) -> bool:
        """Close the open call section if its end is here (at the end of the output it always is)."""
        buf, close = self._buf, self.fmt.close
        if close is not None:
            i = buf.find(close)
            end = (i, i + len(close)) if i >= 0 else None
        elif buf.strip() and buf.lstrip()[0] not in "{[":
            end = (0, 0)  # no JSON follows the marker: not a call
        else:
            j = _json_end(buf)
            end = (j, j) if j is not None else None
        if end is None:
            if not final:
                return False
            end = (len(buf), len(buf))
        marker, self._marker = self._marker or "", None
        self._section(out, buf[: end[0]], marker, buf[end[0] : end[1]])
        self._buf = buf[end[1] :]
        if self.fmt.bare_json and self.calls:
            self._at_start = True  # another bare call may follow
        return True

    def _section(self, out: list[Piece], body: str, marker: str, close: str = "") -> None:
        """The calls a section between `marker` and `close` holds, or, if it holds none, its text."""
        calls = parse_calls(body, self.names) if body.strip() else None
        if calls is None:
            self._text(out, marker + body + close)  # not a call after all: it was content
            return
        if not self.parallel:
            calls = calls[: max(0, 1 - len(self.calls))]  # at most one call in the turn
        self._ws = ""
        self.calls += calls
        out += calls

    def _text(self, out: list[Piece], text: str) -> None:
        if not self._content:
            text = text.lstrip()
        head = text.rstrip()
        if head:
            out.append(self._ws + head)
            self._ws, self._content = "", True
        self._ws += text[len(head) :]


def parser_for(spec: ToolSpec | None, template: str | None) -> ToolCallParser | None:
    """The parser a request's output goes through; None when calls are not parsed (no tools, or
    tool_choice none)."""
    if spec is None or spec.choice == "none":
        return None
    return ToolCallParser(FORCED if spec.forced else call_format(template), spec.names, spec.parallel)


def call_deltas(call: ToolCall, index: int) -> list[dict[str, Any]]:
    """A call as OpenAI streams it: its id, type and name first, then its arguments."""
    return [
        {"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}},
        {"index": index, "function": {"arguments": call.arguments}},
    ]


def finish_reason(engine_reason: str, calls: list[ToolCall]) -> str:
    """OpenAI's "tool_calls" for a turn that ended in calls; "length" and the rest stand."""
    return "tool_calls" if calls and engine_reason == "stop" else engine_reason


def forced_call_schema(functions: dict[str, dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The JSON Schema constrained decoding holds the output to when a call is required: a call
    `{"name", "arguments"}` to one of `functions` (name -> its parameters schema), whose arguments
    validate against that function's schema; a non-empty array of calls when `parallel`."""
    one = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name, parameters in functions.items()
    ]
    call = one[0] if len(one) == 1 else {"anyOf": one}
    return {"type": "array", "items": call, "minItems": 1} if parallel else call
