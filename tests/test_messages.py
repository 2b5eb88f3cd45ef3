"""POST /v1/messages with the official anthropic client: system and messages, text and tool_use
blocks, tool_result blocks going back in, streaming events; on the chat path."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from conftest import LiveServer, Script
from tiny_models import write_model

anthropic = pytest.importorskip("anthropic")

KEY = "msg-key"
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    path = write_model(tmp_path_factory.mktemp("messages") / "tiny.gguf", "llama", context=4096)
    with LiveServer(path, api_key=KEY) as s:
        yield s


@pytest.fixture
def client(server: LiveServer):
    # A harness's base URL has no /v1 (the client adds it); the key goes as a bearer token.
    return anthropic.Anthropic(base_url=server.url, auth_token=KEY, api_key=None, max_retries=0)


def test_text_is_the_chat_answer(client, server: LiveServer) -> None:
    r = client.messages.create(
        model=server.model_id,
        max_tokens=8,
        system="Be brief.",
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": "Tell me about the sea."}],
    )  # greedy
    with server.client(headers={"Authorization": f"Bearer {KEY}"}) as c:
        chat = c.post(
            "/v1/chat/completions",
            json={
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Tell me about the sea."},
                ],
                "max_tokens": 8,
                "temperature": 0,
            },
        ).json()
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_")
    text = "".join(b.text for b in r.content if b.type == "text")
    assert text == chat["choices"][0]["message"]["content"]
    assert r.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat["choices"][0]["finish_reason"]]
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == chat["usage"]["prompt_tokens"]
    assert r.usage.output_tokens == chat["usage"]["completion_tokens"]


def test_tool_use_and_tool_result(client, server: LiveServer, scripted: Script) -> None:
    scripted += ['Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>']
    ask = {"role": "user", "content": "Weather in Paris?"}
    r = client.messages.create(model=server.model_id, max_tokens=64, tools=[WEATHER], messages=[ask])
    text, use = r.content
    assert (text.type, text.text, r.stop_reason) == ("text", "Let me check.", "tool_use")
    assert (use.type, use.name, use.input) == ("tool_use", "get_weather", {"city": "Paris"})
    scripted[:] = ["It is 18 C."]
    follow = client.messages.create(
        model=server.model_id,
        max_tokens=64,
        tools=[WEATHER],
        messages=[
            ask,
            {"role": "assistant", "content": [b.model_dump() for b in r.content]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": use.id, "content": "18 C"},
                    {"type": "text", "text": "And tomorrow?"},
                ],
            },
        ],
    )
    assert [b.text for b in follow.content] == ["It is 18 C."] and follow.stop_reason == "end_turn"
    prompt = server.engine.loaded.tokenizer.decode(scripted.prompts[-1])
    assert prompt.index("get_weather") < prompt.index("18 C") < prompt.index("And tomorrow?")


def test_streamed_events(client, server: LiveServer, scripted: Script) -> None:
    scripted += ["Sure. ", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>']
    args = {
        "model": server.model_id,
        "max_tokens": 64,
        "tools": [WEATHER],
        "messages": [{"role": "user", "content": "Weather?"}],
    }
    events = list(client.messages.create(**args, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["text", "tool_use"] and kinds.count("content_block_stop") == 2
    assert events[-2].delta.stop_reason == "tool_use" and events[-2].usage.output_tokens == 2
    with client.messages.stream(**args) as stream:  # the SDK's own accumulator rebuilds the same message
        final = stream.get_final_message()
    assert final.content[0].text == "Sure."
    assert (final.content[1].name, final.content[1].input) == ("get_weather", {"city": "Paris"})


def test_a_streamed_answer_counts_its_cached_prompt_as_a_plain_one_does(client, server: LiveServer) -> None:
    """The prompt cache is read after message_start goes out; message_delta's usage, cumulative,
    then says what it held, and the SDK's accumulator takes it (it read 0 cached before)."""
    args = {
        "model": server.model_id,
        "max_tokens": 4,
        "extra_body": {"temperature": 0},
        "messages": [{"role": "user", "content": "Tell me a story about a lighthouse keeper and the sea."}],
    }
    client.messages.create(**args)  # its prompt is in the cache from now on
    plain = client.messages.create(**args).usage
    with client.messages.stream(**args) as stream:
        streamed = stream.get_final_message().usage
    assert plain.cache_read_input_tokens > 0
    counts = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens", "output_tokens")
    assert [getattr(streamed, k) for k in counts] == [getattr(plain, k) for k in counts]


def test_refusals(server: LiveServer) -> None:
    with server.client(headers={"Authorization": f"Bearer {KEY}"}) as c:

        def error(body: dict) -> dict:
            r = c.post("/v1/messages", json={"model": server.model_id, "max_tokens": 4, **body})
            assert r.status_code == 400, r.text
            return r.json()["error"]

        hi = [{"role": "user", "content": "hi"}]
        assert (
            error({"messages": hi, "thinking": {"type": "enabled", "budget_tokens": 1024}})["code"]
            == "unsupported_parameter"
        )
        assert (
            error({"messages": hi, "tools": [{"type": "web_search_20250305", "name": "web_search"}]})["param"]
            == "tools"
        )
        assert (
            error({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]})["param"] == "messages"
        )
        assert error({"messages": [{"role": "system", "content": "x"}]})["param"] == "messages"
        # Each names what is wrong with the block, not its kind as unsupported.
        call = {"type": "tool_use", "id": "t1", "name": "f", "input": {}}
        for block, role, says in (
            ({**call, "input": "x"}, "assistant", "'input' must be an object"),
            ({k: v for k, v in call.items() if k != "id"}, "assistant", "'id' must be a string"),
            (call, "user", "tool_use blocks belong in assistant messages"),
            ({"type": {"x": 1}}, "user", "blocks are not supported"),
        ):
            refused = error({"messages": [{"role": role, "content": [block]}]})
            assert refused["param"] == "messages" and says in refused["message"], refused
        stops = error({"messages": hi, "stop_sequences": [1]})  # checked as chat's stop
        assert stops["param"] == "stop_sequences" and "'stop_sequences'" in stops["message"]
        assert c.post("/v1/messages", json={"model": server.model_id, "messages": hi}).status_code == 400  # max_tokens


def test_the_key_may_come_as_anthropic_clients_send_it(server: LiveServer) -> None:
    """Anthropic's clients send the key as `x-api-key`; it counts as the bearer token does, once."""
    client = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)
    reply = client.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert reply.type == "message"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).models.list()
    with server.client() as c:  # the key in both headers: which one counts would be a guess
        r = c.get("/v1/models", headers={"Authorization": f"Bearer {KEY}", "x-api-key": KEY})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
