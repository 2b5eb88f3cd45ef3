"""engine/engine.py on its own: requests in, events out, each request's failure its own."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from gmlx.engine.engine import Chunk, Engine, Event, Failed, Finished, Phase, Request
from gmlx.models.loader import load


class Collected:
    def __init__(self) -> None:
        self.events: list[Event] = []
        self.done = threading.Event()
        self.first = threading.Event()

    def __call__(self, event: Event) -> None:
        self.events.append(event)
        self.first.set()
        if isinstance(event, Finished | Failed):
            self.done.set()

    @property
    def end(self) -> Event:
        assert self.done.wait(60), self.events
        return self.events[-1]

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events if isinstance(e, Chunk))


@pytest.fixture(scope="module")
def engine(tiny_models: dict[str, Path]) -> Iterator[Engine]:
    e = Engine(lambda: load(tiny_models["llama"], "float"), "test", decode_batch=4)
    e.start()
    assert e.ready.wait(60) and e.loaded is not None
    yield e
    e.stop()


def submit(engine: Engine, rid: str, prompt: list[int], max_tokens: int) -> Collected:
    out = Collected()
    engine.submit(Request(id=rid, prompt_ids=prompt, max_tokens=max_tokens, emit=out))
    return out


def test_requests_decode_together_each_to_its_own_end(engine: Engine) -> None:
    a, b = submit(engine, "a", [1, 5, 9], 6), submit(engine, "b", [1, 7], 3)
    for out, prompt, generated in ((a, 3, 6), (b, 2, 3)):
        end = out.end
        assert isinstance(end, Finished) and end.finish_reason in ("length", "stop"), out.events
        assert end.prompt_tokens == prompt and end.completion_tokens <= generated
        assert end.ttft_s is not None and end.ttft_s >= 0
    assert engine.in_flight == 0


def test_a_cancel_ends_one_request_and_frees_its_slot(engine: Engine) -> None:
    long, short = submit(engine, "long", [1, 2, 3], 10_000), submit(engine, "short", [1, 4], 4)
    assert long.first.wait(60)  # decoding
    engine.cancel("long")
    end = long.end
    assert isinstance(end, Finished) and end.finish_reason == "cancelled" and end.completion_tokens < 10_000
    assert isinstance(short.end, Finished)
    assert engine.in_flight == 0 and not [r for r in engine.requests() if r.state != Phase.DONE]


def test_a_request_that_cannot_start_fails_alone_and_the_engine_serves_on(engine: Engine) -> None:
    bad = submit(engine, "empty", [], 4)
    assert isinstance(bad.end, Failed) and "empty prompt" in bad.end.message
    good = submit(engine, "after", [1, 3], 2)
    assert isinstance(good.end, Finished) and engine.alive


EXITS_RIGHT_AFTER_STOP = """
import sys, time
import gmlx
from gmlx.engine.engine import Engine, Request
from gmlx.models.loader import load
engine = Engine(lambda: load(sys.argv[1], sys.argv[2]), "exit", decode_batch=2, prefill_step=64)
engine.start()
assert engine.ready.wait(120) and engine.loaded is not None
engine.submit(Request("r", [2, 3, 4], 6, emit=lambda event: None))
while engine.in_flight:
    time.sleep(0.01)
engine.stop()
"""


@pytest.mark.parametrize("weights", ["gguf", "float"])
def test_a_script_that_stops_its_engine_exits_cleanly(tiny_models: dict[str, Path], weights: str) -> None:
    """MLX frees a thread's streams, random key and compile cache as the thread ends, taking the GIL; a
    process exiting meanwhile aborted ("terminate called without an active exception") in about one
    run of three. The engine thread frees them itself before it ends."""
    import subprocess
    import sys

    from gmlx import kernels

    if weights == "gguf" and not kernels.available():
        pytest.skip("no gguf kernels here")
    for _ in range(4):
        r = subprocess.run(
            [sys.executable, "-c", EXITS_RIGHT_AFTER_STOP, str(tiny_models["gemma3"]), weights],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0 and "terminate called" not in r.stderr, r.stderr[-2000:]
