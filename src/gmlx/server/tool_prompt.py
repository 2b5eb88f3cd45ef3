"""Tools into the prompt: `tools`, `tool_choice` and the tool turns of a chat body, validated,
and rendered by the model's own chat template as transformers' `apply_chat_template(tools=...)`
gives them to it, or, for a template that knows no tools, by gmlx's fallback (FALLBACK_TOOLS).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from gmlx.engine.grammar import GrammarError, json_schema_grammar
from gmlx.server.errors import bad_request
from gmlx.server.tools import forced_call_schema

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
CHOICES = ("none", "auto", "required")
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}

# The fallback's system text: Hermes' format (the one Qwen's templates use too), which many
# small models have seen; tools.HERMES parses what it asks for.
FALLBACK_TOOLS = """# Tools

You can call functions to help with the request. Their signatures, as JSON, are inside <tools></tools>:
<tools>
{tools}
</tools>

To call a function, answer with a JSON object that names it and gives its arguments, inside \
<tool_call></tool_call> tags, one block per call:
<tool_call>
{{"name": "<function name>", "arguments": {{<the arguments, as a JSON object>}}}}
</tool_call>
Each function's result comes back in the next user turn, inside <tool_response></tool_response> tags."""


@dataclass(frozen=True)
class ToolSpec:
    tools: tuple[dict[str, Any], ...]  # {"type": "function", "function": {"name", ...}}, as sent
    choice: str  # one of CHOICES, or "function": the one named by `function` must be called
    function: str | None = None
    parallel: bool = True  # several calls in one turn
    grammar: str | None = None  # when a call is forced: the grammar of its JSON (tools.forced_call_schema)

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t["function"]["name"] for t in self.tools)

    @property
    def forced(self) -> bool:
        """Whether the output must be a call (constrained decoding makes it one)."""
        return self.choice in ("required", "function")

    def callable_parameters(self) -> dict[str, dict[str, Any]]:
        """The functions the output may call (name -> parameters schema) when a call is forced; one
        without parameters takes none (OpenAI's reading), not any."""
        fns = [t["function"] for t in self.tools]
        return {
            f["name"]: f.get("parameters") or _NO_PARAMETERS
            for f in fns
            if self.choice != "function" or f["name"] == self.function
        }


def _tool(tool: Any, i: int) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise bad_request(f'{where} must be {{"type": "function", "function": {{...}}}}', "tools")
    fn = tool["function"]
    if not isinstance(fn.get("name"), str) or not _NAME.fullmatch(fn["name"]):
        raise bad_request(f"{where}.function.name must be 1-64 letters, digits, _ or -", "tools")
    if not isinstance(fn.get("description", ""), str):
        raise bad_request(f"{where}.function.description must be a string", "tools")
    if not isinstance(fn.get("strict", False), bool):
        raise bad_request(f"{where}.function.strict must be a boolean", "tools")
    if (parameters := fn.get("parameters")) is not None:
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise bad_request(f"{where}.function.parameters must be a JSON Schema of type object", "tools")
        if (problem := _schema_problem(json.dumps(parameters, sort_keys=True))) is not None:
            raise bad_request(f"{where}.function.parameters is not a valid JSON Schema: {problem}", "tools")
    return {"type": "function", "function": fn}


@lru_cache(maxsize=512)  # a harness sends the same tools every turn; a check takes about a millisecond
def _schema_problem(schema: str) -> str | None:
    """What makes a schema (as JSON text) invalid under JSON Schema 2020-12, or None. Validity only:
    whether a grammar can hold a call to it is asked only when a call is forced."""
    from jsonschema import Draft202012Validator, SchemaError  # 80 ms: paid by the first tools, not at start

    try:
        Draft202012Validator.check_schema(json.loads(schema))
    except SchemaError as e:
        return f"{e.message} at {'/'.join(map(str, e.absolute_path)) or 'its root'}"
    return None


