"""Scheduler logic in the harness: the real scheduler, simulated agents, virtual time."""

from __future__ import annotations

import asyncio

import pytest
from harness import ALICE, BOB, Harness

from controlplane.agents import CallResult
from dsec.httpkit import ApiError
from dsec.image import BASE_IMAGE
from dsec.models import PoolParams, TemplateSpec
from dsec.policy import Create, Pause, ReleaseCloud
from dsec.states import SandboxState as S

# --- helpers ------------------------------------------------------------------------

# A pool with no warm pool at all: every sandbox is made for a request (no refill, no
# scale-up), so what the agents hold is exactly what the requests asked for.
COLD = PoolParams(min_warm=0, max_warm=0, templates=[])
SPECIAL = "special:1"  # an image only some nodes have
TEMPLATES = {
    "base": TemplateSpec(name="base", image=BASE_IMAGE),
    "special": TemplateSpec(name="special", image=SPECIAL),
}
FAULT_500 = CallResult(False, 500, "docker_error", "no space left on device")
UNREACHABLE = CallResult(False, 0, "unreachable", "connection refused")


def uneven(**kwargs) -> Harness:
    """node-1 with 40 slots and node-2 with 10: placement tries node-1 first (the most
    free room), so a fault injected there is met first."""
    h = Harness(nodes=0, **kwargs)
    h.add_node("node-1", 40)
    h.add_node("node-2", 10)
    return h


def in_state(h: Harness, state: S, pool: str | None = None) -> set[str]:
    """The control plane's sandboxes in that state."""
    return {
        e.id
        for e in h.scheduler.view.sandboxes.values()
        if e.state == state and (pool is None or e.pool == pool)
    }


async def sleep_until(h: Harness, at: float) -> None:
    assert at >= h.now(), f"{at} is in the past ({h.now()})"
    await h.settle(at - h.now())


def test_an_acquire_is_served_cold_then_warm_and_release_removes_it():
    async def scenario(h: Harness) -> None:
        first = await h.acquire()
        assert first.path == "cold" and first.node.startswith("node-")
        await h.granted(first)
        assert h.on_agents()[first.id] == S.LEASED
        await h.release(first)
        assert first.id not in h.on_agents()
        await h.settle(5)
        assert h.metric("dsec_episodes_completed_total") == 1

    Harness(nodes=2, pools={"default": PoolParams(min_warm=0)}).run(scenario)


# --- a running sandbox is served before its agent hears of the lease ----------------


def test_a_warm_acquire_is_answered_while_its_grant_is_on_its_way_to_the_agent():
    async def scenario(h: Harness) -> None:
        await h.settle(5)  # the warm pool fills
        lease = await h.acquire()
        assert lease.path == "warm" and lease.schedule_ms == 0.0
        assert h.scheduler.actuator.in_flight(lease.id) is not None  # the grant
        assert h.on_agents()[lease.id] == S.WARM and not h.calls_of("lease")
        await h.granted(lease)
        assert h.on_agents()[lease.id] == S.LEASED
        [grant] = h.calls_of("lease", lease.id)
        assert grant.result.ok and grant.args[0].lease_id == lease.lease_id

    Harness(nodes=1, pools={"default": PoolParams(min_warm=1)}).run(scenario)


def test_a_warm_acquire_is_answered_before_its_grant_or_the_tick_s_creates_are_sent():
    """Each call to an agent is a send that wakes it, up to a millisecond of the control
    plane's loop on a busy node (measured): the client is answered first."""

    async def scenario(h: Harness) -> None:
        await h.settle(5)  # the warm pool fills
        sent: list[str] = []
        agents = h.scheduler.actuator.agents

        def noting(op: str):
            call = getattr(agents, op)

            def sending(*args):
                sent.append(op)
                return call(*args)

            return sending

        for op in ("lease", "create"):
            setattr(agents, op, noting(op))
        lease = await h.acquire()
        assert lease.path == "warm"
        assert sent == [], f"sent before the client was answered: {sent}"
        await h.granted(lease)
        await h.settle(1)
        assert sent == ["lease", "create"]  # its grant, then its replacement

    Harness(nodes=1, pools={"default": PoolParams(min_warm=1)}).run(scenario)


def test_a_warm_acquire_with_a_key_is_answered_only_once_its_node_holds_the_lease():
    """A key is the client's way to get the same lease back after a control plane
    restart, which learns leases from the nodes' reports. Answered before its grant (the
    old code), a control plane killed in between left the client a key whose lease no
    node knew: its retry waited for a report that never came (503 lease_unreported,
    tests/test_crash.py). The grant is answered first. Without a key, or with one the
    client made for this acquire (`new_key`, the SDK's own), the client first."""

    async def scenario(h: Harness) -> None:
        await h.settle(5)  # the warm pool fills
        answered: list[bool] = []  # whether the grant was answered when the client was
        agents = h.scheduler.actuator.agents
        grant = agents.lease

        async def granting(*args):
            result = await grant(*args)
            answered.append(True)
            return result

        agents.lease = granting
        keyed = await h.acquire(idempotency_key="k")
        assert keyed.path == "warm" and answered == [True], answered
        for first in ({}, {"idempotency_key": "new", "new_key": True}):
            lease = await h.acquire(**first)
            assert lease.path == "warm" and answered == [True], (first, answered)  # not yet
            await h.granted(lease)
            answered.pop()

    Harness(nodes=1, pools={"default": PoolParams(min_warm=3)}).run(scenario)


