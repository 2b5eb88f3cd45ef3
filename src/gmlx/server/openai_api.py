"""OpenAI request bodies -> validated parameters, and engine results -> OpenAI responses."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gmlx.engine.grammar import GrammarError, json_schema_grammar
from gmlx.engine.logprobs import MAX_TOP
from gmlx.engine.processors import REPEAT_LAST_N, Decoding
from gmlx.engine.sampling import SamplingParams
from gmlx.server import tool_prompt
from gmlx.server.errors import APIError, bad_request
from gmlx.server.fields import check_fields
from gmlx.server.tools import ToolCall

MAX_STOPS = 16
MAX_STOP_CHARS = 4096  # each; longer ones are no role marker, and only cost the engine thread
_TOOL_ROLES = ("tool", "function")  # function: OpenAI's older tool role (a name, no call id)
ROLES = (
    "system",
    "developer",
    "user",
    "assistant",
    *_TOOL_ROLES,
)  # the roles a chat template is given (the schema's enum)


@dataclass(frozen=True)
class GenerationParams:
    chat: bool
    model: str | None
    messages: list[dict[str, Any]] | None
    prompt: str | list[int] | None
    max_tokens: int | None
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    n: int = 1  # choices, each its own engine row; the server bounds it by its decode batch
    logprobs: int | None = None  # alternatives per token to report (0: the token's own only); None: none
    tools: tool_prompt.ToolSpec | None = None  # chat only: the tools, and how they may be called
    decoding: Decoding = Decoding()  # penalties and logit_bias; the server adds the compiled grammar
    grammar: str | None = None  # chat only: response_format's grammar, checked, to compile for the model


def _typed(body: dict, name: str, types: type | tuple[type, ...], what: str) -> Any:
    value = body.get(name)
    if value is None:
        return None
    # bool is an int subclass: never let true pass as a number, or 1 as a flag.
    if isinstance(value, bool) != (types is bool) or not isinstance(value, types):
        raise bad_request(f"'{name}' must be {what}", name)
    return value


def is_integer(value: Any) -> bool:
    """An int, or a float with an integral value: 169.0 is an integer to JSON Schema too."""
    return (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float) and value.is_integer())


def _integer(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not is_integer(value):
        raise bad_request(f"'{name}' must be an integer", name)
    return int(value)


def _number(body: dict, name: str, lo: float, hi: float, default: float) -> float:
    value = _typed(body, name, (int, float), "a number")
    if value is None:
        return default
    if not lo <= value <= hi:
        raise bad_request(f"'{name}' must be between {lo:g} and {hi:g}, not {value}", name)
    return float(value)


def _message_text(content: Any, i: int) -> str:
    """Text of a message: a string, or the text parts of a content list."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise bad_request(f"messages[{i}].content parts must be objects with a 'type'", "messages")
            if part["type"] != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"messages[{i}]: only text content is supported, not {part['type']!r}", "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"messages[{i}].content must be a string or a list of parts", "messages")


def _message(m: Any, i: int) -> dict[str, Any]:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise bad_request(f"messages[{i}] must be an object with a string 'role'", "messages")
    role = m["role"]
    if role not in ROLES:
        raise bad_request(f"messages[{i}].role must be one of {', '.join(ROLES)}, not {role!r}", "messages")
    for key in ("name", "tool_call_id"):  # strings where given, as the schema says, whatever the role
        if m.get(key) is not None and not isinstance(m[key], str):
            raise bad_request(f"messages[{i}].{key} must be a string", "messages")
    text = _message_text(m.get("content"), i)
    calls = m.get("tool_calls") not in (None, [])
    if calls and role != "assistant":  # a tool message's too: dropped, they would change the prompt unseen
        raise bad_request(f"messages[{i}]: only an assistant message has tool_calls", "messages")
    if role in _TOOL_ROLES:
        return tool_prompt.tool_result(m, i, text)
    # OpenAI's newer name for the system role, which is the one chat templates know.
    out = {"role": "system" if role == "developer" else role, "content": text}
    if calls:  # absent otherwise: templates test for the key
        out["tool_calls"] = tool_prompt.assistant_calls(m["tool_calls"], i)
    return out


def _messages(body: dict) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    return tool_prompt.name_tool_results([_message(m, i) for i, m in enumerate(messages)])


