"""The admission gate on its own: slots, the queue, Retry-After arithmetic, shutdown."""

from __future__ import annotations

import asyncio

import pytest

from gmlx.server.admission import AdmissionGate
from gmlx.server.errors import APIError


def test_retry_after_follows_the_drain_rate() -> None:
    gate = AdmissionGate(1, 4, 10, drain=lambda: (100.0, 50.0))  # 100 tokens a request, 50 tok/s
    assert gate.retry_after(waiting=3) == 6
    assert gate.retry_after(waiting=0) == 1  # clamped up
    assert gate.retry_after(waiting=1000) == 60  # clamped down
    assert AdmissionGate(1, 4, 10).retry_after(10) == 10  # no finished request yet: the fallback


def test_a_refusal_waits_for_those_ahead_and_one_more_to_finish() -> None:
    """Every slot is busy: a request that timed out first in the queue, or is refused by a full
    queue, can be admitted once those ahead of it and one more have finished, not sooner (it
    was told 1 s, the queue ahead of it being empty once it left it)."""

    async def run() -> None:
        gate = AdmissionGate(1, 1, 0.05, drain=lambda: (100.0, 20.0))  # a request finishes every 5 s
        await gate.acquire()
        with pytest.raises(APIError) as late:
            await gate.acquire()
        assert late.value.code == "queue_timeout" and late.value.retry_after == 5
        waiter = asyncio.create_task(gate.acquire())
        await asyncio.sleep(0)
        with pytest.raises(APIError) as full:
            await gate.acquire()
        assert full.value.code == "queue_full" and full.value.retry_after == 10
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)

    asyncio.run(run())


def test_slots_queue_and_handover() -> None:
    async def run() -> None:
        gate = AdmissionGate(1, 1, 10)
        await gate.acquire()
        waiter = asyncio.create_task(gate.acquire())
        await asyncio.sleep(0)
        assert (gate.running, gate.waiting) == (1, 1)
        with pytest.raises(APIError) as full:
            await gate.acquire()
        assert full.value.code == "queue_full" and full.value.retry_after == 5
        gate.release()  # the slot passes to the waiter, the count stays
        await waiter
        assert (gate.running, gate.waiting) == (1, 0)
        gate.release()
        assert gate.running == 0 and gate.rejections == 1

    asyncio.run(run())


def test_several_slots_are_granted_together_and_in_order() -> None:
    """A request of three choices waits until three slots are free at once; one behind it waits
    its turn, though a single slot would fit it sooner (no overtaking)."""

    async def run() -> None:
        gate = AdmissionGate(4, 4, 10)
        await gate.acquire(3)
        three = asyncio.create_task(gate.acquire(3))
        await asyncio.sleep(0)
        one = asyncio.create_task(gate.acquire())
        await asyncio.sleep(0)
        assert (gate.running, gate.waiting) == (3, 2)
        gate.release()
        await asyncio.sleep(0)
        assert (gate.running, gate.waiting) == (2, 2) and not three.done() and not one.done()
        gate.release()
        await three
        assert (gate.running, gate.waiting) == (4, 1)
        gate.release(3)
        await one
        assert (gate.running, gate.waiting) == (2, 0)

    asyncio.run(run())


def test_cancelled_waiter_leaves_no_trace() -> None:
    async def run() -> None:
        gate = AdmissionGate(1, 2, 10)
        await gate.acquire()
        waiter = asyncio.create_task(gate.acquire())
        await asyncio.sleep(0)
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        assert gate.waiting == 0
        gate.release()
        assert gate.running == 0

    asyncio.run(run())


def test_timeout_and_close() -> None:
    async def run() -> None:
        gate = AdmissionGate(1, 2, 0.05)
        await gate.acquire()
        with pytest.raises(APIError) as late:
            await gate.acquire()
        assert late.value.code == "queue_timeout" and late.value.retry_after == 10
        waiter = asyncio.create_task(gate.acquire())
        await asyncio.sleep(0)
        gate.close()
        with pytest.raises(APIError) as closing:
            await waiter
        assert closing.value.code == "shutting_down" and gate.waiting == 0 and gate.running == 1

    asyncio.run(run())


def test_a_slot_granted_as_the_client_leaves_is_not_leaked() -> None:
    """The client goes away just as its wait ends, and the wait returns its slot anyway (Python
    3.11's wait_for can swallow a cancel that lands as its future completes): the handler gets
    the slot, so it goes on to use and release it, rather than raising ClientGone with the slot
    still counted as held (which left a slot lost for good)."""
    from gmlx.server.http import ClientGone, unless_disconnected

    class LeavingClient:  # a request whose client has already disconnected
        async def receive(self) -> dict:
            return {"type": "http.disconnect"}

    async def run() -> None:
        async def wait_swallowing_cancel() -> str:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                pass
            return "slot"

        async def wait_honouring_cancel() -> str:
            await asyncio.Event().wait()
            return "slot"

        assert await unless_disconnected(LeavingClient(), wait_swallowing_cancel()) == "slot"  # type: ignore[arg-type]
        with pytest.raises(ClientGone):
            await unless_disconnected(LeavingClient(), wait_honouring_cancel())  # type: ignore[arg-type]

    asyncio.run(run())


class _Connected:
    """A request whose client stays: `receive` waits for ever."""

    async def receive(self) -> dict:
        await asyncio.Event().wait()
        return {}


def test_a_waiter_whose_caller_is_cancelled_leaves_no_slot_behind() -> None:
    """A queued stream closed while it waited (the client reset its connection) cancels the task
    awaiting its place. Its place goes back, and a slot granted as the cancel landed is released:
    either one held for good would shrink the server by a slot per such client."""
    from gmlx.server.http import unless_disconnected

    async def run() -> None:
        gate = AdmissionGate(1, 4, 10)
        await gate.acquire()  # every slot busy
        release = lambda _: gate.release()  # noqa: E731

        async def wait_for_place() -> None:
            await unless_disconnected(_Connected(), gate.acquire(), abandon=release)  # type: ignore[arg-type]

        queued = asyncio.create_task(wait_for_place())
        await asyncio.sleep(0.01)
        assert gate.waiting == 1
        queued.cancel()
        await asyncio.gather(queued, return_exceptions=True)
        await asyncio.sleep(0.01)
        assert gate.waiting == 0
        gate.release()
        assert gate.running == 0  # nobody was handed the freed slot
        # Granted just as its caller is cancelled: the grant is released, not kept.
        await gate.acquire()
        granted = asyncio.create_task(wait_for_place())
        await asyncio.sleep(0.01)
        gate.release()  # hands the slot to the waiter...
        granted.cancel()  # ...as its caller goes
        await asyncio.gather(granted, return_exceptions=True)
        await asyncio.sleep(0.01)
        assert (gate.running, gate.waiting) == (0, 0)

    asyncio.run(run())
