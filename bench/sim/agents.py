"""Simulated agents: the calls the control plane makes, answered in virtual time.

`SimAgents` implements the control plane's agent interface
(`controlplane.agents.AgentClient`: create, lease, pause, unpause, hibernate,
destroy, reset) with the same results as live agents, including an agent's refusal when a
node is full, and heartbeats each node's report into the same path live reports take
(`Scheduler.on_report`). Durations are drawn from a profile; creates, removes and
snapshots queue for the node's agent, which runs a few at a time (its lifecycle
threads). Faults can be injected for tests: a node that fails or refuses calls, lacks
an image, or stops answering altogether.

Each node's machine runs one Docker engine, which counts what it runs: operations
and the start of every exec (the part of an exec that is the engine's work). With a
profile measured under load, an operation, and the agent's lease call, take as long
as they did with as many others running on the machine: on shared cores, each waits
for CPU behind the others. With `shared_engine`, every node is on one machine with
one engine, as the local multi-node pool is.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import heapq
import logging
import math
import random
from collections import Counter, deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from agent.engine import CREATES, CreateLimit, EngineQueue, SharedCreates, Work
from agent.report import ReportSequence
from bench.sim.profile import Profile
from controlplane.agents import OK, AgentAddress, CallResult
from dsec.models import (
    Capacity,
    CreateSandbox,
    LeaseEnd,
    LeaseGrant,
    NodeReport,
    ReportAck,
    ResetSandbox,
    SandboxRow,
    SnapshotMade,
    Usage,
)
from dsec.policy import Resources
from dsec.states import ASSIGNED, HIBERNATED_FROM, PAUSED_FROM, THAWED_FROM
from dsec.states import SandboxState as S

log = logging.getLogger(__name__)

URL_SCHEME = "sim://"
# sandbox reports the simulated agents make per simulated second, at the most
REPORTED_PER_S = 1000
# what a live agent says when its node lacks the template's image
IMAGE_MISSING = "docker_image_not_found"
# what of a SimSandbox its heartbeat row is made from, that changes
_ROW_FROM = frozenset(("state", "lease", "busy_s", "busy_until", "frozen_at"))


class RowChanges:
    """What a node's next heartbeat looks at: the sandboxes whose rows may have changed
    since its last, and those gone since. A heartbeat then costs what changed, not what
    the node holds (at DSec's scale, 2,400 sandboxes a node)."""

    def __init__(self) -> None:
        self._changed: dict[str, int] = {}  # sandbox id -> its place on the node
        self._command_ends: list[tuple[float, str, int]] = []  # (when, sandbox id, place)
        self._gone: list[str] = []

    def changed(self, sandbox_id: str, place: int) -> None:
        self._changed[sandbox_id] = place

    def changes_at(self, at: float, sandbox_id: str, place: int) -> None:
        """Its row changes by itself at `at`: its last command ends then."""
        heapq.heappush(self._command_ends, (at, sandbox_id, place))

    def gone(self, sandbox_id: str) -> None:
        self._gone.append(sandbox_id)

    def take(self, now: float, present: dict[str, SimSandbox]) -> tuple[list[str], list[str]]:
        """The ids of the sandboxes of `present` to report on at `now`, in the order the
        node made them (the order a report of every one lists them in), and those gone
        since the last report; both start afresh."""
        ends = self._command_ends
        while ends and ends[0][0] <= now:
            _, sandbox_id, place = heapq.heappop(ends)
            self._changed[sandbox_id] = place
        changed = sorted((i for i in self._changed if i in present), key=self._changed.__getitem__)
        gone = [i for i in dict.fromkeys(self._gone) if i not in present]
        self._changed, self._gone = {}, []
        return changed, gone


@dataclass
class SimSandbox:
    state: S
    needs: Resources
    spec: CreateSandbox
    created_at: float
    # its node's next heartbeat looks at it whenever what its row is made from changes
    changes: RowChanges = field(repr=False, compare=False)
    place: int  # made on its node after `place` others
    lease: LeaseGrant | None = None
    busy_s: float = 0.0  # commands run, all time (played ahead: may end in the future)
    busy_until: float = 0.0  # when its last command ends
    frozen_at: float | None = None  # when it was first frozen
    _row: SandboxRow | None = None  # its last row, until what it was made from changes

    def __setattr__(self, name: str, value: object) -> None:
        if name in _ROW_FROM:
            object.__setattr__(self, "_row", None)
            changes = self.__dict__.get("changes")
            if changes is not None:  # None while it is being made
                changes.changed(self.spec.sandbox_id, self.place)
        object.__setattr__(self, name, value)

    def leased(self, grant: LeaseGrant | None) -> None:
        """Given to a lease, or back from one (None: recycled into the warm pool)."""
        self.lease = grant

    def row(self, now: float) -> SandboxRow:
        """What its agent's heartbeat says of it (agent/report.py, sandbox_row). Made anew
        only when it changes: the report sequence then finds it unchanged at once."""
        row = self._row
        if row is not None and (row.active_at is not None or self.busy_until > now):
            return row  # nothing changed, nor has a command running then ended since
        active_at = None if self.busy_until > now else self.busy_until
        if active_at is None:  # its row changes by itself once its last command ends
            self.changes.changes_at(self.busy_until, self.spec.sandbox_id, self.place)
        lease = self.lease
        self._row = row = SandboxRow(
            id=self.spec.sandbox_id,
            pool=lease.pool if lease else self.spec.pool,
            template=self.spec.template.name,
            state=self.state,
            created_at=self.created_at,
            cpus=self.needs.cpus,
            memory_mb=self.needs.memory_mb,
            lease_id=lease.lease_id if lease else None,
            idempotency_key=lease.idempotency_key if lease else None,
            owner=lease.owner if lease else None,
            busy_s=self.busy_s,
            active_at=active_at,
            frozen_at=self.frozen_at,
            grant_proof=lease.grant_proof if lease else None,
        )
        return row


class Job:
    """Something under way on an engine: work left in seconds alone, done at what speed."""

    __slots__ = ("op", "counts", "left", "work", "speed", "done")

    def __init__(self, op: str, counts: bool, left: float, done: asyncio.Future) -> None:
        self.op, self.counts, self.left, self.done = op, counts, left, done
        self.work = left  # all of it, alone: 1 / work is its rate of completion at speed 1
        self.speed = 1.0


class Engine:
    """One machine's Docker engine, its cores shared out among what it runs.

    Jobs (operations, and lease calls, which do not count as engine load) go at the
    speed the profile measured for the load of the moment. Commands in sandboxes are
    load too, as windows of time given in advance: an exec's start (the engine's part
    of it) at the profile's `exec_weight`, and a command in flight, whatever it runs,
    at its `command_weight` (the agent's and the client's share of the machine).
    Whenever the load changes, every job's work left is brought up to date and its
    speed set anew: processor sharing, with the measured slowdowns.

    The engine is also one throughput (the profile's `engine_rates_per_s`): an
    operation of a measured rate uses 1 / rate of an engine-second. An engine exec's
    start (not a command handed to a sandbox's loop) is work too when execs have a
    rate: 1 / rate of the whole engine's, which nobody waits for (its command's window
    was given in advance and does not stretch) but which the engine must still do.
    When what runs asks for more than one engine-second a second, every job goes
    slower in the same proportion, as the machine's cores share out, so the engine's
    work is conserved. Without it, a machine asked for more creates, removes and execs
    a second than it completes would seem to keep up (a trace's busiest two minutes,
    8 episodes a second of 3.4 execs each, took 6 minutes live, and nearly as long
    with no pool, on the engine alone)."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self.running = 0  # jobs that count as load
        # in the order they started (a dict, not a set of objects hashed by address: jobs
        # that end together end in that order, and their speeds add up in it, every run)
        self.jobs: dict[Job, None] = {}
        # windows of load as a heap of (time, change, kind): kind 0 an exec's start
        # through the sandbox's command loop, 1 a command in flight, 2 an exec's start
        # that the engine does (load as kind 0, and work); in_windows[kind] is how many
        # are open
        self._edges: list[tuple[float, int, int]] = []
        self._weights = (profile.exec_weight, profile.command_weight)
        self.in_windows = [0, 0, 0]
        self._rates = profile.engine_rates_per_s
        # the engine's work of one exec start, in seconds of the whole engine (0: none)
        self._exec_work = 1.0 / self._rates["exec"] if "exec" in self._rates else 0.0
        # exec starts under way: all of one size and one speed, so they end in the order
        # they started, and an overloaded engine's hundreds cost one sum, not one each.
        # Each is kept as the mark of `exec_done` (what each has done since the engine
        # began) at which it ends
        self.execs: deque[float] = deque()
        self.exec_done = 0.0
        self._exec_speed = 1.0
        self._last = 0.0  # when the jobs' work left was last brought up to date
        self._wakeup: asyncio.TimerHandle | None = None

    def exec_window(self, start_s: float, end_s: float, by_engine: bool = True) -> None:
        """An exec's start, from `start_s` (now or later) to `end_s`: an engine exec, or
        (not `by_engine`) a command handed to the sandbox's command loop."""
        self._window(start_s, end_s, 2 if by_engine else 0)

    def command_window(self, start_s: float, end_s: float) -> None:
        """A command in a sandbox, from `start_s` (now or later) to `end_s`."""
        if self._weights[1]:
            self._window(start_s, end_s, 1)

    def _window(self, start_s: float, end_s: float, kind: int) -> None:
        heapq.heappush(self._edges, (start_s, 1, kind))
        heapq.heappush(self._edges, (end_s, -1, kind))
        if self.jobs or self._exec_work:
            self._schedule(asyncio.get_running_loop())

    def load(self, now: float) -> float:
        """How many operations run at `now` (which never goes back), with what runs in
        sandboxes at its weight."""
        self._catch_up(now)
        return self._load()

    def _load(self) -> float:
        looped, commands, engine_execs = self.in_windows
        return (
            self.running + self._weights[0] * (looped + engine_execs) + self._weights[1] * commands
        )

    async def run(
        self, op: str, rng: random.Random, counts: bool = True, engine_work: bool = True
    ) -> None:
        """Do `op`: its measured duration under the load at its start, stretched or
        shrunk as the load changes while it runs. Without `engine_work`, it takes no
        share of the engine's throughput: what the agent does from the host in an
        operation's time."""
        loop = asyncio.get_running_loop()
        load = self.load(loop.time())
        took = self.profile.draw(op, rng, load)
        left = took / self.profile.slowdown(op, self.profile.measured_load(op, load))
        job = Job(op, counts, left, loop.create_future())
        if not engine_work:
            job.work = 0.0  # (none of the engine's rates: see _set_speeds)
        self.jobs[job] = None
        self.running += counts
        self._schedule(loop)
        try:
            await job.done
        finally:
            if job in self.jobs:  # cancelled: it stops taking its share
                self._leave(job)
                self._schedule(loop)

    def _leave(self, job: Job) -> None:
        self.jobs.pop(job, None)
        self.running -= job.counts

    def _catch_up(self, now: float) -> None:
        """Bring every job's work left up to `now`, window edge by window edge."""
        edges = self._edges
        while edges and edges[0][0] <= now:
            at, change, kind = heapq.heappop(edges)
            self._advance(at)
            self.in_windows[kind] += change
            if kind == 2 and change > 0 and self._exec_work:
                self.execs.append(self.exec_done + self._exec_work)
            if self.jobs or self.execs:
                self._set_speeds()
        self._advance(now)

    def _advance(self, until: float) -> None:
        elapsed = until - self._last
        if elapsed > 0:
            for job in self.jobs:
                job.left -= elapsed * job.speed
            self.exec_done += elapsed * self._exec_speed
        self._last = max(self._last, until)

    def _set_speeds(self) -> None:
        load = self._load()
        for job in self.jobs:
            job.speed = 1.0 / self.profile.slowdown(job.op, load - job.counts)
        rates = self._rates
        if rates:
            # an exec start is 1 / rate of work: at speed s, it asks for s engine-seconds
            exec_speed = 1.0 / self.profile.slowdown("exec", load)
            # engine-seconds a second asked for: past one, everything goes slower alike
            demand = len(self.execs) * exec_speed + sum(
                job.speed / job.work / rates[job.op]
                for job in self.jobs
                if job.op in rates and job.work > 0
            )
            if demand > 1.0:
                for job in self.jobs:
                    job.speed /= demand
                exec_speed /= demand
            self._exec_speed = exec_speed

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        """Wake at the next job's end or the next change of exec load, whichever first."""
        now = loop.time()
        self._catch_up(now)
        self._set_speeds()
        if self._wakeup is not None:
            self._wakeup.cancel()
            self._wakeup = None
        if not self.jobs and not self.execs and not (self._exec_work and self._edges):
            return
        at = min((now + max(0.0, job.left) / job.speed for job in self.jobs), default=math.inf)
        if self.execs:
            at = min(at, now + max(0.0, self.execs[0] - self.exec_done) / self._exec_speed)
        if self._edges:
            at = min(at, self._edges[0][0])
        self._wakeup = loop.call_at(max(now, at), self._wake, loop)

    def _wake(self, loop: asyncio.AbstractEventLoop) -> None:
        self._wakeup = None
        self._catch_up(loop.time())
        for job in [j for j in self.jobs if j.left <= 1e-9]:
            self._leave(job)
            job.done.set_result(None)
        while self.execs and self.execs[0] <= self.exec_done + 1e-9:
            self.execs.popleft()
        self._schedule(loop)


class SimNode:
    def __init__(
        self,
        node_id: str,
        kind: str,
        capacity: Resources,
        images: set[str],
        engine: Engine,
        concurrency: int,
    ) -> None:
        self.id, self.kind, self.capacity, self.engine = node_id, kind, capacity, engine
        self.images = images
        # the agent's engine queue, in the live agent's order, its creates bounded by the
        # limit it measures as live (agent/docker_driver.py: AsyncDocker)
        self.queue = EngineQueue(
            concurrency, CreateLimit(), lambda: asyncio.get_event_loop().time()
        )
        self.sandboxes: dict[str, SimSandbox] = {}
        self.used = Resources()
        self.down = False  # unreachable: calls fail, heartbeats stop
        self.reports = ReportSequence()  # its agent's heartbeats: deltas, as live
        self.row_changes = RowChanges()  # what its next heartbeat looks at
        self.made = 0  # sandboxes made on it so far
        # op -> results to answer instead of doing it, first first (injected faults)
        self.faults: dict[str, list[CallResult]] = {}
        # the creates its engine runs at once, shared with the nodes on the same engine
        self.engine_wide: SharedCreates | None = None

    def occupy(self, needs: Resources, sign: int) -> None:
        self.used = Resources(
            self.used.cpus + sign * needs.cpus,
            self.used.memory_mb + sign * needs.memory_mb,
            self.used.slots + sign * needs.slots,
        )

    def remove(self, sandbox_id: str) -> None:
        """The sandbox is gone from the node (removed, or lost with its engine): its
        next heartbeat says so."""
        self.sandboxes.pop(sandbox_id, None)
        self.row_changes.gone(sandbox_id)

    def fault(self, op: str) -> CallResult | None:
        if self.down:
            return CallResult(False, 0, "unreachable", f"node {self.id} does not answer")
        queued = self.faults.get(op)
        return queued.pop(0) if queued else None


@dataclass
class SimAgents:
    """The agents of a simulated cluster, behind the control plane's agent interface."""

    profile: Profile
    rng: random.Random
    shared_engine: bool
    nodes: dict[str, SimNode] = field(default_factory=dict)
    background: set[asyncio.Task] = field(default_factory=set)  # removals under way
    # told of every sandbox made ready (created, thawed, reset) and how long that took:
    # the simulator's control plane decides on it that much sooner (bench/sim/ticks.py)
    on_ready: Callable[[float], None] | None = None
    _engine: Engine | None = None
    _engine_wide: SharedCreates | None = None
    # what the engines were asked to do, in the actions Docker's own event stream names
    # (create, start, die, destroy, pause, unpause, commit, exec_start), to compare with
    # a live run's (bench/fidelity.py)
    engine_events: Counter[str] = field(default_factory=Counter)

    def add_node(self, node_id: str, kind: str, capacity: Resources, images: set[str]) -> SimNode:
        engine_wide = None
        if self.shared_engine:
            self._engine = self._engine or Engine(self.profile)
            engine = self._engine
            # its agents share the bound on the engine's creates, as live
            # (agent/engine.py EngineWideCreates)
            self._engine_wide = self._engine_wide or SharedCreates()
            engine_wide = self._engine_wide
        else:
            engine = Engine(self.profile)
        node = self.nodes[node_id] = SimNode(
            node_id, kind, capacity, set(images), engine, self.profile.engine_concurrency
        )
        node.engine_wide = engine_wide
        return node

    def inject(self, node_id: str, op: str, result: CallResult, times: int = 1) -> None:
        """The next `times` calls of `op` (create, lease, pause, unpause, hibernate, reset,
        destroy) on the node answer `result` and do nothing."""
        self.nodes[node_id].faults.setdefault(op, []).extend([result] * times)

    # --- heartbeats -------------------------------------------------------------

    def report(self, node_id: str, now: float) -> NodeReport:
        """The node's next heartbeat, as its live agent would send it (agent/report.py)."""
        node = self.nodes[node_id]
        cap = node.capacity
        changed, gone = node.row_changes.take(now, node.sandboxes)
        part = node.reports.next_changes([node.sandboxes[i].row(now) for i in changed], gone)
        return NodeReport.model_construct(
            node_id=node.id,
            kind=node.kind,
            url=f"{URL_SCHEME}{node.id}",
            capacity=Capacity.model_construct(
                cpus=cap.cpus, memory_mb=cap.memory_mb, slots=cap.slots
            ),
            usage=Usage.model_construct(
                cpus=node.used.cpus, memory_mb=node.used.memory_mb, slots=node.used.slots
            ),
            images=sorted(node.images),
            incarnation="sim",
            engine_ok=True,
            create_limit=node.queue.creates.limit,
            # nodes of one engine (shared_engine) say the same, as live agents do
            engine_id=f"sim-engine-{id(node.engine):x}",
            clock=now,
            seq=part.seq,
            base=part.base,
            sandboxes=part.sandboxes,
            removed=part.removed,
        )

    def heartbeat(
        self, node: SimNode, deliver: Callable[[NodeReport], ReportAck], now: float
    ) -> None:
        """One heartbeat of `node`, and a full report at once if the control plane cannot
        apply the delta (it restarted), as a live agent does."""
        try:
            report = self.report(node.id, now)
            ack = deliver(report)
            node.reports.acknowledged(ack)
            if ack.full_report and report.base is not None:
                node.reports.acknowledged(deliver(self.report(node.id, now)))
        except Exception:  # a live agent's heartbeat would get a 500, and go on
            log.exception("the report of %s failed", node.id)
            node.reports.refused()

    async def heartbeat_forever(
        self, deliver: Callable[[NodeReport], ReportAck], every_s: float, at_most_s: float
    ) -> None:
        """Every node that answers reports every `every_s` (as `dsec agent` does), or
        less often when the cluster holds more sandboxes than REPORTED_PER_S reports a
        second carry: at DSec's scale a report every second would cost more than all the
        rest of the simulation, and what reports tell the policy (idle times for
        lease-idle freezing, minutes long) bears a few seconds' delay. Never less often
        than every `at_most_s`, well within the control plane's heartbeat timeout: past
        it, every node would be taken out of placement for silence (at 366,000 sandboxes
        the thinning alone made it 366 s, against a timeout of 60)."""
        loop = asyncio.get_running_loop()
        while True:
            sandboxes = sum(len(node.sandboxes) for node in self.nodes.values())
            for node in list(self.nodes.values()):
                if not node.down:
                    self.heartbeat(node, deliver, loop.time())
            await asyncio.sleep(min(at_most_s, max(every_s, sandboxes / REPORTED_PER_S)))

    # --- the agent interface ----------------------------------------------------

    async def start(self) -> None:
        """Nothing to open."""

    async def close(self) -> None:
        """Nothing to close."""

    async def _take(
        self, op: str, node: SimNode, counts: bool = True, engine_work: bool = True
    ) -> None:
        """`op` on the node's engine: under load, if the profile says load matters;
        `counts` says whether it is load for the others, `engine_work` whether it takes
        its share of the engine's throughput."""
        if self.profile.contended:
            await node.engine.run(op, self.rng, counts, engine_work)
        else:
            await asyncio.sleep(self.profile.draw(op, self.rng))

    async def _engine_op(self, node: SimNode, op: str, work: Work) -> None:
        engine_wide = contextlib.nullcontext()
        if work in CREATES and node.engine_wide is not None:
            engine_wide = node.engine_wide.slot(node.queue.creates.limit)
        async with node.queue.turn(work), engine_wide:
            started = asyncio.get_running_loop().time()
            await self._take(op, node)
            if work in CREATES:
                took = asyncio.get_running_loop().time() - started
                node.queue.creates.observe(took, node.queue.creating())

    def _node(self, address: AgentAddress, op: str) -> SimNode | CallResult:
        """The node a call goes to, or the answer its agent gives instead (it is down or
        unknown, or a fault was injected for `op`)."""
        node = self.nodes.get(address.id)
        if node is None:
            return CallResult(False, 0, "unreachable", f"no node {address.id}")
        return node.fault(op) or node

    async def _on_sandbox(
        self, address: AgentAddress, op: str, sandbox_id: str, *args
    ) -> CallResult:
        """Do `op` (the method `_<op>`) on a sandbox of the node, or answer as its agent
        would when it cannot."""
        node = self._node(address, op)
        if isinstance(node, CallResult):
            return node
        sb = node.sandboxes.get(sandbox_id)
        if sb is None:
            return CallResult(False, 404, "unknown_sandbox", f"no sandbox {sandbox_id}")
        return await getattr(self, f"_{op}")(node, sandbox_id, sb, *args)

    async def lease(self, address: AgentAddress, sandbox_id: str, grant: LeaseGrant) -> CallResult:
        return await self._on_sandbox(address, "lease", sandbox_id, grant)

    async def pause(self, address: AgentAddress, sandbox_id: str) -> CallResult:
        return await self._on_sandbox(address, "pause", sandbox_id)

    async def unpause(self, address: AgentAddress, sandbox_id: str) -> CallResult:
        return await self._on_sandbox(address, "unpause", sandbox_id)

    async def hibernate(self, address: AgentAddress, sandbox_id: str) -> CallResult:
        return await self._on_sandbox(address, "hibernate", sandbox_id)

    async def destroy(
        self, address: AgentAddress, sandbox_id: str, ended: LeaseEnd = "released"
    ) -> CallResult:
        return await self._on_sandbox(address, "destroy", sandbox_id)

    async def reset(self, address: AgentAddress, sandbox_id: str, req: ResetSandbox) -> CallResult:
        return await self._on_sandbox(address, "reset", sandbox_id, req)

    async def snapshot(self, address: AgentAddress, sandbox_id: str) -> CallResult:
        return await self._on_sandbox(address, "snapshot", sandbox_id)

    async def drop_snapshot(self, address: AgentAddress, snapshot_id: str) -> CallResult:
        return OK

    async def _snapshot(self, node: SimNode, sandbox_id: str, sb: SimSandbox) -> CallResult:
        """A fork's copy: the simulator holds no files, so an empty one, at the cost of
        the agent's own work on a call (as a lease's)."""
        await self._take("lease", node, counts=False)
        made = SnapshotMade(
            snapshot=hashlib.md5(sandbox_id.encode()).hexdigest(),
            token="0" * 64,
            roots=[sb.spec.template.workdir, "/tmp"],
            bytes=0,
        )
        return CallResult(True, 201, "ok", "", answer=made.model_dump())

    async def create(self, address: AgentAddress, spec: CreateSandbox) -> CallResult:
        node = self._node(address, "create")
        if isinstance(node, CallResult):
            return node
        if spec.sandbox_id in node.sandboxes:
            return OK
        if spec.template.image not in node.images:
            return CallResult(False, 422, IMAGE_MISSING, f"no image {spec.template.image}")
        needs = Resources(spec.template.cpus, spec.template.memory_limit_mb, 1)
        if not (node.used + needs).fits_in(node.capacity):
            return CallResult(False, 409, "no_capacity", f"node {node.id} is full")
        loop = asyncio.get_running_loop()
        sb = node.sandboxes[spec.sandbox_id] = SimSandbox(
            S.CREATING, needs, spec, loop.time(), node.row_changes, node.made,
            busy_until=loop.time(),
        )  # fmt: skip
        node.made += 1
        node.occupy(needs, +1)
        work = Work.CREATE_FOR_REQUEST if spec.for_request else Work.CREATE_WARM
        await self._engine_op(node, "create", work)
        self.engine_events.update(("create", "start"))
        sb.state = S.WARM
        self._ready(sb.created_at)
        return CallResult(True, 201, "ok", "")

    def _ready(self, since: float) -> None:
        if self.on_ready is not None:
            self.on_ready(asyncio.get_running_loop().time() - since)

    async def _lease(
        self, node: SimNode, sandbox_id: str, sb: SimSandbox, grant: LeaseGrant
    ) -> CallResult:
        if self.profile.contended:
            # what the same tick started (the refill a claim makes) is under way first
            await asyncio.sleep(0)
        # not an engine operation: the agent's HTTP call and on-disk record, slowed by
        # what the engine runs meanwhile
        await self._take("lease", node, counts=False)
        if sb.state == S.PAUSED:
            await self._unpause_container(node)
        elif sb.state == S.HIBERNATED:
            if not (node.used + sb.needs).fits_in(node.capacity):
                return CallResult(False, 409, "no_capacity", "no room to restore")
            node.occupy(sb.needs, +1)
            await self._engine_op(node, "restore", Work.CLIENT)
            self.engine_events.update(("create", "start"))
        sb.state, sb.frozen_at = S.LEASED, None
        sb.leased(grant)
        sb.busy_until = max(sb.busy_until, asyncio.get_running_loop().time())
        return OK

    async def _pause(self, node: SimNode, sandbox_id: str, sb: SimSandbox) -> CallResult:
        await self._take("pause", node)
        self.engine_events["pause"] += 1
        if sb.state in PAUSED_FROM:
            sb.state = PAUSED_FROM[sb.state]
            sb.frozen_at = asyncio.get_running_loop().time()
        return OK

    async def _unpause(self, node: SimNode, sandbox_id: str, sb: SimSandbox) -> CallResult:
        started = asyncio.get_running_loop().time()
        await self._unpause_container(node)
        if sb.state in THAWED_FROM:
            sb.state, sb.frozen_at = THAWED_FROM[sb.state], None
        self._ready(started)
        return OK

    async def _hibernate(self, node: SimNode, sandbox_id: str, sb: SimSandbox) -> CallResult:
        if sb.state not in HIBERNATED_FROM:
            return CallResult(False, 409, "not_paused", f"sandbox {sandbox_id} is {sb.state}")
        await self._engine_op(node, "commit", Work.FREEZE)
        await self._engine_op(node, "remove", Work.FREEZE)
        self.engine_events.update(("commit", "die", "destroy"))
        sb.state = HIBERNATED_FROM[sb.state]
        node.occupy(sb.needs, -1)  # memory released: the files stay on disk
        return OK

    async def _reset(
        self, node: SimNode, sandbox_id: str, sb: SimSandbox, req: ResetSandbox
    ) -> CallResult:
        """As the live agent: a frozen lease thawed, then the reset, done from the host
        (agent/host.py reset_from_host: no engine exec, and no load on the engine), in
        about one exec's time."""
        if sb.lease is None and sb.state == S.WARM:
            return OK  # a retry of a reset that is done
        if sb.lease is None or sb.lease.lease_id != req.lease_id or sb.state not in ASSIGNED:
            return CallResult(False, 409, "lease_mismatch", f"{sandbox_id} is not that lease's")
        started = asyncio.get_running_loop().time()
        if sb.state == S.LEASED_PAUSED:
            await self._unpause_container(node)
        await self._take("exec", node, counts=False, engine_work=False)
        sb.state, sb.frozen_at = S.WARM, None
        sb.leased(None)
        sb.busy_until = max(sb.busy_until, asyncio.get_running_loop().time())
        self._ready(started)
        return OK

    async def _destroy(self, node: SimNode, sandbox_id: str, sb: SimSandbox) -> CallResult:
        """As the live agent: a kill at once (about a pause's cost: a signal through the
        same runtime), the slot freed, the container removed when the engine is quiet."""
        if sb.state != S.HIBERNATED:
            await self._take("pause", node)
            self.engine_events["die"] += 1  # killed from the host: the engine sees it end
            node.occupy(sb.needs, -1)
            self._later(self._removal(node))
        node.remove(sandbox_id)
        return CallResult(True, 200, "ok", "", busy_s=sb.busy_s)

    async def _unpause_container(self, node: SimNode) -> None:
        await self._take("unpause", node)
        self.engine_events["unpause"] += 1

    async def _removal(self, node: SimNode) -> None:
        await self._engine_op(node, "remove", Work.REMOVE)
        self.engine_events["destroy"] += 1

    def _later(self, work: Coroutine[Any, Any, None]) -> None:
        """Engine work nobody waits for; the simulation cancels what is left at its end."""
        task = asyncio.ensure_future(work)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    # --- what clients do in their sandboxes -------------------------------------

    def run_command(
        self, node_id: str, sandbox_id: str, start_s: float, engine_s: float, took_s: float
    ) -> None:
        """One command from `start_s`: see run_commands."""
        self.run_commands(node_id, sandbox_id, start_s, [0.0], [engine_s], [took_s])

    def run_commands(
        self,
        node_id: str,
        sandbox_id: str,
        start_s: float,
        thinks: list[float],
        engine_s: list[float],
        took: list[float],
    ) -> float:
        """Commands in a sandbox from `start_s`, one after another, each after its think:
        the i-th takes took[i], its first engine_s[i] the engine's work (counted as load
        only when the profile says load matters). Returns how long they all take."""
        node = self.nodes[node_id]
        sb = node.sandboxes.get(sandbox_id)
        # every container boots its command loop (agent/resident.py: boot_script), so a
        # sandbox's commands are the loop's; one gone meanwhile is the engine's to refuse
        by_engine = sb is None
        if by_engine:
            self.engine_events["exec_start"] += len(took)
        if self.profile.contended:
            at = start_s
            for think, engine, command in zip(thinks, engine_s, took, strict=True):
                at += think
                node.engine.exec_window(at, at + engine, by_engine)
                node.engine.command_window(at, at + command)
                at += command
        busy_s = sum(took)
        duration = sum(thinks) + busy_s
        if sb is not None:
            sb.busy_s += busy_s
            sb.busy_until = max(sb.busy_until, start_s + duration)
        return duration

    async def thaw_for_exec(self, node_id: str, sandbox_id: str) -> bool:
        """What the agent does on an exec into a frozen lease; True if it had to thaw."""
        node = self.nodes[node_id]
        sb = node.sandboxes.get(sandbox_id)
        if sb is None or sb.state != S.LEASED_PAUSED:
            return False
        await self._unpause_container(node)
        sb.state, sb.frozen_at = S.LEASED, None
        return True
