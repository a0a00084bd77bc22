"""Lease lifetimes in the harness (the real scheduler, simulated agents, virtual time):
a lease whose client neither runs a command nor renews for the pool's
lease_idle_timeout_s ends, as does one past max_lease_s renewed or not; its sandbox
goes, its slot comes back, and its client hears 410 lease_expired."""

from __future__ import annotations

import asyncio

import pytest
from harness import Harness

from dsec.httpkit import ApiError
from dsec.models import PoolParams
from dsec.policy import ExpireLease, SandboxSnap, Snapshot, decide
from dsec.states import SandboxState as S

IDLE_TIMEOUT_S = 30.0
# no warm pool: what the agents hold is what the leases hold
LAPSING = PoolParams(min_warm=0, max_warm=0, templates=[], lease_idle_timeout_s=IDLE_TIMEOUT_S)


def leased(h: Harness) -> set[str]:
    return {i for i, state in h.on_agents().items() if state in (S.LEASED, S.LEASED_PAUSED)}


def test_a_lease_nobody_renews_ends_after_the_idle_timeout_and_its_client_hears_it():
    async def scenario(h: Harness) -> None:
        lease = await h.acquire(idempotency_key="k1")
        assert lease.lease_idle_timeout_s == IDLE_TIMEOUT_S
        await h.settle(IDLE_TIMEOUT_S * 0.8)
        assert leased(h) == {lease.id}  # not yet
        await h.settle(IDLE_TIMEOUT_S * 0.5)
        assert lease.id not in h.on_agents()  # its container is gone
        assert h.metric("dsec_leases_expired_total", pool="default") == 1
        [expired] = h.decided(ExpireLease)
        assert expired.sandbox_id == lease.id
        [destroy] = h.calls_of("destroy", lease.id)
        assert destroy.args == ("lease_expired",)  # what its agent tells the client
        with pytest.raises(ApiError) as e:
            await h.release(lease)
        assert (e.value.status, e.value.code) == (410, "lease_expired")
        with pytest.raises(ApiError) as e:  # the key is spent: never a second sandbox
            await h.acquire(idempotency_key="k1")
        assert e.value.code == "idempotency_key_spent"

    Harness(pools={"default": LAPSING}).run(scenario)


def test_renewals_keep_a_lease_and_it_ends_a_timeout_after_the_last():
    async def scenario(h: Harness) -> None:
        lease = await h.acquire()
        entry = h.scheduler.view.sandboxes[lease.id]
        for _ in range(10):  # five idle timeouts' worth, renewed three times per timeout
            await h.settle(IDLE_TIMEOUT_S / 3)
            renewed = h.scheduler.leases.renew(entry)
            assert renewed.idle_timeout_s == IDLE_TIMEOUT_S
        assert leased(h) == {lease.id}
        last = h.now()
        await h.settle(IDLE_TIMEOUT_S * 0.8)
        assert leased(h) == {lease.id}
        await h.settle(IDLE_TIMEOUT_S * 0.5)
        assert not h.on_agents()
        [decided_at] = [t for t, a in h.decisions if isinstance(a, ExpireLease)]
        assert IDLE_TIMEOUT_S <= decided_at - last <= IDLE_TIMEOUT_S * 1.1

    Harness(pools={"default": LAPSING}).run(scenario)


def test_max_lease_ends_a_lease_however_often_it_is_renewed():
    capped = LAPSING.model_copy(update={"max_lease_s": 50.0})

    async def scenario(h: Harness) -> None:
        lease = await h.acquire()
        await h.granted(lease)
        entry = h.scheduler.view.sandboxes[lease.id]
        expires_in = h.scheduler.leases.renew(entry).expires_in_s
        assert expires_in == pytest.approx(min(50.0, IDLE_TIMEOUT_S), abs=1)
        while lease.id in leased(h):
            await h.settle(5)
            if lease.id in h.scheduler.view.sandboxes:
                h.scheduler.leases.renew(h.scheduler.view.sandboxes[lease.id])
            assert h.now() < 70, "still leased past max_lease_s"
        assert h.now() >= 50
        assert [a.reason for a in h.decided(ExpireLease)] == ["lease past max_lease_s"]

    Harness(pools={"default": capped}).run(scenario)


