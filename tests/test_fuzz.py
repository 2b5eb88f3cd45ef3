"""Bad input, property-based: whatever a client sends, every route answers without a 500 or a
traceback, a refusal is a 4xx in the OpenAI error shape, and nothing is left holding a slot."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import LiveServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/estimate")
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
roles = st.sampled_from(["user", "system", "developer", "assistant", "tool", "wizard", 3])
messages = st.lists(
    st.fixed_dictionaries(
        {"role": roles, "content": json_values | st.text(max_size=200)}, optional={"tool_calls": json_values}
    ),
    max_size=4,
)
# Bodies near the schema (right names, wrong or extreme values) reach deeper than random JSON.
bodies = st.fixed_dictionaries(
    {},
    optional={
        "messages": messages | json_values,
        "prompt": json_values | st.lists(st.integers(-5, 10**6), max_size=8),
        "max_tokens": json_values | st.integers(-(2**65), 2**65),
        "model": json_values | st.just("no-such-model"),
        "temperature": json_values,
        "top_p": json_values,
        "top_k": json_values,
        "min_p": json_values,
        "seed": json_values,
        "stop": json_values,
        "n": json_values,
        "stream": json_values,
        "stream_options": json_values,
        "dry_run": json_values,
    },
)


@pytest.fixture(scope="module")
def server(tiny_models: dict[str, Path]) -> Iterator[LiveServer]:
    # A short default answer keeps valid bodies cheap; a small body limit lets "enormous" be reached.
    with LiveServer(tiny_models["llama"], max_tokens_default=2, max_body_bytes=64 * 1024) as s:
        yield s


@pytest.fixture(autouse=True)
def leaves_nothing_behind(server: LiveServer) -> Iterator[None]:
    """After each test, whatever it sent: no slot held, nothing queued or running, the engine alive."""
    yield
    st_ = server.model
    server.wait_until(lambda: not (st_.gate.running or st_.gate.waiting or server.engine.in_flight))
    assert server.engine.alive


def check(r: httpx.Response) -> None:
    assert r.status_code < 500 or r.status_code == 503, (r.status_code, r.text)
    assert "Traceback" not in r.text and 'File "' not in r.text
    if r.status_code >= 400:
        error = r.json()["error"]
        assert isinstance(error["message"], str) and isinstance(error["code"], str) and error["type"]


def post(s: LiveServer, route: str, content: bytes) -> None:
    with s.client() as c:
        if route != "/v1/estimate" and b'"stream": true' in content:
            with c.stream("POST", route, content=content) as r:
                r.read()
        else:
            r = c.post(route, content=content)
    check(r)


def _capped(body: dict[str, Any]) -> dict[str, Any]:
    # Huge max_tokens are fuzzed for parsing; a valid one would only make the tiny model run long.
    value = body.get("max_tokens")
    integral = isinstance(value, int) or isinstance(value, float) and value.is_integer()  # 169.0 is valid too
    if integral and value > 4:
        body["max_tokens"] = 4
    return body


@FUZZ
@given(route=st.sampled_from(ROUTES), body=bodies)
def test_fuzz_generation_bodies(server: LiveServer, route: str, body: dict[str, Any]) -> None:
    post(server, route, json.dumps(_capped(body)).encode())


@FUZZ
@given(route=st.sampled_from(ROUTES), raw=st.binary(max_size=64) | json_values.map(lambda v: json.dumps(v).encode()))
def test_fuzz_raw_bodies(server: LiveServer, route: str, raw: bytes) -> None:
    post(server, route, raw)  # malformed JSON, invalid UTF-8, JSON that is not an object


@FUZZ
@given(
    query=st.dictionaries(
        st.sampled_from(["width", "depth", "format", "ready", "x"]),
        st.text(max_size=12) | st.integers(-(2**70), 2**70).map(str),
        max_size=3,
    )
)
def test_fuzz_query_strings(server: LiveServer, query: dict[str, str]) -> None:
    with server.client() as c:
        for path in ("/v1/capacity/plan", "/v1/metrics", "/health", "/v1/models", "/system"):
            r = c.get(path, params=query)
            check(r)


def test_edge_bodies(server: LiveServer) -> None:
    context = server.engine.loaded.context_length
    cases = {
        (
            b'{"messages": [{"role": "user", "content": "' + b"word " * 4 * context + b'"}]}',
            400,
            "context_length_exceeded",
        ),
        (b'{"messages": [{"role": "user", "content": "' + b"x" * 70_000 + b'"}]}', 413, "request_too_large"),
        (b'{"messages": []}', 400, "invalid_request"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}', 400, "invalid_request"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "model": "nope"}', 404, "model_not_found"),
        (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, "invalid_request"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}', 400, "invalid_request"),
        (b'{"prompt": [99999999]}', 400, "invalid_request"),
        # A name that is not a string (schemathesis found a system message's accepted as an object).
        (
            b'{"messages": [{"role": "system", "content": "s", "name": {}}, {"role": "user", "content": "hi"}]}',
            400,
            "invalid_request",
        ),
    }
    with server.client() as c:
        for body, status, code in cases:
            route = "/v1/completions" if b'"prompt"' in body else "/v1/chat/completions"
            r = c.post(route, content=body)
            assert (r.status_code, r.json()["error"]["code"]) == (status, code), (body[:60], r.text)
        for path in ("/v1/capacity/plan?width=0&depth=1", "/v1/capacity/plan?width=x&depth=1", "/v1/capacity/plan"):
            assert c.get(path).status_code == 400
        assert c.get("/nope").status_code == 404 and c.get("/v1/chat/completions").status_code == 405
