"""Fork: `POST /v1/sandboxes/{id}/fork` (docs/contracts.md, "Fork").

A GRPO step runs K rollouts from one starting state, and a tree search branches from a
state mid-episode. A fork makes `count` new leases whose work dir and /tmp are copies of
the source's as they are at the call: its node takes the copy (agent/snapshots.py), then
`count` requests of the source's template join the queue, each a personalised claim
whose grant names the copy (LeaseGrant.fork_from). The policy serves them like any
acquire (warm sandboxes first) and spreads them over nodes (RequestSnap.spread); each
node reads the copy from the source's node, agent to agent, before its lease is
answered. The source keeps running and is not linked to its forks: either may be
released alone. A fork is all or nothing: if one copy fails or is not ready in time,
the leases already made are given back, and the caller gets none.
"""

from __future__ import annotations

import asyncio
import logging
import secrets

from pydantic import ValidationError

from controlplane.agents import AgentClient
from controlplane.claims import Personal
from controlplane.config import ControlPlaneConfig, unknown_name
from controlplane.leases import Leases
from controlplane.metrics import ControlPlaneMetrics
from controlplane.prewarm import room_for
from controlplane.queue import PendingRequest, RequestQueues
from controlplane.view import ClusterView, NodeEntry
from dsec.clock import Clock
from dsec.httpkit import ApiError
from dsec.models import MAX_FORK, Forked, ForkRequest, ForkSource, Lease, SnapshotMade
from dsec.states import ASSIGNED, SandboxState
from dsec.tokens import LEASE_TOKEN_HEADER

log = logging.getLogger(__name__)

# the free sandboxes a fork's copies may take at once: warm or frozen, not being made
FREE = (SandboxState.WARM, SandboxState.PAUSED, SandboxState.HIBERNATED)