def test_a_warm_sandbox_its_node_no_longer_reports_is_not_served_before_its_grant():
    """A warm sandbox that died (with its engine) and that its node's report no longer
    lists is still warm in the view for the confirm grace. It is not served at once:
    its grant's refusal puts the request back in line, and another sandbox serves it."""

    async def scenario(h: Harness) -> None:
        await h.settle(5)
        [dead] = h.on_agents()
        h.agents.nodes["node-1"].remove(dead)  # gone, as an engine restart leaves it
        await h.settle(1.5)  # a report without it
        assert h.scheduler.view.sandboxes[dead].state == S.WARM  # within the grace
        lease = await h.acquire()
        assert lease.id != dead and lease.path == "cold"
        [refused] = h.calls_of("lease", dead)
        assert refused.result.code == "unknown_sandbox"
        await h.granted(lease)
        assert h.on_agents()[lease.id] == S.LEASED

    pools = {"default": PoolParams(min_warm=1, max_warm=1, warm_fraction=0)}
    Harness(nodes=1, pools=pools, confirm_grace_s=10).run(scenario)


def test_a_lease_its_node_refuses_after_it_was_answered_ends_and_its_client_hears_why():
    async def scenario(h: Harness) -> None:
        await h.settle(5)
        h.agents.inject("node-1", "lease", UNREACHABLE)
        # answered before its grant: a key the client made for it, as the SDK's (a key
        # of its own it may send again is answered once its node holds the lease)
        lease = await h.acquire(idempotency_key="ep-9", new_key=True)
        await h.granted(lease)
        await h.settle(2)
        assert lease.id not in h.on_agents()  # removed, never left leased to no one
        for attempt in (h.release(lease), h.acquire(idempotency_key="ep-9")):
            with pytest.raises(ApiError) as ended:
                await attempt
            assert ended.value.status in (409, 410)
            assert ended.value.code in ("lease_expired", "idempotency_key_spent")
        with pytest.raises(ApiError) as told:
            await h.release(lease)
        assert "its node refused it (unreachable)" in told.value.message
        assert h.metric("dsec_agent_call_errors_total", op="lease") == 1

    Harness(nodes=1, pools={"default": PoolParams(min_warm=1)}, resync_s=0).run(scenario)


def test_a_client_that_leaves_once_answered_gives_its_sandbox_back_after_the_grant():
    async def scenario(h: Harness) -> None:
        await h.settle(5)
        [warm] = h.on_agents()
        leases = h.scheduler.leases
        serve, waiting = leases._serve, []

        def leave_as_served(*args) -> None:
            waiting[0].cancel()  # the client hangs up just as its answer is made
            serve(*args)

        leases._serve = leave_as_served
        waiting.append(asyncio.ensure_future(h.acquire()))
        with pytest.raises(asyncio.CancelledError):
            await waiting[0]
        assert h.scheduler.actuator.in_flight(warm) is not None  # the grant still runs
        await h.settle(2)
        assert [c.result.ok for c in h.calls_of("lease", warm)] == [True]
        assert [c.result.ok for c in h.calls_of("destroy", warm)] == [True]
        assert warm not in h.on_agents() and warm not in h.scheduler.view.sandboxes

    Harness(nodes=1, pools={"default": PoolParams(min_warm=1, max_warm=1)}).run(scenario)


def test_a_side_effect_that_has_ended_is_not_in_flight_before_its_callbacks_run():
    """A release waits while its sandbox's grant is in flight. A grant that has just
    ended, whose done callbacks have not run yet, is not in flight: awaiting it returns
    without yielding, and that wait would spin the event loop for good."""

    async def scenario(h: Harness) -> None:
        await h.settle(5)
        [warm] = h.on_agents()
        entry = h.scheduler.view.sandboxes[warm]
        actuator, seen = h.scheduler.actuator, []

        async def side_effect() -> None:
            # runs once this task has ended, before its done callbacks
            asyncio.get_running_loop().call_soon(lambda: seen.append(actuator.in_flight(warm)))

        task = actuator.spawn(entry, side_effect())
        await task
        assert seen == [None] and actuator.in_flight(warm) is None

    Harness(nodes=1, pools={"default": PoolParams(min_warm=1)}).run(scenario)


def test_a_template_whose_image_no_node_holds_fails_at_once_and_no_create_is_sent():
    async def scenario(h: Harness) -> None:
        started = h.now()
        with pytest.raises(ApiError) as refused:
            await h.acquire(template="ghost", timeout_s=600)
        assert refused.value.status == 422 and refused.value.code == "template_unavailable"
        assert "no node holds image nowhere:latest" in refused.value.message
        assert h.now() - started < 5  # not at its timeout
        assert h.metric("dsec_acquires_unplaced_total", code="image_missing") == 1
        # placement knows from the nodes' reports: no node was asked for a create of it
        assert not [c for c in h.calls_of("create") if not c.result.ok]
        assert not h.on_agents()

    templates = {
        "base": TemplateSpec(name="base", image="dsec-base:latest"),
        "ghost": TemplateSpec(name="ghost", image="nowhere:latest"),
    }
    Harness(nodes=3, templates=templates).run(scenario)


# --- idempotency --------------------------------------------------------------------


