"""Tools: validated, rendered by the model's template (or the fallback), and parsed out of the
model's text into OpenAI's tool_calls, streamed or not; forced calls by constrained decoding."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import LiveServer
from tiny_models import write_model
from tool_templates import LLAMA3_TOOLS, QWEN_TOOLS

from gmlx.server import openai_api, tool_prompt, tools
from gmlx.server.errors import APIError
from gmlx.server.tools import FORCED, HERMES, LLAMA3, MISTRAL, ToolCallParser

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
NAMES = frozenset({"get_weather", "get_time"})
ASK = {"role": "user", "content": "Weather in Paris?"}
CALLED = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    ],
}
ANSWERED = {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}
PARIS = ("get_weather", '{"city": "Paris"}')

# (format, model output, expected content, expected calls as (name, arguments))
OUTPUTS = [
    (
        HERMES,
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "Let me check.",
        [PARIS],
    ),
    (
        HERMES,
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
        None,
        [PARIS, ("get_time", "{}")],
    ),
    (
        HERMES,
        'A <tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call> then B',
        "A then B",
        [PARIS],
    ),  # arguments written as a string of JSON
    (HERMES, '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}', None, [PARIS]),  # unclosed at EOS
    (LLAMA3, '{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [PARIS]),
    (
        LLAMA3,
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_time", "parameters": {}}',
        None,
        [PARIS, ("get_time", "{}")],
    ),
    (LLAMA3, 'Sure: <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', "Sure:", [PARIS]),
    (
        MISTRAL,
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]',
        None,
        [PARIS, ("get_time", "{}")],
    ),
    (FORCED, '{"name": "get_weather", "arguments": {"city": "Paris"}}', None, [PARIS]),
    (
        FORCED,
        '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]',
        None,
        [PARIS, ("get_time", "{}")],
    ),
]
# Output that looks like a call and is not one stays content, as the model wrote it.
NOT_CALLS = [
    (HERMES, 'Hi <tool_call>{"name": "get_weather", "arguments": {"city": </tool_call> there'),  # malformed JSON
    (HERMES, '<tool_call>{"name": "get_weather", "arguments": {"city": "Par'),  # cut off
    (HERMES, '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>'),  # not a declared function
    (HERMES, '<tool_call>{"name": "get_weather"}</tool_call>'),  # no arguments
    (HERMES, "a < b and <tool_ call> is not a marker"),
    (LLAMA3, '{"answer": 42}'),
    (LLAMA3, '{"name": "Paris", "parameters": {"population": 2}}'),
    (LLAMA3, '{"name": "get_weather", "parameters": {"city": "Paris"'),
    (MISTRAL, "x [TOOL_CALLS] get_weather"),
    (MISTRAL, '[TOOL_CALLS] [{"name": "get_weather", "arguments": {]'),
]


def calls_of(parser: ToolCallParser) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in parser.calls]


def streamed(fmt: tools.CallFormat, pieces: list[str], parallel: bool = True) -> tuple[str | None, list]:
    """The content and calls a stream of `pieces` gives, the way the server assembles them."""
    parser = ToolCallParser(fmt, NAMES, parallel)
    out = [x for piece in pieces for x in parser.feed(piece)] + parser.close()
    assert [x for x in out if not isinstance(x, str)] == parser.calls  # each call given out once, in order
    content = "".join(x for x in out if isinstance(x, str))
    return (content or None) if parser.calls else content, calls_of(parser)


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), OUTPUTS)
def test_each_format_gives_its_calls_and_the_text_around_them(fmt, text, content, calls) -> None:
    parser = ToolCallParser(fmt, NAMES)
    assert parser.parse(text)[0] == content
    assert calls_of(parser) == calls


@pytest.mark.parametrize(("fmt", "text"), [(f, t) for f, t, *_ in OUTPUTS] + NOT_CALLS)
def test_a_stream_split_anywhere_gives_what_the_whole_text_gives(fmt, text) -> None:
    whole = streamed(fmt, [text])
    for cut in range(len(text) + 1):
        assert streamed(fmt, [text[:cut], text[cut:]]) == whole, cut
    assert streamed(fmt, list(text)) == whole  # a character at a time


@pytest.mark.parametrize(("fmt", "text"), NOT_CALLS)
def test_what_is_not_a_well_formed_call_stays_content(fmt, text) -> None:
    assert ToolCallParser(fmt, NAMES).parse(text) == (text.strip(), [])


def test_text_is_held_back_only_while_it_may_open_a_call() -> None:
    parser = ToolCallParser(HERMES, NAMES)
    assert parser.feed("Hello <tool") == ["Hello"]
    assert parser.feed("box> here") == [" <toolbox> here"]  # no marker after all: released
    assert parser.feed(" <tool_call>{") == []
    assert parser.feed('"name": "get_time", "arguments": {}}</tool_call>') == parser.calls
    llama = ToolCallParser(LLAMA3, NAMES)
    assert llama.feed('{"answer') == ['{"answer']  # a bare object that does not open with "name" is content


def test_forced_calls_go_out_as_each_completes_and_a_cut_one_is_dropped() -> None:
    """`required` lets a looping model write calls until max_tokens: the complete ones are its
    answer, and the grammar's cut-off JSON is not made the assistant's text."""
    text = '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}, {"name'
    parser = ToolCallParser(FORCED, NAMES)
    assert parser.feed(text[:60]) == parser.calls[:1] and calls_of(parser) == [PARIS]  # before the array ends
    assert parser.parse(text[60:]) == (None, parser.calls) and calls_of(parser) == [PARIS, ("get_time", "{}")]
    for cut in range(len(text) + 1):
        assert streamed(FORCED, [text[:cut], text[cut:]]) == (None, [PARIS, ("get_time", "{}")]), cut
    assert ToolCallParser(FORCED, NAMES).parse('{"name": "get_weather", "arguments": {"ci') == ("", [])


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    text = OUTPUTS[1][1]
    assert streamed(HERMES, [text], parallel=False) == (None, [PARIS])


def test_the_template_says_which_format_to_parse() -> None:
    assert tools.call_format(QWEN_TOOLS) is HERMES
    assert tools.call_format(LLAMA3_TOOLS) is LLAMA3
    assert tools.call_format("{{ '[AVAILABLE_TOOLS]' }}{{ '[TOOL_CALLS]' }}") is MISTRAL
    assert tools.call_format(None) is HERMES  # the fallback's format


def test_a_call_streams_name_first_then_arguments() -> None:
    call = tools.ToolCall(*PARIS)
    first, second = tools.call_deltas(call, 2)
    assert call.id.startswith("call_") and len(call.id) > 10
    assert first == {
        "index": 2,
        "id": call.id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": ""},
    }
    assert second == {"index": 2, "function": {"arguments": PARIS[1]}}
    assert tools.finish_reason("stop", [call]) == "tool_calls" and tools.finish_reason("length", [call]) == "length"


# --- requests ------------------------------------------------------------------------------------


def chat(**body: object) -> openai_api.GenerationParams:
    return openai_api.parse({"messages": [ASK], **body}, chat=True)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": {"type": "function"}}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "two words"}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, "tools"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"x": {"type": "nonsense"}}},
                        },
                    }
                ]
            },
            "tools",
        ),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"messages": [ASK, {"role": "tool", "content": "18 C"}]}, "messages"),  # no tool_call_id
        ({"messages": [ASK, {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": 3}}]}]}, "messages"),
        ({"messages": [{"role": "user", "content": "hi", "tool_calls": CALLED["tool_calls"]}]}, "messages"),
    ],
)
def test_bad_tools_are_a_400_naming_the_field(body: dict, param: str) -> None:
    with pytest.raises(APIError) as e:
        chat(**body)
    assert (e.value.status, e.value.param) == (400, param), e.value.message


def test_a_schema_no_grammar_can_hold_is_refused_only_where_a_call_is_forced() -> None:
    """MCP servers' tools use keywords llguidance lacks (`uniqueItems`, `not`); under `auto` and
    `none` nothing constrains the call, so one such tool must not fail every turn of a loop."""
    unique = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    tool = {"type": "function", "function": {"name": "tag", "parameters": unique}}
    for choice in ("auto", "none"):
        assert chat(tools=[tool, WEATHER], tool_choice=choice).tools is not None
    forced = chat(tools=[tool, WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert forced.tools is not None and forced.tools.grammar is not None  # the other tool is not held
    for choice in ("required", {"type": "function", "function": {"name": "tag"}}):
        with pytest.raises(APIError) as e:
            chat(tools=[tool], tool_choice=choice)
        assert e.value.param == "tools" and "tools[0].function.parameters" in e.value.message
        assert "uniqueItems" in e.value.message


def test_tool_turns_reach_the_template_as_transformers_gives_them() -> None:
    p = chat(
        messages=[ASK, CALLED, ANSWERED, {"role": "function", "name": "get_time", "content": "noon"}], tools=[WEATHER]
    )
    assert p.messages[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ],
    }
    assert p.messages[2] == {"role": "tool", "content": "18 C", "tool_call_id": "call_1", "name": "get_weather"}
    assert p.messages[3] == {"role": "tool", "content": "noon", "name": "get_time"}
    assert "tool_calls" not in p.messages[0]  # templates test for the key
    assert (p.tools.choice, p.tools.parallel, p.grammar) == ("auto", True, None)
    assert chat(tools=[]).tools is None and chat(tools=[WEATHER], tool_choice="none").tools.choice == "none"


def test_the_forced_call_schema_admits_exactly_the_allowed_calls() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    params = {"get_weather": WEATHER["function"]["parameters"], "get_time": {"type": "object", "properties": {}}}
    one, many = tools.forced_call_schema(params, parallel=False), tools.forced_call_schema(params, parallel=True)
    good = [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, {"name": "get_time", "arguments": {}}]
    bad = [
        {"name": "get_weather", "arguments": {}},
        {"name": "get_weather", "arguments": {"city": 3}},
        {"name": "launch", "arguments": {}},
        {"name": "get_time"},
        {"name": "get_time", "arguments": {}, "x": 1},
    ]
    for call in good:
        jsonschema.validate(call, one)
    jsonschema.validate(good, many)
    for call in bad:
        assert not jsonschema.Draft202012Validator(one).is_valid(call), call
    assert not jsonschema.Draft202012Validator(many).is_valid([])
    named = chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}).tools
    assert named.grammar and named.callable_parameters() == {  # no parameters: no arguments
        "get_time": {"type": "object", "properties": {}, "additionalProperties": False}
    }


# --- rendering -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def templated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny models carrying a Qwen-style and a Llama-3-style tool template, and one with none."""
    root = tmp_path_factory.mktemp("tool-templates")
    return {
        "qwen": write_model(root / "qwen.gguf", "qwen2", chat_template=QWEN_TOOLS),
        "llama": write_model(root / "llama.gguf", "llama", chat_template=LLAMA3_TOOLS),
        "none": write_model(root / "none.gguf", "gemma3"),
    }


