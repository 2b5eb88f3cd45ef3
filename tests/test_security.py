"""Security: the key on every route but the open ones, no content in open routes or default logs,
bodies over the limit refused before they are read whole, loopback by default."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest
from conftest import LiveServer
from starlette.routing import Route

from gmlx.cli.serve import exposure_warning
from gmlx.server.app import OPEN_PATHS
from gmlx.settings import resolve_settings

CHAT = "/v1/chat/completions"
SECRET = "zanzibar-platypus-4417"  # a prompt no model output or metric contains by chance


def chat_body(content: str = SECRET, **kw: object) -> dict:
    return {"messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 8, **kw}


def test_every_route_but_the_open_ones_needs_the_key(tiny_models: dict[str, Path]) -> None:
    with LiveServer(tiny_models["llama"], api_key="right-key") as s, s.client() as c:
        routes = [(r.path, m) for r in s.app.routes if isinstance(r, Route) for m in r.methods or () if m != "HEAD"]
        assert len(routes) >= 8
        for path, method in routes:
            wrong = (
                {},
                {"Authorization": "Bearer wrong-key"},
                {"Authorization": "right-key"},
                {"Authorization": "Basic right-key"},
            )
            for headers in wrong:
                r = c.request(method, path, headers=headers)
                if path in OPEN_PATHS:
                    assert r.status_code == 200, (path, r.text)
                else:
                    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (method, path)
            r = c.request(method, path, headers={"Authorization": "Bearer right-key"}, json=chat_body())
            assert r.status_code != 401, (method, path)
        assert c.get("/no/such/route").status_code == 401  # no probing for routes without the key
        for scheme in ("bearer", "BEARER"):  # a scheme's case is no part of it (RFC 9110)
            assert c.get("/v1/models", headers={"Authorization": f"{scheme} right-key"}).status_code == 200


def test_open_routes_and_default_logs_hold_no_content(
    tiny_models: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    with LiveServer(tiny_models["llama"], log_level="debug") as s, s.client() as c:
        with c.stream("POST", CHAT, json=chat_body(stream=True, max_tokens=64)) as r:
            lines = r.iter_lines()
            next(lines)
            during = [c.get(p).text for p in ("/system", "/health", "/health?ready=1")]
            list(lines)
        whole = c.post(CHAT, json=chat_body()).json()
        after = [c.get(p).text for p in ("/system", "/health", "/health?ready=1")]
    output = whole["choices"][0]["message"]["content"]
    for body in during + after:
        assert SECRET not in body and (len(output) < 4 or output not in body)
    server_logs = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith(("gmlx", "uvicorn")))
    assert SECRET not in server_logs
    assert "generated=" in server_logs  # the per-request line is logged, without its text


def test_a_path_with_control_characters_is_logged_escaped(
    tiny_models: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """An ESC sequence in a 404's path would clear and recolour a terminal tailing the log."""
    caplog.set_level(logging.INFO)
    with LiveServer(tiny_models["llama"]) as s, s.client() as c:
        assert c.get("/v1/models/a%1b%5b2J%1b%5b31mFAKE%00x").status_code == 404
    logged = [r.getMessage() for r in caplog.records if r.name.startswith("gmlx") and "FAKE" in r.getMessage()]
    assert logged and all(m.isprintable() and r"\x1b[2J\x1b[31mFAKE\x00x" in m for m in logged)


def test_log_input_text_logs_prompts(tiny_models: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    with LiveServer(tiny_models["llama"], log_input_text=True) as s, s.client() as c:
        assert c.post(CHAT, json=chat_body()).status_code == 200
    assert SECRET in caplog.text


def _raw_post(port: int, head: bytes, body: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(
        b"POST " + CHAT.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + head + b"\r\n" + body
    )
    sock.settimeout(10)
    return sock


def test_oversized_bodies_refused_before_read_whole(tiny_models: dict[str, Path]) -> None:
    with LiveServer(tiny_models["llama"], max_body_bytes=1024) as s:
        port = int(s.url.rsplit(":", 1)[1])
        # Claims a megabyte, sends ten bytes: answered now, not after waiting for the rest.
        with _raw_post(port, b"Content-Length: 1000000\r\n", b'{"messages') as sock:
            assert sock.recv(4096).startswith(b"HTTP/1.1 413")
        # Chunked, no length: refused once past the limit, while the stream is still open.
        chunk = b"x" * 600
        with _raw_post(port, b"Transfer-Encoding: chunked\r\n", (b"%x\r\n%s\r\n" % (len(chunk), chunk)) * 3) as sock:
            answer = sock.recv(4096)
            assert answer.startswith(b"HTTP/1.1 413")
        s.wait_until(lambda: s.model.gate.running == 0)


def test_loopback_by_default_and_a_warning_when_open() -> None:
    assert resolve_settings({}, env={}).host == "127.0.0.1"
    assert exposure_warning(resolve_settings({}, env={})) is None
    assert exposure_warning(resolve_settings({"host": "0.0.0.0", "api_key": "k"}, env={})) is None
    warning = exposure_warning(resolve_settings({"host": "0.0.0.0"}, env={}))
    assert warning and "0.0.0.0" in warning and "API key" in warning


def test_two_authorization_headers_are_refused(tiny_models: dict[str, Path]) -> None:
    """Which of two would count is a guess that proxies make differently: neither order passes."""
    with LiveServer(tiny_models["llama"], api_key="right-key") as s, s.client() as c:
        for pair in (
            ["Bearer right-key", "Bearer wrong-key"],
            ["Bearer wrong-key", "Bearer right-key"],
            ["Bearer right-key", "Bearer right-key"],
        ):
            r = c.get("/v1/models", headers=[("Authorization", v) for v in pair])
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", pair
        assert c.get("/v1/models", headers={"Authorization": "Bearer right-key"}).status_code == 200
