"""Observe, decide, apply: the control plane's loop around the pure policy.

A tick runs on a short timer and on every event (an acquire, a release, an outcome,
a heartbeat). It never awaits: it reads the view and the queues into a snapshot, asks
the policy what to do and hands each action to the part that carries it out: claims
and unplaceable requests to `Leases`, everything else to the `Actuator`, which calls
agents and hands their results back as data for the next tick.

`build_scheduler` is the one way to put the parts together: the HTTP app, the
simulator and the test harness all use it, with their own agents and clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
from collections.abc import Callable
from typing import Protocol

from controlplane.actuator import Actuator
from controlplane.agents import AgentClient
from controlplane.cloud import CloudProvider
from controlplane.config import ClientQuota, ControlPlaneConfig, not_recyclable
from controlplane.forks import Forks
from controlplane.identities import Identities
from controlplane.leases import Leases
from controlplane.metrics import ControlPlaneMetrics, SandboxSeconds, ViewCollector
from controlplane.prewarm import Prewarms
from controlplane.queue import PendingRequest, RequestQueues
from controlplane.view import ClusterView, SandboxEntry
from dsec.clock import Clock
from dsec.httpkit import ApiError
from dsec.models import (
    LOST_CAUSES,
    NodeReport,
    PoolParams,
    PrewarmInfo,
    PrewarmRequest,
    ReportAck,
    TemplateSpec,
    normalise_image_ref,
)
from dsec.peaks import PeakTracker
from dsec.policies import Policy, make_policy
from dsec.policy import (
    PREWARM_REASON,
    Action,
    Claim,
    CloudSnap,
    Create,
    ExpireLease,
    Snapshot,
    TemplateSnap,
    Unplaceable,
)
from dsec.rates import RateTracker
from dsec.states import SandboxState

log = logging.getLogger(__name__)

# how much earlier than its timers' sums a lease is looked at again: far more than the
# rounding of a subtraction of instants (a lease's times are seconds since a start)
LEASE_DUE_MARGIN_S = 1e-3


class ImageSource(Protocol):
    """Where images come from for nodes that lack them (controlplane/images.py)."""

    def available(self, image: str) -> bool: ...


class Scheduler:
    def __init__(
        self,
        config: ControlPlaneConfig,
        view: ClusterView,
        queues: RequestQueues,
        agents: AgentClient,
        clock: Clock,
        metrics: ControlPlaneMetrics,
        cloud: CloudProvider | None = None,
        policy: Policy | None = None,
        ids: Callable[[int], str] = secrets.token_hex,
    ) -> None:
        self.config = config
        self.view = view
        self.queues = queues
        self.agents = agents
        self.clock = clock
        self.metrics = metrics
        self.policy = policy or make_policy(config.policy)
        self.cloud = cloud
        self.peaks = PeakTracker(config.peak_window_s)
        # acquires served a second per (pool, template): with the time a create or a
        # reset takes (the actuator's create_times, reset_times), what a steady stream
        # needs warm
        self.acquire_rates = RateTracker()
        self.prewarms = Prewarms()
        self.wakeup = asyncio.Event()
        self.sandbox_seconds = SandboxSeconds(view, metrics, clock.now())
        # sandbox and request ids (hex of n bytes): random, or drawn from the simulator's
        # seed, whose policy samples nodes by request id (a run must repeat)
        self.actuator = Actuator(
            config, view, queues, agents, clock, metrics, self.sandbox_seconds, self.wake, cloud,
            ids,
        )  # fmt: skip
        self.leases = Leases(config, view, queues, self.actuator, clock, metrics, self.wake, ids)
        self.forks = Forks(config, view, queues, self.leases, agents, clock, metrics)
        self.ticks = 0
        self.leases_looked_at = -math.inf
        self._lease_timers: dict[str, tuple[float | None, float, float | None]] = {}
        # sends templates' images to the nodes that lack them (the app sets it; None:
        # nothing is sent, and a node serves only the images its engine already holds)
        self.images: ImageSource | None = None

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
        self.sandbox_seconds.account(now)
        waiting = self.queues.waiting()
        self._observe_demand(now, waiting)
        timeout_s = self.config.heartbeat_timeout_s
        for node in self.view.mark_silent_nodes(now, timeout_s):
            log.warning("node %s missed heartbeats: out of placement", node.id)
            cause = f"its node {node.id} sent no heartbeat for {timeout_s:g} s"
            for entry in self.view.on_node(node.id):
                if entry.state == SandboxState.LOST:
                    self.leases.outcomes.ended(entry, "node_lost", cause)
        self.actuator.retry_destroys(now)
        actions = self.policy.decide(self.snapshot(now, waiting), self.config.pools, now)
        self.apply(actions, now)

    def _observe_demand(self, now: float, waiting: list[PendingRequest]) -> None:
        """Concurrency per (pool, template), leased plus waiting: the peak sizes warm pools."""
        demand = {key: n for key, n in self.view.assigned.items() if n}
        for req in waiting:
            demand[(req.pool, req.template)] = demand.get((req.pool, req.template), 0) + 1
        for pool, params in self.config.pools.items():
            for template in params.templates:
                demand.setdefault((pool, template), 0)
        for key, n in demand.items():
            self.peaks.observe(key, n, now)

    def snapshot(self, now: float, waiting: list[PendingRequest]) -> Snapshot:
        """What the policy decides on, with `waiting` the requests not yet handed a sandbox."""
        templates = {
            name: TemplateSnap(
                name,
                normalise_image_ref(t.image),
                t.cpus,
                t.memory_limit_mb,
                t.may_overflow,
                self.image_sent(t.image),
                t.recyclable,
            )
            for name, t in self.config.templates.items()
        }
        requests = tuple(r.snap() for r in waiting)
        cloud = None
        if self.cloud is not None:
            cloud = CloudSnap(
                max_nodes=self.cloud.max_nodes,
                booting=self.cloud.booting(set(self.view.nodes)),
                idle_release_s=self.cloud.idle_release_s,
            )
        # leases matter to lease-idle freezing and to expiry: a look every tenth of the
        # shortest timer (0.5 to 10 s), a scan of every lease at most that often, for an
        # action at most that late; each lease in the snapshot only once it may be due
        lease_due = None
        timers = [t for p in self.config.pools.values() for t in _lease_timers(p)]
        if now >= self.leases_looked_at + max(0.5, min(10.0, min(timers) / 10)):
            self.leases_looked_at = now
            lease_due = self._lease_due(now)
        return Snapshot(
            nodes=self.view.node_snaps(now),
            sandboxes=self.view.sandbox_snaps(now, lease_due),
            requests=requests,
            templates=templates,
            peaks=self.peaks.peaks(now),
            leased={key: n for key, n in self.view.assigned.items() if n},
            cloud=cloud,
            prewarms=self.prewarms.snaps(now),
            acquire_rates=self.acquire_rates.rates(now),
            create_s=self.actuator.create_times.means,
            reset_s=self.actuator.reset_times.means,
            seed=self.ticks,
        )

    def _lease_due(self, now: float) -> Callable[[SandboxEntry], bool]:
        """Whether a lease may be due for a freeze or an expiry in its pool. One that is
        not is told when it may be at the earliest (its `lease_not_due_before`): at
        DSec's scale a look goes through 380,000 leases, nearly none of them due."""
        # each pool's timers read once: this runs on every lease at every look
        timers = {
            name: (p.max_lease_s, p.lease_idle_freeze_s, p.lease_idle_timeout_s)
            for name, p in self.config.pools.items()
        }
        if timers != self._lease_timers:  # what the leases were told may be wrong now
            self._lease_timers = timers
            for state in (SandboxState.LEASED, SandboxState.LEASED_PAUSED):
                for entry in self.view.by_state[state].values():
                    entry.lease_not_due_before = -math.inf

        def due(entry: SandboxEntry) -> bool:
            pool_timers = timers.get(entry.pool)
            if pool_timers is None:
                return False
            max_lease_s, freeze_s, timeout = pool_timers
            due_at = math.inf  # the earliest instant it may be due, as it is now
            if max_lease_s is not None and entry.leased_at is not None:
                if now - entry.leased_at >= max_lease_s:
                    return True
                due_at = entry.leased_at + max_lease_s
            idle_since = entry.idle_since
            if idle_since is not None:  # else a command runs: neither idle nor lapsed
                # a frozen lease is not due for a freeze again: left out until it may
                # expire (otherwise every frozen lease would be in every look's snapshot)
                if entry.state == SandboxState.LEASED:
                    if now - idle_since >= freeze_s:
                        return True
                    due_at = min(due_at, idle_since + freeze_s)
                if timeout is not None:
                    active_at = max(idle_since, entry.renewed_at or idle_since)
                    if now - active_at >= timeout:
                        return True
                    due_at = min(due_at, active_at + timeout)
            # a little earlier than the sums say: the checks above subtract, and must
            # decide whenever they would
            entry.lease_not_due_before = due_at - LEASE_DUE_MARGIN_S
            return False

        return due

    def apply(self, actions: list[Action], now: float) -> None:
        for action in actions:
            match action:
                case Claim():
                    if req := self.queues.get(action.request_id):
                        self.prewarms.served(req.pool, req.template, req.owner, now)
                        self.acquire_rates.observe((req.pool, req.template), now)
                    self.leases.claim(action, now)
                case Unplaceable():
                    self.leases.unplaceable(action)
                case ExpireLease():
                    self.leases.expire(action, now)
                case _:
                    if isinstance(action, Create) and action.reason == PREWARM_REASON:
                        self.metrics.scale_events.labels(action.pool, "prewarm").inc()
                    self.actuator.carry_out(action, now)

    # --- what agents and operators say ------------------------------------------------

    def on_report(self, report: NodeReport) -> ReportAck:
        """Apply a heartbeat; the answer tells its agent what to send next."""
        now = self.clock.now()
        self.sandbox_seconds.account(now)
        changes = self.view.apply_report(report, now)
        for pool, seconds in changes.busy_s.items():
            self.metrics.busy_seconds.labels(pool).inc(seconds)
        if changes.unproven:
            self.metrics.unproven_leases.labels(report.node_id).inc(len(changes.unproven))
            log.warning(
                "node %s reported leases this control plane did not grant (no valid grant "
                "proof), not taken: %s",
                report.node_id,
                ", ".join(changes.unproven[:10]),
            )
        self.leases.learn(changes.added)
        for entry in changes.vanished:
            if entry.state == SandboxState.LOST:
                outcome = report.lost.get(entry.id, "node_lost")
                self.leases.outcomes.ended(entry, outcome, LOST_CAUSES[outcome])
        self.wake()
        return changes.ack

    def set_pool(self, name: str, params: PoolParams) -> None:
        unknown = [t for t in params.templates if t not in self.config.templates]
        if unknown:
            raise ApiError(
                422,
                "unknown_template",
                f"pool {name!r} names unknown templates",
                [{"loc": "templates", "msg": f"unknown: {unknown}"}],
            )
        if refused := not_recyclable(params, self.config.templates):
            raise ApiError(
                422,
                "template_not_recyclable",
                f"pool {name!r} cannot recycle templates that do not allow it: {refused}",
                [{"loc": "recycle", "msg": f"templates with recyclable false: {refused}"}],
            )
        self.config.pools[name] = params
        self.wake()

    def image_sent(self, image: str) -> bool:
        """Whether `image` is being sent to the nodes that lack it."""
        return self.images is not None and self.images.available(image)

    def pools_keeping(self, template: str) -> list[str]:
        """The pools that keep `template` warm (their `templates` name it)."""
        return sorted(p for p, params in self.config.pools.items() if template in params.templates)

    def nodes_with_image(self, image: str) -> list[str]:
        """The nodes whose last report says their engine holds `image`."""
        ref = normalise_image_ref(image)
        return sorted(n.id for n in self.view.nodes.values() if ref in n.images)

    def set_template(self, spec: TemplateSpec) -> list[SandboxEntry]:
        """Add or change a template live; a change retires the sandboxes made from the
        old one (policy rule 10), which it returns. An ApiError says why it cannot be:
        no node holds its image and none is being sent, or a pool recycles it and it
        does not allow that."""
        holders = self.nodes_with_image(spec.image)
        if not self.image_sent(spec.image) and not any(self.view.nodes[n].healthy for n in holders):
            raise ApiError(
                422,
                "image_not_found",
                f"no node holds image {spec.image!r} of template {spec.name!r}, and the "
                "control plane's host has none to send",
                [{"loc": "image", "msg": "build it (dsec template build) or load it on a node"}],
            )
        templates = {**self.config.templates, spec.name: spec}
        for pool, params in self.config.pools.items():
            if refused := not_recyclable(params, templates):
                raise ApiError(
                    422,
                    "template_not_recyclable",
                    f"pool {pool!r} recycles template {spec.name!r}: it must allow that",
                    [{"loc": "recyclable", "msg": f"pool {pool!r} has recycle on: {refused}"}],
                )
        old = self.config.templates.get(spec.name)
        self.config.templates[spec.name] = spec
        changed = old is not None and old != spec
        retired = self.view.retire_template(spec.name) if changed else []
        log.info(
            "template %s %s (image %s)%s",
            spec.name,
            "added" if old is None else "changed" if changed else "kept as it was",
            spec.image,
            f": {len(retired)} sandboxes of the old one retire" if retired else "",
        )
        self.wake()
        return retired

    def delete_template(self, name: str) -> list[SandboxEntry]:
        """Remove a template live: its sandboxes retire (its idle ones go now, its leases
        run to their end), and they are returned. An ApiError when it is unknown or a
        pool keeps it warm."""
        if name not in self.config.templates:
            raise ApiError(404, "unknown_template", f"no template named {name!r}")
        if users := self.pools_keeping(name):
            raise ApiError(
                409,
                "template_in_use",
                f"template {name!r} is kept warm by pool {users[0]!r}"
                + (f" (and {len(users) - 1} more)" if len(users) > 1 else "")
                + ": take it out of the pool's templates first",
                [{"loc": "pools", "msg": f"pools listing it: {users}"}],
            )
        del self.config.templates[name]
        retired = self.view.retire_template(name)
        log.info("template %s removed: %d sandboxes retire", name, len(retired))
        self.wake()
        return retired

    def prewarm(
        self,
        pool: str,
        body: PrewarmRequest,
        owner: str | None = None,
        quota: ClientQuota | None = None,
    ) -> PrewarmInfo:
        """An announced burst of client `owner` (controlplane/prewarm.py): raises `pool`'s
        warm target by `body.count` until it expires; an ApiError says what `quota`
        (None: no limit) or the pool does not allow."""
        accepted = self.prewarms.accept(
            pool, body, owner, quota, self.config, self.view, self.clock.now(),
            self.clock.wall(), self.actuator.create_times.means,
        )  # fmt: skip
        if body.count > 0:
            meets = "true" if accepted.meets_deadline else "false"
            self.metrics.prewarms.labels(pool, meets).inc()
        self.wake()
        return accepted

    async def drain(self) -> None:
        await self.actuator.drain()


