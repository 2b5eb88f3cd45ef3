"""Queue events: a streamed request that waits for its slot, from a client that sends
`X-Gmlx-Queue-Events: 1`, starts its stream at once and hears its place in the queue while it waits."""

from __future__ import annotations

import json
import re
import socket
import struct
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import LiveServer
from tiny_models import write_model

HEADER = {"X-Gmlx-Queue-Events": "1"}
# A stream that runs until its client leaves: the tiny model's end tokens are banned.
HOLD = {"prompt": "x", "max_tokens": 12000, "temperature": 0, "stream": True, "logit_bias": {"1": -100, "5": -100}}
ASK = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
QUEUED = re.compile(r": queued position=(\d+) waiting=(\d+) eta_s=(\d+)")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    model = write_model(tmp_path_factory.mktemp("queue") / "long.gguf", "llama", context=16384)
    with LiveServer(model, decode_batch=1, queue_size=2, queue_timeout=2.5) as s:
        yield s


class Holder:
    """The one slot, taken by a stream until `set()`, which hangs up (its client leaves)."""

    def __init__(self, server: LiveServer):
        host, port = server.url.removeprefix("http://").split(":")
        body = json.dumps(HOLD).encode()
        self.sock = socket.create_connection((host, int(port)))
        self.sock.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        server.wait_until(lambda: server.model.gate.running == 1)

    def set(self) -> None:
        self.sock.close()


def test_a_waiting_stream_hears_its_place_then_runs(server: LiveServer) -> None:
    release = Holder(server)
    try:  # a failed check still frees the slot, or every later test would find it taken
        with server.client() as c, c.stream("POST", "/v1/chat/completions", json=ASK, headers=HEADER) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            lines = r.iter_lines()
            first = next(lines)
            started = time.monotonic()
            assert (m := QUEUED.fullmatch(first)) and m.group(1) == m.group(2) == "1", first
            second = next(line for line in lines if line)
            assert QUEUED.fullmatch(second) and time.monotonic() - started > 0.5  # about a second apart
            release.set()
            rest = [line for line in lines if line.startswith("data: ")]
    finally:
        release.set()
    assert rest[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in rest[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant" and chunks[-1]["choices"][0]["finish_reason"]


def test_a_timeout_in_the_queue_is_an_error_event_with_its_retry_after(server: LiveServer) -> None:
    release = Holder(server)
    try:
        with server.client() as c, c.stream("POST", "/v1/chat/completions", json=ASK, headers=HEADER) as r:
            events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    finally:
        release.set()
    assert r.status_code == 200 and events[-1] == "[DONE]"
    error = json.loads(events[0])["error"]
    assert error["code"] == "queue_timeout" and error["retry_after"] >= 1 and error["type"]


def test_without_the_header_or_with_a_free_slot_nothing_changes(server: LiveServer) -> None:
    with server.client() as c:
        free = c.post("/v1/chat/completions", json=ASK, headers=HEADER)  # a free slot: no comment at all
        assert free.status_code == 200 and ": queued" not in free.text and free.text.rstrip().endswith("[DONE]")
        release = Holder(server)
        try:
            plain = c.post("/v1/chat/completions", json=ASK)  # waits, then the queue's 503
            too_long = c.post("/v1/chat/completions", json={**ASK, "max_tokens": 10**6}, headers=HEADER)
        finally:
            release.set()
    assert plain.status_code == 503 and plain.json()["error"]["code"] == "queue_timeout"
    assert "Retry-After" in plain.headers
    assert too_long.status_code == 400  # what can be refused before the wait keeps its status


def test_the_openai_client_reads_a_stream_that_waited(server: LiveServer) -> None:
    openai = pytest.importorskip("openai")
    release = Holder(server)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    threading.Timer(1.2, release.set).start()
    stream = client.chat.completions.create(
        model=server.model_id, messages=ASK["messages"], max_tokens=3, stream=True, extra_headers=HEADER
    )
    chunks = list(stream)
    assert chunks and chunks[-1].choices[0].finish_reason is not None


def test_a_client_leaving_while_queued_gives_its_place_back(server: LiveServer) -> None:
    release = Holder(server)
    try:
        with server.client() as c, c.stream("POST", "/v1/chat/completions", json=ASK, headers=HEADER) as r:
            assert QUEUED.fullmatch(next(r.iter_lines()))
            server.wait_until(
                lambda: server.model.gate.waiting == 1, timeout=2
            )  # listed a tick before the gate counts it
        server.wait_until(lambda: server.model.gate.waiting == 0 and not server.model.queued, timeout=5)
    finally:
        release.set()
        server.wait_until(lambda: server.model.gate.running == 0)
    assert httpx.get(server.url + "/health", params={"ready": 1}).status_code == 200


def test_a_model_loading_streams_queue_events(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    folder = tmp_path / "models"
    folder.mkdir()
    write_model(folder / "other.gguf", "qwen3")
    with LiveServer(tiny_models["llama"], models_dir=str(folder)) as server, server.client() as c:
        with c.stream("POST", "/v1/chat/completions", json={**ASK, "model": "other"}, headers=HEADER) as r:
            lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and any(line.startswith("data: {") for line in lines)


def test_a_client_resetting_while_queued_leaves_no_slot_behind(server: LiveServer) -> None:
    """The stream is closed under the waiting request (a reset, not a polite close): the slot it
    would have been handed must not stay taken once the holder leaves, round after round."""
    host, port = server.url.removeprefix("http://").split(":")
    body = json.dumps(ASK).encode()
    for _ in range(3):
        release = Holder(server)
        try:
            sock = socket.create_connection((host, int(port)))
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"X-Gmlx-Queue-Events: 1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            heard = b""
            while b": queued" not in heard:
                heard += sock.recv(1000)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()  # RST
            time.sleep(0.2)
        finally:
            release.set()
        server.wait_until(lambda: server.model.gate.running == 0 and server.model.gate.waiting == 0, timeout=5)
    assert httpx.get(server.url + "/health", params={"ready": 1}).status_code == 200
