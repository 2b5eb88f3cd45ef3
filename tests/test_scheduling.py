"""engine/budget.py in the engine: while streams decode, a short prompt is not held behind a long
one's prefill, and the streams decode on while a long prompt prefills."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from tiny_models import write_model

from gmlx.engine.budget import PrefillBudget
from gmlx.engine.engine import Engine, Finished, Phase, Request
from gmlx.engine.processors import Decoding
from gmlx.models.loader import load

LONG = 6000  # prompt tokens: 12 steps of the engine's 512 with nothing else to do
NO_END = ((1, -100.0), (5, -100.0))  # the tiny vocabulary's end tokens, banned so streams run their length


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    path = write_model(tmp_path_factory.mktemp("long") / "tiny-long.gguf", "llama", context=8192)
    e = Engine(lambda: load(path, "float"), "scheduling", decode_batch=4, prefill_step=512)
    e.start()
    assert e.ready.wait(60) and e.loaded is not None
    yield e
    e.stop()


def request(rid: str, prompt: list[int], max_tokens: int) -> tuple[Request, list]:
    events: list = []
    return Request(rid, prompt, max_tokens, decoding=Decoding(logit_bias=NO_END), emit=events.append), events


def wait(condition, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_a_short_prompt_gets_its_first_token_before_a_long_prompts_prefill_ends(engine: Engine) -> None:
    # Both arrive at once, while a stream decodes. Each padded to 512 tokens a step, the short
    # one's first token would come as the long one's prefill ends, its second step.
    stream, _ = request("decoding", [2, 3], 100_000)
    engine.submit(stream)
    wait(lambda: stream.generated > 0)
    long, long_events = request("long", [2 + i % 50 for i in range(1000)], 2)
    short, _ = request("short", [2, 3, 4], 2)
    seen: list[Phase] = []
    short.emit = lambda event: seen.append(long.state)
    held = threading.Event()
    engine.release_memory(0, lambda *_: held.wait(10))  # holds the engine thread: it takes both at once
    engine.submit(long)
    engine.submit(short)
    held.set()
    wait(lambda: long_events and isinstance(long_events[-1], Finished))
    assert seen and seen[0] == Phase.PREFILL, seen  # the long one was still prefilling
    assert short.first_token_at < long.first_token_at
    engine.cancel("decoding")
    wait(lambda: engine.in_flight == 0)


def test_with_nothing_decoding_a_short_prompt_is_not_padded_to_a_long_ones_chunk(engine: Engine) -> None:
    # A step's chunks are padded to the longest: joining a long prompt's prefill, a short one
    # would cost a whole 512-token chunk of both rows before its first token.
    long, long_events = request("long3", [2 + i % 50 for i in range(LONG)], 2)
    engine.submit(long)
    wait(lambda: long.prefilled >= 512)
    held, holding = threading.Event(), threading.Event()
    engine.release_memory(0, lambda *_: (holding.set(), held.wait(10)))  # between two steps
    assert holding.wait(10)
    before = long.prefilled
    short, _ = request("short3", [2, 3, 4], 2)
    at_first_token: list[int] = []
    short.emit = lambda event: at_first_token.append(long.prefilled)
    engine.submit(short)
    held.set()
    wait(lambda: long_events and isinstance(long_events[-1], Finished))
    # The steps that ended the short prompt took the least chunk (16) of the long one's tokens each,
    # not 512: one step, or two where the short one's last token is a chunk of its own (the prompt
    # cache keeps the cache before it). Its first token goes out with the decode step after, which
    # may have prefilled its own chunk by then (the budget's floor: a row decodes).
    b = PrefillBudget(512)
    ended = {b.least_chunk, 2 * b.least_chunk}
    took = at_first_token[0] - before if at_first_token else None
    assert took in ended | {n + b.floor for n in ended}, (before, at_first_token)
    assert short.first_token_at < long.first_token_at
    wait(lambda: engine.in_flight == 0)


def test_a_stream_decodes_on_while_a_long_prompt_prefills(engine: Engine) -> None:
    stream, _ = request("stream", [2, 3], 100_000)
    engine.submit(stream)
    wait(lambda: stream.generated > 0)
    long, _ = request("long2", [2 + i % 50 for i in range(LONG)], 2)
    engine.submit(long)
    wait(lambda: long.prefilled > 0)
    before = stream.generated
    wait(lambda: long.state != Phase.PREFILL)  # in chunks that fit beside a decode step, each with a token
    assert stream.generated - before >= 20, (before, stream.generated)
    engine.cancel("stream")
    wait(lambda: engine.in_flight == 0)


def test_the_budget_fits_beside_a_decode_step_shared_among_the_prompts() -> None:
    b = PrefillBudget(512)
    assert b.chunk(decoding=0, prefilling=1) == 512
    assert b.chunk(decoding=0, prefilling=8) == 512  # nothing decoding: each prompt as mlx_lm would
    b.observe(decoded=8, prompt_tokens=0, seconds=0.050)  # a decode step: 50 ms
    b.observe(decoded=8, prompt_tokens=100, seconds=0.100)  # 100 prompt tokens added 50 ms
    assert b.chunk(decoding=8, prefilling=1) == 70  # 0.7 of a decode step's time at 0.5 ms a token
    assert b.chunk(decoding=4, prefilling=2) == 35  # shared: a short prompt ends in its first steps
    assert b.chunk(decoding=8, prefilling=7) == 32  # never below the floor: a long prompt still moves
