"""Acquire and release: requests and their futures, idempotency keys, spent keys,
the reservations of cold creates, and what a lease looks like to its client.

An acquire queues a request and waits on its future; the policy's Claim hands it a
sandbox (`claim`, which makes the agent call through the actuator) and its
Unplaceable says why none can be had (`unplaceable`: the acquire fails now when the
reason is final, and otherwise its timeout says it).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable

from controlplane.actuator import Actuator
from controlplane.agents import CallResult
from controlplane.config import ControlPlaneConfig, unknown_name
from controlplane.metrics import ControlPlaneMetrics
from controlplane.queue import PendingRequest, RequestQueues, scoped_key
from controlplane.spent import SpentKeys
from controlplane.view import ClusterView, SandboxEntry
from dsec.clock import Clock
from dsec.httpkit import ApiError, token_matches
from dsec.models import AcquireRequest, Lease, LeaseGrant, SandboxInfo
from dsec.policy import Claim, Unplaceable
from dsec.recent import TOMBSTONES, RecentMap
from dsec.states import ASSIGNED, SandboxState
from dsec.tokens import LEASE_TOKEN_HEADER, lease_token, new_lease_id

log = logging.getLogger(__name__)


class Leases:
    def __init__(
        self,
        config: ControlPlaneConfig,
        view: ClusterView,
        queues: RequestQueues,
        actuator: Actuator,
        clock: Clock,
        metrics: ControlPlaneMetrics,
        wake: Callable[[], None],
    ) -> None:
        self.config = config
        self.view = view
        self.queues = queues
        self.actuator = actuator
        self.clock = clock
        self.metrics = metrics
        self.wake = wake
        # scoped idempotency key -> the waiting request, or the id of the sandbox it got
        self.by_key: dict[str, PendingRequest | str] = {}
        # keys whose sandbox was released: reusing one is refused, not a fresh sandbox
        self.spent_keys = SpentKeys(
            config.state_dir / "spent-keys.jsonl" if config.state_dir else None, TOMBSTONES
        )
        self.started_at = clock.now()
        # sandbox -> the lease it was last recycled from: a late release with that lease's
        # token learns it was released, not that it is forbidden
        self.recycled: RecentMap[str, str] = RecentMap(TOMBSTONES)

    # --- what the policy decided ------------------------------------------------------

    def claim(self, action: Claim, now: float) -> None:
        req = self.queues.get(action.request_id)
        entry = self.view.sandboxes.get(action.sandbox_id)
        if req is None or entry is None or req.done.done():
            return
        log.debug("claim %s for %s (%s): %s", entry.id, req.id, action.path, action.reason)
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

        async def run() -> None:
            result = await self.actuator.call(entry, self.actuator.agents.lease, entry.id, grant)
            self._on_leased(entry, req, action.path, result)

        self.actuator.spawn(entry, run())

    def _on_leased(
        self, entry: SandboxEntry, req: PendingRequest, path: str, result: CallResult
    ) -> None:
        now = self.clock.now()
        if not result.ok:
            entry.op_in_flight = False
            self.actuator.failed(entry, "lease", result)
            req.claimed = False  # back in the queue, first in line by its arrival time
            self.actuator.destroy(entry, now, "destroy")
            self.wake()
            return
        self.actuator.confirmed(entry, now)
        if req.done.done():  # its client gave up while the lease was being made
            self.actuator.destroy(entry, now, "destroy")
            return
        self.queues.remove(req)
        self._unreserve(req)
        if req.scoped_key:
            self.by_key[req.scoped_key] = entry.id
        schedule_s = now - req.arrived_at
        self.metrics.schedule_latency.labels(entry.pool, path).observe(schedule_s)
        self.metrics.acquires.labels(entry.pool, "served").inc()
        req.done.set_result(self.lease_of(entry, path, schedule_s * 1000))

    def unplaceable(self, action: Unplaceable) -> None:
        req = self.queues.get(action.request_id)
        if req is None or req.done.done():
            return
        if req.unplaced != action.reason:  # once per request and reason: ticks repeat it
            req.unplaced = action.reason
            self.metrics.unplaced.labels(req.pool, action.code).inc()
            log.info("acquire %s (pool %s) cannot be placed: %s", req.id, req.pool, action.reason)
        if action.final:  # its client is waiting: the API answers 422 (and counts it)
            req.done.set_exception(ApiError(422, "template_unavailable", action.reason))
            self._forget_request(req)

    # --- what clients ask -------------------------------------------------------------

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
        for field, name, known in (
            ("pool", body.pool, self.config.pools),
            ("template", body.template, self.config.templates),
        ):
            if name not in known:
                raise unknown_name(field, name, known)
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
            why = f" ({req.unplaced})" if req.unplaced else ""
            raise ApiError(
                503,
                "acquire_timeout",
                f"no sandbox was ready within {timeout_s} s{why}; retry later",
            ) from None
        except asyncio.CancelledError:
            if not req.done.done() or req.done.cancelled():
                self._abandon(req, "cancelled")
            elif req.done.exception() is None:
                # the client left after its lease was made: give the sandbox back
                entry = self.view.sandboxes.get(req.done.result().id)
                if entry is not None:
                    self.actuator.destroy(entry, self.clock.now(), "destroy")
            raise

    def _abandon(self, req: PendingRequest, outcome: str) -> None:
        self.metrics.acquires.labels(req.pool, outcome).inc()
        req.done.cancel()  # a lease still in flight sees this and gives its sandbox back
        self._forget_request(req)

    def _forget_request(self, req: PendingRequest) -> None:
        self.queues.remove(req)
        if req.scoped_key and self.by_key.get(req.scoped_key) is req:
            del self.by_key[req.scoped_key]
        self._unreserve(req)
        self.wake()

    def _unreserve(self, req: PendingRequest) -> None:
        """A request served or gone frees the sandbox created for it: it joins the warm pool."""
        entry = self.view.sandboxes.get(req.reservation) if req.reservation else None
        req.reservation = None
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
            if (old := self.recycled.get(sandbox_id)) and token_matches(
                proof, [lease_token(self.config.agent_token, entry.id, old)]
            ):
                raise ApiError(409, "already_released", f"sandbox {sandbox_id} was released")
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
        if entry.lease_id is None:  # its lease ended already: a recycle is resetting it
            raise ApiError(409, "already_released", f"sandbox {sandbox_id} is being released")
        self.metrics.episodes.labels(entry.pool).inc()
        key = scoped_key(entry.owner, entry.idempotency_key)
        lease_id, recycle = entry.lease_id, self.recycles(entry)
        if recycle:
            # the lease ends now, before anything is awaited: its token is void at once
            self.recycled.add(entry.id, lease_id)
            entry.lease_id = entry.owner = entry.idempotency_key = None
            entry.labels = {}
        if key:
            self.by_key.pop(key, None)
            await self.spent_keys.add(key, entry.id)
        # a pause or thaw under way finishes first (one a tick started while the last was
        # awaited too: the removal or reset below must not find a call in flight)
        while (in_flight := self.actuator.in_flight(sandbox_id)) is not None:
            await asyncio.shield(in_flight)
        now = self.clock.now()
        task = None
        if recycle and entry.state in ASSIGNED:
            task = self.actuator.recycle(entry, lease_id, now)
        if task is None:
            task = self.actuator.destroy(entry, now, "release")
        if task is not None:
            await asyncio.shield(task)  # a recycle's answer: warm again, or removed
        return entry

    def recycles(self, entry: SandboxEntry) -> bool:
        """Whether releasing `entry` resets it into the warm pool instead of removing it:
        its pool has `recycle` on and its template allows it (`recyclable`)."""
        params = self.config.pools.get(entry.pool)
        template = self.config.templates.get(entry.template)
        return bool(params and params.recycle and template and template.recyclable)

    def learn(self, entries: list[SandboxEntry]) -> None:
        """Sandboxes a heartbeat taught the view (after a restart): their keys count again."""
        for entry in entries:
            key = scoped_key(entry.owner, entry.idempotency_key)
            if key and entry.state in ASSIGNED:
                self.by_key.setdefault(key, entry.id)


def _key_spent(key: str | None, sandbox_id: str) -> ApiError:
    return ApiError(
        409,
        "idempotency_key_spent",
        f"idempotency key {key!r} belonged to sandbox {sandbox_id}, now released",
    )
