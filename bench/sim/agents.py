"""Simulated agents: the calls the control plane makes, answered in virtual time.

`SimAgents` stands where `controlplane.gateway.AgentGateway` stands and answers the
same requests (create, lease, pause, unpause, hibernate, remove) with the same
results, including an agent's refusal when a node is full. Durations are drawn from
a profile; creates, removes and snapshots queue for the node's engine, which runs a
few at a time, as Docker does. With `shared_engine`, every node queues for one
engine, as the local multi-node pool on one machine does.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

from bench.sim.profile import Profile
from controlplane.gateway import CallResult
from dsec.models import CreateSandbox
from dsec.policy import Resources
from dsec.states import SandboxState as S

URL_SCHEME = "sim://"


@dataclass
class SimSandbox:
    state: S
    needs: Resources


class SimNode:
    def __init__(self, node_id: str, kind: str, capacity: Resources, engine: asyncio.Semaphore):
        self.id, self.kind, self.capacity, self.engine = node_id, kind, capacity, engine
        self.sandboxes: dict[str, SimSandbox] = {}
        self.used = Resources()

    def occupy(self, needs: Resources, sign: int) -> None:
        self.used = Resources(
            self.used.cpus + sign * needs.cpus,
            self.used.memory_mb + sign * needs.memory_mb,
            self.used.slots + sign * needs.slots,
        )


class SimAgents:
    def __init__(self, profile: Profile, rng: random.Random, shared_engine: bool) -> None:
        self.profile = profile
        self.rng = rng
        self.shared_engine = shared_engine
        self.nodes: dict[str, SimNode] = {}
        self._engine: asyncio.Semaphore | None = None

    def add_node(self, node_id: str, kind: str, capacity: Resources) -> str:
        if self.shared_engine:
            self._engine = self._engine or asyncio.Semaphore(self.profile.engine_concurrency)
            engine = self._engine
        else:
            engine = asyncio.Semaphore(self.profile.engine_concurrency)
        self.nodes[node_id] = SimNode(node_id, kind, capacity, engine)
        return f"{URL_SCHEME}{node_id}"

    async def start(self) -> None:
        """Nothing to open: the gateway interface."""

    async def close(self) -> None:
        """Nothing to close: the gateway interface."""

    async def _take(self, op: str) -> None:
        await asyncio.sleep(self.profile.draw(op, self.rng))

    async def _engine_op(self, node: SimNode, op: str) -> None:
        async with node.engine:
            await self._take(op)

    async def call(self, method: str, url: str, body=None, request_id: str = "") -> CallResult:
        node_id, _, path = url.removeprefix(URL_SCHEME).partition("/")
        node = self.nodes.get(node_id)
        if node is None:
            return CallResult(False, 0, "unreachable", f"no node {node_id}")
        parts = path.split("/")  # v1, sandboxes[, id[, verb]]
        if method == "POST" and len(parts) == 2:
            return await self._create(node, body)
        sandbox_id = parts[2]
        verb = parts[3] if len(parts) > 3 else None
        sb = node.sandboxes.get(sandbox_id)
        if sb is None:
            return CallResult(False, 404, "unknown_sandbox", f"no sandbox {sandbox_id}")
        if method == "DELETE":
            return await self._remove(node, sandbox_id, sb)
        handler = {
            "lease": self._lease,
            "pause": self._pause,
            "unpause": self._unpause,
            "hibernate": self._hibernate,
        }[verb]
        return await handler(node, sb)

    async def _create(self, node: SimNode, body: CreateSandbox) -> CallResult:
        if body.sandbox_id in node.sandboxes:
            return CallResult(True, 200, "ok", "")
        needs = Resources(body.template.cpus, body.template.memory_mb, 1)
        if not (node.used + needs).fits_in(node.capacity):
            return CallResult(False, 409, "no_capacity", f"node {node.id} is full")
        sb = node.sandboxes[body.sandbox_id] = SimSandbox(S.CREATING, needs)
        node.occupy(needs, +1)
        await self._engine_op(node, "create")
        sb.state = S.WARM
        return CallResult(True, 201, "ok", "")

    async def _lease(self, node: SimNode, sb: SimSandbox) -> CallResult:
        await self._take("lease")
        if sb.state == S.PAUSED:
            await self._take("unpause")
        elif sb.state == S.HIBERNATED:
            if not (node.used + sb.needs).fits_in(node.capacity):
                return CallResult(False, 409, "no_capacity", "no room to restore")
            node.occupy(sb.needs, +1)
            await self._engine_op(node, "restore")
        sb.state = S.LEASED
        return CallResult(True, 200, "ok", "")

    async def _pause(self, node: SimNode, sb: SimSandbox) -> CallResult:
        await self._take("pause")
        sb.state = S.LEASED_PAUSED if sb.state == S.LEASED else S.PAUSED
        return CallResult(True, 200, "ok", "")

    async def _unpause(self, node: SimNode, sb: SimSandbox) -> CallResult:
        await self._take("unpause")
        sb.state = S.LEASED if sb.state == S.LEASED_PAUSED else S.WARM
        return CallResult(True, 200, "ok", "")

    async def thaw_for_exec(self, node_id: str, sandbox_id: str) -> bool:
        """What the agent does on an exec into a frozen lease; True if it had to thaw."""
        sb = self.nodes[node_id].sandboxes.get(sandbox_id)
        if sb is None or sb.state != S.LEASED_PAUSED:
            return False
        await self._take("unpause")
        sb.state = S.LEASED
        return True

    async def _hibernate(self, node: SimNode, sb: SimSandbox) -> CallResult:
        await self._engine_op(node, "commit")
        await self._engine_op(node, "remove")
        sb.state = S.HIBERNATED
        node.occupy(sb.needs, -1)  # memory released: the files stay on disk
        return CallResult(True, 200, "ok", "")

    async def _remove(self, node: SimNode, sandbox_id: str, sb: SimSandbox) -> CallResult:
        if sb.state != S.HIBERNATED:
            await self._engine_op(node, "remove")
            node.occupy(sb.needs, -1)
        node.sandboxes.pop(sandbox_id, None)
        return CallResult(True, 200, "ok", "")
