"""The capacity routes on a live server: /v1/capacity/plan, /v1/estimate, dry_run, /v1/models."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from conftest import LiveServer, offline_table

PLAN = "/v1/capacity/plan"
FIELDS = [
    "width",
    "depth",
    "ok",
    "max_context_at_width",
    "max_width_at_depth",
    "model",
    "band",
    "decode_batch",
    "in_flight",
    "waiting",
    "slots",
    "admit_now",
    "reason",
]


def test_plan_fields_and_memory_answer(small_memory_model: tuple[Path, int]) -> None:
    path, memory = small_memory_model
    with LiveServer(path, memory=memory, governor=False) as server, server.client() as c:
        expected = offline_table(path, memory, growth=server.model.prefill_growth())
        fits = c.get(PLAN, params={"width": 1, "depth": 512}).json()
        assert list(fits) == FIELDS
        assert fits["ok"] is True and fits["admit_now"] is True and fits["reason"] == "ok"
        assert fits["model"] == "cap" and fits["decode_batch"] == 4 and fits["slots"] == 4
        assert fits["max_context_at_width"] == expected.max_context_at_width(1) < 4096
        big = c.get(PLAN, params={"width": 4, "depth": 1024}).json()
        limit = expected.max_context_at_width(4)
        assert big["ok"] is False and big["admit_now"] is False
        assert big["reason"] == f"depth 1024 exceeds max context {limit} at width 4"
        assert big["max_width_at_depth"] == expected.max_width_at_depth(1024)
        models = c.get("/v1/models").json()["data"][0]
        assert models["max_context_at_width_1"] == expected.max_context_at_width(1)
        assert models["context_length"] == 4096


def test_plan_under_overcommit(small_memory_model: tuple[Path, int]) -> None:
    path, memory = small_memory_model
    with LiveServer(path, memory=memory, overcommit=True, governor=False) as server, server.client() as c:
        r = c.get(PLAN, params={"width": 4, "depth": 4000}).json()
    assert r["ok"] is None and r["admit_now"] is True and r["reason"] == "ok"


@pytest.mark.usefixtures("no_settings_env")
def test_overcommit_from_the_environment(small_memory_model: tuple[Path, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """GMLX_OVERCOMMIT=1 in the server's environment, as an operator sets it, not a settings kwarg."""
    import gmlx.settings as settings

    path, memory = small_memory_model
    monkeypatch.setenv("GMLX_OVERCOMMIT", "1")
    # LiveServer resolves against an empty environment; this one reads the real one, as `gmlx serve` does.
    real = settings.resolve_settings
    monkeypatch.setattr(settings, "resolve_settings", lambda flags, env=None, config=None: real(flags))
    with LiveServer(path, memory=memory, governor=False) as server, server.client() as c:
        assert server.settings.sources["overcommit"] == "env GMLX_OVERCOMMIT"
        r = c.get(PLAN, params={"width": 4, "depth": 4000}).json()
    # Without overcommit this plan fails on memory (test_plan_fields_and_memory_answer).
    assert r["ok"] is None and r["admit_now"] is True and r["reason"] == "ok"
    assert r["max_context_at_width"] == offline_table(path, memory).max_context_at_width(4) < 4000


def test_max_kv_size_caps_the_window(tmp_path: Path) -> None:
    from tiny_models import write_model

    path, memory, cap = write_model(tmp_path / "long.gguf", "llama", context=4096), 8 * 2**30, 300
    with LiveServer(path, memory=memory, max_kv_size=cap, governor=False) as server, server.client() as c:
        model = c.get("/v1/models").json()["data"][0]
        served = server.model.table()
        expected = offline_table(path, memory, context_length=cap, growth=server.model.prefill_growth())
        too_deep = c.get(PLAN, params={"width": 1, "depth": cap + 1}).json()
        long = {"messages": [{"role": "user", "content": "word " * 400}]}
        est = c.post("/v1/estimate", json=long).json()
        r = c.post("/v1/chat/completions", json=long)
    assert model["context_length"] == cap and model["max_context_at_width_1"] == cap
    assert served.context_length == cap and served.to_json() == expected.to_json()
    assert max(served.widths().values()) == cap and max(served.depths()) == cap
    assert too_deep["ok"] is False and too_deep["reason"] == f"depth {cap + 1} exceeds max context {cap} at width 1"
    assert est["context_limit"] == cap and est["prompt_tokens"] > cap and est["context_ok"] is False
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize(
    "query", [{}, {"width": 2}, {"width": "x", "depth": 5}, {"width": 0, "depth": 5}, {"width": 2, "depth": -1}]
)
def test_plan_rejects_bad_queries(live_server: LiveServer, query: dict) -> None:
    with live_server.client() as c:
        r = c.get(PLAN, params=query)
    assert r.status_code == 400
    param = r.json()["error"]["param"]
    assert param in ("width", "depth") and param in r.json()["error"]["message"]


