"""A sandbox as the agent holds it in memory: its stored record, its template, where it
is in the state machine (dsec/states.py) and what it is doing now."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from agent.host import LoopProcess, is_init_of
from agent.output import RelayRate
from agent.store import SandboxRecord
from dsec.models import TemplateSpec
from dsec.states import SandboxState, transition

if TYPE_CHECKING:
    from agent.docker_driver import AsyncDocker


@dataclass
class Sandbox:
    record: SandboxRecord
    spec: TemplateSpec
    state: SandboxState
    last_active: float
    busy_s: float = 0.0
    running_execs: int = 0
    frozen_at: float | None = None  # set when paused, kept through hibernation
    reset_from: str | None = None  # the lease its last reset ended (a retry finds it done)
    resident_tried_at: float | None = None  # its command loop last started (agent/resident.py)
    loop: LoopProcess | None = None  # that loop, where a reset may keep it (agent/host.py)
    init_pid: int | None = None  # its container's init, as container_init keeps it
    relay_rate: RelayRate | None = None  # its output's, from its first command (agent/execs.py)
    # its lease's claim being applied (agent/node.py, Agent.lease): a retried grant waits
    claim_applied: asyncio.Task | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # held while its command loop's exec starts (agent/resident.py), without `lock`: a
    # lease or a command need not wait for it, but a pause or a reset must
    loop_start: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def id(self) -> str:
        return self.record.id

    @property
    def user(self) -> str:
        """Who its commands and file operations run as ("uid:gid")."""
        return self.record.user or self.spec.user

    @property
    def occupies(self) -> bool:
        """Hibernated sandboxes hold disk only: no slot, CPU or memory."""
        return self.state != SandboxState.HIBERNATED

    async def container_init(self, docker: AsyncDocker) -> int | None:
        """Its container's init (None: not running): the PID the engine last said while
        it still is that init, else the engine's answer, kept (an inspect the engine
        need not make on every reset). Raises DockerOpError."""
        container_id = self.record.container_id
        if self.init_pid is not None and is_init_of(self.init_pid, container_id):
            return self.init_pid
        self.init_pid = await docker.init_pid(container_id)
        return self.init_pid

    async def loop_started(self) -> None:
        """Wait for a start of its command loop under way to end. A pause or a reset
        holding `lock` calls it first: an exec that starts in a container being frozen
        hangs in the engine for good, and a reset would find the new loop left over."""
        async with self.loop_start:
            pass

    def move(self, target: SandboxState) -> None:
        self.state = transition(self.state, target)
