"""The surface beyond chat and completions that clients call: `models.retrieve`, and every route
also without the `/v1` prefix, as llama-server serves them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from conftest import LiveServer

KEY = "routes-key"


@pytest.fixture(scope="module")
def server(tiny_models: dict[str, Path]) -> Iterator[LiveServer]:
    with LiveServer(tiny_models["llama"], api_key=KEY) as s:
        yield s


def _client(server: LiveServer, prefix: str = "/v1") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + prefix, api_key=KEY, max_retries=0)


def test_models_retrieve_with_the_openai_client(server: LiveServer) -> None:
    model = _client(server).models.retrieve(server.model_id)
    assert (model.id, model.object, model.owned_by) == (server.model_id, "model", "gmlx")
    listed = _client(server).models.list().data[0].model_dump()
    assert model.model_dump() == listed  # the same entry as the list's, context figures included
    assert listed["context_length"] == server.engine.loaded.context_length


def test_models_retrieve_another_id_is_model_not_found(server: LiveServer) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        _client(server).models.retrieve("gpt-4o")
    assert e.value.status_code == 404 and e.value.code == "model_not_found"
    with server.client() as c:  # the key is needed first, as on every other route
        assert c.get(f"/v1/models/{server.model_id}").status_code == 401


def test_a_base_url_without_v1_reaches_every_route(server: LiveServer) -> None:
    bare = _client(server, prefix="")
    assert bare.models.retrieve(server.model_id).id == server.model_id
    assert [m.id for m in bare.models.list().data] == [server.model_id]
    chat = bare.chat.completions.create(
        model=server.model_id, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0
    )
    assert chat.choices[0].finish_reason in ("stop", "length") and chat.usage.completion_tokens >= 1
    prefixed = _client(server).completions.create(model=server.model_id, prompt="the sea", max_tokens=4, temperature=0)
    unprefixed = bare.completions.create(model=server.model_id, prompt="the sea", max_tokens=4, temperature=0)
    assert unprefixed.choices[0].text == prefixed.choices[0].text  # the same handler, greedy
    auth = {"Authorization": f"Bearer {KEY}"}
    with server.client(headers=auth) as c:
        assert c.get("/capacity/plan", params={"width": 1, "depth": 16}).json()["width"] == 1
        assert c.get("/metrics").headers["content-type"].startswith("text/plain")  # its own, not /v1/metrics' JSON
        assert c.get("/v1/metrics").json()["server"]


def test_the_aliases_answer_as_their_routes_do(server: LiveServer) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    with server.client(headers=auth) as c:
        wrong_method = c.get("/chat/completions")  # the route's 405, saying what is allowed
        assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"
        unknown = c.get("/nowhere")
        assert unknown.status_code == 404 and unknown.json()["error"]["message"] == "GET /nowhere: not found"
        assert c.get("/v1/v1/models").status_code == 404  # the prefix is added once, never stacked
        assert c.get("/models/gpt-4o").json()["error"]["code"] == "model_not_found"
    with server.client() as c:  # no key: the alias is no way around it
        assert c.get("/models").status_code == 401
        assert c.get("/health").status_code == 200


def test_openapi_states_the_alias_and_documents_retrieve(server: LiveServer) -> None:
    with server.client(headers={"Authorization": f"Bearer {KEY}"}) as c:
        doc = c.get("/openapi.json").json()
    assert "without the prefix" in doc["info"]["description"]
    op = doc["paths"]["/v1/models/{model_id}"]["get"]
    assert {"200", "401", "404"} <= set(op["responses"]) and op["operationId"] == "get_v1_models_model_id"
    assert "/models" not in doc["paths"]  # one operation per route: a generated client gets no twins


def test_more_stop_strings_than_openai_allows_are_honoured(server: LiveServer) -> None:
    """OpenAI takes 4; llama.cpp and vLLM any number. gmlx keeps up to 16, each honoured."""
    body = {"prompt": "the cat", "max_tokens": 24, "temperature": 0}
    with server.client(headers={"Authorization": f"Bearer {KEY}"}) as c:
        text = c.post("/v1/completions", json=body).json()["choices"][0]["text"]
        assert len(text) >= 6, "the random model ended too early to pick a stop string"
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        stops = ["\x00never-1", "\x00never-2", "\x00never-3", "\x00never-4", stop]  # the fifth is the one
        r = c.post("/v1/completions", json={**body, "stop": stops})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == (text[: text.index(stop)], "stop")
        r = c.post("/v1/completions", json={**body, "stop": [f"s{i}" for i in range(17)]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
        long = c.post("/v1/completions", json={**body, "stop": ["x" * 4097]})  # no role marker: refused
        assert long.status_code == 400 and "4096 characters" in long.json()["error"]["message"]
        assert c.post("/v1/completions", json={**body, "stop": ["\x00" * 4096]}).status_code == 200


@pytest.fixture(scope="module")
def small_window(tiny_models: dict[str, Path]) -> Iterator[LiveServer]:
    with LiveServer(tiny_models["llama"], max_kv_size=16) as s:
        yield s


def test_max_tokens_past_the_window_is_refused_up_front(small_window: LiveServer) -> None:
    prompt = [5, 6, 7, 8]  # four tokens of a 16-token window: 12 left
    with small_window.client() as c:
        r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 13, "temperature": 0})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert (error["code"], error["type"], error["param"]) == (
            "context_length_exceeded",
            "invalid_request_error",
            "prompt",
        )
        assert "16 tokens" in error["message"] and "at most 12" in error["message"]
        chat = c.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 16}
        )
        assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
        assert small_window.model.engine.stats.finished == 0  # neither queued nor ran
        no_eos = {str(t): -100 for t in small_window.engine.loaded.tokenizer.eos_token_ids}  # run to the end
        fits = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 12, "logit_bias": no_eos})
        assert fits.status_code == 200 and fits.json()["usage"]["completion_tokens"] == 12
        unasked = c.post("/v1/completions", json={"prompt": prompt, "logit_bias": no_eos})
        assert unasked.status_code == 200  # no max_tokens: the server's default, cut to the window
        body = unasked.json()
        assert (body["usage"]["completion_tokens"], body["choices"][0]["finish_reason"]) == (12, "length")


def test_system_fingerprint(server: LiveServer, small_window: LiveServer, tiny_models: dict[str, Path]) -> None:
    from gmlx.server.fingerprint import system_fingerprint

    client = _client(server)
    first = client.chat.completions.create(
        model=server.model_id, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    again = client.completions.create(model=server.model_id, prompt="x", max_tokens=2)
    chunks = list(
        client.chat.completions.create(
            model=server.model_id,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    fingerprint = first.system_fingerprint
    assert fingerprint.startswith("fp_") and len(fingerprint) == 15
    assert again.system_fingerprint == fingerprint and {c.system_fingerprint for c in chunks} == {fingerprint}
    assert system_fingerprint(small_window.engine) == fingerprint  # the same file and weights: whatever the window
    other = LiveServer(tiny_models["qwen2"])  # built, not started: the fingerprint reads the engine once it has loaded
    other.engine.start()
    other.engine.ready.wait(60)
    try:
        assert system_fingerprint(other.engine) != fingerprint
    finally:
        other.engine.stop()