def _choice(value: Any, names: frozenset[str]) -> tuple[str, str | None]:
    if value in CHOICES:
        return value, None
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict):
        name = value["function"].get("name")
        if not isinstance(name, str) or name not in names:
            raise bad_request(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        return "function", name
    raise bad_request(
        '\'tool_choice\' must be none, auto, required or {"type": "function", "function": {"name": ...}}', "tool_choice"
    )


def tool_spec(body: dict) -> ToolSpec | None:
    """The body's tools and what it asks of them; None when it has none."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    if raw is not None and not isinstance(raw, list):
        raise bad_request("'tools' must be a list", "tools")
    tools = tuple(_tool(t, i) for i, t in enumerate(raw or ()))
    names = frozenset(t["function"]["name"] for t in tools)
    if len(names) < len(tools):
        raise bad_request("two tools have the same name", "tools")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    kind, function = _choice(choice, names) if choice is not None else ("auto" if tools else "none", None)
    if not tools:
        if kind not in ("none", "auto"):
            raise bad_request(f"tool_choice {kind!r} needs tools", "tool_choice")
        return None
    spec = ToolSpec(tools, kind, function, parallel is not False)
    if not spec.forced:
        return spec  # the model's calls are its own, unchecked: any schema the template can render will do
    functions = spec.callable_parameters()
    for i, t in enumerate(tools):  # a grammar holds the call: each schema it may take must compile
        if (parameters := functions.get(t["function"]["name"])) is not None:
            try:
                json_schema_grammar(parameters)
            except GrammarError as e:
                where, forcing = f"tools[{i}].function.parameters", "required" if kind == "required" else function
                raise bad_request(f"{where} cannot hold the call tool_choice {forcing} forces: {e}", "tools") from None
    # A named function is called once; `required` may call several when parallel calls are allowed.
    schema = forced_call_schema(functions, spec.parallel and kind == "required")
    try:
        return replace(spec, grammar=json_schema_grammar(schema))
    except GrammarError as e:
        raise bad_request(f"the tools cannot be called under constraint: {e}", "tools") from None


def _call_arguments(arguments: Any) -> Any:
    """An assistant call's arguments for the template: the object the JSON text holds, since many
    templates write them with `tojson` (vLLM does the same); text that holds none stays text."""
    try:
        value = json.loads(arguments) if isinstance(arguments, str) else arguments
    except (ValueError, RecursionError):  # JSON nested past Python's limit
        return arguments
    return value if isinstance(value, dict) else arguments


def assistant_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls`, checked and given to the template."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise bad_request(f"{where} must be a list", "messages")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
            or not isinstance(call.get("id"), str)
            or call.get("type", "function") != "function"
            or not isinstance(fn.get("arguments", ""), (str, dict))
        ):
            raise bad_request(
                f'{where}[{j}] must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}', "messages"
            )
        out.append(
            {
                "id": call["id"],
                "type": "function",
                "function": {"name": fn["name"], "arguments": _call_arguments(fn.get("arguments", {}))},
            }
        )
    return out


def tool_result(m: dict, i: int, content: str) -> dict[str, Any]:
    """A `tool` message (or the older `function` one, which has a name and no id) for the template."""
    out: dict[str, Any] = {"role": "tool", "content": content}
    for key, needed in (("tool_call_id", m["role"] == "tool"), ("name", m["role"] == "function")):
        value = m.get(key)
        if value is None and not needed:
            continue
        if not isinstance(value, str):
            raise bad_request(f"messages[{i}].{key} must be a string", "messages")
        out[key] = value
    return out


def name_tool_results(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool results named after the call they answer, for the templates that show the name."""
    names = {c["id"]: c["function"]["name"] for m in messages for c in m.get("tool_calls", ())}
    return [
        {**m, "name": names[m["tool_call_id"]]}
        if m["role"] == "tool" and "name" not in m and m.get("tool_call_id") in names
        else m
        for m in messages
    ]


def knows_tools(template: str | None) -> bool:
    """Whether a chat template renders tools itself (it reads the `tools` variable)."""
    return bool(template) and re.search(r"\btools\b", template) is not None


def _fallback_call(fn: dict[str, Any]) -> str:
    call = json.dumps({"name": fn["name"], "arguments": fn["arguments"]}, ensure_ascii=False)
    return f"<tool_call>\n{call}\n</tool_call>"


def fallback_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The conversation as plain turns for a template that knows no tools: the tools described in
    the system turn (FALLBACK_TOOLS), calls written in its format, results as the user's turn."""
    out: list[dict[str, Any]] = []
    for previous, m in zip([None, *messages], messages):
        if m["role"] == "tool":
            result = f"<tool_response>\n{m['content']}\n</tool_response>"
            if previous is not None and previous["role"] == "tool":  # one turn's results share a user turn
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + result}
            else:
                out.append({"role": "user", "content": result})
        elif m.get("tool_calls"):
            calls = [_fallback_call(c["function"]) for c in m["tool_calls"]]
            out.append({"role": m["role"], "content": "\n".join(([m["content"]] if m["content"] else []) + calls)})
        else:
            out.append(m)
    if tools:
        described = FALLBACK_TOOLS.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{described}" if out[0]["content"] else described}
        else:
            out.insert(0, {"role": "system", "content": described})
    return out


def render(
    tokenizer: Any, messages: list[dict[str, Any]], spec: ToolSpec | None, add_generation_prompt: bool = True
) -> str:
    """The prompt text: the model's template given the tools, or the fallback's turns."""
    tools = list(spec.tools) if spec is not None else None
    if knows_tools(getattr(tokenizer, "chat_template", None)):
        return tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
        )
    return tokenizer.apply_chat_template(
        fallback_messages(messages, tools), add_generation_prompt=add_generation_prompt, tokenize=False
    )
