"""Recycling (pool parameter `recycle`, template setting `recyclable`), in the scheduler
harness: a released sandbox is reset by its agent and goes back to the warm pool; a
reset that fails removes it; a pool cannot recycle a template that does not allow it.
What a reset really clears in a container is tests/test_recycle_live.py's part."""

from __future__ import annotations

import asyncio

import pytest
from harness import ALICE, BOB, Harness
from inprocess import inprocess_controlplane
from pydantic import ValidationError

from controlplane.agents import CallResult
from controlplane.config import ControlPlaneConfig
from dsec.httpkit import ApiError
from dsec.image import BASE_IMAGE
from dsec.models import PoolParams, TemplateSpec
from dsec.states import SandboxState as S

# no warm floor and no share of the peak, on one node with room for one sandbox: what is
# warm after a release is the recycled sandbox, not a refill or a scale-up
RECYCLING = PoolParams(min_warm=0, max_warm=1, warm_fraction=0, recycle=True)
TEMPLATES = {
    "base": TemplateSpec(name="base", image=BASE_IMAGE, recyclable=True),
    "plain": TemplateSpec(name="plain", image=BASE_IMAGE),  # recyclable: false, the default
}
RESET_FAILED = CallResult(False, 409, "reset_failed", "a process survived the reset: 42 sleep")


def recycling(**kwargs) -> Harness:
    return Harness(nodes=1, slots=1, pools={"default": RECYCLING}, **kwargs)


def test_recycling_is_off_by_default_and_the_base_template_allows_it():
    assert PoolParams().recycle is False
    assert TemplateSpec(name="t", image=BASE_IMAGE).recyclable is False
    config = ControlPlaneConfig(admin_tokens=["a" * 16], agent_token="b" * 16)
    assert config.templates["base"].recyclable and not config.pools["default"].recycle


def test_a_released_sandbox_is_recycled_and_the_next_acquire_gets_it_with_a_new_lease():
    async def scenario(h: Harness) -> None:
        first = await h.acquire(idempotency_key="k1", labels={"run": "1"})
        assert first.path == "cold"
        await h.release(first)
        # back in the warm pool, on the agent and in the control plane's view, no lease
        assert h.on_agents() == {first.id: S.WARM}
        entry = h.scheduler.view.sandboxes[first.id]
        assert entry.state == S.WARM and entry.lease_id is None and entry.owner is None
        assert entry.idempotency_key is None and entry.labels == {}
        [reset] = h.calls_of("reset", first.id)
        assert reset.result.ok and 0 < reset.ended - reset.started < 1  # about an exec
        assert not h.calls_of("destroy")
        assert h.metric("dsec_scale_events_total", action="recycle") == 1
        assert h.metric("dsec_scale_events_total", action="release") == 0
        assert h.metric("dsec_episodes_completed_total") == 1

        second = await h.acquire(owner=BOB)
        assert second.id == first.id and second.path == "warm"
        assert second.lease_id != first.lease_id and second.lease_token != first.lease_token
        assert second.labels == {}
        # the old lease's token is refused: as released, not as the new lease's owner
        with pytest.raises(ApiError) as old:
            await h.release(first)
        assert old.value.status == 409 and old.value.code == "already_released"
        assert h.scheduler.view.sandboxes[first.id].lease_id == second.lease_id
        # its key is spent, as after any release
        with pytest.raises(ApiError) as spent:
            await h.acquire(idempotency_key="k1")
        assert spent.value.code == "idempotency_key_spent"
        await h.release(second)
        assert h.on_agents() == {first.id: S.WARM}
        assert h.metric("dsec_episodes_completed_total") == 2

    recycling(resync_s=0).run(scenario)


def test_a_frozen_lease_is_thawed_and_recycled():
    async def scenario(h: Harness) -> None:
        lease = await h.acquire()
        await h.settle(30)  # idle past lease_idle_freeze_s: paused
        assert h.on_agents()[lease.id] == S.LEASED_PAUSED
        await h.release(lease)
        assert h.on_agents() == {lease.id: S.WARM}
        assert h.scheduler.view.sandboxes[lease.id].state == S.WARM
        again = await h.acquire()
        assert again.id == lease.id and again.path == "warm"

    pools = {"default": RECYCLING.model_copy(update={"lease_idle_freeze_s": 10})}
    Harness(nodes=1, slots=1, pools=pools).run(scenario)


