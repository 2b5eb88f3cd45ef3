"""The server's own OpenAPI description: it lists exactly the app's routes, and a schemathesis run
built from it (against a real server on loopback, with and without the API key) finds no 5xx, no
traceback in a body, only 4xx in the OpenAI error shape, answers that conform to the document, and
no body the document allows refused but for what a schema cannot state."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import LiveServer
from hypothesis import HealthCheck, settings
from starlette.routing import Route

schemathesis = pytest.importorskip("schemathesis")

KEY = "fuzz-key"
EXAMPLES = 25  # random cases per operation (fuzzing phase); the coverage phase adds its deterministic boundary cases
MAX_TOKENS = 3  # a valid body never asks the tiny model for more


def _routes(app) -> set[tuple[str, str]]:
    return {(r.path, m.lower()) for r in app.routes if isinstance(r, Route) for m in r.methods or () if m != "HEAD"}


def _documented(doc: dict) -> set[tuple[str, str]]:
    return {(path, method) for path, ops in doc["paths"].items() for method in ops}


@pytest.fixture(scope="module")
def open_server(tiny_models: dict[str, Path]) -> Iterator[LiveServer]:
    # A small body limit makes "too large" reachable; a short default keeps valid bodies cheap.
    with LiveServer(tiny_models["llama"], max_tokens_default=2, max_body_bytes=64 * 1024) as s:
        yield s


@pytest.fixture(scope="module")
def keyed_server(tiny_models: dict[str, Path]) -> Iterator[LiveServer]:
    with LiveServer(tiny_models["llama"], max_tokens_default=2, max_body_bytes=64 * 1024, api_key=KEY) as s:
        yield s


def test_document_lists_every_route_and_only_those(keyed_server: LiveServer) -> None:
    from gmlx.server import app as app_module
    from gmlx.server import openapi

    with keyed_server.client() as c:
        assert c.get("/openapi.json").status_code == 401  # a route like the others: the key is needed
        doc = c.get("/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert _documented(doc) == _routes(keyed_server.app)
    assert openapi.OPEN_PATHS == app_module.OPEN_PATHS
    for path, ops in doc["paths"].items():
        for op in ops.values():
            assert ("401" in op["responses"]) == (path not in openapi.OPEN_PATHS), path
            assert (op.get("security") == []) == (path in openapi.OPEN_PATHS), path
    assert "security" not in openapi.document(api_key=False)  # without a key, nothing is declared
    json.dumps(openapi.document(api_key=True))  # plain JSON data


def _schema(server: LiveServer, headers: dict | None = None, coverage: bool = True):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json", headers=headers or {})
    schema.config.update(base_url=server.url, headers=headers, request_timeout=60)
    schema.config.phases.coverage.enabled = coverage
    # A body over the server's limit is refused before it is read (413), whatever else is wrong with it.
    rejection = schema.config.checks.negative_data_rejection
    rejection.expected_statuses = [*rejection.expected_statuses, "413"]
    return schema


@pytest.fixture(scope="module")
def open_schema(open_server: LiveServer):
    # The coverage phase walks every boundary the document states (wrong types, out-of-range and
    # huge numbers, missing required fields, empty arrays, undeclared methods); then random fuzzing.
    return _schema(open_server)


@pytest.fixture(scope="module")
def keyed_schema(keyed_server: LiveServer):
    # With the key: random fuzzing only (the boundaries are the same as above); schemathesis'
    # ignored_auth check replays successful cases without the key and with a wrong one, expecting 401.
    return _schema(keyed_server, {"Authorization": f"Bearer {KEY}"}, coverage=False)


def _clamp(case) -> None:
    """Huge max_tokens are fuzzed for parsing; a valid one would only make the model run long."""
    if isinstance(case.body, dict):
        for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            value = case.body.get(name)
            if _integral(value) and value > MAX_TOKENS:
                case.body[name] = MAX_TOKENS


def _integral(value: object) -> bool:
    """An integer to JSON Schema: 169 and 169.0 alike, true not."""
    return isinstance(value, int) and not isinstance(value, bool) or isinstance(value, float) and value.is_integer()


# What a body the document allows may still get: the model's id is any string (404), the body's size
# and a prompt's length once tokenized are not schema facts (413, 400 context_length_exceeded), and load.
ACCEPTED = {200, 401, 404, 413, 503}


def _check_body(response, case) -> None:
    text = response.text
    assert "Traceback" not in text and 'File "' not in text, text[:500]
    if 400 <= response.status_code < 500:
        error = response.json()["error"]
        assert all(isinstance(error[k], str) and error[k] for k in ("message", "type", "code")), text[:500]
    if case.meta is not None and case.meta.generation.mode.is_positive and response.status_code not in ACCEPTED:
        # Nor are the tools' rules across fields (tool_choice names one of the tools, names are
        # distinct), a schema constrained decoding cannot compile (a tool's parameters, a
        # response_format's), or a logit_bias token id past the vocabulary.
        error = response.json()["error"]
        # Nor whether previous_response_id names an answer the server still keeps (/v1/responses).
        assert error["code"] == "context_length_exceeded" or error["param"] in (
            "tools",
            "tool_choice",
            "response_format",
            "logit_bias",
            "previous_response_id",
        ), (case.body, text[:500])


def _run(case, server: LiveServer) -> None:
    _clamp(case)
    # positive_data_acceptance is _check_body's, which knows the refusals a schema cannot state.
    from schemathesis import checks

    excluded = [checks.positive_data_acceptance]
    if not server.settings.api_key:
        excluded.append(checks.ignored_auth)
    response = case.call_and_validate(excluded_checks=excluded)
    _check_body(response, case)


FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))

open_api = schemathesis.pytest.from_fixture("open_schema")
keyed_api = schemathesis.pytest.from_fixture("keyed_schema")


@open_api.parametrize()
@FUZZ
def test_schemathesis_without_key(case, open_server: LiveServer) -> None:
    _run(case, open_server)


@keyed_api.parametrize()
@FUZZ
def test_schemathesis_with_key(case, keyed_server: LiveServer) -> None:
    _run(case, keyed_server)


@pytest.mark.parametrize("server_name", ["open_server", "keyed_server"])
def test_fuzz_left_nothing_behind(server_name: str, request: pytest.FixtureRequest) -> None:
    server: LiveServer = request.getfixturevalue(server_name)
    st_ = server.model
    server.wait_until(lambda: not (st_.gate.running or st_.gate.waiting or server.engine.in_flight))
    assert server.engine.alive
    headers = {"Authorization": f"Bearer {KEY}"} if server.settings.api_key else {}
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=headers, timeout=60)
    assert r.status_code == 200, r.text


def test_what_the_fuzz_found_stays_fixed(open_server: LiveServer) -> None:
    hi = [{"role": "user", "content": "hi"}]
    refused = {  # each a schema violation the server used to accept (or a 405 without Allow)
        ("POST", "/v1/chat/completions"): [
            {"messages": hi, "dry_run": {}},
            {"messages": hi, "stream_options": {"include_usage": "yes"}},
            {"messages": hi, "max_completion_tokens": 2, "max_tokens": 0},
            {"messages": hi, "max_completion_tokens": 2, "max_tokens": "many"},
            {"messages": hi, "response_format": {}},
            {  # a tool message with calls, which only an assistant's may have
                "messages": [
                    *hi,
                    {"role": "tool", "tool_call_id": "c1", "content": "4", "tool_calls": [{"id": "c2"}]},
                ]
            },
        ],
        ("POST", "/v1/estimate"): [{"messages": hi, "response_format": {}}],
        ("GET", "/v1/metrics"): [{"format": "xml"}, {"format": "null"}],
        ("GET", "/v1/capacity/plan"): [
            {"width": w, "depth": "1"} for w in (" 2", "+2", "1_000", "\u0663", "--2", "9" * 5000)
        ],
    }
    with open_server.client() as c:
        for (method, path), cases in refused.items():
            for case in cases:
                kw = {"json": case} if method == "POST" else {"params": case}
                r = c.request(method, path, **kw)
                assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", (path, case, r.text)
        r = c.request("TRACE", "/v1/chat/completions")
        assert r.status_code == 405 and r.headers["allow"] == "POST", r.headers
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert c.get("/v1/capacity/plan", params={"width": 10**30, "depth": 1}).json()["ok"] is False


def test_the_document_and_the_validator_agree(open_server: LiveServer) -> None:
    vocab = open_server.engine.loaded.geometry.vocab_size
    hi = [{"role": "user", "content": "hi"}]
    with open_server.client() as c:
        schemas = c.get("/openapi.json").json()["components"]["schemas"]
        ids = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"][1]
        assert ids["items"]["maximum"] == vocab - 1  # the served model's vocabulary bounds a token id
        assert schemas["ChatCompletionRequest"]["properties"]["messages"]["items"]["properties"]["role"]["enum"] == [
            "system",
            "developer",
            "user",
            "assistant",
            "tool",
            "function",
        ]
        # Integral floats are integers to JSON Schema, so they are to the server too.
        for path, body in [
            (
                "/v1/chat/completions",
                {
                    "messages": hi,
                    "seed": 169.0,
                    "max_tokens": 2.0,
                    "n": 1.0,
                    "top_k": 5.0,
                    "max_completion_tokens": 2.0,
                },
            ),
            ("/v1/completions", {"prompt": [1.0, vocab - 1], "max_tokens": 2}),
            ("/v1/estimate", {"messages": hi, "seed": 169.0}),
        ]:
            r = c.post(path, json=body)
            assert r.status_code == 200, (body, r.text)
        for path, body, param in [
            ("/v1/chat/completions", {"messages": hi, "seed": 169.5}, "seed"),
            ("/v1/chat/completions", {"messages": hi, "max_tokens": 2.5}, "max_tokens"),
            ("/v1/completions", {"prompt": [1.5]}, "prompt"),
            ("/v1/completions", {"prompt": [vocab]}, "prompt"),
        ]:
            r = c.post(path, json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
