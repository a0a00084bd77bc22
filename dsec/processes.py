"""The child processes dsec starts (agents, control planes): their command lines, and
stopping them."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from dsec.models import Capacity, NodeKind

if TYPE_CHECKING:
    from dsec.tls import TlsFiles

STOP_GRACE_S = 60.0
PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before any fork


def signalled_at_parent_death(sig: signal.Signals) -> Callable[[], None]:
    """A `preexec_fn` for a child: `sig` when the process starting it dies, however it
    dies (SIGKILL included), so a launcher's services never outlive it (Linux's
    PR_SET_PDEATHSIG, armed for the thread that forks: start children from the thread
    that lives as long as they should). A launcher gone before it is armed: `sig` at once."""
    parent = os.getpid()

    def arm() -> None:
        _prctl(PR_SET_PDEATHSIG, sig)
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)

    return arm


def interrupt_on_termination() -> None:
    """SIGTERM and SIGHUP as Ctrl-C (KeyboardInterrupt): a command that started a pool
    stops it on the way out, as on Ctrl-C, when a supervisor, a `timeout` or a closed
    terminal ends it, instead of dying and leaving its services and sandboxes behind."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _as_ctrl_c)


def _as_ctrl_c(signum: int, frame: object) -> None:
    """Deliver the signal as SIGINT, to whichever handler SIGINT has: under asyncio.run,
    the one that cancels the main task at an await; elsewhere, KeyboardInterrupt as
    raised here before. Raised from here, it could land inside a library that catches
    it: in pydantic's pattern check it became a ValidationError, and `dsec bench tune`
    exited 1 on SIGHUP with its pool's clean-up skipped."""
    signal.raise_signal(signal.SIGINT)


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


def is_credential(name: str) -> bool:
    """Whether an environment variable holds a dsec credential (DSEC_TOKEN,
    DSEC_ADMIN_TOKEN, DSEC_AGENT_TOKEN, DSEC_METRICS_TOKEN, ...)."""
    return name.startswith("DSEC_") and name.endswith("TOKEN")


def child_env(credentials: Mapping[str, str]) -> dict[str, str]:
    """Our environment for a child process, with `credentials` and no other credential:
    a child started from a shell that sourced the env file, or by the control plane,
    must not inherit tokens it has no use for (an agent holding the admin token could do
    whatever an operator can)."""
    env = {name: value for name, value in os.environ.items() if not is_credential(name)}
    return {**env, **credentials}


def agent_credentials(agent_token: str, metrics_token: str | None) -> dict[str, str]:
    """The pool's join token (the control plane's, and an agent's started by hand), and
    the metrics token if there is one."""
    return {"DSEC_AGENT_TOKEN": agent_token, **_metrics_credential(metrics_token)}


def node_credentials(node_token: str, metrics_token: str | None) -> dict[str, str]:
    """What an agent dsec starts needs: its own node token (controlplane/identities.py),
    never the join token, with which it could join as any node; and the metrics token
    if there is one."""
    return {"DSEC_NODE_TOKEN": node_token, **_metrics_credential(metrics_token)}


def _metrics_credential(metrics_token: str | None) -> dict[str, str]:
    return {} if metrics_token is None else {"DSEC_METRICS_TOKEN": metrics_token}


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
    execs_per_sandbox: int | None = None,
    execs_per_node: int | None = None,
    container_check_s: float | None = None,
    tls: TlsFiles | None = None,
) -> list[str]:
    """The arguments of `dsec agent` (after `python -m dsec.cli`, see dsec_argv) for an
    agent that registers with `controlplane`; port 0: any free port, which the agent
    prints on its first line; `tls`: it serves and verifies with those files."""
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
    if execs_per_sandbox is not None:
        args += ["--execs-per-sandbox", str(execs_per_sandbox)]
    if execs_per_node is not None:
        args += ["--execs-per-node", str(execs_per_node)]
    if container_check_s is not None:
        args += ["--container-check-s", str(container_check_s)]
    if tls is not None:
        args += tls.args()
    return args