def test_without_timeouts_a_lease_lasts():
    lasting = LAPSING.model_copy(update={"lease_idle_timeout_s": None})

    async def scenario(h: Harness) -> None:
        lease = await h.acquire()
        await h.settle(3600)
        assert lease.id in leased(h) and not h.decided(ExpireLease)

    Harness(pools={"default": lasting}).run(scenario)


def test_a_running_command_holds_the_lease_and_max_lease_does_not_wait_for_it():
    def snap(**fields) -> SandboxSnap:
        return SandboxSnap("n.0", "n", "default", "base", S.LEASED, 0.0, **fields)

    pools = {"default": LAPSING.model_copy(update={"max_lease_s": 500.0})}
    running = snap(leased_at=0.0, idle_since=None)  # a command runs: no idle time
    idle = snap(leased_at=0.0, idle_since=10.0, renewed_at=20.0)
    for now, sandbox, expired in (
        (400.0, running, False),
        (49.0, idle, False),  # renewed at 20: the timeout runs to 50
        (50.0, idle, True),
        (500.0, running, True),  # max_lease_s
    ):
        snapshot = Snapshot(nodes=(), sandboxes=(sandbox,), requests=(), templates={})
        actions = [a for a in decide(snapshot, pools, now) if isinstance(a, ExpireLease)]
        assert bool(actions) == expired, (now, sandbox)


# --- nothing leaks: keys across restarts, and each waiter's own timeout ---------------

COLD = PoolParams(min_warm=0, max_warm=0, templates=[])


def test_after_a_restart_a_retry_waits_for_a_late_node_and_never_gets_a_second_sandbox(
    tmp_path,
):
    async def scenario(h: Harness) -> None:
        lease = await h.acquire(idempotency_key="ep-9")
        await h.settle(2)
        node = h.agents.nodes[lease.node]
        node.down = True  # silent through the restart and past its resync window
        await h.restart()
        with pytest.raises(ApiError) as early:
            await h.acquire(idempotency_key="ep-9", timeout_s=10)
        assert (early.value.status, early.value.code) == (503, "lease_unreported")
        assert len(h.calls_of("create")) == 1  # no second sandbox
        node.down = False  # it reports again, still holding the sandbox
        again = await h.acquire(idempotency_key="ep-9", timeout_s=30)
        assert (again.id, again.lease_token) == (lease.id, lease.lease_token)
        assert len(h.calls_of("create")) == 1 and h.on_agents() == {lease.id: S.LEASED}

    Harness(nodes=2, pools={"default": COLD}, state_dir=tmp_path).run(scenario)


def test_a_retry_with_a_shorter_timeout_does_not_cancel_the_first_waiter():
    async def scenario(h: Harness) -> None:
        for node in h.agents.nodes.values():
            node.down = True  # nothing can be served for now
        first = asyncio.ensure_future(h.acquire(idempotency_key="ep-5", timeout_s=60))
        await h.settle(1)
        with pytest.raises(ApiError) as retry:
            await h.acquire(idempotency_key="ep-5", timeout_s=2)
        assert retry.value.code == "acquire_timeout"
        assert len(h.scheduler.queues.by_id) == 1  # the first one's request still waits
        for node in h.agents.nodes.values():
            node.down = False
        lease = await first
        await h.granted(lease)
        assert h.on_agents() == {lease.id: S.LEASED}

    Harness(nodes=1, pools={"default": COLD}).run(scenario)


def test_a_shorter_timeout_set_live_ends_a_lease_a_look_found_not_yet_due():
    """A look at the leases remembers when each may be due at the earliest, and passes
    it by until then; a pool's timers changed meanwhile count at once."""

    async def scenario(h: Harness) -> None:
        lease = await h.acquire()
        await h.settle(IDLE_TIMEOUT_S / 2)  # looked at: not due for another 15 s
        assert leased(h) == {lease.id}
        h.scheduler.set_pool("default", LAPSING.model_copy(update={"lease_idle_timeout_s": 5.0}))
        changed_at = h.now()
        await h.settle(IDLE_TIMEOUT_S / 4)
        [decided_at] = [t for t, a in h.decisions if isinstance(a, ExpireLease)]
        assert decided_at - changed_at <= 1.0  # due already: the next look ends it

    Harness(pools={"default": LAPSING}).run(scenario)