def _prompt(body: dict) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(is_integer(t) for t in prompt):
        return [int(t) for t in prompt]
    raise bad_request("'prompt' must be a string or a list of token ids (one prompt per request)", "prompt")


def parse(body: Any, chat: bool) -> GenerationParams:
    """Validate a chat or completions body: a wrong type is a 400, and so is a field gmlx does not
    honour unless it changes nothing (gmlx.server.fields)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    check_fields(body, chat)
    model = _typed(body, "model", str, "a string")
    n = _integer(body, "n")
    if n is not None and n < 1:
        raise bad_request("'n' must be at least 1", "n")
    max_tokens = None
    for name in ("max_tokens", "max_completion_tokens"):  # both are checked; the newer name wins
        value = _integer(body, name)
        if value is not None and value < 1:
            raise bad_request(f"'{name}' must be at least 1", name)
        max_tokens = value if value is not None else max_tokens
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop
    if stops is not None and (not isinstance(stops, list) or not all(isinstance(s, str) for s in stops)):
        raise bad_request("'stop' must be a string or a list of strings", "stop")
    if stops and len(stops) > MAX_STOPS:
        raise bad_request(f"at most {MAX_STOPS} stop strings", "stop")
    if stops and max(map(len, stops)) > MAX_STOP_CHARS:
        raise bad_request(f"a stop string may be at most {MAX_STOP_CHARS} characters long", "stop")
    top_k = _integer(body, "top_k")
    seed = _integer(body, "seed")
    if seed is not None and not 0 <= seed < 2**64:  # MLX's random key takes an unsigned 64-bit seed
        raise bad_request("'seed' must be between 0 and 2**64 - 1", "seed")
    stream = bool(_typed(body, "stream", bool, "a boolean"))
    options = _typed(body, "stream_options", dict, "an object") or {}
    _typed(options, "include_usage", bool, "a boolean")  # checked like the rest, not just truth-tested
    _typed(body, "dry_run", bool, "a boolean")  # true is answered before parse(); anything but a flag is a 400
    sampling = SamplingParams(
        temperature=_number(body, "temperature", 0.0, 2.0, 1.0),
        top_p=_number(body, "top_p", 0.0, 1.0, 1.0),
        top_k=max(top_k or 0, 0),  # -1 means "off" in several clients
        min_p=_number(body, "min_p", 0.0, 1.0, 0.0),
        seed=seed,
    )
    tools = tool_prompt.tool_spec(body) if chat else None
    return GenerationParams(
        chat=chat,
        model=model,
        messages=_messages(body) if chat else None,
        prompt=None if chat else _prompt(body),
        max_tokens=max_tokens,
        sampling=sampling,
        stop=tuple(stops or ()),
        stream=stream,
        include_usage=bool(options.get("include_usage")),
        n=n or 1,
        logprobs=_logprobs(body, chat),
        tools=tools,
        decoding=_decoding(body),
        grammar=_grammar(body, tools) if chat else None,
    )


def parse_chat_of(body: dict, renamed: dict[str, str]) -> GenerationParams:
    """`parse` of the chat body another API's route built from its own (/v1/responses,
    /v1/messages), its errors naming that API's fields: `renamed` maps chat's names to them."""
    try:
        return parse(body, chat=True)
    except APIError as e:
        if e.param in renamed:
            e.message = e.message.replace(f"'{e.param}'", f"'{renamed[e.param]}'")
            e.param = renamed[e.param]
        raise


def _grammar(body: dict, tools: tool_prompt.ToolSpec | None) -> str | None:
    """What constrains a chat's output: a forced tool call's grammar, or response_format's."""
    grammar = _response_format(body)
    if tools is None or tools.grammar is None:
        return grammar
    if grammar is not None:
        raise bad_request(
            "a forced tool call (tool_choice required or a function) and a JSON response_format "
            "cannot both shape the output",
            "tool_choice",
        )
    return tools.grammar


