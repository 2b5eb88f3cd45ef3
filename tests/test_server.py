"""End-to-end: a real server on a loopback port, driven by httpx and the openai client."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import threading
from pathlib import Path

import httpx
import openai
import pytest
from conftest import LiveServer
from tiny_models import write_model

CHAT = "/v1/chat/completions"


def chat_body(content: str = "Hello there", **kw: object) -> dict:
    return {"messages": [{"role": "user", "content": content}], "temperature": 0, **kw}


def sse_events(response: httpx.Response) -> list[dict]:
    out = []
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


def test_chat_non_streaming_and_usage(live_server: LiveServer) -> None:
    with live_server.client() as c:
        r = c.post(CHAT, json=chat_body(max_tokens=12))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == live_server.model_id
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    tokenizer = live_server.engine.loaded.tokenizer
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello there"}], add_generation_prompt=True, tokenize=False
    )
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(tokenizer.encode(text, add_special_tokens=False))
    assert usage["completion_tokens"] in range(1, 13)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    if choice["finish_reason"] == "length":
        assert usage["completion_tokens"] == 12


def test_streaming_matches_non_streaming(live_server: LiveServer) -> None:
    with live_server.client() as c:
        whole = c.post(CHAT, json=chat_body(max_tokens=16)).json()
        with c.stream(
            "POST", CHAT, json=chat_body(max_tokens=16, stream=True, stream_options={"include_usage": True})
        ) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            events = sse_events(r)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    finishes = [e["choices"][0]["finish_reason"] for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert finishes == [whole["choices"][0]["finish_reason"]]
    assert events[-1]["choices"] == []
    streamed = events[-1]["usage"]
    assert streamed.pop("prompt_tokens_details") == {"cached_tokens": streamed["prompt_tokens"] - 1}  # seen before
    whole["usage"].pop("prompt_tokens_details")
    assert streamed == whole["usage"]


def test_completions_max_tokens_and_stop(live_server: LiveServer) -> None:
    with live_server.client() as c:
        free = c.post("/v1/completions", json={"prompt": "the cat", "max_tokens": 24, "temperature": 0}).json()
        text = free["choices"][0]["text"]
        assert free["object"] == "text_completion"
        assert free["usage"]["completion_tokens"] <= 24
        if len(text) < 6:
            pytest.skip("the random model ended too early to pick a stop string")
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        stopped = c.post(
            "/v1/completions", json={"prompt": "the cat", "max_tokens": 24, "temperature": 0, "stop": [stop]}
        ).json()
    assert stopped["choices"][0]["text"] == text[: text.index(stop)]
    assert stopped["choices"][0]["finish_reason"] == "stop"


def test_seeded_sampling_repeats(live_server: LiveServer) -> None:
    body = chat_body(max_tokens=16, temperature=1.0, seed=1234)
    with live_server.client() as c:
        texts = [c.post(CHAT, json=body).json()["choices"][0]["message"]["content"] for _ in range(2)]
        other = [c.post(CHAT, json={**body, "seed": s}).json()["choices"][0]["message"]["content"] for s in (1, 2, 3)]
    assert texts[0] == texts[1]
    assert any(t != texts[0] for t in other)


def test_openai_client(live_server: LiveServer) -> None:
    client = openai.OpenAI(base_url=live_server.url + "/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == [live_server.model_id]
    r = client.chat.completions.create(
        model=live_server.model_id, messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0
    )
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens >= 1
    stream = client.chat.completions.create(
        model=live_server.model_id,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=8,
        temperature=0,
        stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == r.choices[0].message.content


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ("{not json", 400, "invalid_request"),
        ([1, 2], 400, "invalid_request"),
        ({"messages": "hi"}, 400, "invalid_request"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}, 400, "invalid_request"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": True}, 400, "invalid_request"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 5}, 400, "invalid_request"),  # past the decode batch
        ({"messages": [{"role": "user", "content": "x"}], "model": "gpt-4"}, 404, "model_not_found"),
        ({"messages": [{"role": "user", "content": "word " * 400}]}, 400, "context_length_exceeded"),
    ],
)
def test_bad_requests(live_server: LiveServer, body: object, status: int, code: str) -> None:
    content = body if isinstance(body, str) else json.dumps(body)
    with live_server.client() as c:
        r = c.post(CHAT, content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code and r.json()["error"]["message"]
    # Nothing leaked: the slot is free and the next request is served.
    assert live_server.model.gate.running == 0
    with live_server.client() as c:
        assert c.post(CHAT, json=chat_body(max_tokens=2)).status_code == 200


def test_unknown_roles_are_refused_and_tool_turns_rendered(live_server: LiveServer) -> None:
    hi = {"role": "user", "content": "hi"}
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    refused = [
        [{"role": "wizard", "content": "hi"}],
        [hi, {"role": "User", "content": "hi"}],
        [hi, {"role": "tool", "content": "18 C"}],
    ]  # a tool message answers a call: it needs the id
    rendered = [
        [
            hi,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        ],
        [hi, {"role": "function", "name": "get_weather", "content": "18 C"}],
        [hi, {"role": "assistant", "content": "hello", "tool_calls": []}, hi],
    ]
    with live_server.client() as c:
        for messages in refused + rendered:
            for path in (CHAT, "/v1/estimate"):
                r = c.post(path, json={"messages": messages, "max_tokens": 2})
                if messages in rendered:
                    assert r.status_code == 200, (messages, r.text)
                else:
                    error = r.json()["error"]
                    assert (r.status_code, error["code"], error["param"]) == (400, "invalid_request", "messages"), (
                        r.text
                    )


def test_developer_messages_are_system_messages(live_server: LiveServer) -> None:
    from gmlx.server import openai_api

    def prompt(role: str) -> list[int]:
        body = {"messages": [{"role": role, "content": "Be brief."}, {"role": "user", "content": "hi"}]}
        return live_server.model.tokenize(openai_api.parse(body, chat=True))

    # The chat templates know only system; the tiny model's used to render developer as an answer.
    assert prompt("developer") == prompt("system")


def test_body_too_large(tiny_models: dict[str, Path]) -> None:
    with LiveServer(tiny_models["llama"], max_body_bytes=2000) as server, server.client() as c:
        r = c.post(CHAT, json=chat_body("x" * 5000))
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_api_key(tiny_models: dict[str, Path]) -> None:
    with LiveServer(tiny_models["llama"], api_key="s3cret") as server, server.client() as c:
        assert c.get("/v1/models").status_code == 401
        r = c.post(CHAT, json=chat_body(max_tokens=2), headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert c.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert c.get("/health").json()["status"] == "healthy"  # open without a key


def test_health_and_loading(tiny_models: dict[str, Path]) -> None:
    from gmlx.models.loader import load

    gate = threading.Event()
    server = LiveServer(tiny_models["llama"])
    real_load = server.engine._load
    server.engine._load = lambda: (gate.wait(30), real_load())[1]
    server.state.residency.preload()
    server._thread.start()
    server.wait_until(lambda: server.server.started)
    port = server.server.servers[0].sockets[0].getsockname()[1]
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as c:
            assert c.get("/health").json()["status"] == "healthy"
            r = c.get("/health", params={"ready": 1})
            assert r.status_code == 503 and r.json()["reason"] == "loading" and int(r.headers["Retry-After"]) > 0
            assert c.get("/v1/models").json()["data"][0]["status"] == "loading"
            plan = c.get("/v1/capacity/plan", params={"width": 1, "depth": 16}).json()
            assert (plan["admit_now"], plan["reason"]) == (False, "model loading")
            # A request meanwhile waits in the model's queue, and is answered once it has loaded.
            waiting = threading.Thread(target=lambda: answers.append(c.post(CHAT, json=chat_body())), daemon=True)
            answers: list[httpx.Response] = []
            waiting.start()
            server.wait_until(lambda: server.model.gate.waiting == 1)
            gate.set()
            server.wait_until(server.engine.ready.is_set)
            waiting.join(30)
            assert answers[0].status_code == 200 and answers[0].json()["choices"][0]["message"]["role"] == "assistant"
            assert c.get("/v1/models").json()["data"][0]["status"] == "loaded"
            r = c.get("/health", params={"ready": 1})
            assert r.status_code == 200 and r.json()["ready"] is True
            assert c.get("/v1/capacity/plan", params={"width": 1, "depth": 16}).json()["admit_now"] is True
    finally:
        gate.set()
        server.__exit__()
    assert load  # the loader the server used is the real one


def test_ready_reasons_follow_the_gate(tmp_path: Path) -> None:
    """decode_batch 1: idle is ready; one stream running is `busy`; one more waiting is `queue`; each
    503 carries Retry-After, and readiness comes back once the clients leave."""
    model = write_model(tmp_path / "long.gguf", "llama", context=4096)
    with LiveServer(model, decode_batch=1, queue_size=2) as server:
        gate = server.model.gate

        async def run() -> list[tuple[int, str | None, str | None]]:
            seen = []
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as ac:

                async def ready() -> None:
                    r = await ac.get("/health", params={"ready": 1})
                    seen.append((r.status_code, r.json().get("reason"), r.headers.get("Retry-After")))
                    assert r.json()["pid"] == os.getpid() and r.json()["status"] == "healthy"

                body = {"prompt": "x", "max_tokens": 3000, "temperature": 0, "stream": True}
                await ready()
                async with ac.stream("POST", "/v1/completions", json=body):
                    while gate.running < 1:
                        await asyncio.sleep(0.005)
                    await ready()
                    queued = asyncio.create_task(ac.post("/v1/completions", json={**body, "stream": False}))
                    while gate.waiting < 1:
                        await asyncio.sleep(0.005)
                    await ready()
                    queued.cancel()
                while gate.running or gate.waiting:
                    await asyncio.sleep(0.01)
                await ready()
            return seen

        seen = asyncio.run(run())
    assert [(status, reason) for status, reason, _ in seen] == [(200, None), (503, "busy"), (503, "queue"), (200, None)]
    assert all(int(retry) in range(1, 61) for status, _, retry in seen if status == 503)


def test_every_request_ends_in_one_log_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Finished, left mid-stream by its client, left while queued, or turned away: each request's id
    gets exactly one line with its counts and how it ended."""
    caplog.set_level(logging.INFO, logger="gmlx.server")
    model = write_model(tmp_path / "long.gguf", "llama", context=4096)
    with LiveServer(model, decode_batch=1, queue_size=1) as server:
        gate = server.model.gate
        done = server.client().post("/v1/completions", json={"prompt": "x", "max_tokens": 5, "temperature": 0})

        async def run() -> int:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as ac:
                body = {"prompt": "x", "max_tokens": 3000, "temperature": 0, "stream": True}
                async with ac.stream("POST", "/v1/completions", json=body):
                    while gate.running < 1:
                        await asyncio.sleep(0.005)
                    queued = asyncio.create_task(ac.post("/v1/completions", json=body))
                    while gate.waiting < 1:
                        await asyncio.sleep(0.005)
                    turned_away = await ac.post("/v1/completions", json=body)
                    queued.cancel()
                while gate.running or gate.waiting or server.engine.in_flight:
                    await asyncio.sleep(0.01)
                return turned_away.status_code

        assert done.status_code == 200 and asyncio.run(run()) == 503
    lines = [r.getMessage() for r in caplog.records if r.name == "gmlx.server" and " finish=" in r.getMessage()]
    ends = {
        m.group(1): m.group(2)
        for line in lines
        if (m := re.match(r"(\S+) prompt=\d+ generated=\d+ .*finish=(\S+)", line))
    }
    assert len(ends) == len(lines) == 4, lines
    assert sorted(ends.values()) == ["client_gone", "client_gone", "length", "rejected:queue_full"], lines
    finished = next(line for line in lines if "finish=length" in line)
    assert re.search(r"generated=5 queued=[\d.]+s ttft=[\d.]+s decode=[\d.]+ tok/s", finished), finished


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_batching_is_real(tiny_models: dict[str, Path], arch: str) -> None:
    """Four streams decode together, and each gives what it gives alone (greedy). For gemma3 the
    prompts outrun its 64-token sliding window, so the batched rotating caches are exercised."""
    words = 4 if arch == "llama" else 30
    prompts = [f"prompt number {i} says " + "hello world " * (words * (i + 1) // 4) for i in range(4)]
    with LiveServer(tiny_models[arch], decode_batch=4) as server:
        with server.client() as c:
            alone = [
                c.post("/v1/completions", json={"prompt": p, "max_tokens": 48, "temperature": 0}).json()
                for p in prompts
            ]
        seen = []

        def watch() -> None:
            server.wait_until(lambda: server.engine.decoding == 4 or bool(seen), timeout=60)
            seen.append(server.engine.decoding)

        watcher = threading.Thread(target=watch)
        watcher.start()

        async def burst() -> list[dict]:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as ac:
                rs = await asyncio.gather(
                    *(
                        ac.post("/v1/completions", json={"prompt": p, "max_tokens": 48, "temperature": 0})
                        for p in prompts
                    )
                )
            return [r.json() for r in rs]

        together = asyncio.run(burst())
        seen.append(-1)
        watcher.join()
    assert seen[0] == 4, "the four requests were never in decode at the same time"
    assert [t["choices"][0]["text"] for t in together] == [a["choices"][0]["text"] for a in alone]


def test_queue_full_and_retry_after(tiny_models: dict[str, Path]) -> None:
    with LiveServer(tiny_models["llama"], decode_batch=1, queue_size=2) as server:
        body = {"prompt": "a long one", "max_tokens": 200, "temperature": 0}
        snapshot = {}

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as ac:
                tasks = [asyncio.create_task(ac.post("/v1/completions", json=body)) for _ in range(3)]
                while server.model.gate.waiting < 2:
                    await asyncio.sleep(0.005)
                extra = await asyncio.gather(*(ac.post("/v1/completions", json=body) for _ in range(3)))
                snapshot.update(running=server.model.gate.running, waiting=server.model.gate.waiting)
                return list(extra) + list(await asyncio.gather(*tasks))

        responses = asyncio.run(burst())
    rejected = [r for r in responses if r.status_code == 503]
    assert snapshot == {"running": 1, "waiting": 2}
    assert len(rejected) == 3 and sum(r.status_code == 200 for r in responses) == 3
    for r in rejected:
        assert r.json()["error"]["code"] == "queue_full"
        assert r.headers["Retry-After"] == "5"  # no request has finished: no drain rate to go on yet


def test_queue_timeout(tiny_models: dict[str, Path]) -> None:
    # The first request must hold the slot well past the timeout: the tiny model decodes 200
    # tokens in about 0.2 s here, so the queue waits a quarter of that.
    with LiveServer(tiny_models["llama"], decode_batch=1, queue_timeout=0.05) as server:

        async def run() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as ac:
                first = asyncio.create_task(
                    ac.post("/v1/completions", json={"prompt": "x", "max_tokens": 240, "temperature": 0})
                )
                while server.model.gate.running < 1:
                    await asyncio.sleep(0.005)
                queued = await asyncio.gather(
                    *(ac.post("/v1/completions", json={"prompt": w, "max_tokens": 2}) for w in ("y", "z"))
                )
                return [await first, *queued]

        first, *queued = asyncio.run(run())
        queue = server.client().get("/v1/metrics").json()["server"]["queue"]
    assert queue["timeouts"] == 2 and queue["last_reject_reason"] == "queue_timeout"
    assert first.status_code == 200 and first.json()["choices"][0]["finish_reason"] == "length"
    for r in queued:
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_timeout"
        assert r.headers["Retry-After"] == "10"  # nothing has finished yet: the spec's default


def test_queued_client_that_disconnects_frees_its_place(tiny_models: dict[str, Path]) -> None:
    with LiveServer(tiny_models["llama"], decode_batch=1, queue_size=1) as server:
        gate = server.model.gate

        async def run() -> int:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as ac:
                first = asyncio.create_task(
                    ac.post("/v1/completions", json={"prompt": "x", "max_tokens": 200, "temperature": 0})
                )
                while gate.running < 1:
                    await asyncio.sleep(0.005)
                async with httpx.AsyncClient(base_url=server.url, timeout=60) as gone:
                    queued = asyncio.create_task(gone.post("/v1/completions", json={"prompt": "y", "max_tokens": 2}))
                    while gate.waiting < 1:
                        await asyncio.sleep(0.005)
                    queued.cancel()
                while gate.waiting:
                    await asyncio.sleep(0.005)
                third = await ac.post("/v1/completions", json={"prompt": "z", "max_tokens": 2})
                await first
                return third.status_code

        assert asyncio.run(run()) == 200


def test_dropped_streams_never_leak_a_slot(tiny_models: dict[str, Path]) -> None:
    with LiveServer(tiny_models["llama"], decode_batch=2) as server:
        with server.client() as c:
            for i in range(50):
                with c.stream("POST", CHAT, json=chat_body(max_tokens=200, stream=True)) as r:
                    # Hang up after the opening event (still in prefill) or a few tokens into decode.
                    data = (line for line in r.iter_lines() if line.startswith("data: "))
                    for _ in range(1 if i % 2 else 4):
                        next(data)
            server.wait_until(lambda: server.engine.in_flight == 0 and server.model.gate.running == 0)
            assert server.engine.alive
            assert c.post(CHAT, json=chat_body(max_tokens=4)).status_code == 200


def test_graceful_shutdown_ends_every_stream_properly(tmp_path: Path) -> None:
    # A context long enough that the stream is still running when the drain runs out.
    model = write_model(tmp_path / "long.gguf", "llama", context=8192)
    server = LiveServer(model, decode_batch=1, shutdown_timeout=0.3).__enter__()
    gate = server.model.gate
    lines: list[str] = []

    def stream() -> None:
        with server.client() as c, c.stream("POST", CHAT, json=chat_body(max_tokens=8000, stream=True)) as r:
            lines.extend(r.iter_lines())

    streaming = threading.Thread(target=stream)
    streaming.start()
    server.wait_until(lambda: server.engine.decoding == 1)
    queued: list[httpx.Response] = []
    waiter = threading.Thread(target=lambda: queued.append(server.client().post(CHAT, json=chat_body(max_tokens=2))))
    waiter.start()
    server.wait_until(lambda: gate.waiting == 1)
    server.__exit__()
    streaming.join(10)
    waiter.join(10)
    assert not server._thread.is_alive()
    assert queued[0].status_code == 503 and queued[0].json()["error"]["code"] == "shutting_down"
    events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert events[-1]["error"]["message"] == "the server is shutting down"
    assert lines[-1] == "data: [DONE]" or lines[-2] == "data: [DONE]"


def test_engine_survives_a_failing_step(live_server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlx_lm.generate import BatchGenerator

    real_next, calls = BatchGenerator.next, []

    def next_failing_once(self: BatchGenerator):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return real_next(self)

    monkeypatch.setattr(BatchGenerator, "next", next_failing_once)
    with live_server.client() as c:
        r = c.post(CHAT, json=chat_body(max_tokens=4))
        assert r.status_code == 500 and "boom" in r.json()["error"]["message"]
        assert live_server.engine.alive and live_server.model.gate.running == 0
        assert c.post(CHAT, json=chat_body(max_tokens=4)).status_code == 200


def test_long_prompt_prefills_in_chunks_between_decode_steps(tmp_path: Path) -> None:
    """A long prompt arriving while a stream decodes does not stall it: the running stream keeps
    generating while the newcomer's prefill advances chunk by chunk (read from engine state)."""
    model = write_model(tmp_path / "long.gguf", "llama", context=8192)
    with LiveServer(model, decode_batch=2, prefill_step=16) as server:
        engine, progress = server.engine, []

        def long_prompt_seen() -> bool:
            rows = {r.id.split("-")[0]: r for r in engine.requests()}
            running, newcomer = rows.get("cmpl"), rows.get("chatcmpl")
            if running and newcomer and newcomer.state == "prefill" and newcomer.prefilled:
                progress.append((newcomer.prefilled, running.generated))
            return len(progress) >= 2 and progress[-1][0] > progress[0][0] and progress[-1][1] > progress[0][1]

        def stream() -> None:
            with server.client() as c:
                c.post("/v1/completions", json={"prompt": "x", "max_tokens": 4000, "temperature": 0})

        first = threading.Thread(target=stream)
        first.start()
        server.wait_until(lambda: engine.decoding == 1)
        second = threading.Thread(
            target=lambda: server.client().post(CHAT, json=chat_body("word " * 3000, max_tokens=2))
        )
        second.start()
        server.wait_until(long_prompt_seen, timeout=60)
        engine.cancel_all()
        first.join(30)
        second.join(30)