def rendered(path: Path, p: openai_api.GenerationParams) -> str:
    from gmlx.gguf.header import read_header
    from gmlx.gguf.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(read_header(path), cache_dir=path.parent)
    ids = openai_api.prompt_token_ids(tokenizer, p, 10**6)
    text = tool_prompt.render(tokenizer, p.messages, p.tools)
    assert tokenizer.decode(ids) == text  # the engine's prompt is the rendered text
    return text


def test_a_qwen_template_renders_the_tools_calls_and_results(templated: dict[str, Path]) -> None:
    text = rendered(templated["qwen"], chat(messages=[ASK, CALLED, ANSWERED], tools=[WEATHER]))
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>"
    ) in text
    assert "<tools>" not in rendered(templated["qwen"], chat())


def test_a_llama3_template_renders_the_tools_calls_and_results(templated: dict[str, Path]) -> None:
    text = rendered(templated["llama"], chat(messages=[ASK, CALLED, ANSWERED], tools=[WEATHER]))
    assert json.dumps(WEATHER, indent=4) in text and "Environment: ipython" in text
    assert (
        '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": '
        '{"city": "Paris"}}<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n18 C<|eot_id|>'
    ) in text


def test_a_template_without_tools_gets_the_fallback(templated: dict[str, Path]) -> None:
    system = {"role": "system", "content": "Be brief."}
    text = rendered(templated["none"], chat(messages=[system, ASK, CALLED, ANSWERED, ANSWERED], tools=[WEATHER]))
    described = tool_prompt.FALLBACK_TOOLS.format(tools=json.dumps(WEATHER))
    assert f"<start_of_turn>user\nBe brief.\n\n{described}\n\nWeather in Paris?<end_of_turn>" in text
    assert (
        '<start_of_turn>model\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call><end_of_turn>\n<start_of_turn>user\n<tool_response>\n18 C\n</tool_response>\n"
        "<tool_response>\n18 C\n</tool_response><end_of_turn>"
    ) in text  # one turn's results share a turn
    assert tools.call_format(None) is HERMES and "<tool_call>" in described  # it asks for what is parsed


