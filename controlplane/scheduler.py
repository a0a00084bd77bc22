"""Observe, decide, apply: the control plane's loop around the pure policy.

A tick runs on a short timer and on every event (an acquire, a release, an
outcome, a heartbeat). It never awaits: it reads the view and the queues into a
snapshot, asks `dsec.policy.decide` what to do, marks the view and starts one task
per side effect. Each task calls an agent (idempotent, with a request id) and hands
its result back as data to `_on_*`, which updates the view and wakes the loop; a
failure there is just another input to the next tick.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
from collections.abc import Awaitable

from controlplane.cloud import CloudProvider
from controlplane.config import ControlPlaneConfig
from controlplane.gateway import AgentGateway, CallResult
from controlplane.metrics import ControlPlaneMetrics
from controlplane.queue import PendingRequest, RequestQueues, scoped_key
from controlplane.spent import SpentKeys
from controlplane.view import TOMBSTONES, ClusterView, SandboxEntry
from dsec.baselines import Policy, make_policy
from dsec.clock import Clock
from dsec.httpkit import ApiError, token_matches
from dsec.models import (
    AcquireRequest,
    CreateSandbox,
    Lease,
    LeaseGrant,
    NodeReport,
    PoolParams,
    SandboxInfo,
)
from dsec.peaks import PeakTracker
from dsec.policy import (
    Action,
    Claim,
    CloudSnap,
    Create,
    Destroy,
    Hibernate,
    Pause,
    ProvisionCloud,
    ReleaseCloud,
    RequestSnap,
    Snapshot,
    TemplateSnap,
    Thaw,
)
from dsec.states import ASSIGNED, SandboxState
from dsec.tokens import LEASE_TOKEN_HEADER, lease_token, new_lease_id

log = logging.getLogger(__name__)

# An agent's refusals that are about the template, not the node (an image it lacks, a
# setting Docker rejects): the node stays open to other templates.
TEMPLATE_REFUSALS = frozenset({"docker_image_not_found", "docker_invalid", "docker_start_failed"})


class Scheduler:
    def __init__(
        self,
        config: ControlPlaneConfig,
        view: ClusterView,
        queues: RequestQueues,
        gateway: AgentGateway,
        clock: Clock,
        metrics: ControlPlaneMetrics,
        cloud: CloudProvider | None = None,
        policy: Policy | None = None,
    ) -> None:
        self.config = config
        self.view = view
        self.queues = queues
        self.gateway = gateway
        self.clock = clock
        self.metrics = metrics
        self.policy = policy or make_policy(config.policy)
        self.cloud = cloud
        self.peaks = PeakTracker(config.peak_window_s)
        self.requests: dict[str, PendingRequest] = {}
        # scoped idempotency key -> the waiting request, or the id of the sandbox it got
        self.by_key: dict[str, PendingRequest | str] = {}
        # keys whose sandbox was released: reusing one is refused, not a fresh sandbox
        self.spent_keys = SpentKeys(
            config.state_dir / "spent-keys.jsonl" if config.state_dir else None, TOMBSTONES
        )
        self.wakeup = asyncio.Event()
        self.tasks: set[asyncio.Task] = set()
        self.ops: dict[str, asyncio.Task] = {}  # the side effect in flight, per sandbox
        self.reservations: dict[str, str] = {}  # request id -> the sandbox created for it
        self.ticks = 0
        self.started_at = clock.now()
        self.alive_accounted_at = clock.now()
        self.leases_looked_at = -math.inf

    # --- the loop ---------------------------------------------------------------

    def wake(self) -> None:
        self.wakeup.set()

    async def run_forever(self) -> None:
        while True:
            # asyncio.timeout, not wait_for: on 3.11 wait_for drops a cancel that lands
            # just as the event is set, and the loop would never stop
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.tick_s):
                    await self.wakeup.wait()
            self.wakeup.clear()
            try:
                self.tick()
            except Exception:  # a bug must not stop the pool: log it, tick again
                log.exception("tick failed")
            if self.config.min_tick_gap_s:
                # events closer than this share one tick: the cost of a tick is bounded
                # per second, whatever the event rate
                await asyncio.sleep(self.config.min_tick_gap_s)

    def tick(self) -> None:
        now = self.clock.now()
        self.ticks += 1
        self._account_alive(now)
        self._observe_demand(now)
        for node in self.view.mark_silent_nodes(now, self.config.heartbeat_timeout_s):
            log.warning("node %s missed heartbeats: out of placement", node.id)
        self._retry_destroys()
        actions = self.policy.decide(self.snapshot(now), self.config.pools, now)
        self.apply(actions, now)

    def _observe_demand(self, now: float) -> None:
        """Concurrency per (pool, template), leased plus waiting: the peak sizes warm pools."""
        demand = {key: n for key, n in self.view.assigned.items() if n}
        for req in self.queues.waiting():
            demand[(req.pool, req.template)] = demand.get((req.pool, req.template), 0) + 1
        for pool, params in self.config.pools.items():
            for template in params.templates:
                demand.setdefault((pool, template), 0)
        for key, n in demand.items():
            self.peaks.observe(key, n, now)

    def snapshot(self, now: float) -> Snapshot:
        templates = {
            name: TemplateSnap(name, t.image, t.cpus, t.memory_limit_mb, t.may_overflow)
            for name, t in self.config.templates.items()
        }
        requests = tuple(
            RequestSnap(r.id, r.pool, r.template, r.priority, r.arrived_at, frozenset(r.refused_by))
            for r in self.queues.waiting()
        )
        cloud = None
        if self.cloud is not None:
            cloud = CloudSnap(
                max_nodes=self.cloud.max_nodes,
                booting=self.cloud.booting(set(self.view.nodes)),
                idle_release_s=self.cloud.idle_release_s,
            )
        # leases matter only to lease-idle freezing: a look every few seconds, at those
        # idle for long enough in the most eager pool
        leases_idle_since = None
        eagerest = min(p.lease_idle_freeze_s for p in self.config.pools.values())
        # a look every tenth of the timer (0.5 to 10 s): a scan of every lease at most
        # that often, for a freeze at most that late
        if now >= self.leases_looked_at + max(0.5, min(10.0, eagerest / 10)):
            self.leases_looked_at = now
            leases_idle_since = now - eagerest
        return Snapshot(
            nodes=self.view.node_snaps(now),
            sandboxes=self.view.sandbox_snaps(leases_idle_since),
            requests=requests,
            templates=templates,
            peaks=self.peaks.peaks(now),
            leased={key: n for key, n in self.view.assigned.items() if n},
            cloud=cloud,
            seed=self.ticks,
        )

    def apply(self, actions: list[Action], now: float) -> None:
        for action in actions:
            match action:
                case Claim():
                    self._claim(action, now)
                case Create():
                    self._create(action, now)
                case Destroy():
                    entry = self.view.sandboxes.get(action.sandbox_id)
                    if entry is not None and entry.retry_at <= now:
                        self._destroy(entry, now, action="destroy")
                case Pause() | Thaw() | Hibernate():
                    entry = self.view.sandboxes.get(action.sandbox_id)
                    if entry is not None and entry.retry_at <= now:
                        self._freeze_or_thaw(action, entry)
                case ProvisionCloud():
                    for _ in range(action.count):
                        self._provision_cloud()
                case ReleaseCloud():
                    self._release_cloud(action.node)

    def _spawn(self, entry: SandboxEntry, coro: Awaitable[None]) -> asyncio.Task:
        entry.op_in_flight = True
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        self.ops[entry.id] = task

        def done(t: asyncio.Task) -> None:
            self.tasks.discard(t)
            if self.ops.get(entry.id) is t:
                del self.ops[entry.id]

        task.add_done_callback(done)
        return task

    def _account_alive(self, now: float) -> None:
        """Sandbox-seconds up to now. Called before every change of what occupies a node
        (ticks, outcomes, reports), so a sandbox gone between ticks is counted to the end."""
        elapsed = now - self.alive_accounted_at
        self.alive_accounted_at = now
        for (pool, kind), n in self.view.occupying.items():
            if not n:
                continue
            self.metrics.alive_seconds.labels(pool).inc(n * elapsed)
            # cloud sandbox-seconds cost more: counted apart
            self.metrics.sandbox_node_seconds.labels(pool, kind).inc(n * elapsed)

    # --- applying actions ---------------------------------------------------------

    def _node_url(self, node_id: str) -> str:
        return self.view.nodes[node_id].url

    def _create(self, action: Create, now: float) -> None:
        node = self.view.nodes.get(action.node)
        template = self.config.templates.get(action.template)
        if node is None or template is None:
            return
        entry = SandboxEntry(
            id=f"{node.id}.{secrets.token_hex(8)}",
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
        if action.for_request is not None:
            self.reservations[action.for_request] = entry.id
        kind = "overflow" if node.kind == "cloud" else "create"
        self.metrics.scale_events.labels(action.pool, kind).inc()
        body = CreateSandbox(
            sandbox_id=entry.id, pool=action.pool, template=template, request_id=entry.id
        )

        async def run() -> None:
            result = await self._call_node(
                node.id, "POST", f"{node.url}/v1/sandboxes", body, request_id=entry.id
            )
            self._on_created(entry, result)

        self._spawn(entry, run())

    def _on_created(self, entry: SandboxEntry, result: CallResult) -> None:
        now = self.clock.now()
        self._account_alive(now)
        entry.op_in_flight = False
        if result.ok:
            self.view.move(entry, SandboxState.WARM, now)
            entry.confirmed_at = now
            entry.failures = 0
        else:
            self._call_failed(entry, "create", result)
            about_template = result.code in TEMPLATE_REFUSALS
            if entry.reserved_for and (req := self.requests.get(entry.reserved_for)):
                req.refused_by.add(entry.node)  # the agent's refusal is final for that node
                if about_template and self._refused_everywhere(req):
                    self._reject(req, result)
            if result.refused and not about_template:
                self.view.refuse(entry.node, now + self.config.refusal_cooldown_s)
            if entry.reserved_for:
                self.reservations.pop(entry.reserved_for, None)
            self.view.move(entry, SandboxState.GONE, now)
            # no tombstone: if Docker did create it after all, the next heartbeat says so
            self.view.forget(entry.id, tombstone=False)
        self.wake()

    def _refused_everywhere(self, req: PendingRequest) -> bool:
        template, now = self.config.templates[req.template], self.clock.now()
        candidates = {
            n.id
            for n in self.view.nodes.values()
            if n.placeable(now) and (n.kind == "local" or template.may_overflow)
        }
        return candidates <= req.refused_by

    def _reject(self, req: PendingRequest, refusal: CallResult) -> None:
        """Every node refused the request's template: say why now, not at its timeout."""
        template = self.config.templates[req.template]
        if not req.done.done():  # its client is waiting: the API answers 422 (and counts it)
            req.done.set_exception(
                ApiError(
                    422,
                    "template_unavailable",
                    f"no node can run template {req.template!r} (image {template.image}): "
                    f"{refusal.code}: {refusal.message}",
                )
            )
        self._forget_request(req)

    def _claim(self, action: Claim, now: float) -> None:
        req = self.requests.get(action.request_id)
        entry = self.view.sandboxes.get(action.sandbox_id)
        if req is None or entry is None or req.done.done():
            return
        self.view.move(entry, SandboxState.LEASED, now)
        self.view.set_pool(entry, req.pool)  # a higher-priority pool may have taken it over
        entry.frozen_at = None
        entry.idle_since = now
        entry.lease_id = new_lease_id()
        entry.idempotency_key = req.idempotency_key
        entry.owner = req.owner
        entry.labels = dict(req.labels)
        entry.reserved_for = None
        req.claimed = True
        if action.path == "thaw":
            self.metrics.scale_events.labels(entry.pool, "thaw").inc()
        grant = LeaseGrant(
            lease_id=entry.lease_id,
            pool=req.pool,
            idempotency_key=req.idempotency_key,
            owner=req.owner,
            labels=req.labels,
            request_id=req.id,
        )
        url = f"{self._node_url(entry.node)}/v1/sandboxes/{entry.id}/lease"

        async def run() -> None:
            result = await self._call_node(entry.node, "POST", url, grant, request_id=req.id)
            self._on_leased(entry, req, action.path, result)

        self._spawn(entry, run())

    def _on_leased(
        self, entry: SandboxEntry, req: PendingRequest, path: str, result: CallResult
    ) -> None:
        now = self.clock.now()
        entry.op_in_flight = False
        if not result.ok:
            self._call_failed(entry, "lease", result)
            req.claimed = False  # back in the queue, first in line by its arrival time
            self._destroy(entry, now, action="destroy")
            self.wake()
            return
        entry.confirmed_at = now
        entry.failures = 0
        if req.done.done():  # its client gave up while the lease was being made
            self._destroy(entry, now, action="destroy")
            return
        self.queues.remove(req)
        self.requests.pop(req.id, None)
        self._unreserve(req)
        if req.scoped_key:
            self.by_key[req.scoped_key] = entry.id
        schedule_s = now - req.arrived_at
        self.metrics.schedule_latency.labels(entry.pool, path).observe(schedule_s)
        self.metrics.acquires.labels(entry.pool, "served").inc()
        req.done.set_result(self.lease_of(entry, path, schedule_s * 1000))

    def _destroy(self, entry: SandboxEntry, now: float, action: str) -> asyncio.Task | None:
        if entry.op_in_flight:
            return None
        if entry.state != SandboxState.DESTROYING:
            self.view.move(entry, SandboxState.DESTROYING, now)
            self.metrics.scale_events.labels(entry.pool, action).inc()
        node = self.view.nodes.get(entry.node)

        async def run() -> None:
            if node is None:
                result = CallResult(False, 0, "unreachable", f"node {entry.node} is unknown")
            else:
                result = await self._call_node(
                    node.id, "DELETE", f"{node.url}/v1/sandboxes/{entry.id}", request_id=entry.id
                )
            self._on_destroyed(entry, result)

        return self._spawn(entry, run())

    def _on_destroyed(self, entry: SandboxEntry, result: CallResult) -> None:
        self._account_alive(self.clock.now())
        entry.op_in_flight = False
        final_busy_s = (result.body or {}).get("busy_s")
        if final_busy_s is not None and final_busy_s > entry.busy_s:
            # what it ran since its node's last heartbeat, which no report will carry
            self.metrics.busy_seconds.labels(entry.pool).inc(final_busy_s - entry.busy_s)
            entry.busy_s = final_busy_s
        if result.ok or result.status in (404, 410):
            self.view.move(entry, SandboxState.GONE, self.clock.now())
            self.view.forget(entry.id)
        else:
            self._call_failed(entry, "destroy", result)  # retried by a later tick
        self.wake()

    def _retry_destroys(self) -> None:
        now = self.clock.now()
        for entry in list(self.view.by_state[SandboxState.DESTROYING].values()):
            node = self.view.nodes.get(entry.node)
            if (
                not entry.op_in_flight
                and entry.retry_at <= now
                and node is not None
                and node.healthy
            ):
                self._destroy(entry, now, action="destroy")

    def _freeze_or_thaw(self, action: Pause | Thaw | Hibernate, entry: SandboxEntry) -> None:
        verb, metric, target = {
            Pause: ("pause", "freeze", {
                SandboxState.WARM: SandboxState.PAUSED,
                SandboxState.LEASED: SandboxState.LEASED_PAUSED,
            }),
            Thaw: ("unpause", "thaw", {SandboxState.PAUSED: SandboxState.WARM}),
            Hibernate: ("hibernate", "hibernate", {SandboxState.PAUSED: SandboxState.HIBERNATED}),
        }[type(action)]  # fmt: skip
        new_state = target.get(entry.state)
        if entry.op_in_flight or new_state is None:
            return
        url = f"{self._node_url(entry.node)}/v1/sandboxes/{entry.id}/{verb}"

        async def run() -> None:
            result = await self._call_node(entry.node, "POST", url, request_id=entry.id)
            entry.op_in_flight = False
            now = self.clock.now()
            self._account_alive(now)
            if result.ok:
                self.view.move(entry, new_state, now)
                entry.confirmed_at = now
                entry.failures = 0
                if verb == "pause":
                    entry.frozen_at = now
                elif verb == "unpause":
                    entry.frozen_at = None
                self.metrics.scale_events.labels(entry.pool, metric).inc()
            else:
                self._call_failed(entry, verb, result)
            self.wake()

        self._spawn(entry, run())

    def _provision_cloud(self) -> None:
        if self.cloud is None:
            return
        cloud = self.cloud

        async def run() -> None:
            try:
                node_id = await cloud.start_node()
                log.info("provisioned cloud node %s", node_id)
            except Exception as e:  # a provider failure is data for the next tick
                log.warning("cloud provisioning failed: %s", e)

        self._track(asyncio.ensure_future(run()))

    def _release_cloud(self, node_id: str) -> None:
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
            log.info("released cloud node %s", node_id)

        self._track(asyncio.ensure_future(run()))

    def _track(self, task: asyncio.Task) -> None:
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _call_node(
        self, node_id: str, method: str, url: str, body=None, *, request_id: str
    ) -> CallResult:
        """Call an agent, and keep count of the node's failures: one that keeps failing
        is out of placement until a probe after its backoff succeeds."""
        result = await self.gateway.call(method, url, body, request_id=request_id)
        if not result.node_fault:
            self.view.call_succeeded(node_id)
        elif self.view.call_failed(
            node_id,
            self.clock.now(),
            self.config.node_failure_threshold,
            self.config.node_failure_backoff_s,
        ):
            self.metrics.nodes_taken_out.labels(node_id).inc()
            log.warning("node %s keeps failing (%s): out of placement", node_id, result.code)
        return result

    def _call_failed(self, entry: SandboxEntry, op: str, result: CallResult) -> None:
        # back off: an agent that is down is not asked again on every tick
        entry.failures += 1
        entry.retry_at = self.clock.now() + min(30.0, 0.5 * 2**entry.failures)
        self.metrics.agent_call_errors.labels(entry.node, op, result.code).inc()
        log.warning(
            "%s of %s on %s failed: %s %s", op, entry.id, entry.node, result.code, result.message
        )

    # --- what the API asks ----------------------------------------------------------

    def lease_of(self, entry: SandboxEntry, path: str, schedule_ms: float) -> Lease:
        assert entry.lease_id is not None
        return Lease(
            **self.info_of(entry).model_dump(exclude={"lease_id"}),
            lease_id=entry.lease_id,
            lease_token=lease_token(self.config.agent_token, entry.id, entry.lease_id),
            path=path,
            schedule_ms=schedule_ms,
        )

    def info_of(self, entry: SandboxEntry) -> SandboxInfo:
        node = self.view.nodes.get(entry.node)
        return SandboxInfo(
            id=entry.id,
            node=entry.node,
            agent_url=node.url if node else "",
            pool=entry.pool,
            template=entry.template,
            state=entry.state,
            created_at=entry.created_at,
            lease_id=entry.lease_id,
            labels=entry.labels,
        )

    async def acquire(self, body: AcquireRequest, owner: str | None = None) -> Lease:
        """`owner` is the client asking (dsec.tokens.client_id of its token); None for a
        caller in this process, such as the simulator."""
        if body.pool not in self.config.pools:
            raise ApiError(
                422,
                "unknown_pool",
                f"no pool named {body.pool!r}",
                [{"loc": "pool", "msg": f"known: {sorted(self.config.pools)}"}],
            )
        if body.template not in self.config.templates:
            raise ApiError(
                422,
                "unknown_template",
                f"no template named {body.template!r}",
                [{"loc": "template", "msg": f"known: {sorted(self.config.templates)}"}],
            )
        key = scoped_key(owner, body.idempotency_key)
        if key is not None and key not in self.by_key:
            await self._resync(body.timeout_s)
        if key is not None and key in self.spent_keys:
            raise _key_spent(body.idempotency_key, self.spent_keys.sandbox_of(key))
        if key is not None and key in self.by_key:
            return await self._acquire_again(key, body)
        req = PendingRequest(
            id=secrets.token_hex(8),
            pool=body.pool,
            template=body.template,
            priority=body.priority,
            arrived_at=self.clock.now(),
            idempotency_key=body.idempotency_key,
            owner=owner,
            labels=dict(body.labels),
        )
        self.queues.add(req)
        self.requests[req.id] = req
        if key is not None:
            self.by_key[key] = req
        self.wake()
        return await self._await_lease(req, body.timeout_s)

    async def _resync(self, timeout_s: float) -> None:
        """Hold a keyed acquire until the agents have reported since this control plane
        started (resync_s, a few heartbeats): after a restart, a retry must find the
        sandbox its key already holds, not be served a second one."""
        left = self.started_at + self.config.resync_s - self.clock.now()
        if left <= 0:
            return
        if left > timeout_s:
            await self.clock.sleep(timeout_s)
            raise ApiError(
                503, "resyncing", "the control plane is relearning the cluster; retry shortly"
            )
        await self.clock.sleep(left)

    async def _acquire_again(self, key: str, body: AcquireRequest) -> Lease:
        known = self.by_key[key]
        if isinstance(known, PendingRequest):
            return await self._await_lease(known, body.timeout_s)
        entry = self.view.sandboxes.get(known)
        if entry is None or entry.state not in ASSIGNED:
            raise _key_spent(body.idempotency_key, known)
        return self.lease_of(entry, "warm", 0.0)

    async def _await_lease(self, req: PendingRequest, timeout_s: float) -> Lease:
        try:
            return await asyncio.wait_for(asyncio.shield(req.done), timeout_s)
        except TimeoutError:
            if req.done.done() and not req.done.cancelled():
                return req.done.result()
            self._abandon(req, "timed_out")
            raise ApiError(
                503, "acquire_timeout", f"no sandbox was ready within {timeout_s} s; retry later"
            ) from None
        except asyncio.CancelledError:
            if not req.done.done() or req.done.cancelled():
                self._abandon(req, "cancelled")
            elif req.done.exception() is None:
                # the client left after its lease was made: give the sandbox back
                entry = self.view.sandboxes.get(req.done.result().id)
                if entry is not None:
                    self._destroy(entry, self.clock.now(), action="destroy")
            raise

    def _abandon(self, req: PendingRequest, outcome: str) -> None:
        self.metrics.acquires.labels(req.pool, outcome).inc()
        req.done.cancel()  # a lease still in flight sees this and gives its sandbox back
        self._forget_request(req)

    def _forget_request(self, req: PendingRequest) -> None:
        self.queues.remove(req)
        self.requests.pop(req.id, None)
        if req.scoped_key and self.by_key.get(req.scoped_key) is req:
            del self.by_key[req.scoped_key]
        self._unreserve(req)
        self.wake()

    def _unreserve(self, req: PendingRequest) -> None:
        """A request served or gone frees the sandbox created for it: it joins the warm pool."""
        sandbox_id = self.reservations.pop(req.id, None)
        entry = self.view.sandboxes.get(sandbox_id) if sandbox_id else None
        if entry is not None and entry.reserved_for == req.id:
            entry.reserved_for = None

    async def release(self, sandbox_id: str, proof: str | None) -> SandboxEntry:
        """`proof` is the caller's lease token; None for an operator, who may release any."""
        entry = self.view.sandboxes.get(sandbox_id)
        if entry is None:
            if sandbox_id in self.view.released:
                raise ApiError(409, "already_released", f"sandbox {sandbox_id} was released")
            raise ApiError(404, "unknown_sandbox", f"no sandbox {sandbox_id}")
        if entry.state == SandboxState.DESTROYING:
            raise ApiError(409, "already_released", f"sandbox {sandbox_id} is being released")
        if proof is not None and not (
            entry.lease_id
            and token_matches(
                proof, [lease_token(self.config.agent_token, entry.id, entry.lease_id)]
            )
        ):
            raise ApiError(
                403,
                "forbidden",
                f"releasing {sandbox_id} takes its lease token ({LEASE_TOKEN_HEADER})",
            )
        if entry.state == SandboxState.LOST:
            self.view.forget(sandbox_id)  # nothing to remove we can reach; its node may
            return entry  # still report it, and the tombstone makes that a removal
        if entry.state not in ASSIGNED:
            raise ApiError(409, "not_leased", f"sandbox {sandbox_id} is not leased")
        self.metrics.episodes.labels(entry.pool).inc()
        if key := scoped_key(entry.owner, entry.idempotency_key):
            self.by_key.pop(key, None)
            await self.spent_keys.add(key, entry.id)
        if (in_flight := self.ops.get(sandbox_id)) is not None:
            await asyncio.shield(in_flight)  # a pause or thaw under way finishes first
        task = self._destroy(entry, self.clock.now(), action="release")
        if task is not None:
            await asyncio.shield(task)
        return entry

    def on_report(self, report: NodeReport) -> None:
        now = self.clock.now()
        self._account_alive(now)
        changes = self.view.apply_report(report, now)
        for pool, seconds in changes.busy_s.items():
            self.metrics.busy_seconds.labels(pool).inc(seconds)
        for entry in changes.added:
            key = scoped_key(entry.owner, entry.idempotency_key)
            if key and entry.state in ASSIGNED:
                self.by_key.setdefault(key, entry.id)
        self.wake()

    def set_pool(self, name: str, params: PoolParams) -> None:
        unknown = [t for t in params.templates if t not in self.config.templates]
        if unknown:
            raise ApiError(
                422,
                "unknown_template",
                f"pool {name!r} names unknown templates",
                [{"loc": "templates", "msg": f"unknown: {unknown}"}],
            )
        self.config.pools[name] = params
        self.wake()

    async def drain(self) -> None:
        """Wait for side effects in flight, so shutdown leaves nothing half-done."""
        if self.tasks:
            await asyncio.gather(*list(self.tasks), return_exceptions=True)


def _key_spent(key: str | None, sandbox_id: str) -> ApiError:
    return ApiError(
        409,
        "idempotency_key_spent",
        f"idempotency key {key!r} belonged to sandbox {sandbox_id}, now released",
    )
