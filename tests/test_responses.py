"""POST /v1/responses with the official openai client: plain text, instructions, streaming with the
Responses event types, a tool call and its result, structured output, and previous_response_id;
all on the chat path, so the answers are the chat route's."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest
from conftest import LiveServer, Script
from tiny_models import write_model

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A tiny model with no template of its own (the tools' fallback), and room for a tool prompt."""
    path = write_model(tmp_path_factory.mktemp("responses") / "tiny.gguf", "llama", context=4096)
    with LiveServer(path) as s:
        yield s


@pytest.fixture
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0)


def test_plain_text_is_the_chat_answer(client: openai.OpenAI, server: LiveServer) -> None:
    args = {"model": server.model_id, "temperature": 0}
    r = client.responses.create(input="Tell me about the sea.", max_output_tokens=8, instructions="Be brief.", **args)
    chat = client.chat.completions.create(
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about the sea."}],
        max_tokens=8,
        **args,
    )
    assert r.object == "response" and r.id.startswith("resp_") and r.model == server.model_id
    assert r.output_text == chat.choices[0].message.content  # greedy: the same tokens as chat's
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert r.instructions == "Be brief." and r.output[0].type == "message" and r.output[0].role == "assistant"
    # Cut by max_output_tokens, the message is incomplete as the response is (OpenAI's shape), streamed or not.
    cut = client.responses.create(input="Tell me about the sea.", max_output_tokens=1, **args)
    [item] = cut.output
    assert (cut.status, item.status, cut.incomplete_details.reason) == ("incomplete", "incomplete", "max_output_tokens")
    assert cut.output_text
    *_, last = client.responses.create(input="Tell me about the sea.", max_output_tokens=1, stream=True, **args)
    final = last.response
    assert last.type == "response.incomplete" and final.output[0].status == "incomplete"
    assert final.output_text == cut.output_text


def test_streamed_events(client: openai.OpenAI, server: LiveServer, scripted: Script) -> None:
    scripted += ["The sea ", "is ", "calm."]
    events = list(client.responses.create(model=server.model_id, input="hi", stream=True))
    kinds = [e.type for e in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 3,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "The sea is calm."
    final = events[-1].response
    assert final.status == "completed" and final.output_text == "The sea is calm." and final.usage.output_tokens == 3
    assert events[2].item.id == final.output[0].id == events[-2].item.id
    with client.responses.stream(model=server.model_id, input="hi") as stream:  # the SDK's own accumulator
        assert stream.get_final_response().output_text == "The sea is calm."


def test_a_tool_call_and_its_result(client: openai.OpenAI, server: LiveServer, scripted: Script) -> None:
    scripted += ['Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>']
    r = client.responses.create(model=server.model_id, input="Weather in Paris?", tools=[WEATHER])
    message, call = r.output
    assert (message.type, message.content[0].text) == ("message", "Let me check.")
    assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "get_weather", {"city": "Paris"})
    assert call.call_id.startswith("call_")
    streamed = list(
        client.responses.create(model=server.model_id, input="Weather in Paris?", tools=[WEATHER], stream=True)
    )
    args = "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == {"city": "Paris"}
    done = [e.item for e in streamed if e.type == "response.output_item.done"]
    assert [i.type for i in done] == ["message", "function_call"] and done[1].name == "get_weather"
    # The result goes back as a function_call_output item, after the call, as an agent loop sends it.
    scripted[:] = ["It is 18 C."]
    follow = client.responses.create(
        model=server.model_id,
        tools=[WEATHER],
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"},
        ],
    )
    assert follow.output_text == "It is 18 C."
    prompt = server.engine.loaded.tokenizer.decode(scripted.prompts[-1])
    assert "<tool_response>" in prompt and "18 C" in prompt and "get_weather" in prompt


def test_previous_response_id_continues_the_conversation(
    client: openai.OpenAI, server: LiveServer, scripted: Script
) -> None:
    decode = server.engine.loaded.tokenizer.decode
    scripted += ["Hello, Ann."]
    first = client.responses.create(model=server.model_id, input="My name is Ann.", instructions="Be kind.")
    scripted[:] = ["You are Ann."]
    second = client.responses.create(model=server.model_id, input="Who am I?", previous_response_id=first.id)
    prompt = decode(scripted.prompts[-1])
    assert prompt.index("My name is Ann.") < prompt.index("Hello, Ann.") < prompt.index("Who am I?")
    assert "Be kind." not in prompt  # instructions are not carried over, as OpenAI's are not
    assert second.previous_response_id == first.id
    unkept = client.responses.create(model=server.model_id, input="x", store=False)
    for rid in (unkept.id, "resp_nope"):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=server.model_id, input="y", previous_response_id=rid)
        assert e.value.code == "previous_response_not_found"


def test_structured_output(client: openai.OpenAI, server: LiveServer) -> None:
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "name": "num", "schema": schema, "strict": True}
    r = client.responses.create(
        model=server.model_id, input="A number, as JSON.", max_output_tokens=40, text={"format": fmt}
    )
    if r.status == "completed":  # the grammar holds the random model to the schema; 40 tokens may cut it short
        assert isinstance(json.loads(r.output_text)["n"], int)
    assert r.text.format.type == "json_schema"


def test_refusals(server: LiveServer) -> None:
    with server.client() as c:

        def error(body: dict) -> dict:
            r = c.post("/v1/responses", json=body)
            assert r.status_code == 400, r.text
            return r.json()["error"]

        assert error({"input": "x", "reasoning": {"effort": "high"}})["code"] == "unsupported_parameter"
        assert error({"input": "x", "tools": [{"type": "web_search"}]})["code"] == "unsupported_parameter"
        assert error({"input": [{"type": "input_image", "image_url": "x"}]})["param"] == "input"
        assert error({"input": [{"role": "user", "content": [{"type": "input_image"}]}]})["param"] == "input"
        assert error({"instructions": "x"})["param"] == "input"
        assert error({"input": "x", "whatever": 1})["code"] == "unsupported_parameter"
        # Each names what is wrong with the item, not its kind as unsupported.
        for item, says in (
            ({"type": "function_call", "call_id": "c", "name": "f", "arguments": {"a": 1}}, "'arguments' as a string"),
            ({"type": "function_call", "call_id": "c", "arguments": "{}"}, "'name' as a string"),
            ({"role": "wizard", "content": "x"}, "role must be one of"),
            ("hi", "must be an object"),
            ({"type": ["x"]}, "items are not supported"),
        ):
            refused = error({"input": [item]})
            assert refused["param"] == "input" and says in refused["message"], refused
        too_few = error({"input": "x", "max_output_tokens": 0})  # checked as chat's max_completion_tokens
        assert too_few["param"] == "max_output_tokens" and "'max_output_tokens'" in too_few["message"]
        assert c.post("/responses", json={"input": "x", "max_output_tokens": 2}).status_code == 200  # the bare alias
