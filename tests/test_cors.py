"""CORS: off by default; `--cors-origins` allows the origins named (or `*`), a browser's preflight is
answered before the API key is asked for, and only an allowed origin sees `Access-Control-*`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import LiveServer, invoke_json

from gmlx.settings import SettingsError, resolve_settings

KEY = "cors-key"
PAGE = "http://localhost:5173"
CHAT = "/v1/chat/completions"
# What a browser sends before a fetch() with the key and a JSON body from another origin.
PREFLIGHT = {
    "Origin": PAGE,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type, x-stainless-lang",
}
BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}


def _cors_headers(headers) -> set[str]:
    return {k.lower() for k in headers if k.lower().startswith("access-control-")}


@pytest.fixture(scope="module")
def keyed(tiny_models: dict[str, Path]) -> Iterator[LiveServer]:
    with LiveServer(tiny_models["llama"], api_key=KEY, cors_origins=(PAGE, "https://app.example")) as s:
        yield s


@pytest.fixture(scope="module")
def open_any(tiny_models: dict[str, Path]) -> Iterator[LiveServer]:
    with LiveServer(tiny_models["llama"], cors_origins=("*",)) as s:
        yield s


def test_preflight_is_answered_before_the_key(keyed: LiveServer) -> None:
    with keyed.client() as c:
        r = c.options(CHAT, headers=PREFLIGHT)
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == PAGE
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        # Then the request itself: without the key a 401 the page can read, with it the answer.
        denied = c.post(CHAT, json=BODY, headers={"Origin": PAGE})
        assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == PAGE
        ok = c.post(CHAT, json=BODY, headers={"Origin": PAGE, "Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == PAGE
        assert "Retry-After" in ok.headers["access-control-expose-headers"]
        assert ok.json()["choices"][0]["message"]["role"] == "assistant"


def test_a_preflight_refused_is_an_openai_error_the_page_can_read(keyed: LiveServer) -> None:
    with keyed.client() as c:
        r = c.options(CHAT, headers={**PREFLIGHT, "Access-Control-Request-Method": "PUT"})
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert error["code"] == "cors_refused" and "method" in error["message"]
    assert r.headers["access-control-allow-origin"] == PAGE and "Origin" in r.headers["vary"]  # not cached for others


def test_an_origin_not_listed_sees_no_cors(keyed: LiveServer) -> None:
    other = {**PREFLIGHT, "Origin": "https://evil.example"}
    with keyed.client() as c:
        r = c.options(CHAT, headers=other)
        assert r.status_code == 401 and not _cors_headers(r.headers)  # as if CORS were off
        r = c.get("/v1/models", headers={"Origin": "https://evil.example", "Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and not _cors_headers(r.headers)
        r = c.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})  # no Origin: not a browser's call
        assert r.status_code == 200 and not _cors_headers(r.headers)


def test_star_allows_any_origin_without_a_key(open_any: LiveServer) -> None:
    with open_any.client() as c:
        r = c.options("/chat/completions", headers={**PREFLIGHT, "Origin": "https://any.example"})  # an alias too
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        r = c.get("/health", headers={"Origin": "https://any.example"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        assert "access-control-allow-credentials" not in r.headers  # the key is a header, not a cookie


def test_off_by_default(live_server: LiveServer) -> None:
    with live_server.client() as c:
        r = c.options(CHAT, headers=PREFLIGHT)
        assert r.status_code == 405 and not _cors_headers(r.headers)
        r = c.get("/v1/models", headers={"Origin": PAGE})
        assert r.status_code == 200 and not _cors_headers(r.headers)


def test_origins_setting() -> None:
    s = resolve_settings({}, env={"GMLX_CORS_ORIGINS": "http://a.test:3000, https://b.test"})
    assert s.cors_origins == ("http://a.test:3000", "https://b.test")
    assert resolve_settings({"cors_origins": ["*"]}, env={}).cors_origins == ("*",)
    assert resolve_settings({}, env={}).cors_origins == ()
    for bad in ("http://localhost:3000/", "localhost:3000", "*, http://a.test", "ftp://a.test"):
        with pytest.raises(SettingsError, match="cors_origins"):
            resolve_settings({}, env={"GMLX_CORS_ORIGINS": bad})


def test_the_flag(no_settings_env: None, tmp_path: Path) -> None:
    config = invoke_json(
        "serve",
        tmp_path / "m.gguf",
        "--cors-origins",
        "http://a.test",
        "--cors-origins",
        "http://b.test,http://c.test",
        "--print-config",
    )
    assert config["cors_origins"] == {"value": ["http://a.test", "http://b.test", "http://c.test"], "source": "flag"}