def _decoding(body: dict) -> Decoding:
    # Bounded so that dividing or multiplying a float32 logit by it stays finite (5e-324 made NaNs).
    repetition = _number(body, "repetition_penalty", 0.01, 100.0, 1.0)
    last = _integer(body, "repeat_last_n")
    if last is not None and last < -1:
        raise bad_request("'repeat_last_n' must be -1 (the whole context), 0 (off) or more", "repeat_last_n")
    if last is not None and last >= 2**31:  # past any context: the whole of it (MLX slices with 32-bit indices)
        last = -1
    return Decoding(
        presence_penalty=_number(body, "presence_penalty", -2.0, 2.0, 0.0),
        frequency_penalty=_number(body, "frequency_penalty", -2.0, 2.0, 0.0),
        repetition_penalty=repetition,
        repeat_last_n=REPEAT_LAST_N if last is None else last,
        logit_bias=_logit_bias(body),
    )


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """Token id strings to biases in [-100, 100]; ids are checked against the vocabulary once
    the model is known (check_logit_bias)."""
    bias = _typed(body, "logit_bias", dict, "an object mapping token ids to numbers") or {}
    out = []
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and len(key.lstrip("0")) <= 10):  # int() refuses past 4,300 digits
            raise bad_request(f"logit_bias: {key[:40]!r} is not a token id", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise bad_request(f"logit_bias[{key!r}] must be a number between -100 and 100", "logit_bias")
        out.append((int(key), float(value)))
    return tuple(out)


def check_logit_bias(p: GenerationParams, vocab_size: int) -> None:
    for token, _ in p.decoding.logit_bias:
        if token >= vocab_size:
            raise bad_request(f"logit_bias: token id {token} is not in [0, {vocab_size})", "logit_bias")


def _response_format(body: dict) -> str | None:
    """response_format as a grammar (None for text); a schema that cannot be used is a 400 here.
    `json_schema` is checked whenever it is given, as the OpenAPI schema says, whatever the type."""
    fmt = _typed(body, "response_format", dict, "an object")
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind not in ("text", "json_object", "json_schema"):  # required: {} is no request for text
        raise bad_request(
            f"response_format.type must be text, json_object or json_schema, not {kind!r}", "response_format"
        )
    given = "json_schema" in fmt or kind == "json_schema"
    spec = _json_schema_spec(fmt.get("json_schema")) if given else {}
    if kind == "text":
        return None
    schema: Any = {"type": "object"} if kind == "json_object" else spec.get("schema", {})  # none given: any JSON
    try:
        return json_schema_grammar(schema)
    except GrammarError as e:
        raise bad_request(f"response_format: the schema cannot be used: {e}", "response_format") from None


def _json_schema_spec(spec: Any) -> dict:
    """response_format.json_schema, its fields' types checked."""
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise bad_request("response_format.json_schema must be an object with a string 'name'", "response_format")
    if not isinstance(spec.get("description", ""), str):
        raise bad_request("response_format.json_schema.description must be a string", "response_format")
    if not isinstance(spec.get("schema", {}), dict):
        raise bad_request("response_format.json_schema.schema must be an object (a JSON Schema)", "response_format")
    if not isinstance(spec.get("strict", False), (bool, type(None))):
        raise bad_request("response_format.json_schema.strict must be a boolean", "response_format")
    return spec


def _logprobs(body: dict, chat: bool) -> int | None:
    """Chat asks with `logprobs: true` and `top_logprobs` 0-20; completions with `logprobs` N."""
    if not chat:
        n = _integer(body, "logprobs")
        if n is not None and not 0 <= n <= MAX_TOP:
            raise bad_request(f"'logprobs' must be between 0 and {MAX_TOP}", "logprobs")
        return n
    on, top = _typed(body, "logprobs", bool, "a boolean"), _integer(body, "top_logprobs")
    if top is not None and not 0 <= top <= MAX_TOP:
        raise bad_request(f"'top_logprobs' must be between 0 and {MAX_TOP}", "top_logprobs")
    if top is not None and not on:
        raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if on else None


def completion_budget(p: GenerationParams, prompt_tokens: int, context: int, default: int) -> int:
    """The tokens a request may generate. A prompt at or over the window, or one that leaves less
    room than `max_tokens` asks, is a 400 `context_length_exceeded` before it queues, as OpenAI and
    vLLM answer, rather than a `length` finish the client did not ask for. Without `max_tokens`
    the server's default applies, cut to what the window leaves."""
    param = "messages" if p.chat else "prompt"
    if prompt_tokens >= context:
        raise bad_request(
            f"the prompt has {prompt_tokens} tokens; the context window holds {context}",
            param,
            code="context_length_exceeded",
        )
    if p.max_tokens is not None and prompt_tokens + p.max_tokens > context:
        raise bad_request(
            f"the context window holds {context} tokens, but {prompt_tokens + p.max_tokens} were asked "
            f"for ({prompt_tokens} in the {param}, {p.max_tokens} to generate): ask for at most "
            f"{context - prompt_tokens}, or leave max_tokens out",
            param,
            code="context_length_exceeded",
        )
    return p.max_tokens or min(default, context - prompt_tokens)


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def choice(
    p: GenerationParams,
    index: int,
    text: str | None,
    finish: str,
    logprobs: dict | None = None,
    tool_calls: Sequence[ToolCall] = (),
) -> dict:
    """One entry of a completion's `choices`."""
    out: dict[str, Any] = {"index": index, "finish_reason": finish, "logprobs": logprobs}
    if p.chat:
        out["message"] = {"role": "assistant", "content": text}
        if tool_calls:
            out["message"]["tool_calls"] = [c.to_json() for c in tool_calls]
    else:
        out["text"] = text
    return out


def completion(p: GenerationParams, rid: str, model: str, choices: list[dict], use: dict, fingerprint: str) -> dict:
    kind = "chat.completion" if p.chat else "text_completion"
    return {
        "id": rid,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": fingerprint,
        "choices": choices,
        "usage": use,
    }


def chunk(
    p: GenerationParams,
    rid: str,
    model: str,
    index: int = 0,
    text: str | None = None,
    finish: str | None = None,
    role: bool = False,
    use: dict | None = None,
    logprobs: dict | None = None,
    tool_call: dict | None = None,
    *,
    fingerprint: str,
) -> dict:
    """One streamed chunk of choice `index`: a text delta, a tool-call delta (tools.call_deltas),
    the opening role, the finish, or the usage (no choices). Each carries the system_fingerprint, as OpenAI's do."""
    kind = "chat.completion.chunk" if p.chat else "text_completion"
    out: dict[str, Any] = {
        "id": rid,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": fingerprint,
    }
    if use is not None:
        out["choices"], out["usage"] = [], use
        return out
    choice: dict[str, Any] = {"index": index, "finish_reason": finish, "logprobs": logprobs}
    if p.chat:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if text is not None:
            delta["content"] = text
        if tool_call is not None:
            delta["tool_calls"] = [tool_call]
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    out["choices"] = [choice]
    return out


_USER_MARK = "\ue000gmlx-user\ue000"  # a private-use sentinel no real message contains


def system_prefix_tokens(
    tokenizer: Any,
    messages: list[dict[str, Any]] | None,
    prompt_ids: list[int],
    tools: tool_prompt.ToolSpec | None = None,
) -> int:
    """How many of prompt_ids the leading system message(s) account for: the rendered prompt up to
    where the first user message's text would start, so requests that share a system prompt and
    differ after it share exactly this prefix (the prompt cache anchors there). 0 without one."""
    system = []
    for m in messages or ():
        if m.get("role") != "system":  # parse() named developer messages system
            break
        system.append(m)
    if not system or len(system) == len(messages or ()):
        return 0
    try:
        text = tool_prompt.render(
            tokenizer, [*system, {"role": "user", "content": _USER_MARK}], tools, add_generation_prompt=False
        )
    except Exception:  # a template that will not render this shape has no anchor
        return 0
    cut = text.find(_USER_MARK)
    if cut <= 0:
        return 0
    head = tokenizer.encode(text[:cut], add_special_tokens=False)
    # The first user token may merge with what precedes it: only the prefix both tokenizations share counts.
    shared = next((i for i, (a, b) in enumerate(zip(head, prompt_ids)) if a != b), min(len(head), len(prompt_ids)))
    return shared if shared < len(prompt_ids) else 0


def prompt_token_ids(tokenizer: Any, p: GenerationParams, vocab_size: int) -> list[int]:
    """The prompt as the engine will see it: the chat template applied, or the raw prompt."""
    if p.chat:
        try:
            text = tool_prompt.render(tokenizer, p.messages, p.tools)
        except Exception as e:  # a template's own error, e.g. roles that must alternate
            raise bad_request(f"the chat template rejected the messages: {e}", "messages") from None
        return tokenizer.encode(text, add_special_tokens=False)
    if isinstance(p.prompt, list):
        if not all(0 <= t < vocab_size for t in p.prompt):
            raise bad_request(f"token ids must be in [0, {vocab_size})", "prompt")
        return list(p.prompt)
    return tokenizer.encode(p.prompt)
