"""Simulated agents: the calls the control plane makes, answered in virtual time.

`SimAgents` stands where `controlplane.gateway.AgentGateway` stands and answers the
same requests (create, lease, pause, unpause, hibernate, remove) with the same
results, including an agent's refusal when a node is full. Durations are drawn from
a profile; creates, removes and snapshots queue for the node's agent, which runs a
few at a time (its lifecycle threads).

Each node's machine runs one Docker engine, which counts what it runs: operations
and the start of every exec (the part of an exec that is the engine's work). With a
profile measured under load, an operation, and the agent's lease call, take as long
as they did with as many others running on the machine: on shared cores, each waits
for CPU behind the others. With `shared_engine`, every node is on one machine with
one engine, as the local multi-node pool is.
"""

from __future__ import annotations

import asyncio
import heapq
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


class Engine:
    """One machine's Docker engine: a count of all it runs now."""

    def __init__(self) -> None:
        self.running = 0  # operations under way (not queued)
        # exec starts, as two heaps of times: those started minus those ended is what runs
        self._exec_starts: list[float] = []
        self._exec_ends: list[float] = []
        self._execs = 0

    def exec_window(self, start_s: float, end_s: float) -> None:
        """An exec's engine work, from `start_s` (now or later) to `end_s`."""
        heapq.heappush(self._exec_starts, start_s)
        heapq.heappush(self._exec_ends, end_s)

    def load(self, now: float) -> int:
        """How many operations and exec starts run at `now` (which never goes back)."""
        while self._exec_starts and self._exec_starts[0] <= now:
            heapq.heappop(self._exec_starts)
            self._execs += 1
        while self._exec_ends and self._exec_ends[0] <= now:
            heapq.heappop(self._exec_ends)
            self._execs -= 1
        return self.running + self._execs


class SimNode:
    def __init__(
        self, node_id: str, kind: str, capacity: Resources, engine: Engine, concurrency: int
    ) -> None:
        self.id, self.kind, self.capacity, self.engine = node_id, kind, capacity, engine
        self.slots = asyncio.Semaphore(concurrency)  # the agent's threads for Docker calls
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
        self._engine: Engine | None = None

    def add_node(self, node_id: str, kind: str, capacity: Resources) -> str:
        if self.shared_engine:
            self._engine = self._engine or Engine()
            engine = self._engine
        else:
            engine = Engine()
        self.nodes[node_id] = SimNode(
            node_id, kind, capacity, engine, self.profile.engine_concurrency
        )
        return f"{URL_SCHEME}{node_id}"

    async def start(self) -> None:
        """Nothing to open: the gateway interface."""

    async def close(self) -> None:
        """Nothing to close: the gateway interface."""

    def _load(self, engine: Engine) -> int:
        if not self.profile.contended:
            return 0
        return engine.load(asyncio.get_running_loop().time())

    async def _take(self, op: str, node: SimNode) -> None:
        """An engine operation, counted as under way while it runs."""
        engine = node.engine
        took = self.profile.draw(op, self.rng, self._load(engine))
        engine.running += 1
        try:
            await asyncio.sleep(took)
        finally:
            engine.running -= 1

    async def _engine_op(self, node: SimNode, op: str) -> None:
        async with node.slots:
            await self._take(op, node)

    def exec_window(self, node_id: str, start_s: float, end_s: float) -> None:
        """An exec on `node_id` keeps its engine busy from `start_s` to `end_s`; counted
        only when the profile says that load matters."""
        if self.profile.contended:
            self.nodes[node_id].engine.exec_window(start_s, end_s)

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
        if self.profile.contended:
            # what the same tick started (the refill a claim makes) is under way first
            await asyncio.sleep(0)
        # not an engine operation: the agent's HTTP call and on-disk record, slowed by
        # what the engine runs meanwhile
        await asyncio.sleep(self.profile.draw("lease", self.rng, self._load(node.engine)))
        if sb.state == S.PAUSED:
            await self._take("unpause", node)
        elif sb.state == S.HIBERNATED:
            if not (node.used + sb.needs).fits_in(node.capacity):
                return CallResult(False, 409, "no_capacity", "no room to restore")
            node.occupy(sb.needs, +1)
            await self._engine_op(node, "restore")
        sb.state = S.LEASED
        return CallResult(True, 200, "ok", "")

    async def _pause(self, node: SimNode, sb: SimSandbox) -> CallResult:
        await self._take("pause", node)
        sb.state = S.LEASED_PAUSED if sb.state == S.LEASED else S.PAUSED
        return CallResult(True, 200, "ok", "")

    async def _unpause(self, node: SimNode, sb: SimSandbox) -> CallResult:
        await self._take("unpause", node)
        sb.state = S.LEASED if sb.state == S.LEASED_PAUSED else S.WARM
        return CallResult(True, 200, "ok", "")

    async def thaw_for_exec(self, node_id: str, sandbox_id: str) -> bool:
        """What the agent does on an exec into a frozen lease; True if it had to thaw."""
        sb = self.nodes[node_id].sandboxes.get(sandbox_id)
        if sb is None or sb.state != S.LEASED_PAUSED:
            return False
        await self._take("unpause", self.nodes[node_id])
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