def test_plan_timing_reasons(tiny_models: dict[str, Path]) -> None:
    with LiveServer(tiny_models["llama"], decode_batch=1, queue_size=4) as server:
        state = server.model

        async def run() -> dict[str, dict]:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as ac:
                body = {"prompt": "x", "max_tokens": 200, "temperature": 0}
                first = asyncio.create_task(ac.post("/v1/completions", json=body))
                while state.gate.running < 1:
                    await asyncio.sleep(0.005)
                busy = (await ac.get(PLAN, params={"width": 1, "depth": 64})).json()
                second = asyncio.create_task(ac.post("/v1/completions", json=body))
                while state.gate.waiting < 1:
                    await asyncio.sleep(0.005)
                queued = (await ac.get(PLAN, params={"width": 1, "depth": 64})).json()
                await asyncio.gather(first, second)
                return {"busy": busy, "queued": queued}

        got = asyncio.run(run())
    assert got["busy"]["reason"] == "0 free slot(s) of 1, need 1" and got["busy"]["in_flight"] == 1
    assert got["queued"]["reason"] == "1 waiting for a slot" and got["queued"]["waiting"] == 1


def test_plan_governor_bands(live_server: LiveServer) -> None:
    with live_server.client() as c:
        live_server.state.band = "yellow"  # only one slot counts as free
        assert c.get(PLAN, params={"width": 1, "depth": 64}).json()["admit_now"] is True
        r = c.get(PLAN, params={"width": 2, "depth": 64}).json()
        assert r["reason"] == "1 free slot(s) of 4, need 2" and r["band"] == "yellow"
        live_server.state.band = "orange"
        assert c.get(PLAN, params={"width": 1, "depth": 64}).json()["reason"] == "governor orange"
        live_server.state.band = "red"
        red = c.get(PLAN, params={"width": 1, "depth": 64}).json()
        assert red["reason"] == "governor red" and red["admit_now"] is False and red["ok"] is True


def test_estimate_and_dry_run_agree(live_server: LiveServer) -> None:
    body = {"messages": [{"role": "user", "content": "hello world"}], "max_tokens": 100}
    with live_server.client() as c:
        est = c.post("/v1/estimate", json=body).json()
        dry = c.post("/v1/chat/completions", json={**body, "dry_run": True}).json()
        real = c.post("/v1/chat/completions", json={**body, "max_tokens": 1}).json()
    assert est == dry
    assert est["prompt_tokens"] == real["usage"]["prompt_tokens"]
    assert est["context_ok"] is True and est["context_limit"] == 256 and est["resident"] is True
    assert est["fits_now"] is True and est["fits_drained"] is True and est["estimated"] is True
    assert est["warm_tokens"] == 0 and est["cache_tier"] == "miss" and est["est_ttft_s"] >= 0
    assert est["need_bytes"] > live_server.model.table().stream_bytes(est["prompt_tokens"] + 100) - 1


def test_a_completions_body_is_estimated_and_dry_run_too(live_server: LiveServer) -> None:
    with live_server.client() as c:
        for prompt in ("Once upon a time", [1, 2, 3, 4, 5]):
            body = {"prompt": prompt, "max_tokens": 50, "n": 2}
            est = c.post("/v1/estimate", json=body).json()
            dry = c.post("/v1/completions", json={**body, "dry_run": True}).json()
            real = c.post("/v1/completions", json={**body, "max_tokens": 1}).json()
            assert est == dry and est["prompt_tokens"] == real["usage"]["prompt_tokens"] and est["estimated"]
        assert c.post("/v1/completions", json={"prompt": "x", "dry_run": "yes"}).json()["error"]["param"] == "dry_run"
        assert c.post("/v1/completions", json={"prompt": [10**6], "dry_run": True}).status_code == 400  # as sent
        for route in ("/v1/completions", "/v1/chat/completions"):  # each reads its own body, not embeddings'
            assert c.post(route, json={"input": "x", "dry_run": True}).status_code == 400


