"""Stopping the child processes dsec starts (agents, control planes)."""

from __future__ import annotations

import asyncio
import contextlib
import signal

STOP_GRACE_S = 60.0


async def stop_process(proc: asyncio.subprocess.Process, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM, so it cleans up on the way out (an agent removes its sandboxes); SIGKILL
    if it has not exited within `grace_s`."""
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(proc.wait(), grace_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