def test_a_reset_that_fails_removes_the_sandbox_and_never_hands_it_out():
    async def scenario(h: Harness) -> None:
        first = await h.acquire()
        h.agents.inject("node-1", "reset", RESET_FAILED)
        await h.release(first)
        await h.settle(2)
        assert first.id not in h.on_agents() and first.id not in h.scheduler.view.sandboxes
        assert [c.result.ok for c in h.calls_of("reset", first.id)] == [False]
        assert [c.result.ok for c in h.calls_of("destroy", first.id)] == [True]
        assert h.metric("dsec_agent_call_errors_total", op="reset") == 1
        second = await h.acquire()
        assert second.id != first.id and second.path == "cold"
        await h.granted(second)
        # never leased again: its only lease was the first
        leases = {c.sandbox_id for c in h.calls_of("lease")}
        assert leases == {first.id, second.id}

    recycling().run(scenario)


def test_an_unreachable_agent_during_a_reset_removes_the_sandbox_when_it_answers():
    async def scenario(h: Harness) -> None:
        first = await h.acquire()
        h.agents.inject("node-1", "reset", CallResult(False, 0, "unreachable", "refused"))
        await h.release(first)
        await h.settle(5)
        assert first.id not in h.on_agents()
        assert (await h.acquire()).id != first.id

    recycling().run(scenario)


def test_a_template_that_does_not_allow_recycling_is_removed_on_release():
    async def scenario(h: Harness) -> None:
        lease = await h.acquire(template="plain")
        await h.release(lease)
        assert lease.id not in h.on_agents()
        assert not h.calls_of("reset")
        assert h.metric("dsec_scale_events_total", action="release") == 1

    Harness(nodes=1, pools={"default": RECYCLING}, templates=TEMPLATES).run(scenario)


def test_recycling_a_template_that_does_not_allow_it_is_refused():
    bad = PoolParams(recycle=True, templates=["base", "plain"])
    with pytest.raises(ValidationError, match="plain"):
        ControlPlaneConfig(
            admin_tokens=["a" * 16], agent_token="b" * 16, pools={"p": bad}, templates=TEMPLATES
        )

    async def scenario(h: Harness) -> None:
        before = h.scheduler.config.pools["default"]
        with pytest.raises(ApiError) as refused:
            h.scheduler.set_pool("default", bad)
        assert refused.value.status == 422 and refused.value.code == "template_not_recyclable"
        assert "plain" in refused.value.message and "base" not in str(refused.value.details)
        assert h.scheduler.config.pools["default"] is before
        # off, the same templates are fine; on, with only recyclable ones, too
        h.scheduler.set_pool("default", bad.model_copy(update={"recycle": False}))
        h.scheduler.set_pool("train", PoolParams(recycle=True, templates=["base"]))

    Harness(nodes=1, templates=TEMPLATES).run(scenario)


@pytest.mark.asyncio
async def test_put_pool_refuses_recycling_a_template_that_does_not_allow_it():
    async with inprocess_controlplane(templates=TEMPLATES) as cp:
        headers = {"Authorization": f"Bearer {cp.tokens.admin}"}
        body = {"recycle": True, "templates": ["plain"]}
        async with cp.http.put("/v1/pools/default", json=body, headers=headers) as resp:
            answer = await resp.json()
            assert resp.status == 422, answer
        assert answer["error"]["code"] == "template_not_recyclable"
        assert "plain" in answer["error"]["message"]
        body = {"recycle": True, "templates": ["base"]}
        async with cp.http.put("/v1/pools/default", json=body, headers=headers) as resp:
            assert resp.status == 200 and (await resp.json())["params"]["recycle"] is True


def test_the_same_client_releasing_twice_while_the_reset_runs_is_told_released():
    async def scenario(h: Harness) -> None:
        lease = await h.acquire(owner=ALICE)
        first = asyncio.ensure_future(h.release(lease))
        await asyncio.sleep(0)  # the first release is under way: the reset runs
        with pytest.raises(ApiError) as again:
            await h.release(lease)
        assert again.value.code == "already_released"
        await first
        assert h.metric("dsec_episodes_completed_total") == 1
        assert len(h.calls_of("reset")) == 1

    recycling().run(scenario)


# --- the agent's reset, against a fake engine -----------------------------------------
# (what the reset's commands do in a real container: tests/test_recycle_live.py)

LEASE, OTHER = "a" * 32, "b" * 32
CLEAN = b"process 1\nprocess 7\nchecked\n"


