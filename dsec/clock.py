"""The one source of time.

Everything that needs the time takes a `Clock`; nothing else calls `time` or
`loop.time()`. The live services use `SystemClock`; the simulator drives the same
code with a virtual clock.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Monotonic seconds: for deadlines, ages and latencies."""

    def wall(self) -> float:
        """Seconds since the epoch: for timestamps shown to people."""

    async def sleep(self, seconds: float) -> None: ...


class SystemClock:
    def now(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
