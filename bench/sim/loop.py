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
THREAD_WAIT_S = 5.0  # real seconds the loop waits at most for a worker thread's answer


class _SkipAheadSelector(selectors.DefaultSelector):
    def __init__(self, loop: VirtualTimeLoop) -> None:
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None):
        if self._loop.in_threads:
            ready = super().select(0)
            if ready or timeout == 0:  # timeout 0: callbacks are ready to run
                return ready
            # a worker thread's work (a file written) takes no virtual time: the clock
            # waits for it, as it would for any other step of the code
            return super().select(THREAD_WAIT_S)
        # with no thread out, nothing but a thread's answer comes in through the loop's
        # files (virtual time has no sockets): no need to ask the kernel
        ready = []
        if timeout == 0:  # callbacks are ready to run
            return ready
        if timeout is None:
            raise RuntimeError("virtual time stands still: nothing is scheduled and nothing runs")
        self._loop.virtual_now += timeout
        return ready


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self.virtual_now = 0.0
        self.in_threads = 0  # calls handed to worker threads that have not answered
        super().__init__(selector=_SkipAheadSelector(self))

    def run_in_executor(self, executor, func, *args):  # type: ignore[override]
        future = super().run_in_executor(executor, func, *args)
        self.in_threads += 1

        def answered(_: asyncio.Future) -> None:
            self.in_threads -= 1

        future.add_done_callback(answered)
        return future

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