def build_scheduler(
    config: ControlPlaneConfig,
    agents: AgentClient,
    clock: Clock,
    *,
    cloud: CloudProvider | None = None,
    policy: Policy | None = None,
    confirm_grace_s: float | None = None,
    ids: Callable[[int], str] = secrets.token_hex,
) -> Scheduler:
    """The scheduler with its view, queues and metrics, as the app, the simulator and
    the test harness all run it. `confirm_grace_s`: how long a report may lag behind an
    outcome the control plane saw (two heartbeat timeouts unless said; 0 where reports
    are never late, as in the simulator). `ids`: where sandbox and request ids come from
    (hex of n bytes)."""
    if confirm_grace_s is None:
        confirm_grace_s = 2 * config.heartbeat_timeout_s
    metrics = ControlPlaneMetrics()
    view = ClusterView(confirm_grace_s=confirm_grace_s, identities=Identities.of(config))
    queues = RequestQueues()
    scheduler = Scheduler(config, view, queues, agents, clock, metrics, cloud, policy, ids)
    metrics.watch(
        ViewCollector(
            view,
            queues,
            lambda: list(config.pools),
            clock.now,
            lambda: scheduler.prewarms.targets(clock.now()),
        )
    )
    return scheduler


def _lease_timers(params: PoolParams) -> list[float]:
    """A pool's timers on leases: idle freezing, and its expiries if set."""
    timers = [params.lease_idle_freeze_s, params.max_lease_s, params.lease_idle_timeout_s]
    return [t for t in timers if t is not None]
