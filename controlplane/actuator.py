"""Carrying out the policy's actions on sandboxes and nodes, through the agent interface.

Each action becomes one task that calls an agent (`controlplane.agents.AgentClient`)
and hands its `CallResult` back as data: the view is updated, a failure is counted
and backed off, and the loop is woken so the next tick decides what follows. Each
action's reason is logged as it is carried out. Claims and unplaceable requests are
acquire business and go to `controlplane.leases`, which makes its agent calls here.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable, Callable

from controlplane.agents import AgentClient, CallResult
from controlplane.cloud import CloudProvider
from controlplane.config import ControlPlaneConfig
from controlplane.metrics import ControlPlaneMetrics, SandboxSeconds
from controlplane.queue import RequestQueues
from controlplane.view import ClusterView, SandboxEntry
from dsec.clock import Clock
from dsec.models import CreateSandbox, ResetSandbox
from dsec.policy import Create, Destroy, Hibernate, Pause, ProvisionCloud, ReleaseCloud, Thaw
from dsec.rates import Durations
from dsec.states import HIBERNATED_FROM, PAUSED_FROM, THAWED_FROM, SandboxState

log = logging.getLogger(__name__)

# An agent's refusals that are about the template, not the node (an image it lacks, a
# setting Docker rejects): the node stays open to other templates.
TEMPLATE_REFUSALS = frozenset({"docker_image_not_found", "docker_invalid", "docker_start_failed"})

# Per freezing action: the agent operation, the scale-event name, the state it leads to.
FREEZES = {
    Pause: ("pause", "freeze", PAUSED_FROM),
    Thaw: ("unpause", "thaw", THAWED_FROM),
    Hibernate: ("hibernate", "hibernate", HIBERNATED_FROM),
}


class Actuator:
    def __init__(
        self,
        config: ControlPlaneConfig,
        view: ClusterView,
        queues: RequestQueues,
        agents: AgentClient,
        clock: Clock,
        metrics: ControlPlaneMetrics,
        sandbox_seconds: SandboxSeconds,
        wake: Callable[[], None],
        cloud: CloudProvider | None = None,
        ids: Callable[[int], str] = secrets.token_hex,
    ) -> None:
        self.ids = ids
        self.config = config
        self.view = view
        self.queues = queues
        self.agents = agents
        self.clock = clock
        self.metrics = metrics
        self.sandbox_seconds = sandbox_seconds
        self.wake = wake
        self.cloud = cloud
        self.tasks: set[asyncio.Task] = set()
        self.ops: dict[str, asyncio.Task] = {}  # the side effect in flight, per sandbox
        # how long a create takes, per template, from the policy's decision to warm, and
        # a recycle's reset, from the release to warm: the time a taken warm sandbox
        # takes to replace (the policy's flow target)
        self.create_times = Durations()
        self.reset_times = Durations()

    def carry_out(self, action: Create | Destroy | Pause | Thaw | Hibernate, now: float) -> None:
        log.debug("carrying out %s", action)  # its reason included
        match action:
            case Create():
                self.create(action, now)
            case Destroy():
                if entry := self.view.sandboxes.get(action.sandbox_id):
                    self.destroy(entry, now, "destroy")
            case Pause() | Thaw() | Hibernate():
                if entry := self.view.sandboxes.get(action.sandbox_id):
                    self.freeze_or_thaw(action, entry)
            case ProvisionCloud():
                for _ in range(action.count):
                    self.provision_cloud(action.reason)
            case ReleaseCloud():
                self.release_cloud(action.node, action.reason)

    # --- tasks --------------------------------------------------------------------

    def spawn(self, entry: SandboxEntry, coro: Awaitable[None]) -> asyncio.Task:
        """Run one side effect about `entry`; none other starts until it ends."""
        entry.call_started()
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        self.ops[entry.id] = task

        def done(t: asyncio.Task) -> None:
            self.tasks.discard(t)
            if self.ops.get(entry.id) is t:
                del self.ops[entry.id]

        task.add_done_callback(done)
        return task

    def in_flight(self, sandbox_id: str) -> asyncio.Task | None:
        """The side effect under way about the sandbox. Not one that has ended but whose
        done callback has not run yet: awaiting that returns at once, without yielding,
        so a loop that waits until nothing is in flight would spin."""
        task = self.ops.get(sandbox_id)
        return task if task is not None and not task.done() else None

    async def settled(self, sandbox_id: str) -> None:
        """Wait until no side effect about the sandbox is under way (one started while
        the last was awaited too)."""
        while (in_flight := self.in_flight(sandbox_id)) is not None:
            await asyncio.shield(in_flight)

    def track(self, task: asyncio.Task) -> None:
        """Keep a side effect that is about no one sandbox until it ends (drain waits)."""
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def drain(self) -> None:
        """Wait for side effects in flight, so shutdown leaves nothing half-done."""
        if self.tasks:
            await asyncio.gather(*list(self.tasks), return_exceptions=True)

    async def call(
        self, entry: SandboxEntry, op: Callable[..., Awaitable[CallResult]], *args
    ) -> CallResult:
        """Call the agent that holds `entry`, and keep count of its node's failures: one
        that keeps failing is out of placement until a probe after its backoff succeeds."""
        node = self.view.nodes.get(entry.node)
        if node is None:
            return CallResult(False, 0, "unreachable", f"node {entry.node} is unknown")
        result = await op(node, *args)
        if not result.node_fault:
            self.view.call_succeeded(node.id)
        elif self.view.call_failed(
            node.id,
            self.clock.now(),
            self.config.node_failure_threshold,
            self.config.node_failure_backoff_s,
        ):
            self.metrics.nodes_taken_out.labels(node.id).inc()
            log.warning("node %s keeps failing (%s): out of placement", node.id, result.code)
        return result

    def failed(self, entry: SandboxEntry, op: str, result: CallResult) -> None:
        """A call about `entry` failed: it backs off (the snapshot leaves it out until its
        `retry_at`), counted and logged."""
        entry.call_failed(self.clock.now())
        self.metrics.agent_call_errors.labels(entry.node, op, result.code).inc()
        log.warning(
            "%s of %s on %s failed: %s %s", op, entry.id, entry.node, result.code, result.message
        )

    # --- creates ------------------------------------------------------------------

    def create(self, action: Create, now: float) -> None:
        node = self.view.nodes.get(action.node)
        template = self.config.templates.get(action.template)
        if node is None or template is None:
            return
        entry = SandboxEntry(
            id=f"{node.id}.{self.ids(8)}",
            node=node.id,
            pool=action.pool,
            template=action.template,
            state=SandboxState.CREATING,
            since=now,
            created_at=self.clock.wall(),
            cpus=template.cpus,
            memory_mb=template.memory_limit_mb,
            reserved_for=action.for_request,
        )
        self.view.add(entry)
        if action.for_request and (req := self.queues.get(action.for_request)):
            req.reservation = entry.id
        kind = "overflow" if node.kind == "cloud" else "create"
        self.metrics.scale_events.labels(action.pool, kind).inc()
        spec = CreateSandbox(
            sandbox_id=entry.id,
            pool=action.pool,
            template=template,
            request_id=entry.id,
            for_request=action.for_request is not None,
        )

        async def run() -> None:
            self._on_created(entry, await self.call(entry, self.agents.create, spec))

        self.spawn(entry, run())

    def _on_created(self, entry: SandboxEntry, result: CallResult) -> None:
        now = self.clock.now()
        self.sandbox_seconds.account(now)
        if result.ok:
            entry.call_confirmed(now)
            self.create_times.observe(entry.template, now - entry.since)
            self.view.move(entry, SandboxState.WARM, now)
            self.wake()
            return
        self.failed(entry, "create", result)
        about_template = result.code in TEMPLATE_REFUSALS
        req = self.queues.get(entry.reserved_for) if entry.reserved_for else None
        if req is not None:
            req.refused_by.add(entry.node)  # the agent's refusal is final for that node
            if about_template:  # the policy rejects it once every node has said so
                req.template_refusal = f"{result.code}: {result.message}"
            if req.reservation == entry.id:
                req.reservation = None
        if result.refused and not about_template:
            self.view.refuse(entry.node, now + self.config.refusal_cooldown_s)
        self.view.move(entry, SandboxState.GONE, now)
        # no tombstone: if Docker did create it after all, the next heartbeat says so
        self.view.forget(entry.id, tombstone=False)
        self.wake()

    # --- removals -----------------------------------------------------------------

    def destroy(self, entry: SandboxEntry, now: float, action: str) -> asyncio.Task | None:
        """Remove `entry` (`action` names it in the scale events: destroy or release)."""
        if entry.op_in_flight:
            return None
        if entry.state != SandboxState.DESTROYING:
            self.view.move(entry, SandboxState.DESTROYING, now)
            self.metrics.scale_events.labels(entry.pool, action).inc()

        async def run() -> None:
            result = await self.call(entry, self.agents.destroy, entry.id, entry.ended)
            self._on_destroyed(entry, result)

        return self.spawn(entry, run())

    def _on_destroyed(self, entry: SandboxEntry, result: CallResult) -> None:
        now = self.clock.now()
        self.sandbox_seconds.account(now)
        if result.busy_s is not None and result.busy_s > entry.busy_s:
            # what it ran since its node's last heartbeat, which no report will carry
            self.metrics.busy_seconds.labels(entry.pool).inc(entry.busy_reported(result.busy_s))
        if result.ok or result.gone:
            entry.call_confirmed(now)
            self.view.move(entry, SandboxState.GONE, now)
            self.view.forget(entry.id)
        else:
            self.failed(entry, "destroy", result)  # retried by a later tick
        self.wake()

    def retry_destroys(self, now: float) -> None:
        for entry in list(self.view.by_state[SandboxState.DESTROYING].values()):
            node = self.view.nodes.get(entry.node)
            if (
                not entry.op_in_flight
                and entry.retry_at <= now
                and node is not None
                and node.healthy
            ):
                self.destroy(entry, now, "destroy")

    # --- recycling ----------------------------------------------------------------

    def recycle(self, entry: SandboxEntry, lease_id: str, now: float) -> asyncio.Task | None:
        """Reset a sandbox released from `lease_id` and put it back in the warm pool (a
        pool with `recycle` on, a template that allows it; `Leases.release` has cleared
        its lease, so its token is void while the agent works). The agent kills
        every process but the template's own, empties the work dir, /tmp and /dev/shm and
        checks; a reset that fails or does not check out is removed, never handed out."""
        if entry.op_in_flight:
            return None
        req = ResetSandbox(lease_id=lease_id, request_id=f"reset-{lease_id}")
        self.metrics.scale_events.labels(entry.pool, "recycle").inc()

        async def run() -> None:
            result = await self.call(entry, self.agents.reset, entry.id, req)
            self._on_reset(entry, result, now)

        return self.spawn(entry, run())

    def _on_reset(self, entry: SandboxEntry, result: CallResult, began: float) -> None:
        now = self.clock.now()
        self.sandbox_seconds.account(now)
        if result.ok:
            self.reset_times.observe(entry.template, now - began)
            entry.call_confirmed(now)
            self.view.move(entry, SandboxState.WARM, now)
            entry.recycled(now)
            self.wake()
            return
        self.failed(entry, "reset", result)
        self.destroy(entry, now, "destroy")  # not clean, or not known to be: it goes
        self.wake()

    # --- freezing and thawing -----------------------------------------------------

    def freeze_or_thaw(self, action: Pause | Thaw | Hibernate, entry: SandboxEntry) -> None:
        verb, event, targets = FREEZES[type(action)]
        new_state = targets.get(entry.state)
        if entry.op_in_flight or new_state is None:
            return
        op = getattr(self.agents, verb)

        async def run() -> None:
            result = await self.call(entry, op, entry.id)
            now = self.clock.now()
            self.sandbox_seconds.account(now)
            if result.ok:
                entry.call_confirmed(now)
                self.view.move(entry, new_state, now)
                if verb == "pause":
                    entry.frozen(now)
                elif verb == "unpause":
                    entry.thawed()
                self.metrics.scale_events.labels(entry.pool, event).inc()
            else:
                self.failed(entry, verb, result)
            self.wake()

        self.spawn(entry, run())

    # --- cloud nodes --------------------------------------------------------------

    def provision_cloud(self, reason: str) -> None:
        if self.cloud is None:
            return
        cloud = self.cloud

        async def run() -> None:
            try:
                node_id = await cloud.start_node()
                log.info("provisioned cloud node %s: %s", node_id, reason)
            except Exception as e:  # a provider failure is data for the next tick
                log.warning("cloud provisioning failed: %s", e)

        self.track(asyncio.ensure_future(run()))

    def release_cloud(self, node_id: str, reason: str) -> None:
        node = self.view.nodes.get(node_id)
        if self.cloud is None or node is None or node.draining:
            return
        self.view.set_draining(node_id, True)  # no placements while it goes
        cloud = self.cloud

        async def run() -> None:
            await cloud.stop_node(node_id)
            if self.view.on_node(node_id):
                self.view.set_draining(node_id, False)  # something landed after all: keep it
                return
            self.view.drop_node(node_id)
            log.info("released cloud node %s: %s", node_id, reason)

        self.track(asyncio.ensure_future(run()))