def test_estimate_and_dry_run_count_the_tools(templated: dict[str, Path]) -> None:
    with LiveServer(templated["qwen"]) as s, s.client() as c:
        body = {"messages": [ASK], "max_tokens": 4}
        plain = c.post("/v1/estimate", json=body).json()["prompt_tokens"]
        with_tools = {**body, "tools": [WEATHER]}
        counted = c.post("/v1/estimate", json=with_tools).json()["prompt_tokens"]
        assert counted == len(s.model.tokenize(openai_api.parse(with_tools, chat=True))) > plain + 40
        assert c.post("/v1/chat/completions", json={**with_tools, "dry_run": True}).json()["prompt_tokens"] == counted
        bad = c.post("/v1/estimate", json={**body, "tools": [{"type": "function", "function": {"name": "a b"}}]})
        assert (bad.status_code, bad.json()["error"]["param"]) == (400, "tools")


# --- on the wire ---------------------------------------------------------------------------------


@pytest.fixture
def live_server(tmp_path: Path) -> Iterator[LiveServer]:
    """A tiny model with no template of its own (so the fallback's), and room for its tool prompt."""
    with LiveServer(write_model(tmp_path / "tiny.gguf", "llama", context=4096)) as server:
        yield server


@pytest.fixture
def scripted(live_server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The live server's engine answers every request with the pieces of text this list holds."""
    from gmlx.engine.engine import Chunk, Finished

    script: list[str] = []

    def submit(req) -> None:
        def run() -> None:
            for piece in script:
                req.emit(Chunk(piece))
            req.emit(Finished("stop", len(req.prompt_ids), len(script), 0.01, 100.0))

        threading.Thread(target=run, daemon=True).start()

    monkeypatch.setattr(live_server.model.engine, "submit", submit)
    yield script


def reassembled(stream) -> tuple[str | None, list[dict], str | None]:
    """A stream's content, its calls rebuilt from the deltas by index, and its finish reason."""
    content, calls, finish = [], {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        if choice.delta.content:
            content.append(choice.delta.content)
        for d in choice.delta.tool_calls or ():
            call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            if d.id:
                assert not call["arguments"] and call["id"] is None  # the id and name come first
                call["id"], call["name"] = d.id, d.function.name
            call["arguments"] += d.function.arguments or ""
    return "".join(content) or None, [calls[i] for i in sorted(calls)], finish


def test_calls_reach_the_openai_client_streamed_or_not(live_server: LiveServer, scripted: list[str]) -> None:
    openai = pytest.importorskip("openai")
    text = OUTPUTS[0][1] + '\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    scripted += [text[i : i + 3] for i in range(0, len(text), 3)]  # a few characters a token
    client = openai.OpenAI(base_url=live_server.url + "/v1", api_key="k")
    args = {"model": live_server.model_id, "messages": [ASK], "tools": [WEATHER, TIME]}
    r = client.chat.completions.create(**args)
    choice = r.choices[0]
    assert (choice.finish_reason, choice.message.content) == ("tool_calls", "Let me check.")
    got = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert got == [PARIS, ("get_time", "{}")] and all(
        c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls
    )
    content, calls, finish = reassembled(client.chat.completions.create(**args, stream=True))
    assert (content, finish) == ("Let me check.", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == got and all(c["id"].startswith("call_") for c in calls)
    # tool_choice none: the same text is only text.
    r = client.chat.completions.create(**args, tool_choice="none")
    assert (r.choices[0].message.content, r.choices[0].message.tool_calls, r.choices[0].finish_reason) == (
        text,
        None,
        "stop",
    )
    # The loop goes on: the calls and the tool's answer go back in.
    scripted[:] = ["It is 18 C."]
    messages = [
        ASK,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": "18 C"},
    ]
    r = client.chat.completions.create(**{**args, "messages": messages})
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("It is 18 C.", "stop")


@pytest.mark.slow
def test_an_agent_loop_on_the_default_model(default_model: Path) -> None:
    """A forced call and a required one, whose arguments validate; the tool's answer; a final text."""
    openai = pytest.importorskip("openai")
    jsonschema = pytest.importorskip("jsonschema")
    with LiveServer(default_model, weights="auto") as s:  # as `gmlx serve` runs it (gguf where it can)
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="k")
        messages: list = [{"role": "user", "content": "What is the weather in Paris?"}]
        args = {"model": s.model_id, "tools": [WEATHER, TIME], "max_tokens": 64, "temperature": 0}
        for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
            r = client.chat.completions.create(**args, messages=messages, tool_choice=choice)
            assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
            for call in r.choices[0].message.tool_calls:
                spec = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]
                jsonschema.validate(json.loads(call.function.arguments), spec.get("parameters", {}))
        assert r.choices[0].message.tool_calls[0].function.name in NAMES
        messages += [
            r.choices[0].message.model_dump(exclude_none=True),
            *(
                {"role": "tool", "tool_call_id": c.id, "content": "18 C, sunny"}
                for c in r.choices[0].message.tool_calls
            ),
        ]
        final = client.chat.completions.create(**args, messages=messages, tool_choice="none")
        assert final.choices[0].message.content and final.choices[0].message.tool_calls is None
