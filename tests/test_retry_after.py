"""A Retry-After on every 503 (docs/ARCHITECTURE.md, "Contract"): every place the server builds a 503
is found in its source and must give one, and the refusals a router meets most are checked live."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import LiveServer

SRC = Path(__file__).parent.parent / "src" / "gmlx"


def _is_503(node: ast.expr) -> bool:
    """503 itself, or a conditional whose branches include it (`503 if pressure else 500`)."""
    return any(isinstance(n, ast.Constant) and n.value == 503 for n in ast.walk(node))


def _name(call: ast.Call) -> str:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def sites_503() -> dict[str, bool]:
    """Every call that builds a 503 response, by file:line, and whether it sets a Retry-After."""
    found = {}
    for path in SRC.rglob("*.py"):
        for call in (n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)):
            kw = {k.arg: k.value for k in call.keywords}
            where = f"{path.relative_to(SRC)}:{call.lineno}"
            if _name(call) in ("APIError", "error_bytes") and call.args and _is_503(call.args[0]):
                # APIError(status, message, code, ..., retry_after=);
                # error_bytes(status, reason, message, code, retry_after)
                found[where] = "retry_after" in kw or (_name(call) == "error_bytes" and len(call.args) >= 5)
            elif "status_code" in kw and _is_503(kw["status_code"]):
                headers = kw.get("headers")
                found[where] = isinstance(headers, ast.Dict) and any(
                    isinstance(k, ast.Constant) and k.value == "Retry-After" for k in headers.keys
                )
    return found


def test_every_503_in_the_source_sets_retry_after() -> None:
    sites = sites_503()
    # queue_full and queue_timeout, shutting_down (gate, generation), model_loading, memory_pressure,
    # too_many_connections, /health?ready=1: the scan sees them all.
    assert len(sites) >= 7, sites
    assert all(sites.values()), [where for where, ok in sites.items() if not ok]


def test_the_refusals_a_router_meets_carry_retry_after(tiny_models: dict[str, Path]) -> None:
    body = {"prompt": "hello", "max_tokens": 2}
    with LiveServer(tiny_models["llama"], decode_batch=1, queue_size=0) as server, server.client() as c:
        state = server.model
        state.gate.running = 1  # every slot held: with no queue, the next request is refused at once
        full = c.post("/v1/completions", json=body)
        busy = c.get("/health", params={"ready": 1})
        state.gate.running = 0
        state.gate.close()  # draining
        draining = c.post("/v1/completions", json=body)
        not_ready = c.get("/health", params={"ready": 1})
    for r, code in ((full, "queue_full"), (draining, "shutting_down")):
        assert r.status_code == 503 and r.json()["error"]["code"] == code
        assert int(r.headers["Retry-After"]) >= 1
    for r, reason in ((busy, "busy"), (not_ready, "shutting_down")):
        assert r.status_code == 503 and r.json()["reason"] == reason and int(r.headers["Retry-After"]) >= 1
