"""Every lease ends with an outcome (docs/contracts.md, "Lease outcomes"): its client's
release, its pool's limits, an operator's removal, a container killed from outside, a
node whose agent is killed. A call on a lease that ended under its client raises
SandboxLost with the cause, an infrastructure fault or not; GET /v1/leases/{id} says
the same, and dsec_lease_outcomes_total counts it.

The engine restarting under a lease (engine_lost) is tested with the private engine
of tests/test_reliability.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from conftest import acquire_on, eventually, make_spec, metric_value, started_pool, until_placeable

from agent.docker_driver import LABEL_NODE, LABEL_SANDBOX
from bench.extra_nodes import start_agent
from dsec.client import Client, DsecError, Sandbox, SandboxLost
from dsec.launch.local import LocalPool
from dsec.models import LeaseStatus, PoolParams
from dsec.tokens import new_token

pytestmark = [pytest.mark.docker, pytest.mark.asyncio(loop_scope="module")]

MINE, OTHER = new_token(), new_token()  # this module's client, and a second one


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pool(docker_client, tmp_path_factory) -> AsyncIterator[LocalPool]:
    spec = make_spec(tmp_path_factory.mktemp("outcomes"), nodes=2)
    spec.more_pools = {
        "short": PoolParams(min_warm=1, max_lease_s=1.5),
        "idle": PoolParams(min_warm=1, lease_idle_timeout_s=1.0),
    }
    with pytest.MonkeyPatch.context() as env:
        env.setenv("DSEC_TOKEN", f"{MINE},{OTHER}")
        async with started_pool(spec, docker_client) as p:
            yield p


@pytest_asyncio.fixture(loop_scope="module")
async def client(pool: LocalPool) -> AsyncIterator[Client]:
    async with Client(pool.url, token=MINE) as c:
        yield c


async def ended(client: Client, sb: Sandbox, timeout: float = 20.0) -> LeaseStatus:
    async def status() -> LeaseStatus | None:
        got = await client.lease_status(sb.lease.lease_id)
        return got if got.ended else None

    return await eventually(status, f"the lease on {sb.id} to end", timeout=timeout)


def containers_of(docker_client, sandbox_id: str) -> list:
    return docker_client.containers.list(
        all=True, filters={"label": f"{LABEL_SANDBOX}={sandbox_id}"}
    )


async def test_a_release_is_the_clients_own_end_and_no_fault(pool, client):
    before = await metric_value(pool, "dsec_lease_outcomes_total", {"outcome": "released"})
    sb = await client.acquire()
    running = await client.lease_status(sb.lease.lease_id)
    assert (running.ended, running.outcome, running.sandbox_id) == (False, None, sb.id)
    assert running.lost_within_s > 0
    await sb.release()
    status = await client.lease_status(sb.lease.lease_id)
    assert (status.outcome, status.infra_fault, status.pool) == ("released", False, "default")
    assert status.ended_at is not None and status.message
    after = await metric_value(pool, "dsec_lease_outcomes_total", {"outcome": "released"})
    assert after == before + 1
    # a call after its own release is not a lost sandbox: the plain error
    with pytest.raises(DsecError) as e:
        await sb.exec(["true"])
    assert not isinstance(e.value, SandboxLost) and e.value.status == 410


async def test_a_lease_is_only_its_own_clients_to_see(pool, client):
    sb = await client.acquire()
    try:
        async with Client(pool.url, token=OTHER) as other:
            with pytest.raises(DsecError) as e:
                await other.lease_status(sb.lease.lease_id)
            assert (e.value.status, e.value.code) == (404, "unknown_lease")
            with pytest.raises(DsecError) as e:
                await other.lease_status("not-a-lease")
            assert (e.value.status, e.value.code) == (400, "invalid_lease_id")
        async with Client(pool.url, token=pool.tokens.admin) as operator:
            assert (await operator.lease_status(sb.lease.lease_id)).sandbox_id == sb.id
    finally:
        await sb.release()


async def test_a_container_killed_from_outside_is_lost_as_the_infrastructures_fault(
    pool, client, docker_client
):
    sb = await client.acquire()
    [container] = containers_of(docker_client, sb.id)
    running = asyncio.ensure_future(sb.exec(["sleep", "30"]))
    await asyncio.sleep(0.5)
    os.kill(container.attrs["State"]["Pid"], signal.SIGKILL)
    for call in (running, sb.exec(["true"]), sb.files.read("/work/x")):
        with pytest.raises(SandboxLost) as e:
            await call
        assert (e.value.cause, e.value.infra_fault) == ("container_died", True), e.value
    status = await ended(client, sb)
    assert (status.outcome, status.infra_fault) == ("container_died", True)
    # its node dropped it at once: no container is left for it, before any release
    await eventually(lambda: not containers_of(docker_client, sb.id), "its container removed")
    await sb.release()  # a lost lease is released without fuss
    assert (await client.lease_status(sb.lease.lease_id)).outcome == "container_died"


async def test_an_operator_removing_a_leased_sandbox_evicts_it(pool, client):
    sb = await client.acquire()
    async with Client(pool.url, token=pool.tokens.admin) as operator:
        await operator.release(sb.id)
    with pytest.raises(SandboxLost) as e:
        await sb.exec(["true"])
    assert (e.value.cause, e.value.infra_fault) == ("evicted", True)
    status = await client.lease_status(sb.lease.lease_id)
    assert (status.outcome, status.infra_fault) == ("evicted", True)


@pytest.mark.parametrize(("pool_name", "outcome"), [("short", "expired"), ("idle", "idle_timeout")])
async def test_a_pools_limits_end_a_lease_and_are_no_fault(pool, client, pool_name, outcome):
    before = await metric_value(
        pool, "dsec_lease_outcomes_total", {"pool": pool_name, "outcome": outcome}
    )
    sb = await client.acquire(pool=pool_name)
    status = await ended(client, sb)
    assert (status.outcome, status.infra_fault) == (outcome, False)
    with pytest.raises(SandboxLost) as e:
        await sb.exec(["true"])
    assert (e.value.cause, e.value.infra_fault) == (outcome, False), e.value
    after = await metric_value(
        pool, "dsec_lease_outcomes_total", {"pool": pool_name, "outcome": outcome}
    )
    assert after == before + 1


async def test_a_failed_setup_is_counted_as_its_own_outcome(pool, client):
    labels = {"pool": "default", "outcome": "setup_failed"}
    before = await metric_value(pool, "dsec_lease_outcomes_total", labels)
    with pytest.raises(DsecError) as e:
        await client.acquire(setup=["false"])
    assert (e.value.status, e.value.code) == (422, "setup_failed")
    assert await metric_value(pool, "dsec_lease_outcomes_total", labels) == before + 1


async def test_an_agent_killed_under_its_leases_ends_them_as_node_lost(pool, client, docker_client):
    agent = await start_agent(pool, f"{pool.spec.name}-doomed", host="127.0.0.12", slots=4)
    held: list[Sandbox] = []
    try:
        await until_placeable(pool, agent.node_id)
        doomed = await acquire_on(client, agent.node_id, held)
        other = next((sb for sb in held if sb.node != agent.node_id), None)
        if other is None:
            other = await client.acquire()
            held.append(other)
        running = asyncio.ensure_future(doomed.exec(["sleep", "60"]))
        await asyncio.sleep(0.5)
        agent.proc.send_signal(signal.SIGKILL)
        await agent.proc.wait()
        # the command in flight and the next both learn it, once the control plane has
        # found the node silent: no hang, no exit code of a command that did not end
        for call in (running, doomed.exec(["true"])):
            with pytest.raises(SandboxLost) as e:
                await call
            assert (e.value.cause, e.value.infra_fault) == ("node_lost", True), e.value
        status = await client.lease_status(doomed.lease.lease_id)
        assert (status.outcome, status.infra_fault) == ("node_lost", True)
        # the sandbox on another node is untouched
        assert (await other.exec(["echo", "fine"])).stdout == "fine\n"
    finally:
        for sb in held:
            await sb.release()
        await agent.stop()
        # its agent never came back to remove its containers: this test does
        for c in docker_client.containers.list(
            all=True, filters={"label": f"{LABEL_NODE}={agent.node_id}"}
        ):
            c.remove(force=True)
