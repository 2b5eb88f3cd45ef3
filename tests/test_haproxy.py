"""HAProxy in front of two `gmlx serve` processes, with deploy/haproxy/haproxy.cfg as a user runs it
(only the addresses come from the environment): a burst larger than one server holds spreads over
both, a 503 reaches the client only when both shed and carries Retry-After, nothing is lost, and a
server killed mid-burst is taken out by the checks while its streams end with an error, not a hang."""

from __future__ import annotations

import asyncio
import csv
import io
import os
import shutil
import subprocess
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from conftest import ServeProcess, free_port
from tiny_models import write_model
from tiny_vocab import spm_vocab

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy is not installed (make system)"),
]

CONFIG = Path(__file__).parent.parent / "deploy" / "haproxy" / "haproxy.cfg"
SERVERS = ("gmlx-a", "gmlx-b")


class HAProxy:
    """haproxy in the foreground on deploy/'s configuration, its servers and ports from the environment."""

    def __init__(self, backends: list[str], log: Path):
        self._backends, self._log = backends, log

    def __enter__(self) -> HAProxy:
        for _ in range(3):  # a free port may be taken by another process before haproxy binds it: new ports
            self.url, self.stats = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
            env = {
                **os.environ,
                "GMLX_A": self._backends[0],
                "GMLX_B": self._backends[1],
                "GMLX_FRONTEND": self.url.removeprefix("http://"),
                "GMLX_STATS": self.stats.removeprefix("http://"),
            }
            self._out = self._log.open("wb")
            self.proc = subprocess.Popen(
                ["haproxy", "-db", "-f", str(CONFIG)], env=env, stdout=self._out, stderr=subprocess.STDOUT
            )
            try:
                self.proc.wait(0.5)
            except subprocess.TimeoutExpired:
                break  # bound and running
            self._out.close()
            assert "cannot bind" in self._log.read_text(), self._log.read_text()  # any other failure is one
        self.wait_for(lambda s: all(s.get(name) == "UP" for name in SERVERS), 20)
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        self._out.close()

    def status(self) -> dict[str, str]:
        """Each server's check status, from the stats page's CSV."""
        try:
            text = httpx.get(f"{self.stats}/stats;csv", timeout=2).text.lstrip("# ")
        except httpx.TransportError:
            return {}
        return {r["svname"]: r["status"] for r in csv.DictReader(io.StringIO(text)) if r["pxname"] == "gmlx"}

    def wait_for(self, predicate, timeout: float) -> float:
        """Seconds until predicate(status) held."""
        start = time.monotonic()
        while not predicate(self.status()):
            assert self.proc.poll() is None, self._log.read_text()
            assert time.monotonic() - start < timeout, f"haproxy: {self.status()}"
            time.sleep(0.1)
        return time.monotonic() - start


def finished(server: ServeProcess) -> int:
    totals = httpx.get(f"{server.url}/v1/metrics", timeout=10).json()["server"]["totals"]
    return sum(totals["requests_finished"].values())


def rejected(server: ServeProcess) -> int:
    return httpx.get(f"{server.url}/v1/metrics", timeout=10).json()["server"]["queue"]["rejections"]


def test_a_fleet_behind_haproxy(tmp_path: Path) -> None:
    model = write_model(tmp_path / "tiny.gguf", "llama", context=8192)
    small = ("--decode-batch", "1", "--queue-size", "1")  # each server holds 2: one decoding, one waiting
    with ExitStack() as stack:
        servers = [stack.enter_context(ServeProcess(model, tmp_path / f"{name}.log", *small)) for name in SERVERS]
        proxy = stack.enter_context(HAProxy([s.url.removeprefix("http://") for s in servers], tmp_path / "haproxy.log"))
        tokens = spm_vocab()[0]
        no_end = {str(tokens.index(t)): -100 for t in ("<eos>", "<end_of_turn>")}  # each request runs its length
        body = {"prompt": "the sea", "max_tokens": 1500, "temperature": 0, "logit_bias": no_end}

        async def burst(n: int) -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=proxy.url, timeout=60) as c:
                return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(n)))

        answers = asyncio.run(burst(8))  # twice what the fleet holds at once
        statuses = Counter(r.status_code for r in answers)
        assert set(statuses) <= {200, 503} and statuses[200] >= 4, statuses
        for r in answers:
            if r.status_code == 503:  # only when both shed: each refused it, and the client learns when to retry
                assert int(r.headers["Retry-After"]) >= 1 and r.json()["error"]["code"] == "queue_full"
        by_server = Counter(r.headers["X-Gmlx-Server"] for r in answers if r.status_code == 200)
        assert set(by_server) == set(SERVERS), by_server  # both took work
        assert sum(finished(s) for s in servers) == statuses[200]  # nothing lost: every 200 was one completion
        assert sum(rejected(s) for s in servers) >= 2 * statuses[503]

        stream = {**body, "max_tokens": 3000, "stream": True}

        async def kill_mid_stream() -> dict[str, object]:
            """One stream on each server; the first server is killed once both are decoding."""
            async with httpx.AsyncClient(base_url=proxy.url, timeout=httpx.Timeout(60, read=20)) as c:
                started: dict[str, asyncio.Event] = {name: asyncio.Event() for name in SERVERS}

                async def one() -> tuple[str, object]:
                    async with c.stream("POST", "/v1/completions", json=stream) as r:
                        name = r.headers["X-Gmlx-Server"]
                        try:
                            async for line in r.aiter_lines():
                                started[name].set()
                                if line == "data: [DONE]":
                                    return name, "done"
                        except httpx.HTTPError as e:
                            return name, e
                    return name, "cut"

                tasks = [asyncio.create_task(one()) for _ in SERVERS]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started.values())), 30)
                servers[0].proc.kill()

                def out(s: dict) -> bool:
                    return s.get("gmlx-a", "").startswith("DOWN")

                out_after = await asyncio.to_thread(proxy.wait_for, out, 10)
                return {**dict(await asyncio.wait_for(asyncio.gather(*tasks), 40)), "out_after_s": out_after}

        ends = asyncio.run(kill_mid_stream())
        assert isinstance(ends["gmlx-a"], httpx.HTTPError), ends  # an error: the connection is cut...
        assert not isinstance(ends["gmlx-a"], httpx.TimeoutException), ends  # ...at once, not a read left hanging
        assert ends["gmlx-b"] == "done"
        assert ends["out_after_s"] < 5  # taken out by two failed checks a second apart
        after = asyncio.run(burst(2))
        assert [r.status_code for r in after].count(200) >= 1
        assert all(r.headers.get("X-Gmlx-Server") == "gmlx-b" for r in after if r.status_code == 200)
        assert all("Retry-After" in r.headers for r in after if r.status_code == 503)
        servers[1].proc.kill()  # no server left: HAProxy's own 503 says when to come back too
        proxy.wait_for(lambda s: s.get("gmlx-b", "").startswith("DOWN"), 10)
        none = httpx.post(f"{proxy.url}/v1/completions", json=body, timeout=30)
        assert none.status_code == 503 and none.headers["Retry-After"] == "5"
