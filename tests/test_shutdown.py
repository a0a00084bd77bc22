"""A service's shutdown always ends: its background loops end when cancelled, also one
cancelled just as a call it waits for answers, which Python 3.11's asyncio.wait_for turns
into a normal return (a shutdown that awaited such a loop would end only with its
supervisor's SIGKILL, 60 s later, leaving the agent's containers behind: CI saw such
stops, though which loop hung there is not known)."""

from __future__ import annotations

import asyncio

import pytest
from conftest import eventually
from inprocess import IdleEngine, inprocess_agent

from dsec.httpkit import cancel_and_wait

pytestmark = pytest.mark.asyncio(loop_scope="module")


class PingCancelsTheWatch(IdleEngine):
    """Its first ping cancels the agent's engine watch as it answers: a shutdown that
    comes just as a ping ends."""

    def __init__(self) -> None:
        super().__init__()
        self.cancelled: asyncio.Task | None = None

    async def ping(self) -> None:
        if self.cancelled is None:
            self.cancelled = next(t for t in asyncio.all_tasks() if t.get_name() == "engine")
            self.cancelled.cancel()


async def test_the_engine_watch_ends_when_cancelled_as_a_ping_answers(tmp_path):
    engine = PingCancelsTheWatch()
    async with asyncio.timeout(30):  # the shutdown too: before, it never ended
        async with inprocess_agent(tmp_path, engine, engine_check_s=0.01):
            await eventually(lambda: engine.cancelled is not None, "a ping", timeout=10)
            await eventually(engine.cancelled.done, "the watch to end", timeout=5)
            assert engine.cancelled.cancelled()


async def test_a_task_that_goes_on_after_its_cancellation_is_cancelled_again():
    cancels = 0

    async def goes_on_once() -> None:
        nonlocal cancels
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                cancels += 1
                if cancels > 1:
                    raise

    task = asyncio.create_task(goes_on_once())
    await asyncio.sleep(0)
    async with asyncio.timeout(10):
        await cancel_and_wait(task)
    assert task.cancelled() and cancels == 2