def test_a_retry_with_the_same_key_gets_the_same_sandbox_also_while_the_first_waits():
    async def scenario(h: Harness) -> None:
        first = asyncio.ensure_future(h.acquire(idempotency_key="ep-1"))
        await h.settle(0.01)  # its cold create takes ~170 ms
        assert not first.done() and h.scheduler.queues.depth("default") == 1
        second = await h.acquire(idempotency_key="ep-1")
        lease = await first
        assert (second.id, second.lease_id, second.lease_token) == (
            lease.id,
            lease.lease_id,
            lease.lease_token,
        )
        third = await h.acquire(idempotency_key="ep-1")  # after it was served
        assert (third.id, third.lease_token) == (lease.id, lease.lease_token)
        await h.granted(lease)
        assert h.on_agents() == {lease.id: S.LEASED}  # one sandbox, one lease
        assert len(h.calls_of("create")) == 1 and len(h.calls_of("lease")) == 1
        assert h.metric("dsec_acquire_requests_total", outcome="served") == 1

    Harness(nodes=2, pools={"default": COLD}, resync_s=0).run(scenario)


def test_the_same_key_from_another_client_gets_a_sandbox_of_its_own():
    async def scenario(h: Harness) -> None:
        alice = await h.acquire(owner=ALICE, idempotency_key="ep-1")
        bob = await h.acquire(owner=BOB, idempotency_key="ep-1")
        assert bob.id != alice.id and bob.lease_token != alice.lease_token
        assert (await h.acquire(owner=ALICE, idempotency_key="ep-1")).id == alice.id
        assert (await h.acquire(owner=BOB, idempotency_key="ep-1")).id == bob.id
        await h.release(alice)  # alice's key is spent, bob's is not
        with pytest.raises(ApiError) as spent:
            await h.acquire(owner=ALICE, idempotency_key="ep-1")
        assert spent.value.status == 409 and spent.value.code == "idempotency_key_spent"
        assert (await h.acquire(owner=BOB, idempotency_key="ep-1")).id == bob.id
        assert h.on_agents() == {bob.id: S.LEASED}

    Harness(nodes=2, pools={"default": COLD}, resync_s=0).run(scenario)


def test_a_released_key_is_spent_also_after_a_restart(tmp_path):
    async def scenario(h: Harness) -> None:
        lease = await h.acquire(idempotency_key="ep-7")
        await h.release(lease)
        with pytest.raises(ApiError) as spent:
            await h.acquire(idempotency_key="ep-7")
        assert spent.value.status == 409 and spent.value.code == "idempotency_key_spent"
        assert lease.id in spent.value.message
        await h.restart()
        creates = len(h.calls_of("create"))
        with pytest.raises(ApiError) as still:
            await h.acquire(idempotency_key="ep-7", timeout_s=30)
        assert still.value.status == 409 and still.value.code == "idempotency_key_spent"
        assert lease.id in still.value.message
        assert len(h.calls_of("create")) == creates and not h.on_agents()
        # the key is alice's alone, and a fresh key is served
        assert (await h.acquire(owner=BOB, idempotency_key="ep-7")).id != lease.id
        assert (await h.acquire(idempotency_key="ep-8")).id != lease.id

    Harness(nodes=2, pools={"default": COLD}, state_dir=tmp_path).run(scenario)
    assert (tmp_path / "spent-keys.jsonl").exists()


def test_after_a_restart_a_retry_with_a_live_key_gets_the_same_sandbox_not_a_second():
    async def scenario(h: Harness) -> None:
        lease = await h.acquire(idempotency_key="ep-3")
        await h.settle(2)
        creates = len(h.calls_of("create"))
        await h.restart()  # the retry lands before any heartbeat: it waits resync_s
        started = h.now()
        again = await h.acquire(idempotency_key="ep-3")
        assert h.now() - started >= h.config.resync_s - 1e-9
        assert (again.id, again.lease_id, again.lease_token) == (
            lease.id,
            lease.lease_id,
            lease.lease_token,
        )
        assert len(h.calls_of("create")) == creates
        assert h.on_agents() == {lease.id: S.LEASED}
        await h.release(again)
        with pytest.raises(ApiError) as spent:
            await h.acquire(idempotency_key="ep-3")
        assert spent.value.code == "idempotency_key_spent"

    Harness(nodes=2, pools={"default": COLD}).run(scenario)


def test_a_new_key_is_served_at_once_after_a_restart_and_a_retried_one_waits():
    async def scenario(h: Harness) -> None:
        await h.settle(2)
        await h.restart()  # before any heartbeat: keyed acquires wait resync_s
        started = h.now()
        await h.acquire(idempotency_key="made-now", new_key=True)
        assert h.now() - started < 1.0  # a key nobody sent before is no lease's
        await h.acquire(idempotency_key="sent-before")  # a retry's, perhaps: it waits
        assert h.now() - started >= h.config.resync_s - 1e-9

    Harness(nodes=1, pools={"default": PoolParams(min_warm=2)}, resync_s=3).run(scenario)


def test_a_keyed_acquire_shorter_than_the_resync_answers_resyncing():
    async def scenario(h: Harness) -> None:
        await h.restart()
        started = h.now()
        with pytest.raises(ApiError) as early:
            await h.acquire(idempotency_key="ep-1", timeout_s=1)
        assert early.value.status == 503 and early.value.code == "resyncing"
        assert h.now() - started == pytest.approx(1.0)
        assert not h.scheduler.queues.by_id and not h.on_agents()

    Harness(nodes=1, pools={"default": COLD}, resync_s=3).run(scenario)


# --- refusals -----------------------------------------------------------------------