class Forks:
    def __init__(
        self,
        config: ControlPlaneConfig,
        view: ClusterView,
        queues: RequestQueues,
        leases: Leases,
        agents: AgentClient,
        clock: Clock,
        metrics: ControlPlaneMetrics,
    ) -> None:
        self.config = config
        self.view = view
        self.queues = queues
        self.leases = leases
        self.agents = agents
        self.clock = clock
        self.metrics = metrics

    async def fork(
        self, sandbox_id: str, proof: str | None, owner: str | None, body: ForkRequest
    ) -> Forked:
        """`proof` is the caller's lease token on the source (None: an operator's call);
        `owner` the client the forks are leased to."""
        started = self.clock.now()
        entry = self.view.sandboxes.get(sandbox_id)
        if entry is None:
            raise ApiError(404, "unknown_sandbox", f"no sandbox {sandbox_id}")
        if proof is not None and not self.leases.holds(entry, proof):
            raise ApiError(
                403,
                "forbidden",
                f"forking {sandbox_id} takes its lease token ({LEASE_TOKEN_HEADER})",
            )
        if entry.state not in ASSIGNED or entry.lease_id is None:
            raise ApiError(409, "not_leased", f"sandbox {sandbox_id} is {entry.state}, not leased")
        pool = body.pool or entry.pool
        if pool not in self.config.pools:
            raise unknown_name("pool", pool, self.config.pools)
        spec = self.config.templates.get(entry.template)
        if spec is None or entry.retired:
            raise ApiError(
                409,
                "template_changed",
                f"sandbox {sandbox_id}'s template {entry.template!r} was changed or removed "
                "since it was made: a fork would not be its copy",
            )
        quota = self.config.quota_of(owner) if owner is not None else None
        if quota is not None:
            self.leases.check_allowed(quota, pool, 0)
        self._check_fits(body.count, pool, entry.template, owner, started)
        node = self.view.nodes.get(entry.node)
        if node is None:
            raise ApiError(409, "node_lost", f"sandbox {sandbox_id}'s node is not known")
        result = await self.agents.snapshot(node, entry.id)
        made = _snapshot_of(result.answer) if result.ok else None
        if made is None:
            self.metrics.forks.labels(pool, "failed").inc()
            # a file of the sandbox's that its own user may not read is the workload's
            # doing (422), not the caller's credential (the node's 403)
            status = 502 if result.node_fault or result.ok else result.status
            if result.code == "permission_denied":
                status = 422
            raise ApiError(
                status, "snapshot_failed", f"node {node.id} could not copy {sandbox_id}: "
                f"{result.code}: {result.message}"
            )  # fmt: skip
        copied = self.clock.now()
        landed: set[str] = set()  # the nodes the copies went to, which fetched it
        try:
            leases = await self._leases_of(body, pool, entry.template, owner, node, made, landed)
        finally:
            for node_id in {node.id, *landed}:
                if (held := self.view.nodes.get(node_id)) is not None:
                    self._drop_later(held, made.snapshot)
        self.metrics.forks.labels(pool, "forked").inc()
        done = self.clock.now()
        log.info(
            "forked %s into %d (%d bytes): copy %.0f ms, all usable %.0f ms",
            sandbox_id, len(leases), made.bytes, (copied - started) * 1000, (done - started) * 1000,
        )  # fmt: skip
        return Forked(
            source=sandbox_id,
            leases=leases,
            bytes=made.bytes,
            snapshot_ms=(copied - started) * 1000,
            fork_ms=(done - started) * 1000,
        )

    def _check_fits(
        self, count: int, pool: str, template: str, owner: str | None, now: float
    ) -> None:
        """`count` fits what the caller may hold and what the pool can serve now: its
        free sandboxes of the template and the room the nodes have for more. 422 saying
        what fits, before anything is copied or leased."""
        quota = self.config.quota_of(owner) if owner is not None else None
        limits: list[tuple[int, str]] = [(MAX_FORK, f"a fork makes at most {MAX_FORK}")]
        if quota is not None and quota.max_leases is not None:
            held = self.leases.held_by(owner)
            limits.append(
                (
                    max(0, quota.max_leases - held),
                    f"this client holds {held} leases of its max_leases {quota.max_leases}",
                )
            )
        free = self.view.count_unreserved(pool, template, FREE)
        waiting = sum(1 for r in self.queues.waiting() if r.pool == pool and r.template == template)
        room = room_for(self.config.templates[template], self.view, now)
        limits.append(
            (
                max(0, free + room - waiting),
                f"pool {pool} has {free} free sandboxes of template {template}, the nodes "
                f"room for {room} more, and {waiting} acquires wait for them",
            )
        )
        fits, why = min(limits, key=lambda limit: limit[0])
        if count > fits:
            self.metrics.forks.labels(pool, "refused").inc()
            raise ApiError(
                422,
                "fork_too_large",
                f"count {count} does not fit; at most {fits}: {why}",
                [{"loc": "count", "msg": f"at most {fits}"}],
            )

    async def _leases_of(
        self,
        body: ForkRequest,
        pool: str,
        template: str,
        owner: str | None,
        node: NodeEntry,
        made: SnapshotMade,
        landed: set[str],
    ) -> list[Lease]:
        """`body.count` leases on copies of `made`, or none and the first failure; the
        nodes of the sandboxes claimed for them are added to `landed`."""
        source = ForkSource(
            node=node.id,
            agent_url=node.url,
            snapshot=made.snapshot,
            token=made.token,
            roots=made.roots,
        )
        personal = Personal({}, None, None, body.timeout_s, fork_from=source)
        group = secrets.token_hex(8)
        requests = [
            PendingRequest(
                id=self.leases.ids(8),
                pool=pool,
                template=template,
                priority=0,
                arrived_at=self.clock.now(),
                idempotency_key=None,
                owner=owner,
                labels=dict(body.labels),
                personal=personal,
                spread=group,
            )
            for _ in range(body.count)
        ]
        for req in requests:
            self.queues.add(req)
        self.leases.wake()
        answers = await asyncio.gather(
            *(self.leases.await_lease(req, body.timeout_s) for req in requests),
            return_exceptions=True,
        )
        landed.update(req.claimed_on for req in requests if req.claimed_on is not None)
        leases = [a for a in answers if isinstance(a, Lease)]
        failures = [a for a in answers if not isinstance(a, Lease)]
        if not failures:
            return leases
        self.metrics.forks.labels(pool, "failed").inc()
        # nothing half-made: the copies made are never handed out
        for lease in leases:
            entry = self.view.sandboxes.get(lease.id)
            if entry is not None:
                self.leases.give_back_unserved(entry, "a copy beside it failed: never handed out")
        first = failures[0]
        if not isinstance(first, ApiError):
            raise first
        raise ApiError(
            first.status,
            first.code,
            f"{len(failures)} of {body.count} copies failed, none is kept: {first.message}",
            first.details,
        )

    def _drop_later(self, node: NodeEntry, snapshot_id: str) -> None:
        """The copies have read the snapshot (or failed): its node drops it."""
        self.leases.actuator.track(
            asyncio.ensure_future(self.agents.drop_snapshot(node, snapshot_id))
        )


def _snapshot_of(answer: dict | None) -> SnapshotMade | None:
    try:
        return SnapshotMade.model_validate(answer)
    except ValidationError:
        return None
