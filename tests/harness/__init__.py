"""The scheduler harness: the real control-plane scheduler against simulated agents, in
virtual time.

`Harness` builds the scheduler with `controlplane.scheduler.build_scheduler` (as the
HTTP app and the simulator do), hands it `bench.sim.agents.SimAgents` that heartbeat
through `Scheduler.on_report`, and runs a scenario on `bench.sim.loop`'s virtual-time
loop: a minute of waiting takes milliseconds, and a run is the same every time. Faults
are injected in the simulated agents (`inject`, `down`, a node without an image); a
control-plane restart builds a fresh scheduler on the same agents, which learns the
cluster back from their heartbeats.

What happened is kept for the assertions: `h.calls` is every call the control plane
made to an agent (op, node, sandbox, when it started and ended, its result), and
`h.decisions` every action the policy decided, with its time.

    def test_something():
        async def scenario(h: Harness) -> None:
            lease = await h.acquire()
            ...
        Harness(nodes=2).run(scenario)
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from bench.sim.agents import SimAgents
from bench.sim.loop import VirtualClock, VirtualTimeLoop
from bench.sim.profile import Profile
from controlplane.agents import AgentAddress, CallResult
from controlplane.config import ControlPlaneConfig
from controlplane.scheduler import Scheduler, build_scheduler
from dsec.image import BASE_IMAGE
from dsec.models import (
    AcquireRequest,
    CreateSandbox,
    Lease,
    LeaseEnd,
    LeaseGrant,
    PoolParams,
    PrewarmInfo,
    PrewarmRequest,
    ResetSandbox,
    TemplateSpec,
)
from dsec.policies import Policy, make_policy
from dsec.policy import Action, Resources, Snapshot
from dsec.states import SandboxState
from dsec.tokens import client_id

TOKEN = "harness-agent-token-0000"
ALICE, BOB = client_id("alice's token"), client_id("bob's token")  # two clients


@dataclass(frozen=True)
class Call:
    """One call the control plane made to an agent, and what it answered."""

    op: str  # create, lease, pause, unpause, hibernate, destroy, reset
    node: str
    sandbox_id: str
    started: float
    ended: float
    result: CallResult
    # what the call said besides the sandbox (a destroy: why it ended; a lease: the grant)
    args: tuple = ()


class RecordingAgents:
    """The simulated agents behind the agent interface, each call kept in `calls`."""

    def __init__(self, agents: SimAgents, clock: VirtualClock, calls: list[Call]) -> None:
        self.agents, self.clock, self.calls = agents, clock, calls

    async def start(self) -> None:
        await self.agents.start()

    async def close(self) -> None:
        await self.agents.close()

    async def _record(
        self, op: str, node: AgentAddress, sandbox_id: str, call, args: tuple = ()
    ) -> CallResult:
        started = self.clock.now()
        result = await call
        self.calls.append(Call(op, node.id, sandbox_id, started, self.clock.now(), result, args))
        return result

    async def create(self, node: AgentAddress, spec: CreateSandbox) -> CallResult:
        return await self._record("create", node, spec.sandbox_id, self.agents.create(node, spec))

    async def lease(self, node: AgentAddress, sandbox_id: str, grant: LeaseGrant) -> CallResult:
        call = self.agents.lease(node, sandbox_id, grant)
        return await self._record("lease", node, sandbox_id, call, (grant,))

    async def pause(self, node: AgentAddress, sandbox_id: str) -> CallResult:
        return await self._record("pause", node, sandbox_id, self.agents.pause(node, sandbox_id))

    async def unpause(self, node: AgentAddress, sandbox_id: str) -> CallResult:
        call = self.agents.unpause(node, sandbox_id)
        return await self._record("unpause", node, sandbox_id, call)

    async def hibernate(self, node: AgentAddress, sandbox_id: str) -> CallResult:
        call = self.agents.hibernate(node, sandbox_id)
        return await self._record("hibernate", node, sandbox_id, call)

    async def destroy(
        self, node: AgentAddress, sandbox_id: str, ended: LeaseEnd = "released"
    ) -> CallResult:
        call = self.agents.destroy(node, sandbox_id, ended)
        return await self._record("destroy", node, sandbox_id, call, (ended,))

    async def reset(self, node: AgentAddress, sandbox_id: str, req: ResetSandbox) -> CallResult:
        call = self.agents.reset(node, sandbox_id, req)
        return await self._record("reset", node, sandbox_id, call)


class RecordingPolicy:
    """A policy whose every decided action is kept in `decisions`, as (time, action)."""

    def __init__(self, policy: Policy, decisions: list[tuple[float, Action]]) -> None:
        self.policy, self.decisions = policy, decisions
        self.name = policy.name

    def decide(self, snapshot: Snapshot, pools: Mapping[str, PoolParams], now: float):
        actions = self.policy.decide(snapshot, pools, now)
        self.decisions.extend((now, a) for a in actions)
        return actions


class SimCloud:
    """A cloud provider whose nodes are simulated agents that boot after a delay."""

    def __init__(
        self, agents: SimAgents, max_nodes: int, slots: int, boot_s: float, idle_release_s: float
    ) -> None:
        self.agents, self.max_nodes, self.slots = agents, max_nodes, slots
        self.boot_s, self.idle_release_s = boot_s, idle_release_s
        self.starting: set[str] = set()
        self.started: list[str] = []
        self.stopped: list[str] = []

    def booting(self, registered: set[str]) -> int:
        return len(self.starting - registered)

    async def start_node(self) -> str:
        node_id = f"cloud-{len(self.started) + 1}"
        self.started.append(node_id)
        self.starting.add(node_id)
        await asyncio.sleep(self.boot_s)
        self.agents.add_node(node_id, "cloud", Resources(64.0, 1 << 20, self.slots), {BASE_IMAGE})
        return node_id  # its first heartbeat registers it

    async def stop_node(self, node_id: str) -> None:
        self.starting.discard(node_id)
        self.agents.nodes.pop(node_id, None)
        self.stopped.append(node_id)

    async def close(self) -> None:
        """Nothing to close."""


class Harness:
    def __init__(
        self,
        nodes: int = 2,
        slots: int = 10,
        *,
        pools: dict[str, PoolParams] | None = None,
        templates: dict[str, TemplateSpec] | None = None,
        policy: str = "dsec",
        heartbeat_s: float = 1.0,
        confirm_grace_s: float = 0.0,
        cloud_nodes: int = 0,
        cloud_boot_s: float = 5.0,
        cloud_idle_release_s: float = 60.0,
        state_dir: Path | None = None,
        seed: int = 0,
        **config,
    ) -> None:
        self.loop = VirtualTimeLoop()
        self.clock = VirtualClock(self.loop)
        self.config = ControlPlaneConfig(
            admin_tokens=[TOKEN],
            agent_token=TOKEN,
            pools=pools or {"default": PoolParams(min_warm=0)},
            **({"templates": templates} if templates else {}),
            policy=policy,
            state_dir=state_dir,
            **config,
        )
        self.heartbeat_s = heartbeat_s
        self.confirm_grace_s = confirm_grace_s
        self.agents = SimAgents(Profile.default(seed=seed), random.Random(seed), False)
        for i in range(nodes):
            self.add_node(f"node-{i + 1}", slots)
        self.cloud = (
            SimCloud(self.agents, cloud_nodes, slots, cloud_boot_s, cloud_idle_release_s)
            if cloud_nodes
            else None
        )
        self.calls: list[Call] = []  # every call to an agent, across restarts
        self.decisions: list[tuple[float, Action]] = []  # every action decided, with its time
        self.scheduler = self._build()
        self._tasks: list[asyncio.Task] = []

    def _build(self) -> Scheduler:
        # the reports are never late (the simulated agents' state at their instant), so
        # no grace unless a test asks for one
        return build_scheduler(
            self.config,
            RecordingAgents(self.agents, self.clock, self.calls),
            self.clock,
            cloud=self.cloud,
            policy=RecordingPolicy(make_policy(self.config.policy), self.decisions),
            confirm_grace_s=self.confirm_grace_s,
        )

    def add_node(self, node_id: str, slots: int, images: set[str] | None = None) -> None:
        capacity = Resources(cpus=float(slots), memory_mb=slots * 4096, slots=slots)
        self.agents.add_node(node_id, "local", capacity, {BASE_IMAGE} if images is None else images)

    # --- running a scenario -------------------------------------------------------

    def run(self, scenario: Callable[[Harness], Awaitable[None]]) -> None:
        """Run `scenario(self)` in virtual time with the control plane up; stop it after."""

        async def main() -> None:
            self.start()
            try:
                await scenario(self)
            finally:
                await self.stop()
                for task in self.agents.background:  # removals the engine had not got to
                    task.cancel()
                await asyncio.gather(*self.agents.background, return_exceptions=True)

        try:
            self.loop.run_until_complete(main())
        finally:
            self.loop.close()

    def start(self) -> None:
        s = self.scheduler
        self._tasks = [
            asyncio.ensure_future(s.run_forever()),
            asyncio.ensure_future(
                self.agents.heartbeat_forever(
                    s.on_report, self.heartbeat_s, s.config.heartbeat_timeout_s / 2
                )
            ),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.scheduler.drain()

    async def restart(self) -> None:
        """The control plane dies and a new one starts with an empty view: what runs on
        the agents carries on, and their heartbeats teach the new one."""
        await self.stop()
        self.scheduler = self._build()
        self.start()

    # --- what clients and operators do --------------------------------------------

    async def acquire(self, owner: str | None = ALICE, **fields) -> Lease:
        fields.setdefault("timeout_s", 60)
        return await self.scheduler.leases.acquire(AcquireRequest(**fields), owner)

    async def granted(self, lease: Lease) -> None:
        """Wait until its agent has answered the grant of `lease`: a running sandbox is
        served at its claim, while the grant is still on its way to the agent."""
        while (in_flight := self.scheduler.actuator.in_flight(lease.id)) is not None:
            await asyncio.shield(in_flight)

    async def release(self, lease: Lease) -> None:
        await self.scheduler.leases.release(lease.id, lease.lease_token)

    def prewarm(self, pool: str = "default", owner: str | None = ALICE, **fields) -> PrewarmInfo:
        """An announced burst of client `owner`, under its quota, as
        `POST /v1/pools/{pool}/prewarm` makes it (None: no client, no quota)."""
        quota = self.config.quota_of(owner) if owner is not None else None
        return self.scheduler.prewarm(pool, PrewarmRequest(**fields), owner, quota)

    async def settle(self, seconds: float = 2.0) -> None:
        """Let virtual time pass: ticks, outcomes and heartbeats happen meanwhile."""
        await asyncio.sleep(seconds)

    # --- what to look at ------------------------------------------------------------

    def now(self) -> float:
        return self.clock.now()

    def states(self, pool: str | None = None) -> dict[SandboxState, int]:
        """The control plane's count of sandboxes by state."""
        counts: dict[SandboxState, int] = {}
        for entry in self.scheduler.view.sandboxes.values():
            if pool is None or entry.pool == pool:
                counts[entry.state] = counts.get(entry.state, 0) + 1
        return counts

    def on_agents(self, node_id: str | None = None) -> dict[str, SandboxState]:
        """What the simulated agents really hold: sandbox id -> state."""
        return {
            sid: sb.state
            for node in self.agents.nodes.values()
            if node_id is None or node.id == node_id
            for sid, sb in node.sandboxes.items()
        }

    def calls_of(
        self, op: str | None = None, sandbox_id: str | None = None, node: str | None = None
    ) -> list[Call]:
        """The calls made to agents, oldest first, of that op, sandbox and node."""
        return [
            c
            for c in self.calls
            if (op is None or c.op == op)
            and (sandbox_id is None or c.sandbox_id == sandbox_id)
            and (node is None or c.node == node)
        ]

    def decided(self, kind: type | None = None, reason: str | None = None) -> list[Action]:
        """The actions the policy decided, oldest first, of that type and reason."""
        return [
            a
            for _, a in self.decisions
            if (kind is None or isinstance(a, kind))
            and (reason is None or getattr(a, "reason", None) == reason)
        ]

    def metric(self, name: str, **labels: str) -> float:
        """The sum of a control-plane metric's samples whose labels include `labels`."""
        total = 0.0
        for family in self.scheduler.metrics.registry.collect():
            for sample in family.samples:
                if sample.name == name and labels.items() <= sample.labels.items():
                    total += sample.value
        return total