def test_a_node_that_refuses_the_template_is_passed_over_for_one_that_runs_it():
    async def scenario(h: Harness) -> None:
        missing = CallResult(False, 422, "docker_image_not_found", "no image dsec-base")
        h.agents.inject("node-1", "create", missing)
        started = h.now()
        lease = await h.acquire(timeout_s=600)
        assert lease.node == "node-2" and lease.path == "cold"
        assert h.now() - started < 1
        creates = h.calls_of("create")
        assert [(c.node, c.result.status) for c in creates] == [("node-1", 422), ("node-2", 201)]
        assert h.metric("dsec_acquires_unplaced_total", code="template_refused") == 0
        # a refusal of a template is not a full node: node-1 stays open to placements
        assert h.scheduler.view.nodes["node-1"].refused_until == 0
        assert (await h.acquire()).node == "node-1"

    uneven(pools={"default": COLD}).run(scenario)


def test_a_template_one_node_lacks_waits_for_room_on_the_node_that_has_it():
    async def scenario(h: Harness) -> None:
        held = [await h.acquire(template="special") for _ in range(2)]
        assert {x.node for x in held} == {"node-2"}  # only it has the image
        waiting = asyncio.ensure_future(h.acquire(template="special", timeout_s=60))
        await h.settle(3)
        # node-2 has the image and no room: the request waits (not final), and node-1
        # (room, no image by its reports) is never sent a create
        assert not waiting.done()
        assert h.calls_of("create", node="node-1") == []
        assert h.metric("dsec_acquires_unplaced_total", code="template_refused") == 0
        assert h.metric("dsec_acquires_unplaced_total", code="no_room") >= 1
        await h.release(held[0])
        lease = await waiting
        assert lease.node == "node-2"

    h = Harness(nodes=0, pools={"default": COLD}, templates=TEMPLATES)
    h.add_node("node-1", 10)
    h.add_node("node-2", 2, images={BASE_IMAGE, SPECIAL})
    h.run(scenario)


def test_a_full_node_that_refuses_is_cooled_down_and_the_request_served_elsewhere():
    async def scenario(h: Harness) -> None:
        await h.settle(1)
        h.agents.inject("node-1", "create", CallResult(False, 409, "no_capacity", "full"))
        lease = await h.acquire()
        assert lease.node == "node-2"
        [refusal] = h.calls_of("create", node="node-1")
        assert refusal.result.status == 409
        cooldown_ends = h.scheduler.view.nodes["node-1"].refused_until
        assert cooldown_ends == pytest.approx(refusal.ended + h.config.refusal_cooldown_s)
        # within the cooldown, node-1 (the most room) is passed over
        assert (await h.acquire()).node == "node-2"
        assert h.now() < cooldown_ends
        await sleep_until(h, cooldown_ends + 0.5)
        assert (await h.acquire()).node == "node-1"
        assert len(h.calls_of("create", node="node-1")) == 2

    uneven(pools={"default": COLD}).run(scenario)


# --- timeouts and cancellation ------------------------------------------------------


def test_an_acquire_nothing_can_serve_times_out_saying_why_and_leaves_nothing():
    async def scenario(h: Harness) -> None:
        held = [await h.acquire(), await h.acquire()]  # the node is full of leases
        started = h.now()
        with pytest.raises(ApiError) as timed_out:
            await h.acquire(timeout_s=10)
        assert timed_out.value.status == 503 and timed_out.value.code == "acquire_timeout"
        assert "no node has room" in timed_out.value.message
        assert h.now() - started == pytest.approx(10, abs=0.01)
        assert not h.scheduler.queues.by_id and h.scheduler.queues.depth("default") == 0
        assert h.metric("dsec_acquire_requests_total", outcome="timed_out") == 1
        assert h.metric("dsec_acquires_unplaced_total", code="no_room") >= 1
        await h.settle(5)
        assert h.on_agents() == {x.id: S.LEASED for x in held}
        assert len(h.calls_of("create")) == 2
        # the freed slot serves the next request
        await h.release(held[0])
        again = await h.acquire(timeout_s=5)
        assert again.node == "node-1" and again.path == "cold"

    Harness(nodes=1, slots=2, pools={"default": COLD}).run(scenario)


def test_a_cancelled_acquire_leaves_the_queue_and_gets_nothing():
    async def scenario(h: Harness) -> None:
        held = await h.acquire()
        waiting = asyncio.ensure_future(h.acquire(timeout_s=60))
        await h.settle(1)
        assert h.scheduler.queues.depth("default") == 1
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert h.scheduler.queues.depth("default") == 0 and not h.scheduler.queues.by_id
        assert h.metric("dsec_acquire_requests_total", outcome="cancelled") == 1
        await h.release(held)  # the room it waited for is free now: nobody takes it
        await h.settle(5)
        assert h.on_agents() == {} and len(h.calls_of("create")) == 1

    Harness(nodes=1, slots=1, pools={"default": COLD}).run(scenario)


# --- backoff ------------------------------------------------------------------------


