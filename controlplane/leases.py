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
import math
import secrets
from collections.abc import Callable

from controlplane.actuator import Actuator
from controlplane.agents import CallResult
from controlplane.claims import personal_of
from controlplane.config import ClientQuota, ControlPlaneConfig, unknown_name
from controlplane.identities import Identities
from controlplane.metrics import ControlPlaneMetrics
from controlplane.outcomes import LeaseOutcomes
from controlplane.queue import PendingRequest, RequestQueues, scoped_key
from controlplane.spent import KeyLog
from controlplane.view import ClusterView, SandboxEntry
from dsec.clock import Clock
from dsec.httpkit import ApiError
from dsec.models import AcquireRequest, Lease, LeaseGrant, LeaseRenewed, SandboxInfo
from dsec.policy import Claim, ExpireLease, Unplaceable
from dsec.recent import TOMBSTONES, RecentMap
from dsec.states import ASSIGNED, SandboxState
from dsec.tokens import (
    LEASE_TOKEN_HEADER,
    NO_EXPIRY,
    lease_token,
    lease_token_expiry,
    new_lease_id,
)

log = logging.getLogger(__name__)
HELD_KEYS = 1_000_000  # at most one per live lease: far above what a cluster holds
REPORT_POLL_S = 0.1  # how often a retry waiting for its sandbox's node looks again


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
        ids: Callable[[int], str] = secrets.token_hex,
    ) -> None:
        self.ids = ids
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
        state = config.state_dir
        self.spent_keys = KeyLog(state / "spent-keys.jsonl" if state else None, TOMBSTONES)
        # keys that hold a live lease: a retry after a restart waits for that sandbox
        self.held_keys = KeyLog(state / "held-keys.jsonl" if state else None, HELD_KEYS)
        self.started_at = clock.now()
        # sandbox -> the lease it was last recycled from, and that lease's client: a late
        # release with that lease's token learns it was released, not that it is forbidden
        self.recycled: RecentMap[str, tuple[str, str | None]] = RecentMap(TOMBSTONES)
        # lease tokens are made with the lease key of the sandbox's node
        self.identities = Identities.of(config)
        # sandboxes whose lease expired -> why: their clients hear 410 lease_expired
        self.expired: RecentMap[str, str] = RecentMap(TOMBSTONES)
        self.outcomes = LeaseOutcomes(clock, metrics)

    # --- what the policy decided ------------------------------------------------------

    def claim(self, action: Claim, now: float) -> None:
        req = self.queues.get(action.request_id)
        entry = self.view.sandboxes.get(action.sandbox_id)
        if req is None or entry is None or req.done.done():
            return
        log.debug("claim %s for %s (%s): %s", entry.id, req.id, action.path, action.reason)
        # A running sandbox its agent vouches for is served at once: its lease token
        # proves the lease to its agent, which takes it up from the client's first call
        # if the grant is not there yet (dsec/tokens.py). A frozen one waits for its
        # agent to thaw it, and one its agent may have lost for the grant's answer.
        # A personalised claim is answered once its node has applied it. So is one with
        # a key of the client's own, which it may send again once answered (after its
        # own restart): a control plane killed between an earlier answer and the grant
        # would leave the key a lease no node reports, which no restart can give back
        # (a key the client made for this acquire, `new_key`, only its unanswered
        # retries send again).
        at_once = (
            req.personal is None
            and (req.scoped_key is None or req.new_key)
            and entry.state == SandboxState.WARM
            and self.view.vouched_warm(entry, now)
        )
        lease_id = new_lease_id()
        grant = LeaseGrant(
            lease_id=lease_id,
            pool=req.pool,
            idempotency_key=req.idempotency_key,
            owner=req.owner,
            labels=req.labels,
            request_id=req.id,
            grant_proof=self.identities.grant_proof(
                entry.node, entry.id, lease_id, req.owner, req.idempotency_key, req.pool
            ),
        )
        if req.personal is not None:
            grant = req.personal.applied_to(grant, now - req.arrived_at)
        self.view.move(entry, SandboxState.LEASED, now)
        self.view.set_pool(entry, req.pool)  # a higher-priority pool may have taken it over
        entry.granted(grant, self._token_deadline(req.pool), now)
        req.claimed, req.claimed_on = True, entry.node
        if action.path == "thaw":
            self.metrics.scale_events.labels(entry.pool, "thaw").inc()
        # the key on disk before its node is asked: a restart mid-call still knows the
        # key's sandbox. Then served here, in the tick, where it can be: its client is
        # answered before the grant and the tick's creates are sent (a send that wakes an
        # agent costs the control plane's loop up to a millisecond on a busy node)
        key_kept = req.scoped_key is None or self.held_keys.add_now(req.scoped_key, entry.id)
        served = at_once and key_kept
        if served:  # (timed to now, not the tick's start: its decision is part of it)
            self._serve(entry, req, action.path, self.clock.now())

        async def run(served: bool) -> None:
            # a personalised claim is work its node does while the client waits: the next
            # one is claimed on a node that does less (dsec/policy.py, NodeSnap.applying)
            applying = req.personal is not None
            if applying:
                self.view.applying(entry.node, +1)
            try:
                if not key_kept:
                    assert req.scoped_key is not None
                    await self.held_keys.add(req.scoped_key, entry.id)
                    served = at_once and not req.done.done()
                    if served:
                        self._serve(entry, req, action.path, self.clock.now())
                asked = self.clock.now()
                result = await self.actuator.call(
                    entry, self.actuator.agents.lease, entry.id, grant
                )
            finally:
                if applying:
                    self.view.applying(entry.node, -1)
            if applying:
                req.setup_ms = (self.clock.now() - asked) * 1000
            self._on_leased(entry, req, action.path, result, served)

        self.actuator.spawn(entry, run(served))

    def _on_leased(
        self,
        entry: SandboxEntry,
        req: PendingRequest,
        path: str,
        result: CallResult,
        served: bool,
    ) -> None:
        """The agent's answer to the grant; `served` says whether its client has the
        lease already (a running sandbox is served before the agent answers)."""
        now = self.clock.now()
        if served:
            if result.ok:
                entry.call_confirmed(now)
            else:  # its client holds a lease the node refused: it ends, and it is told why
                self.actuator.failed(entry, "lease", result)
                refused = ExpireLease(entry.id, f"its node refused it ({result.code})")
                self.outcomes.ended(entry, "node_lost", f"{refused.reason}: {result.message}")
                self.expire(refused, now)
            return
        if req.scoped_key and (not result.ok or req.done.done()):
            # the key holds nothing after all (the sandbox goes below)
            self.actuator.track(asyncio.ensure_future(self.held_keys.drop(req.scoped_key)))
        if not result.ok and result.code == "setup_failed":
            # the claim's own command failed: its client hears how, and no other
            # sandbox is tried for it; the node removed this one
            if not req.done.done():
                req.fail(ApiError(422, "setup_failed", result.message, result.details))
                self._forget_request(req)
            self.outcomes.ended(entry, "setup_failed", result.message)
            entry.call_confirmed(now)
            self.actuator.destroy(entry, now, "destroy")
            return
        if not result.ok:
            self.actuator.failed(entry, "lease", result)
            req.claimed = False  # back in the queue, first in line by its arrival time
            self.actuator.destroy(entry, now, "destroy")
            self.wake()
            return
        entry.call_confirmed(now)
        if req.done.done():  # its client gave up while the lease was being made
            self.actuator.destroy(entry, now, "destroy")
            return
        self._serve(entry, req, path, now)

    def _serve(self, entry: SandboxEntry, req: PendingRequest, path: str, now: float) -> None:
        """Answer `req` with the lease on `entry`."""
        self.queues.remove(req)
        self._unreserve(req)
        if req.scoped_key:
            self.by_key[req.scoped_key] = entry.id
        schedule_s = now - req.arrived_at
        self.metrics.schedule_latency.labels(entry.pool, path).observe(schedule_s)
        self.metrics.acquires.labels(entry.pool, "served").inc()
        lease = self.lease_of(entry, path, schedule_s * 1000)
        lease.setup_ms = req.setup_ms
        req.answer(lease)

    def expire(self, action: ExpireLease, now: float) -> None:
        """End a lease its client let lapse (or its node refused after it was served):
        its key is spent (a retry gets 409, not a second sandbox), the sandbox goes, and
        its client hears 410 lease_expired, from here and from the agent."""
        entry = self.view.sandboxes.get(action.sandbox_id)
        if entry is None or entry.state not in ASSIGNED or entry.lease_id is None:
            return  # released or gone meanwhile
        log.info("lease on %s expired: %s", entry.id, action.reason)
        self.outcomes.ended(entry, action.outcome, action.reason)
        self.expired.add(entry.id, action.reason)
        self.metrics.leases_expired.labels(entry.pool).inc()
        key = scoped_key(entry.owner, entry.idempotency_key)
        entry.lease_expired()

        async def run() -> None:
            if key:
                self.by_key.pop(key, None)
                await self.spent_keys.add(key, entry.id)
                await self.held_keys.drop(key)
            if task := self.actuator.destroy(entry, self.clock.now(), "expire"):
                await task

        self.actuator.track(asyncio.ensure_future(run()))

    def renew(self, entry: SandboxEntry) -> LeaseRenewed:
        """The lease's client is alive: its idle timeout starts again (max_lease_s does
        not move)."""
        if entry.state not in ASSIGNED or entry.lease_id is None:
            raise ApiError(409, "not_leased", f"sandbox {entry.id} is not leased")
        now = self.clock.now()
        entry.renewed(now)
        params = self.config.pools.get(entry.pool)
        ends_in = [
            (entry.leased_at or now) + params.max_lease_s - now
            if params and params.max_lease_s is not None
            else None,
            params.lease_idle_timeout_s if params else None,
        ]
        return LeaseRenewed(
            id=entry.id,
            idle_timeout_s=params.lease_idle_timeout_s if params else None,
            expires_in_s=min((t for t in ends_in if t is not None), default=None),
        )

    def check_not_expired(self, sandbox_id: str) -> None:
        if (why := self.expired.get(sandbox_id)) is not None:
            raise ApiError(410, "lease_expired", f"the lease on {sandbox_id} expired: {why}")

    def unplaceable(self, action: Unplaceable) -> None:
        req = self.queues.get(action.request_id)
        if req is None or req.done.done():
            return
        if req.unplaced != action.reason:  # once per request and reason: ticks repeat it
            req.unplaced = action.reason
            self.metrics.unplaced.labels(req.pool, action.code).inc()
            log.info("acquire %s (pool %s) cannot be placed: %s", req.id, req.pool, action.reason)
        if action.final:  # its client is waiting: the API answers 422 (and counts it)
            req.fail(ApiError(422, "template_unavailable", action.reason))
            self._forget_request(req)

    # --- what clients ask -------------------------------------------------------------

    def lease_of(self, entry: SandboxEntry, path: str, schedule_ms: float) -> Lease:
        assert entry.lease_id is not None
        return Lease(
            **self._info_fields(entry),
            lease_id=entry.lease_id,
            lease_token=self.token_of(entry),
            path=path,
            schedule_ms=schedule_ms,
            lease_idle_timeout_s=self.config.pools[entry.pool].lease_idle_timeout_s
            if entry.pool in self.config.pools
            else None,
        )

    def token_of(self, entry: SandboxEntry) -> str:
        """The lease token of `entry`'s lease (dsec/tokens.py): the same every time asked."""
        assert entry.lease_id is not None
        return lease_token(
            self.identities.lease_key(entry.node),
            entry.id,
            entry.lease_id,
            entry.owner,
            entry.token_expiry(self._token_deadline(entry.pool)),
        )

    def _token_deadline(self, pool: str) -> int:
        """The Unix second a new lease's token stops working: its pool's max_lease_s from
        now, or never. Kept on the lease, so that its token does not change; its agent
        refuses the token past it, even if this control plane cannot reach it then."""
        params = self.config.pools.get(pool)
        if params is None or params.max_lease_s is None:
            return NO_EXPIRY
        return math.ceil(self.clock.wall() + params.max_lease_s)

    def holds(self, entry: SandboxEntry, proof: str) -> bool:
        """Whether `proof` is a token of `entry`'s lease now."""
        return entry.lease_id is not None and self._holds(entry, proof, entry.lease_id, entry.owner)

    def _holds(self, entry: SandboxEntry, proof: str, lease_id: str, owner: str | None) -> bool:
        """Whether `proof` is a token of that lease on `entry` (past its expiry or not:
        releasing what has ended harms no one)."""
        key = self.identities.lease_key(entry.node)
        return lease_token_expiry(key, proof, entry.id, lease_id, owner) is not None

    def holding(self, lease_id: str) -> SandboxEntry | None:
        """The sandbox that holds lease `lease_id` now (a lost one's lease stands until its
        outcome is told), if any."""
        for state in (*ASSIGNED, SandboxState.LOST):
            for entry in self.view.by_state[state].values():
                if entry.lease_id == lease_id:
                    return entry
        return None

    def info_of(self, entry: SandboxEntry) -> SandboxInfo:
        return SandboxInfo(**self._info_fields(entry), lease_id=entry.lease_id)

    def _info_fields(self, entry: SandboxEntry) -> dict[str, object]:
        """What SandboxInfo and Lease say of `entry`, but its lease id (a Lease is made
        from these at every acquire, not through a SandboxInfo and a dump of it)."""
        node = self.view.nodes.get(entry.node)
        return {
            "id": entry.id,
            "node": entry.node,
            "agent_url": node.url if node else "",
            "pool": entry.pool,
            "template": entry.template,
            "state": entry.state,
            "created_at": entry.created_at,
            "labels": entry.labels,
        }

    async def acquire(self, body: AcquireRequest, owner: str | None = None) -> Lease:
        """`owner` is the client asking (dsec.tokens.client_id of its token); None for a
        caller in this process, such as the simulator."""
        for field, name, known in (
            ("pool", body.pool, self.config.pools),
            ("template", body.template, self.config.templates),
        ):
            if name not in known:
                raise unknown_name(field, name, known)
        personal = personal_of(
            body,
            self.config.templates[body.template],
            self.config.max_claim_files_bytes,
            self.clock.wall(),
        )
        quota = self.config.quota_of(owner) if owner is not None else None
        if quota is not None:
            self.check_allowed(quota, body.pool, body.priority)
        key = scoped_key(owner, body.idempotency_key)
        # (a key sent for the first time can be no lease's: nothing to wait to relearn)
        if key is not None and key not in self.by_key and not body.new_key:
            await self._resync(body.timeout_s)
            if key in self.held_keys:
                await self._await_reported(key, body.timeout_s)
        if key is not None and key in self.spent_keys:
            raise _key_spent(body.idempotency_key, self.spent_keys.sandbox_of(key))
        if key is not None and key in self.by_key:
            return await self._acquire_again(key, body)
        if quota is not None:
            self._check_room(quota, owner)
        req = PendingRequest(
            id=self.ids(8),
            pool=body.pool,
            template=body.template,
            priority=body.priority,
            arrived_at=self.clock.now(),
            idempotency_key=body.idempotency_key,
            owner=owner,
            labels=dict(body.labels),
            personal=personal,
            new_key=body.new_key,
        )
        self.queues.add(req)
        if key is not None:
            self.by_key[key] = req
        self.wake()
        return await self.await_lease(req, body.timeout_s)

    def check_allowed(self, quota: ClientQuota, pool: str, priority: int) -> None:
        """What the client may ask for at all: 403 naming the limit."""
        if quota.pools is not None and pool not in quota.pools:
            raise ApiError(
                403,
                "pool_not_allowed",
                f"this client may use pools {quota.pools}, not {pool!r}",
            )
        if quota.max_priority is not None and priority > quota.max_priority:
            raise ApiError(
                403,
                "priority_not_allowed",
                f"this client may ask for priority {quota.max_priority} at most (its "
                f"quota's max_priority), not {priority}",
                [{"loc": "priority", "msg": f"at most {quota.max_priority}"}],
            )

    def _check_room(self, quota: ClientQuota, owner: str) -> None:
        """What the client holds and waits for already: 429 naming the limit. A retry of
        an acquire it made (same key) is not a new one and is never refused here."""
        if quota.max_pending is not None:
            pending = sum(1 for r in self.queues.by_id.values() if r.owner == owner)
            if pending >= quota.max_pending:
                raise ApiError(
                    429,
                    "pending_quota",
                    f"this client has {pending} acquires waiting (max_pending {quota.max_pending})",
                )
        if quota.max_leases is not None:
            held = self.held_by(owner)
            if held >= quota.max_leases:
                raise ApiError(
                    429,
                    "lease_quota",
                    f"this client holds {held} leases (max_leases {quota.max_leases}); "
                    "release one first",
                )

    def held_by(self, owner: str) -> int:
        """The leases client `owner` holds."""
        return sum(
            1
            for state in ASSIGNED
            for e in self.view.by_state[state].values()
            if e.owner == owner and e.lease_id is not None
        )

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

    async def _await_reported(self, key: str, timeout_s: float) -> None:
        """A key that held a lease before a restart, whose node has not reported it yet:
        wait for the node (up to the caller's timeout), never make a second sandbox."""
        sandbox_id = self.held_keys.sandbox_of(key)
        deadline = self.clock.now() + timeout_s
        while key not in self.by_key and key in self.held_keys:
            if self.clock.now() >= deadline:
                raise ApiError(
                    503,
                    "lease_unreported",
                    f"this key holds sandbox {sandbox_id}, whose node has not reported since "
                    "the control plane restarted; retry later (or use another key)",
                )
            await self.clock.sleep(REPORT_POLL_S)

    async def _acquire_again(self, key: str, body: AcquireRequest) -> Lease:
        known = self.by_key[key]
        if isinstance(known, PendingRequest):
            return await self.await_lease(known, body.timeout_s)
        entry = self.view.sandboxes.get(known)
        if entry is None or entry.state not in ASSIGNED:
            raise _key_spent(body.idempotency_key, known)
        return self.lease_of(entry, "warm", 0.0)

    async def await_lease(self, req: PendingRequest, timeout_s: float) -> Lease:
        """Wait for `req`'s lease up to this caller's own timeout. A retry with the same
        key waits on the same request: the request is given up only when its last
        waiter times out or leaves."""
        waiter = asyncio.get_running_loop().create_future()
        req.waiters.append(waiter)
        try:
            if not req.done.done():
                async with asyncio.timeout(timeout_s):
                    await waiter  # its own: a timeout or a cancel here leaves req.done be
            return req.done.result()
        except TimeoutError:
            if req.done.done() and not req.done.cancelled():
                return req.done.result()
            if len(req.waiters) == 1:
                self._abandon(req, "timed_out")
            why = f" ({req.unplaced})" if req.unplaced else ""
            raise ApiError(
                503,
                "acquire_timeout",
                f"no sandbox was ready within {timeout_s} s{why}; retry later",
            ) from None
        except asyncio.CancelledError:
            if len(req.waiters) > 1:
                raise  # another waiter still wants it
            if not req.done.done() or req.done.cancelled():
                self._abandon(req, "cancelled")
            elif req.done.exception() is None:
                # the client left after its lease was made: give the sandbox back
                entry = self.view.sandboxes.get(req.done.result().id)
                if entry is not None:
                    self.actuator.track(asyncio.ensure_future(self._give_back(entry)))
            raise
        finally:
            req.waiters.remove(waiter)

    def give_back_unserved(self, entry: SandboxEntry, why: str) -> None:
        """A lease made for a caller that will never be told of it (a fork whose other
        copies failed): it ends as a claim that failed, and its sandbox goes."""
        self.outcomes.ended(entry, "setup_failed", why)
        self.actuator.track(asyncio.ensure_future(self._give_back(entry)))

    async def _give_back(self, entry: SandboxEntry) -> None:
        """Remove a sandbox whose lease no one took, once its agent has answered the
        grant (a running sandbox's lease is answered while the grant is under way)."""
        await self.actuator.settled(entry.id)
        if entry.state in ASSIGNED:
            self.actuator.destroy(entry, self.clock.now(), "destroy")

    def _abandon(self, req: PendingRequest, outcome: str) -> None:
        self.metrics.acquires.labels(req.pool, outcome).inc()
        req.give_up()  # a lease still in flight sees this and gives its sandbox back
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
            entry.unreserved()

    async def release(self, sandbox_id: str, proof: str | None) -> SandboxEntry:
        """`proof` is the caller's lease token; None for an operator, who may release any."""
        self.check_not_expired(sandbox_id)
        entry = self.view.sandboxes.get(sandbox_id)
        if entry is None:
            if sandbox_id in self.view.released:
                raise ApiError(409, "already_released", f"sandbox {sandbox_id} was released")
            raise ApiError(404, "unknown_sandbox", f"no sandbox {sandbox_id}")
        if entry.state == SandboxState.DESTROYING:
            raise ApiError(409, "already_released", f"sandbox {sandbox_id} is being released")
        if proof is not None and not (
            entry.lease_id and self._holds(entry, proof, entry.lease_id, entry.owner)
        ):
            if (old := self.recycled.get(sandbox_id)) and self._holds(entry, proof, *old):
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
        if proof is None:
            self.outcomes.ended(entry, "evicted", "an operator removed it while it was leased")
        else:
            self.outcomes.ended(entry, "released", "its client released it")
        key = scoped_key(entry.owner, entry.idempotency_key)
        lease_id, recycle = entry.lease_id, self.recycles(entry)
        if recycle:
            self.recycled.add(entry.id, (lease_id, entry.owner))
            entry.released_to_recycle()
        if key:
            self.by_key.pop(key, None)
            await self.spent_keys.add(key, entry.id)
            await self.held_keys.drop(key)
        # a pause, thaw or grant under way finishes first: the removal or reset below
        # must not find a call in flight
        await self.actuator.settled(sandbox_id)
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
        its pool has `recycle` on and its template, as it was made from, allows it
        (`recyclable`; one since removed or changed never comes back)."""
        params = self.config.pools.get(entry.pool)
        template = self.config.templates.get(entry.template)
        return bool(
            params and params.recycle and template and template.recyclable and not entry.retired
        )

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
