"""Ordinary asyncio code in virtual time.

`VirtualTimeLoop` is asyncio's selector loop with one change: when nothing is ready
it does not wait for the next timer, it jumps the clock to it. Everything built on
the loop (sleep, wait_for, call_later, the scheduler's timers) then runs in
simulated time, as fast as the CPU allows and in the same order every run.
"""

from __future__ import annotations

import asyncio
import selectors

EPOCH = 1_700_000_000.0  # wall-clock seconds shown for virtual time zero


class _SkipAheadSelector(selectors.DefaultSelector):
    def __init__(self, loop: VirtualTimeLoop) -> None:
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None):
        ready = super().select(0)
        if ready:
            return ready
        if timeout is None:
            raise RuntimeError("virtual time stands still: nothing is scheduled and nothing runs")
        self._loop.virtual_now += timeout
        return ready


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self.virtual_now = 0.0
        super().__init__(selector=_SkipAheadSelector(self))

    def time(self) -> float:
        return self.virtual_now


class VirtualClock:
    """The Clock the control plane takes, reading the virtual loop's time."""

    def __init__(self, loop: VirtualTimeLoop) -> None:
        self.loop = loop

    def now(self) -> float:
        return self.loop.virtual_now

    def wall(self) -> float:
        return EPOCH + self.loop.virtual_now

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