def test_a_failed_pause_is_retried_after_its_backoff_and_the_step_goes_to_another():
    async def scenario(h: Harness) -> None:
        await h.settle(2)
        assert len(in_state(h, S.WARM)) == 2
        h.agents.inject("node-1", "pause", FAULT_500)
        short = PoolParams(
            min_warm=0, warm_fraction=0, freeze_after_s=1, hibernate_after_s=600, frozen_ttl_s=600
        )
        h.scheduler.set_pool("default", short)
        await h.settle(5)
        failed = h.calls_of("pause")[0]
        assert failed.result.status == 500
        a = failed.sandbox_id  # the oldest: the first the scale-down step picks
        [b] = {c.sandbox_id for c in h.calls_of("create")} - {a}
        retry = h.calls_of("pause", a)[1]
        backoff = 0.5 * 2**1  # after one failure
        assert failed.ended + backoff <= retry.started <= failed.ended + backoff + 0.5
        # nothing about it during its backoff: no call, and no step of the policy
        assert not [
            c for c in h.calls if c.sandbox_id == a and failed.ended < c.started < retry.started
        ]
        assert not [
            t
            for t, action in h.decisions
            if isinstance(action, Pause)
            and action.sandbox_id == a
            and failed.ended < t < retry.started
        ]
        # the step went to the other idle sandbox meanwhile
        [b_pause] = h.calls_of("pause", b)
        assert b_pause.started < retry.started and b_pause.result.ok
        assert h.on_agents() == {a: S.PAUSED, b: S.PAUSED}
        assert h.scheduler.view.nodes["node-1"].failures == 0

    pools = {"default": PoolParams(min_warm=2, warm_fraction=0)}
    Harness(nodes=1, pools=pools).run(scenario)


def test_a_failed_destroy_is_retried_after_its_backoff():
    async def scenario(h: Harness) -> None:
        lease = await h.acquire()
        h.agents.inject("node-1", "destroy", FAULT_500, times=2)
        await h.release(lease)  # answered: the removal is the control plane's to finish
        await h.settle(0.5)
        # the agent still reports it leased; the view keeps it on its way out
        assert h.on_agents() == {lease.id: S.LEASED}
        assert h.scheduler.view.sandboxes[lease.id].state == S.DESTROYING
        with pytest.raises(ApiError) as again:
            await h.release(lease)
        assert again.value.status == 409 and again.value.code == "already_released"
        await h.settle(5)
        first, second, third = h.calls_of("destroy", lease.id)
        assert [c.result.status for c in (first, second, third)] == [500, 500, 200]
        assert first.ended + 1.0 <= second.started <= first.ended + 1.0 + 0.5  # 0.5 x 2^1
        assert second.ended + 2.0 <= third.started <= second.ended + 2.0 + 0.5  # 0.5 x 2^2
        assert h.on_agents() == {} and lease.id not in h.scheduler.view.sandboxes
        assert h.metric("dsec_nodes_taken_out_total") == 0  # two in a row: not out

    Harness(nodes=1, pools={"default": COLD}).run(scenario)


def test_a_node_whose_calls_keep_failing_leaves_placement_until_a_call_succeeds():
    async def scenario(h: Harness) -> None:
        await h.settle(1)
        for fault in (FAULT_500, UNREACHABLE, FAULT_500):
            h.agents.inject("node-1", "create", fault)
        for n in range(3):  # each tries node-1 first, fails there, is served on node-2
            assert (await h.acquire()).node == "node-2"
            assert h.metric("dsec_nodes_taken_out_total", node="node-1") == (1 if n == 2 else 0)
        [*_, third] = h.calls_of("create", node="node-1")
        out_until = h.scheduler.view.nodes["node-1"].failing_until
        assert out_until == pytest.approx(third.ended + h.config.node_failure_backoff_s)
        assert not h.scheduler.view.nodes["node-1"].placeable(h.now())
        # out of placement: new sandboxes go elsewhere, nothing is tried on node-1
        assert (await h.acquire()).node == "node-2"
        assert h.now() < out_until
        assert len(h.calls_of("create", node="node-1")) == 3
        # after its backoff, the next placement there is a probe; its success brings it back
        await sleep_until(h, out_until + 0.5)
        assert (await h.acquire()).node == "node-1"
        node = h.scheduler.view.nodes["node-1"]
        assert node.failures == 0 and node.placeable(h.now())
        assert h.metric("dsec_nodes_taken_out_total") == 1

    uneven(pools={"default": COLD}).run(scenario)


# --- cloud overflow -----------------------------------------------------------------


def test_past_the_overflow_threshold_creates_go_to_a_cloud_node_released_once_idle():
    async def scenario(h: Harness) -> None:
        await h.settle(1)
        held = await asyncio.gather(*(h.acquire(timeout_s=60) for _ in range(7)))
        local = [x for x in held if x.node == "node-1"]
        cloud = [x for x in held if x.node != "node-1"]
        assert len(local) == 5 and len(cloud) == 2
        assert {x.node for x in cloud} == {"cloud-1"} and {x.path for x in cloud} == {"overflow"}
        assert {x.path for x in local} == {"cold"}
        assert h.cloud.started == ["cloud-1"]  # one node provisioned, however many waited
        assert min(x.schedule_ms for x in cloud) >= 5000  # they waited for it to boot
        # local at 4/5 = 80% has a free slot, and still the next create goes to the cloud
        await h.release(local[0])
        extra = await h.acquire()
        assert extra.node == "cloud-1" and extra.path == "overflow"
        assert h.metric("dsec_scale_events_total", action="overflow") == 3
        await asyncio.gather(*(h.release(x) for x in [*local[1:], *cloud, extra]))
        emptied = max(c.ended for c in h.calls_of("destroy", node="cloud-1"))
        await h.settle(9)
        assert "cloud-1" in h.scheduler.view.nodes and not h.cloud.stopped
        await h.settle(3)
        assert h.cloud.stopped == ["cloud-1"] and "cloud-1" not in h.scheduler.view.nodes
        [(released_at, _)] = [(t, a) for t, a in h.decisions if isinstance(a, ReleaseCloud)]
        assert emptied + 10 <= released_at <= emptied + 10 + 0.5

    h = Harness(
        nodes=1, slots=5, pools={"default": COLD}, cloud_nodes=1, cloud_boot_s=5,
        cloud_idle_release_s=10,
    )  # fmt: skip
    h.run(scenario)


