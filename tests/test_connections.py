"""Connections against a real server on loopback: slow or idle clients cannot lock others out, a
request's headers and body each have a deadline, and uvicorn's own refusals answer in the OpenAI
error shape. These drive uvicorn's h11 protocol through gmlx.server.connections, so they also fail
when a uvicorn release changes what that module relies on."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import LiveServer

from gmlx.server.connections import RepeatFilter, connection_cap

CAP = 8


@pytest.fixture(scope="module")
def server(tiny_models: dict[str, Path]) -> Iterator[LiveServer]:
    with LiveServer(
        tiny_models["llama"], max_connections=CAP, header_timeout=1.0, body_timeout=1.0, max_tokens_default=2
    ) as s:
        yield s


def connect(s: LiveServer) -> socket.socket:
    host, port = s.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=5)
    return sock


def read_response(sock: socket.socket) -> tuple[int, dict]:
    """Status and JSON body of the one response the server writes before it closes."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def connections(s: LiveServer) -> dict:
    with s.client() as c:
        return c.get("/v1/metrics").json()["server"]["connections"]


def test_clients_trickling_headers_cannot_lock_out_health(server: LiveServer) -> None:
    """Four times the cap of clients that send one header line every 0.1 s, reconnecting whenever
    they are closed: /health?ready=1 meanwhile answers at once, 200 nearly always. A refusal is the
    rare moment when every place holds a newcomer still in its grace: a 503 with Retry-After, never
    a hang or a reset."""
    before = connections(server)
    stop = threading.Event()

    def trickle() -> None:
        while not stop.is_set():
            try:
                with connect(server) as sock:
                    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
                    while not stop.wait(0.1):
                        sock.sendall(b"X-Slow: 1\r\n")
            except OSError:  # closed by the server: come back, as an attacker would
                stop.wait(0.1)

    attackers = [threading.Thread(target=trickle, daemon=True) for _ in range(4 * CAP)]
    for t in attackers:
        t.start()
    try:
        time.sleep(0.3)  # the cap is full of tricklers by now
        statuses, slowest = [], 0.0
        for _ in range(20):
            started = time.monotonic()
            r = httpx.get(server.url + "/health?ready=1", timeout=5)
            slowest = max(slowest, time.monotonic() - started)
            statuses.append(r.status_code)
            if r.status_code != 200:
                assert r.status_code == 503 and r.json()["error"]["code"] == "too_many_connections"
                assert r.headers["Retry-After"] == "1"
            time.sleep(0.05)
    finally:
        stop.set()
        for t in attackers:
            t.join(5)
    assert statuses.count(200) >= 17 and slowest < 1.0, (statuses, slowest)
    after = connections(server)
    assert after["evicted"] > before["evicted"] and after["cap"] == CAP
    server.wait_until(lambda: connections(server)["open"] <= 1, timeout=10)  # only the metrics request's own


def test_headers_not_sent_in_time_get_408(server: LiveServer) -> None:
    before = connections(server)["header_timeouts"]
    with connect(server) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        started = time.monotonic()
        status, body = read_response(sock)
    assert status == 408 and body["error"]["code"] == "header_timeout"
    assert time.monotonic() - started < 3
    assert connections(server)["header_timeouts"] == before + 1


def test_a_body_shorter_than_its_length_gets_408(server: LiveServer) -> None:
    before = connections(server)["body_timeouts"]
    with connect(server) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"messages":'
        )
        started = time.monotonic()
        status, body = read_response(sock)
    assert status == 408 and body["error"]["code"] == "body_timeout"
    # Closed with the answer: the unread rest of the body cannot be skipped to reuse the connection.
    assert time.monotonic() - started < 3
    assert connections(server)["body_timeouts"] == before + 1


def test_at_the_cap_with_every_connection_busy_a_new_one_gets_503(server: LiveServer) -> None:
    """Connections whose requests are in (here, each mid-body) are not evicted: the next is refused
    with a 503 and Retry-After, and is served again once they end."""
    refused = connections(server)["refused"]
    busy = [connect(server) for _ in range(CAP)]
    try:
        for sock in busy:
            sock.sendall(b"POST /v1/estimate HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{")
        time.sleep(0.1)
        with connect(server) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            status, body = read_response(sock)
        assert status == 503 and body["error"]["code"] == "too_many_connections"
    finally:
        for sock in busy:
            sock.close()
    assert connections(server)["refused"] == refused + 1
    server.wait_until(lambda: httpx.get(server.url + "/health").status_code == 200, timeout=10)


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: x\r\n\r\n{}",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
        b"NOT HTTP AT ALL\r\n\r\n",
    ],
    ids=["two-lengths", "bad-length", "bad-chunk", "gzip-chunked", "garbage"],
)
def test_malformed_http_gets_400_in_the_openai_shape(server: LiveServer, request_bytes: bytes) -> None:
    with connect(server) as sock:
        sock.sendall(request_bytes)
        status, body = read_response(sock)
    assert status == 400 and body["error"]["code"] == "invalid_http" and body["error"]["message"]


def test_connection_counts_in_prometheus(server: LiveServer) -> None:
    with server.client() as c:
        text = c.get("/v1/metrics", params={"format": "prometheus"}).text
    assert f'connections_cap="{server.state.connections.cap}"' in text  # configuration: a label of gmlx_config_info
    for name in (
        "gmlx_connections_open",
        "gmlx_connections_refused_total",
        "gmlx_connections_evicted_total",
        "gmlx_connections_header_timeouts_total",
        "gmlx_connections_body_timeouts_total",
    ):
        assert f"\n{name} " in text, name


def test_the_cap_stays_below_the_file_limit() -> None:
    assert connection_cap(1024, 4096) == 1024
    assert connection_cap(1024, 256) == 256 - 64  # room kept for the model files, logs and /proc reads


def test_repeated_errors_are_logged_once_per_window() -> None:
    records: list[logging.LogRecord] = []
    logger = logging.getLogger("gmlx.test.repeats")
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    handler.addFilter(RepeatFilter(window_s=0.2))
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    try:
        for _ in range(1000):
            logger.error("socket.accept() out of system resource")
        logger.error("another failure")
        time.sleep(0.25)
        logger.error("socket.accept() out of system resource")
        logger.info("socket.accept() out of system resource")  # info is never held back
    finally:
        logger.removeHandler(handler)
    messages = [r.getMessage() for r in records]
    assert messages[:2] == ["socket.accept() out of system resource", "another failure"]
    assert messages[2].startswith("socket.accept() out of system resource [999 more like this")
    assert len(messages) == 4