def test_estimate_counts_a_row_for_every_choice(live_server: LiveServer) -> None:
    """`n` choices decode as n rows, each with its own cache; more than the decode batch is the
    400 the request itself would get, whether estimated, dry-run or sent."""
    body = {"messages": [{"role": "user", "content": "hello world"}], "max_tokens": 100}
    over = {**body, "n": live_server.model.gate.width + 1}
    with live_server.client() as c:
        one = c.post("/v1/estimate", json=body).json()
        three = c.post("/v1/estimate", json={**body, "n": 3}).json()
        refused = [
            c.post("/v1/estimate", json=over),
            c.post("/v1/chat/completions", json={**over, "dry_run": True}),
            c.post("/v1/chat/completions", json=over),
        ]
    row = one["need_bytes"] - live_server.model.table().budget.prefill_bytes
    assert row > 0 and three["need_bytes"] == one["need_bytes"] + 2 * row
    assert [(r.status_code, r.json()["error"]["param"]) for r in refused] == [(400, "n")] * 3


def test_estimate_edge_cases(live_server: LiveServer) -> None:
    with live_server.client() as c:
        long = c.post("/v1/estimate", json={"messages": [{"role": "user", "content": "word " * 400}]}).json()
        assert long["context_ok"] is False
        media = c.post(
            "/v1/estimate",
            json={
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "what is this?"},
                            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                        ],
                    }
                ]
            },
        ).json()
        assert media["estimated"] is False and "image_url" in media["note"] and media["prompt_tokens"] > 0
        assert c.post("/v1/estimate", json={"messages": "x"}).status_code == 400
        assert c.post("/v1/estimate", json={"messages": 1}).status_code == 400  # found by the fuzzer
        assert c.post("/v1/chat/completions", json={"messages": 1, "dry_run": True}).status_code == 400
        assert (
            c.post("/v1/estimate", json={"messages": [{"role": "user", "content": "x"}], "model": "other"}).status_code
            == 404
        )


def test_fits_drained_leaves_the_prompt_cache_bound(tiny_models: dict[str, Path]) -> None:
    """The estimate and the capacity table count the same memory: a prompt cache bound that leaves
    less than one stream makes the estimate say no, as the table does."""
    path, memory = tiny_models["llama"], 8 * 2**30
    without = offline_table(path, memory, prompt_cache_bytes=0)
    bound = without.budget.kv_bytes - without.stream_bytes(256) + 1  # one byte short of a 256-token stream
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 100}
    with LiveServer(path, memory=memory, prompt_cache_bytes=bound, governor=False) as server, server.client() as c:
        est = c.post("/v1/estimate", json=body).json()
        table = server.model.table()
    depth = est["prompt_tokens"] + 100
    assert table.budget.prompt_cache_bytes == bound and table.max_width_at_depth(depth) == 0
    assert est["need_bytes"] <= without.budget.drained_bytes  # it would fit, were the bound not kept
    assert est["fits_drained"] is False and est["fits_now"] is False


def test_estimate_beside_a_long_stream_counts_the_padded_row(tmp_path: Path) -> None:
    """A short request that would join a long stream's batch needs a row as deep as the long one."""
    from tiny_models import write_model

    with LiveServer(write_model(tmp_path / "long.gguf", "llama", context=4096), decode_batch=2) as server:
        engine, table = server.engine, server.model.table()
        short = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

        async def run() -> tuple[dict, dict, int]:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as ac:
                alone = (await ac.post("/v1/estimate", json=short)).json()
                body = {"prompt": "the sea " * 400, "max_tokens": 2000, "temperature": 0, "stream": True}  # fits 4096
                async with ac.stream("POST", "/v1/completions", json=body):
                    while not any(r.state == "decode" and r.generated > 8 for r in engine.requests()):
                        await asyncio.sleep(0.005)
                    long_prompt = len(engine.requests()[0].prompt_ids)
                    beside = (await ac.post("/v1/estimate", json=short)).json()
            return alone, beside, long_prompt

        alone, beside, long_prompt = asyncio.run(run())
    assert alone["need_now_bytes"] == alone["need_bytes"]
    assert beside["need_bytes"] == alone["need_bytes"]  # its own need is unchanged; joining costs more
    assert beside["need_now_bytes"] >= table.budget.prefill_bytes + table.stream_bytes(long_prompt)
    assert table.stream_bytes(long_prompt) > table.stream_bytes(alone["prompt_tokens"] + 4)