# --- priorities ---------------------------------------------------------------------

PRIORITY_POOLS = {
    "train": PoolParams(priority=0, min_warm=0, max_warm=0, templates=[]),
    "eval": PoolParams(priority=10, min_warm=0, max_warm=0, templates=[]),
}


def test_a_higher_priority_pool_is_served_first():
    async def scenario(h: Harness) -> None:
        held = [await h.acquire(pool="train"), await h.acquire(pool="train")]
        train = asyncio.ensure_future(h.acquire(pool="train"))
        await h.settle(1)
        eval_ = asyncio.ensure_future(h.acquire(pool="eval"))  # arrives later
        await h.settle(1)
        assert not train.done() and not eval_.done()
        await h.release(held[0])
        await h.settle(1)
        assert eval_.done() and not train.done()
        assert eval_.result().pool == "eval"
        await h.release(held[1])
        await h.settle(1)
        assert train.done() and train.result().pool == "train"

    Harness(nodes=1, slots=2, pools=PRIORITY_POOLS).run(scenario)


def test_a_higher_priority_pool_takes_idle_sandboxes_of_a_lower_one_never_leased_ones():
    async def scenario(h: Harness) -> None:
        await h.settle(2)
        idle = in_state(h, S.WARM, "train")
        assert len(idle) == 2
        taken = await h.acquire(pool="eval")
        assert taken.id in idle and taken.path == "warm" and taken.pool == "eval"
        assert h.scheduler.view.sandboxes[taken.id].pool == "eval"
        await h.settle(2)  # train refills its warm pool: the node is full
        held = [await h.acquire(pool="train"), await h.acquire(pool="train")]
        assert len(h.on_agents()) == 3
        with pytest.raises(ApiError) as timed_out:
            await h.acquire(pool="eval", timeout_s=5)
        assert timed_out.value.code == "acquire_timeout"
        for lease in held:  # untouched: still train's, leased once, to its client
            entry = h.scheduler.view.sandboxes[lease.id]
            assert entry.state == S.LEASED and entry.pool == "train"
            assert entry.lease_id == lease.lease_id
            assert len(h.calls_of("lease", lease.id)) == 1
            assert h.on_agents()[lease.id] == S.LEASED

    pools = {
        "train": PoolParams(priority=0, min_warm=2, warm_fraction=0),
        # eval's eager lease-idle freezing puts train's idle leases in every snapshot
        # (train's own, at its default, never pauses them): the policy sees them, and
        # must not hand them out
        "eval": PoolParams(
            priority=10, min_warm=0, max_warm=0, templates=[], lease_idle_freeze_s=1
        ),
    }
    Harness(nodes=1, slots=3, pools=pools).run(scenario)


def test_a_lower_priority_pool_does_not_take_idle_sandboxes_of_a_higher_one():
    async def scenario(h: Harness) -> None:
        await h.settle(2)
        [kept] = in_state(h, S.WARM, "eval")
        lease = await h.acquire(pool="train")
        assert lease.id != kept and lease.path == "cold"
        assert h.scheduler.view.sandboxes[kept].state == S.WARM
        assert h.scheduler.view.sandboxes[kept].pool == "eval"

    pools = {
        "train": PRIORITY_POOLS["train"],
        "eval": PoolParams(priority=10, min_warm=1, warm_fraction=0),
    }
    Harness(nodes=1, slots=4, pools=pools).run(scenario)


# --- the warm pool and elasticity ---------------------------------------------------


def test_the_warm_pool_is_kept_at_min_warm():
    async def scenario(h: Harness) -> None:
        await h.settle(3)
        assert h.states() == {S.WARM: 3}
        lease = await h.acquire()
        assert lease.path == "warm" and lease.schedule_ms < 50
        await h.settle(20)  # refilled, and not beyond
        assert h.states() == {S.WARM: 3, S.LEASED: 1}
        assert len(h.calls_of("create")) == 4

    pools = {"default": PoolParams(min_warm=3, warm_fraction=0)}
    Harness(nodes=2, pools=pools).run(scenario)


def test_a_steady_stream_of_short_leases_never_drains_the_warm_pool_on_defaults():
    """Code-reward calls: acquire, run ~0.1 s, release, ten times a second. The recent
    peak of concurrency is ~2, which on its own keeps min_warm (2) warm: each acquire
    then waits for a create. The rate times a create's time keeps enough warm."""
    cycles_per_s, lease_s, seconds = 10, 0.1, 40

    async def scenario(h: Harness) -> None:
        await h.settle(3)
        paths: list[tuple[float, str]] = []

        async def cycle() -> None:
            lease = await h.acquire()
            paths.append((h.now(), lease.path))
            await h.settle(lease_s)
            await h.release(lease)

        running = []
        for _ in range(cycles_per_s * seconds):
            running.append(asyncio.ensure_future(cycle()))
            await h.settle(1 / cycles_per_s)
        await asyncio.gather(*running)
        started = paths[0][0]
        late_cold = [t - started for t, path in paths if path != "warm" and t - started > 10]
        assert not late_cold, f"{len(late_cold)} acquires past 10 s not warm: {late_cold[:5]}"
        rate = h.scheduler.acquire_rates.rates(h.now())[("default", "base")]
        assert cycles_per_s * 0.8 <= rate <= cycles_per_s * 1.2
        assert h.scheduler.actuator.create_times.means["base"] > 0

    Harness(nodes=3, slots=100, pools={"default": PoolParams()}).run(scenario)


