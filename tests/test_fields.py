"""No field silently ignored: every field of the official client's chat and completions bodies is
honoured, accepted as changing nothing, or refused with a 400 `unsupported_parameter` naming it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import LiveServer
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from gmlx.server import fields

CLIENT_FIELDS = {
    True: sorted(chat_create_params.CompletionCreateParamsBase.__annotations__),
    False: sorted(completion_create_params.CompletionCreateParamsBase.__annotations__),
}
ASKS_FOR_SOMETHING = {"x": 1}  # no field's value that asks for nothing


@pytest.fixture(scope="module")
def server(tiny_models: dict[str, Path]) -> Iterator[LiveServer]:
    with LiveServer(tiny_models["llama"], max_tokens_default=2) as s:
        yield s


def post(s: LiveServer, chat: bool, **extra: object) -> tuple[int, dict]:
    body = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    with s.client() as c:
        r = c.post("/v1/chat/completions" if chat else "/v1/completions", json={**body, **extra})
    return r.status_code, r.json()


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_every_client_field_is_honoured_accepted_or_refused_by_name(server: LiveServer, chat: bool) -> None:
    honoured = set(fields.HONOURED_BOTH) | set(fields.HONOURED_CHAT if chat else fields.HONOURED_COMPLETION)
    checked = []
    for name in CLIENT_FIELDS[chat]:
        if name in honoured:
            continue  # each has its own tests
        status, body = post(server, chat, **{name: "x" if name in fields.NO_EFFECT else ASKS_FOR_SOMETHING})
        if name in fields.NO_EFFECT:
            assert status == 200, (name, body)
        else:  # unsupported, or a field newer than gmlx: refused either way, never dropped
            assert status == 400 and body["error"]["code"] == "unsupported_parameter", (name, body)
            assert body["error"]["param"] == name and name in body["error"]["message"]
        checked.append(name)
    assert len(checked) >= (8 if chat else 3)


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_unsupported_fields_asking_for_nothing_are_accepted(server: LiveServer, chat: bool) -> None:
    for name, values in fields.unsupported(chat).items():
        for value in values:
            status, body = post(server, chat, **{name: value})
            assert status == 200, (name, value, body)


def test_a_field_gmlx_does_not_know_is_refused_by_name(server: LiveServer) -> None:
    for chat in (True, False):
        status, body = post(server, chat, frobnicate=1)
        assert status == 400 and body["error"]["param"] == "frobnicate"
    status, body = post(server, False, messages=[{"role": "user", "content": "hi"}])  # chat's field, elsewhere
    assert status == 400 and body["error"]["param"] == "messages"
    status, body = post(server, True, n=True)  # true is no 1
    assert status == 400


def test_every_field_the_server_knows_is_in_its_schema(server: LiveServer) -> None:
    with server.client() as c:
        schemas = c.get("/openapi.json").json()["components"]["schemas"]
    for chat, name in ((True, "ChatCompletionRequest"), (False, "CompletionRequest")):
        assert schemas[name]["additionalProperties"] is False
        assert set(schemas[name]["properties"]) == fields.known(chat), name
