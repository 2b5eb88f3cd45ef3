"""Request bodies and clients that leave (gmlx.server.http): whatever arrives, a 4xx in the OpenAI
error shape rather than a 500, one log line per request, and nothing held for a client that left."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import LiveServer
from tiny_models import write_model

from gmlx.server.http import MAX_JSON_DEPTH

CHAT = "/v1/chat/completions"
SURROGATE = '"\\ud800"'  # JSON's escape for a lone UTF-16 surrogate: valid JSON, not valid Unicode


@pytest.fixture(scope="module")
def server(tiny_models: dict[str, Path]) -> Iterator[LiveServer]:
    with LiveServer(tiny_models["llama"], decode_batch=1, queue_size=0, max_tokens_default=2) as s:
        yield s


def assert_refused(r, status: int = 400) -> dict:  # noqa: ANN001
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert error["message"] and error["code"] and error["type"]
    return error


@pytest.mark.parametrize(
    ("route", "body"),
    [
        (CHAT, '{"messages":[{"role":"user","content":%s}],"max_tokens":2}'),
        (CHAT, '{"messages":[{"role":%s,"content":"hi"}],"max_tokens":2}'),
        (CHAT, '{"messages":[{"role":"user","content":[{"type":"text","text":%s}]}],"max_tokens":2}'),
        (CHAT, '{"messages":[{"role":"user","content":%s}],"dry_run":true}'),
        ("/v1/completions", '{"prompt":%s,"max_tokens":2}'),
        ("/v1/estimate", '{"messages":[{"role":"user","content":%s}]}'),
        (CHAT, '{"messages":[{"role":"user","content":"hi"}],"user":%s}'),  # a field the server ignores
        (CHAT, '{"messages":[{"role":"user","content":"hi"}],%s:1}'),  # a key
    ],
    ids=["content", "role", "content-part", "dry-run", "prompt", "estimate", "ignored-field", "key"],
)
def test_a_lone_surrogate_anywhere_is_a_400(server: LiveServer, route: str, body: str) -> None:
    with server.client() as c:
        r = c.post(route, content=body % SURROGATE, headers={"Content-Type": "application/json"})
    assert "Unicode" in assert_refused(r)["message"]


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 980, 100_000])
def test_json_nested_too_deep_is_a_400(server: LiveServer, depth: int) -> None:
    inner = "[" * depth + "]" * depth
    body = '{"messages":[{"role":"user","content":"hi"}],"max_tokens":2,"metadata":' + inner + "}"
    with server.client() as c:
        r = c.post(CHAT, content=body, headers={"Content-Type": "application/json"})
    assert "nested deeper" in assert_refused(r)["message"]


def test_json_at_the_depth_limit_is_served(server: LiveServer) -> None:
    depth = MAX_JSON_DEPTH - 1  # the body object itself is one level
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
    inner = "[" * depth + "]" * depth
    content = json.dumps(body)[:-1] + ',"metadata":' + inner + "}"
    with server.client() as c:
        assert c.post(CHAT, content=content, headers={"Content-Type": "application/json"}).status_code == 200


def test_an_unexpected_failure_is_a_500_in_the_openai_shape(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*a: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(server.model, "tokenize_with_anchor", broken)
    with server.client() as c:
        r = c.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}]})
    assert assert_refused(r, 500)["code"] == "internal_error" and "Traceback" not in r.text


def raw_post(s: LiveServer, body: bytes, length: int | None = None) -> socket.socket:
    host, port = s.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(
        f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body) if length is None else length}\r\n\r\n".encode()
        + body
    )
    return sock


def test_a_client_leaving_mid_upload_is_logged_once_without_a_traceback(
    server: LiveServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    for _ in range(5):
        raw_post(server, b'{"messages": [', length=500).close()
    server.wait_until(lambda: caplog.text.count("client_gone (mid-upload)") == 5, timeout=10)
    assert "Traceback" not in caplog.text and "ClientDisconnect" not in caplog.text
    assert not server.model.gate.running


def test_a_client_gone_before_the_queue_takes_no_place_and_is_no_rejection(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Clients that send a request and leave while it is tokenized (here, slowly) are logged as
    gone; with the one slot busy and no queue, they would otherwise count as queue_full."""
    caplog.set_level(logging.INFO)
    tokenize = server.model.tokenize_with_anchor

    def slow(p: object) -> object:
        time.sleep(0.3)
        return tokenize(p)

    rejections = server.model.gate.rejections
    monkeypatch.setattr(server.model, "tokenize_with_anchor", slow)
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "stream": True}).encode()
    holder = raw_post(server, body)  # takes the only slot for a while
    try:
        server.wait_until(lambda: server.model.gate.running == 1, timeout=10)
        for _ in range(3):
            sock = raw_post(server, json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode())
            time.sleep(0.05)
            sock.close()
        server.wait_until(lambda: caplog.text.count("finish=client_gone (before the queue)") == 3, timeout=10)
    finally:
        holder.close()
    assert server.model.gate.rejections == rejections
    assert "rejected:queue_full" not in caplog.text


def test_a_client_gone_while_running_frees_its_slot_before_the_engine_drops_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the one slot held by a request whose client left, the next request is admitted at once,
    though the engine takes its time (here, two seconds) to drop the first: no queue_full meanwhile."""
    model = write_model(tmp_path / "long.gguf", "llama", context=1 << 14)  # a stream that outlasts the test
    with LiveServer(model, decode_batch=1, queue_size=0, max_tokens_default=2) as server:
        cancel = server.engine.cancel
        monkeypatch.setattr(server.engine, "cancel", lambda *a: threading.Timer(2.0, cancel, a).start())
        no_end = {str(i): -100 for i in server.engine.loaded.tokenizer.eos_token_ids}  # it must outlast the test
        gone = raw_post(
            server,
            json.dumps(
                {
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 10_000,
                    "stream": True,
                    "logit_bias": no_end,
                }
            ).encode(),
        )
        server.wait_until(lambda: server.engine.decoding == 1, timeout=10)
        gone.close()
        server.wait_until(lambda: server.model.gate.running == 0, timeout=1.5)
        assert server.engine.in_flight == 1  # the engine still holds it
        with server.client() as c:
            r = c.post(CHAT, json={"messages": [{"role": "user", "content": "next"}], "max_tokens": 2})
        assert r.status_code == 200, r.text
