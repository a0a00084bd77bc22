"""The child processes dsec starts (agents, control planes): their command lines, and
stopping them."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from pathlib import Path

from dsec.models import Capacity, NodeKind

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


def dsec_argv(*args: str) -> list[str]:
    """`python -m dsec.cli ARGS...` with this interpreter: how dsec starts its parts."""
    return [sys.executable, "-m", "dsec.cli", *args]


def agent_args(
    node_id: str,
    *,
    host: str,
    controlplane: str,
    capacity: Capacity,
    state_dir: Path,
    heartbeat_s: float,
    kind: NodeKind = "local",
    port: int = 0,
    cleanup_on_exit: bool = True,
) -> list[str]:
    """The arguments of `dsec agent` (after `python -m dsec.cli`, see dsec_argv) for an
    agent that registers with `controlplane`; port 0: any free port, which the agent
    prints on its first line."""
    args = [
        "agent",
        "--node-id", node_id,
        "--kind", kind,
        "--host", host,
        "--port", str(port),
        "--controlplane", controlplane,
        "--cpus", str(capacity.cpus),
        "--memory-mb", str(capacity.memory_mb),
        "--slots", str(capacity.slots),
        "--state-dir", str(state_dir),
        "--heartbeat-s", str(heartbeat_s),
    ]  # fmt: skip
    if cleanup_on_exit:
        args.append("--cleanup-on-exit")
    return args
