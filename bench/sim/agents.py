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


class Job:
    """Something under way on an engine: work left in seconds alone, done at what speed."""

    __slots__ = ("op", "counts", "left", "speed", "done")

    def __init__(self, op: str, counts: bool, left: float, done: asyncio.Future) -> None:
        self.op, self.counts, self.left, self.done = op, counts, left, done
        self.speed = 1.0


class Engine:
    """One machine's Docker engine, its cores shared out among what it runs.

    Jobs (operations, and lease calls, which do not count as engine load) go at the
    speed the profile measured for the load of the moment; exec starts are load too,
    as windows of time given in advance. Whenever the load changes, every job's work
    left is brought up to date and its speed set anew: processor sharing, with the
    measured slowdowns."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self.running = 0  # jobs that count as load
        self.jobs: set[Job] = set()
        # exec starts, as two heaps of times: those started minus those ended is what runs
        self._exec_starts: list[float] = []
        self._exec_ends: list[float] = []
        self._execs = 0
        self._last = 0.0  # when the jobs' work left was last brought up to date
        self._wakeup: asyncio.TimerHandle | None = None

    def exec_window(self, start_s: float, end_s: float) -> None:
        """An exec's engine work, from `start_s` (now or later) to `end_s`."""
        heapq.heappush(self._exec_starts, start_s)
        heapq.heappush(self._exec_ends, end_s)
        if self.jobs:
            self._schedule(asyncio.get_running_loop())

    def load(self, now: float) -> float:
        """How many operations run at `now` (which never goes back), exec starts counted
        at the profile's weight."""
        self._catch_up(now)
        return self.running + self.profile.exec_weight * self._execs

    async def run(self, op: str, rng: random.Random, counts: bool = True) -> None:
        """Do `op`: its measured duration under the load at its start, stretched or
        shrunk as the load changes while it runs."""
        loop = asyncio.get_running_loop()
        load = self.load(loop.time())
        took = self.profile.draw(op, rng, load)
        left = took / self.profile.slowdown(op, self.profile.measured_load(op, load))
        job = Job(op, counts, left, loop.create_future())
        self.jobs.add(job)
        self.running += counts
        self._schedule(loop)
        try:
            await job.done
        finally:
            if job in self.jobs:  # cancelled: it stops taking its share
                self._leave(job)
                self._schedule(loop)

    def _leave(self, job: Job) -> None:
        self.jobs.discard(job)
        self.running -= job.counts

    def _catch_up(self, now: float) -> None:
        """Bring every job's work left up to `now`, exec window by exec window."""
        while True:
            starts, ends = self._exec_starts, self._exec_ends
            edge = min(starts[0] if starts else now, ends[0] if ends else now, now)
            self._advance(edge)
            if edge == now:
                break
            if starts and starts[0] == edge:
                heapq.heappop(starts)
                self._execs += 1
            else:
                heapq.heappop(ends)
                self._execs -= 1
            self._set_speeds()
        while self._exec_starts and self._exec_starts[0] <= now:
            heapq.heappop(self._exec_starts)
            self._execs += 1
        while self._exec_ends and self._exec_ends[0] <= now:
            heapq.heappop(self._exec_ends)
            self._execs -= 1

    def _advance(self, until: float) -> None:
        elapsed = until - self._last
        if elapsed > 0:
            for job in self.jobs:
                job.left -= elapsed * job.speed
        self._last = max(self._last, until)

    def _set_speeds(self) -> None:
        load = self.running + self.profile.exec_weight * self._execs
        for job in self.jobs:
            job.speed = 1.0 / self.profile.slowdown(job.op, load - job.counts)

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        """Wake at the next job's end or the next change of exec load, whichever first."""
        now = loop.time()
        self._catch_up(now)
        self._set_speeds()
        if self._wakeup is not None:
            self._wakeup.cancel()
            self._wakeup = None
        if not self.jobs:
            return
        at = min(now + max(0.0, job.left) / job.speed for job in self.jobs)
        for edges in (self._exec_starts, self._exec_ends):
            if edges:
                at = min(at, edges[0])
        self._wakeup = loop.call_at(max(now, at), self._wake, loop)

    def _wake(self, loop: asyncio.AbstractEventLoop) -> None:
        self._wakeup = None
        self._catch_up(loop.time())
        for job in [j for j in self.jobs if j.left <= 1e-9]:
            self._leave(job)
            job.done.set_result(None)
        self._schedule(loop)


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
            self._engine = self._engine or Engine(self.profile)
            engine = self._engine
        else:
            engine = Engine(self.profile)
        self.nodes[node_id] = SimNode(
            node_id, kind, capacity, engine, self.profile.engine_concurrency
        )
        return f"{URL_SCHEME}{node_id}"

    async def start(self) -> None:
        """Nothing to open: the gateway interface."""

    async def close(self) -> None:
        """Nothing to close: the gateway interface."""

    async def _take(self, op: str, node: SimNode, counts: bool = True) -> None:
        """`op` on the node's engine: under load, if the profile says load matters;
        `counts` says whether it is load for the others."""
        if self.profile.contended:
            await node.engine.run(op, self.rng, counts)
        else:
            await asyncio.sleep(self.profile.draw(op, self.rng))

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
        needs = Resources(body.template.cpus, body.template.memory_limit_mb, 1)
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
        await self._take("lease", node, counts=False)
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
