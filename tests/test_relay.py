"""The engine-to-loop relay: every event arrives, in order, and a burst costs one loop wake-up."""

from __future__ import annotations

import asyncio
import threading

import pytest

from gmlx.server.http import Relay, relay


def test_a_burst_from_another_thread_arrives_in_order_with_one_wake_up() -> None:
    async def main() -> tuple[list[tuple[int, int]], int]:
        loop = asyncio.get_running_loop()
        got: list[tuple[int, int]] = []
        wakes = 0
        real = loop.call_soon_threadsafe

        def counting(*args, **kw):  # type: ignore[no-untyped-def]
            nonlocal wakes
            wakes += 1
            return real(*args, **kw)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        r = relay(loop)
        assert relay(loop) is r  # one per loop: every stream shares its wake-ups
        done = asyncio.Event()

        def burst() -> None:  # as a decode step emits: one event per stream, back to back
            for step in range(3):
                for stream in range(8):
                    r.call(got.append, (step, stream))
            r.call(lambda _: done.set(), None)

        t = threading.Thread(target=burst)
        t.start()
        await asyncio.wait_for(done.wait(), 10)
        t.join()
        return got, wakes

    got, wakes = asyncio.run(main())
    assert got == [(s, i) for s in range(3) for i in range(8)]
    assert wakes < len(got)  # the loop did not run while the thread emitted: far fewer wake-ups than events


def test_a_failing_call_does_not_drop_the_rest() -> None:
    async def main() -> list[int]:
        r = Relay(asyncio.get_running_loop())
        got: list[int] = []

        def boom(_: object) -> None:
            raise ValueError("consumer gone")

        r.call(got.append, 1)
        r.call(boom, None)
        r.call(got.append, 2)
        await asyncio.sleep(0.05)
        return got

    assert asyncio.run(main()) == [1, 2]


def test_a_closed_loop_refuses_and_a_new_call_is_not_swallowed() -> None:
    loop = asyncio.new_event_loop()
    r = Relay(loop)
    loop.close()
    with pytest.raises(RuntimeError):
        r.call(print, "x")
    with pytest.raises(RuntimeError):  # nothing left pending that would silence the next one
        r.call(print, "y")