@pytest.mark.parametrize(
    ("min_warm", "burst", "scale_up"),
    [
        (4, 8, 0),  # 8 pending, not more than 2 x 4 idle
        (4, 9, 2),  # 9 > 2 x 4: 50% of the 4 idle
        (4, 20, 2),
        (0, 10, 5),  # nothing idle: 50% of the 10 pending
    ],
)
def test_a_burst_of_pending_past_k_times_idle_scales_up_by_the_step(min_warm, burst, scale_up):
    async def scenario(h: Harness) -> None:
        await h.settle(3)
        assert h.states() == ({S.WARM: min_warm} if min_warm else {})
        held = await asyncio.gather(*(h.acquire() for _ in range(burst)))
        assert len({x.id for x in held}) == burst
        assert len(h.decided(Create, reason="scale-up: pending > k x idle")) == scale_up
        cold = [x for x in held if x.path == "cold"]
        assert len(cold) == burst - min(burst, min_warm)

    pools = {"default": PoolParams(min_warm=min_warm, warm_fraction=0, max_warm=64)}
    Harness(nodes=1, slots=100, pools=pools).run(scenario)


def test_idle_warm_sandboxes_are_paused_hibernated_then_destroyed_on_time():
    async def scenario(h: Harness) -> None:
        await h.settle(2)
        warm = in_state(h, S.WARM)
        assert len(warm) == 2
        h.scheduler.set_pool(
            "default",
            PoolParams(
                min_warm=0, warm_fraction=0, freeze_after_s=5, hibernate_after_s=20,
                frozen_ttl_s=60,
            ),
        )  # fmt: skip
        warm_since = min(c.ended for c in h.calls_of("create"))
        await sleep_until(h, warm_since + 5 - 0.1)
        assert h.on_agents() == dict.fromkeys(warm, S.WARM)  # not before freeze_after
        await h.settle(100)
        for sid in warm:
            [create] = h.calls_of("create", sid)
            [pause] = h.calls_of("pause", sid)
            [hibernate] = h.calls_of("hibernate", sid)
            [destroy] = h.calls_of("destroy", sid)
            assert create.ended + 5 <= pause.started <= create.ended + 5 + 0.6
            assert pause.ended + 20 <= hibernate.started <= pause.ended + 20 + 0.6
            assert pause.ended + 60 <= destroy.started <= pause.ended + 60 + 0.6
            assert all(c.result.ok for c in (pause, hibernate, destroy))
        assert h.on_agents() == {} and h.states() == {}
        for action in ("freeze", "hibernate", "destroy"):
            assert h.metric("dsec_scale_events_total", action=action) == 2
        assert len(h.calls_of("create")) == 2  # nothing refilled

    pools = {"default": PoolParams(min_warm=2, warm_fraction=0)}
    Harness(nodes=1, pools=pools).run(scenario)


@pytest.mark.parametrize("frozen", [S.PAUSED, S.HIBERNATED])
def test_a_claim_thaws_a_frozen_sandbox(frozen):
    async def scenario(h: Harness) -> None:
        await h.settle(2)
        [sid] = in_state(h, S.WARM)
        h.scheduler.set_pool(
            "default",
            PoolParams(
                min_warm=0, warm_fraction=0, freeze_after_s=1, frozen_ttl_s=3600,
                hibernate_after_s=3 if frozen == S.HIBERNATED else 3000,
            ),
        )  # fmt: skip
        await h.settle(8)
        assert h.on_agents() == {sid: frozen}
        lease = await h.acquire()
        assert lease.id == sid and lease.path == "thaw"
        assert h.on_agents()[sid] == S.LEASED
        assert not [a for a in h.decided(Create) if a.for_request]  # no cold create for it
        assert h.metric("dsec_scale_events_total", action="thaw") == 1
        assert h.metric("dsec_schedule_latency_seconds_count", path="thaw") == 1

    pools = {"default": PoolParams(min_warm=1, warm_fraction=0)}
    Harness(nodes=1, pools=pools).run(scenario)


def test_an_idle_lease_is_paused_after_lease_idle_freeze_s_and_activity_postpones_it():
    async def scenario(h: Harness) -> None:
        quiet, busy = await h.acquire(), await h.acquire()
        await h.granted(quiet)
        await h.granted(busy)
        leased_at = {x.id: h.calls_of("lease", x.id)[0].ended for x in (quiet, busy)}
        await h.settle(5)
        ran_until = h.now() + 1
        h.agents.run_command(busy.node, busy.id, h.now(), 0.01, 1.0)  # a command of 1 s
        await h.settle(20)
        [quiet_pause] = h.calls_of("pause", quiet.id)
        [busy_pause] = h.calls_of("pause", busy.id)
        assert leased_at[quiet.id] + 10 <= quiet_pause.started <= leased_at[quiet.id] + 10 + 1.5
        assert ran_until + 10 <= busy_pause.started <= ran_until + 10 + 1.5
        assert h.on_agents() == {quiet.id: S.LEASED_PAUSED, busy.id: S.LEASED_PAUSED}
        assert in_state(h, S.LEASED_PAUSED) == {quiet.id, busy.id}
        # the next exec thaws it on the agent; the lease carries on and is released
        assert await h.agents.thaw_for_exec(quiet.node, quiet.id)
        h.agents.run_command(quiet.node, quiet.id, h.now(), 0.01, 0.05)
        await h.settle(2)
        assert h.scheduler.view.sandboxes[quiet.id].state == S.LEASED
        await h.release(quiet)
        await h.release(busy)  # released while frozen
        assert h.on_agents() == {}

    pools = {"default": PoolParams(min_warm=0, max_warm=0, templates=[], lease_idle_freeze_s=10)}
    Harness(nodes=1, pools=pools).run(scenario)