class FakeDocker:
    """The engine calls a reset makes, answered from a script of outputs."""

    def __init__(self, verify: bytes = CLEAN, kill: tuple = (0, b"main 7\nemptied\n", b"")):
        self.verify, self.kill_answer = verify, kill
        self.calls: list[str] = []

    async def run(self, op, container_id, cmd, *, user="", stdin=None, cap=1 << 20, work=None):
        self.calls.append(op)
        script = cmd[-1]
        assert user == "1000:1000" and script.count("/dev/shm") >= 1
        code, killed, err = self.kill_answer
        # one command kills, empties, then checks: the check runs only after a clean kill
        return (code, killed + self.verify, err) if code == 0 else self.kill_answer

    async def unpause(self, container_id, work):
        self.calls.append("unpause")

    async def init_pid(self, container_id):
        # past any PID the kernel gives (pid_max is at most 2**22): the host's side of
        # the sandbox is out of reach, so the engine's reset runs (agent/host.py)
        return (1 << 22) + 1

    async def kill(self, container_id):
        self.calls.append("kill")

    async def remove(self, container_id, work=None):
        self.calls.append("remove")


def leased_agent(tmp_path, docker: FakeDocker, state: S = S.LEASED):
    from agent.config import AgentConfig
    from agent.metrics import AgentMetrics
    from agent.node import Agent
    from agent.sandboxes import Sandbox
    from agent.store import SandboxRecord
    from dsec.clock import SystemClock

    config = AgentConfig(node_id="n1", agent_token="t" * 16, state_dir=tmp_path, loops_dir=tmp_path)
    agent = Agent(config, docker, SystemClock(), AgentMetrics("n1"))  # type: ignore[arg-type]
    spec = TemplateSpec(name="base", image=BASE_IMAGE, recyclable=True)
    record = SandboxRecord(
        id="n1.0123456789abcdef",
        container_id="c1",
        pool="default",
        template=spec.model_dump(),
        created_at=0.0,
        lease_id=LEASE,
        idempotency_key="k",
        owner="0123456789abcdef",
        labels={"run": "1"},
    )
    agent.sandboxes[record.id] = Sandbox(record, spec, state, 0.0, busy_s=3.0)
    return agent, record.id


async def test_the_agent_resets_a_lease_into_a_warm_sandbox_and_a_retry_finds_it_done(tmp_path):
    from dsec.models import ResetSandbox

    docker = FakeDocker()
    agent, sid = leased_agent(tmp_path, docker, S.LEASED_PAUSED)
    sandbox = await agent.reset(sid, ResetSandbox(lease_id=LEASE, request_id="r1"))
    assert sandbox.state == S.WARM and sandbox.busy_s == 3.0  # kept: all time
    record = sandbox.record
    assert (record.lease_id, record.owner, record.idempotency_key, record.labels) == (
        None,
        None,
        None,
        {},
    )
    assert docker.calls == ["unpause", "reset"]  # thawed first
    [stored] = await agent.store.all()
    assert stored.lease_id is None and stored.owner is None
    # kept with it: that lease's token never takes the sandbox up again (Agent.adopt)
    assert record.ended_leases == stored.ended_leases == {LEASE}
    again = await agent.reset(sid, ResetSandbox(lease_id=LEASE, request_id="r1"))
    assert again is sandbox and docker.calls == ["unpause", "reset"]
    with pytest.raises(ApiError) as other:
        await agent.reset(sid, ResetSandbox(lease_id=OTHER, request_id="r2"))
    assert other.value.status == 409 and other.value.code == "lease_mismatch"
    await agent.store.close()


@pytest.mark.parametrize(
    ("docker", "why"),
    [
        (FakeDocker(verify=b"process 1\nprocess 7\nprocess 42\nchecked\n"), "processes left"),
        (FakeDocker(verify=b"process 1\nprocess 7\nfile /work/.x\nchecked\n"), "file /work/.x"),
        (FakeDocker(verify=b"process 1\nprocess 7\nipc shm 3\nchecked\n"), "ipc shm 3"),
        (FakeDocker(verify=b"process 1\nprocess 7\n"), "did not finish"),
        (FakeDocker(kill=(3, b"no main process", b"")), "no main process"),
    ],
)
async def test_a_reset_that_does_not_check_out_removes_the_sandbox_on_the_agent(
    tmp_path, docker, why
):
    from dsec.models import ResetSandbox

    agent, sid = leased_agent(tmp_path, docker)
    with pytest.raises(ApiError) as failed:
        await agent.reset(sid, ResetSandbox(lease_id=LEASE, request_id="r1"))
    assert failed.value.status == 409 and failed.value.code == "reset_failed"
    assert why in failed.value.message
    assert sid not in agent.sandboxes and sid in agent.released
    assert "kill" in docker.calls  # stopped at once; removed when the engine is quiet
    assert not await agent.store.all()
    await asyncio.gather(*agent.operations)
    await agent.store.close()