# --- restarts and silent nodes ------------------------------------------------------


def test_a_control_plane_restart_loses_no_lease():
    async def scenario(h: Harness) -> None:
        leases = [await h.acquire(idempotency_key="ep-1"), await h.acquire(owner=BOB)]
        leases.append(await h.acquire(labels={"episode": "7"}))
        await h.settle(2)
        warm = in_state(h, S.WARM)
        assert len(warm) >= 2
        creates = len(h.calls_of("create"))
        await h.restart()
        await h.settle(3)
        view = h.scheduler.view.sandboxes
        for lease in leases:
            entry = view[lease.id]
            assert entry.state == S.LEASED and entry.lease_id == lease.lease_id
            assert entry.node == lease.node
        assert view[leases[0].id].idempotency_key == "ep-1"
        assert view[leases[1].id].owner == BOB
        # heartbeats carry no labels (their agent keeps them): unknown here, not empty
        assert view[leases[2].id].labels is None
        assert in_state(h, S.WARM) == warm  # learnt back, not made again
        assert len(h.calls_of("create")) == creates
        for lease in leases:  # the old lease tokens release them through the new one
            await h.release(lease)
        assert h.on_agents() == dict.fromkeys(warm, S.WARM)

    pools = {"default": PoolParams(min_warm=2, warm_fraction=0)}
    Harness(nodes=2, pools=pools).run(scenario)


def test_a_silent_node_has_its_sandboxes_marked_lost_after_the_heartbeat_timeout():
    async def scenario(h: Harness) -> None:
        lease = await h.acquire()
        other = "node-2" if lease.node == "node-1" else "node-1"
        await h.settle(0.5)
        h.agents.nodes[lease.node].down = True
        last_seen = h.scheduler.view.nodes[lease.node].last_seen
        timeout = h.config.heartbeat_timeout_s
        await sleep_until(h, last_seen + timeout - 0.2)
        assert h.scheduler.view.sandboxes[lease.id].state == S.LEASED
        await sleep_until(h, last_seen + timeout + 0.5)
        assert h.scheduler.view.sandboxes[lease.id].state == S.LOST
        assert not h.scheduler.view.nodes[lease.node].healthy
        assert (await h.acquire()).node == other

    Harness(nodes=2, pools={"default": COLD}).run(scenario)


def test_a_lost_sandbox_released_then_reported_again_by_its_node_is_removed():
    async def scenario(h: Harness) -> None:
        lease = await h.acquire()
        await h.granted(lease)  # its node holds the lease, then goes silent
        node = h.agents.nodes[lease.node]
        node.down = True
        await h.settle(h.config.heartbeat_timeout_s + 2)
        assert h.scheduler.view.sandboxes[lease.id].state == S.LOST
        await h.release(lease)  # its client gives it up while its node is silent
        assert lease.id not in h.scheduler.view.sandboxes
        with pytest.raises(ApiError) as again:
            await h.release(lease)
        assert again.value.code == "already_released"
        node.down = False  # the node answers again, still holding the sandbox
        await h.settle(5)
        assert lease.id not in h.scheduler.view.sandboxes
        assert lease.id not in h.on_agents(), "a released sandbox is left on its node"

    Harness(nodes=1, pools={"default": COLD}).run(scenario)


# --- baseline policies --------------------------------------------------------------


def test_the_cold_baseline_creates_per_request_and_keeps_nothing_unclaimed():
    async def scenario(h: Harness) -> None:
        await h.settle(3)
        assert h.on_agents() == {}  # min_warm means nothing to it
        held = await asyncio.gather(*(h.acquire() for _ in range(3)))
        assert {x.path for x in held} == {"cold"}
        assert {c.sandbox_id for c in h.calls_of("create")} == {x.id for x in held}
        # a request that leaves while its create is under way: that sandbox is removed
        leaving = asyncio.ensure_future(h.acquire())
        await h.settle(0.01)
        leaving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await leaving
        await h.settle(3)
        [orphan] = {c.sandbox_id for c in h.calls_of("create")} - {x.id for x in held}
        assert h.calls_of("destroy", orphan)
        assert h.on_agents() == {x.id: S.LEASED for x in held}
        for lease in held:
            await h.release(lease)
        await h.settle(3)
        assert h.on_agents() == {} and len(h.calls_of("create")) == 4

    pools = {"default": PoolParams(min_warm=2)}
    Harness(nodes=2, pools=pools, policy="cold").run(scenario)


def test_the_static_baseline_keeps_min_warm_replicas_replaced_on_release():
    async def scenario(h: Harness) -> None:
        await h.settle(3)
        assert h.states() == {S.WARM: 3}
        lease = await h.acquire()
        assert lease.path == "warm"
        await h.settle(3)  # a replica is leased, not replaced: the pool stays at 3
        assert h.states() == {S.WARM: 2, S.LEASED: 1}
        await h.release(lease)
        await h.settle(3)
        assert h.states() == {S.WARM: 3} and len(h.calls_of("create")) == 4

    pools = {"default": PoolParams(min_warm=3)}
    Harness(nodes=1, pools=pools, policy="static").run(scenario)
