"""A node's Docker engine fails: it restarts, or its disk fills up; a node is stopped
while its commands run.

One node of the pool runs on a private Docker engine this module starts (its own data
root on a small tmpfs, its own socket), so the tests can restart that engine and fill
its disk for real while the rest of the pool, on the shared engine, keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import uuid
from collections.abc import AsyncIterator, Iterator

import aiohttp
import docker
import pytest
import pytest_asyncio
from conftest import (
    acquire_on,
    commands_running,
    eventually,
    make_spec,
    metric_value,
    pool_containers,
    started_pool,
    until_placeable,
)

from agent.docker_driver import LABEL_NODE
from bench.extra_nodes import (
    DISK_MB,
    ExtraAgent,
    PrivateEngine,
    node_info,
    private_engine,
    start_agent,
)
from controlplane.config import default_templates
from dsec.client import Client, DsecError, Sandbox, SandboxLost
from dsec.image import BASE_IMAGE
from dsec.launch.local import LocalPool
from dsec.models import Capacity, PoolParams, TemplateSpec
from dsec.processes import STOP_GRACE_S

PRIVATE_HOST = "127.0.0.9"  # LocalPool gives its own agents 127.0.0.2 upwards


@pytest.fixture(scope="module")
def engine() -> Iterator[PrivateEngine]:
    with private_engine("dsec-engine-", DISK_MB) as engine:
        yield engine


@pytest_asyncio.fixture(loop_scope="module")
async def pool(docker_client, tmp_path) -> AsyncIterator[LocalPool]:
    """One small node on the shared engine; the private-engine node joins per test."""
    spec = make_spec(
        tmp_path,
        nodes=1,
        capacity=Capacity(cpus=8, memory_mb=8192, slots=3),
        pool=PoolParams(min_warm=2, max_warm=4),
    )
    async with started_pool(spec, docker_client) as p:
        yield p


@pytest_asyncio.fixture(loop_scope="module")
async def private_node(pool: LocalPool, engine: PrivateEngine) -> AsyncIterator[ExtraAgent]:
    agent = await start_agent(
        pool,
        f"{pool.spec.name}-private-{uuid.uuid4().hex[:4]}",
        host=PRIVATE_HOST,
        slots=6,
        env={"DOCKER_HOST": engine.socket},
    )
    try:
        await until_placeable(pool, agent.node_id)
        yield agent
    finally:
        await agent.stop()
        assert not engine.containers(agent.node_id), "the agent left containers behind"


@pytest.mark.asyncio(loop_scope="module")
async def test_engine_restart_loses_its_sandboxes_clearly_and_the_node_recovers(
    pool: LocalPool,
    private_node: ExtraAgent,
    engine: PrivateEngine,
    client: Client,
    operator: Client,
):
    shared_node = pool.node_ids[0]
    node_id = private_node.node_id
    held: list[Sandbox] = []
    victim = await acquire_on(client, node_id, held)
    assert (await victim.exec(["sh", "-c", "echo before > f; cat f"])).stdout == "before\n"

    engine.stop()  # dockerd stops every container it runs

    async def engine_down() -> bool:
        info = await node_info(operator, node_id)
        return info is not None and not info.engine_ok and not info.placeable

    await eventually(engine_down, "the node to report its engine down", timeout=15)
    info = await node_info(operator, node_id)
    assert info is not None and info.healthy, "it still heartbeats: its leases are not lost"
    # a command meanwhile fails on the engine (502), and its client waits to learn
    # whether the lease survives: no engine restarts with its containers running
    pending = asyncio.ensure_future(victim.exec(["true"]))

    # the other node keeps serving, and no new work goes to the node without an engine
    for sandbox in held:
        if sandbox is not victim:
            await sandbox.release()
    held = [victim]
    async with client.sandbox(pool="default", template="base", timeout=30) as fresh:
        assert fresh.node == shared_node
        assert (await fresh.exec(["echo", "served"])).stdout == "served\n"

    engine.start()

    async def engine_back() -> bool:
        info = await node_info(operator, node_id)
        return info is not None and info.engine_ok and info.placeable

    await eventually(engine_back, "the node to take work again", timeout=20)
    with pytest.raises(SandboxLost) as lost:
        await pending
    assert (lost.value.cause, lost.value.infra_fault) == ("engine_lost", True), lost.value
    assert lost.value.code == "docker_engine_unreachable", "raised from the call's own error"
    status = await client.lease_status(victim.lease.lease_id)
    assert (status.outcome, status.infra_fault) == ("engine_lost", True)

    async def victim_lost() -> bool:
        return (await client.get(victim.id)).state == "lost"

    await eventually(victim_lost, "the dead sandbox to be reported lost", timeout=15)
    with pytest.raises(SandboxLost) as gone:
        await victim.exec(["true"])
    assert gone.value.status == 410 and gone.value.code == "sandbox_lost"
    assert gone.value.cause == "engine_lost"
    assert "Docker engine restarted" in gone.value.message
    await victim.release()  # a lost lease is released without fuss
    stopped = [c for c in engine.containers(node_id) if c.status != "running"]
    assert not stopped, f"stopped containers left on the node: {stopped}"

    # the node serves again: sandboxes land on it and run commands
    held = []
    try:
        again = await acquire_on(client, node_id, held)
        assert (await again.exec(["echo", "after"])).stdout == "after\n"
    finally:
        for sandbox in held:
            await sandbox.release()


@pytest.mark.asyncio(loop_scope="module")
async def test_a_node_whose_disk_is_full_leaves_placement_until_it_recovers(
    pool: LocalPool,
    private_node: ExtraAgent,
    engine: PrivateEngine,
    client: Client,
    operator: Client,
):
    shared_node = pool.node_ids[0]
    node_id = private_node.node_id
    engine.fill_disk()
    held: list[Sandbox] = []
    try:
        # two leases empty the warm pool, whose refills go to the emptiest node, the
        # private one; each create fails in Docker (no space left) until it is taken out
        for _ in range(2):
            held.append(await client.acquire(pool="default", template="base", timeout=30))

        async def taken_out() -> bool:
            info = await node_info(operator, node_id)
            return info is not None and not info.placeable and info.failures >= 3

        await eventually(taken_out, "the failing node to leave placement", timeout=30)
        info = await node_info(operator, node_id)
        assert info is not None and info.healthy and info.engine_ok  # only its calls fail
        taken = await metric_value(pool, "dsec_nodes_taken_out_total", {"node": node_id})
        assert taken >= 1
        errors = await metric_value(
            pool, "dsec_agent_call_errors_total", {"node": node_id, "code": "docker_disk_full"}
        )
        assert errors >= 3
        # the pool keeps serving from the healthy node, and nothing leaked on the full one
        held.append(await client.acquire(pool="default", template="base", timeout=30))
        assert {s.node for s in held} == {shared_node}
        assert [(await s.exec(["echo", "ok"])).stdout for s in held] == ["ok\n"] * 3
        assert not engine.containers(node_id)
    finally:
        engine.free_disk()
        for sandbox in held:
            await sandbox.release()

    # once its backoff ends, the node takes placements again; the first create that
    # succeeds there clears its record of failures
    async def placeable() -> bool:
        info = await node_info(operator, node_id)
        return info is not None and info.placeable

    await eventually(placeable, "the node's backoff to end", timeout=70)
    held = []
    try:
        back = await acquire_on(client, node_id, held)
        assert (await back.exec(["echo", "back"])).stdout == "back\n"
        info = await node_info(operator, node_id)
        assert info is not None and info.failures == 0
    finally:
        for sandbox in held:
            await sandbox.release()


@pytest.mark.asyncio(loop_scope="module")
async def test_a_template_whose_image_no_node_has_is_refused_at_once(docker_client, tmp_path):
    ghost = TemplateSpec(name="ghost", image="dsec-no-such-image:latest")
    spec = make_spec(tmp_path, nodes=2, templates={**default_templates(), "ghost": ghost})
    async with started_pool(spec, docker_client) as pool:
        async with Client(pool.url, token=pool.tokens.client) as client:
            with pytest.raises(DsecError) as refused:
                # no node reports the image: refused at once, without a create anywhere
                await client.acquire(pool="default", template="ghost", timeout=120)
            assert refused.value.status == 422
            assert refused.value.code == "template_unavailable"
            assert "dsec-no-such-image:latest" in refused.value.message
            assert "no node holds" in refused.value.message
            rejected = await metric_value(
                pool, "dsec_acquire_requests_total", {"pool": "default", "outcome": "rejected"}
            )
            assert rejected == 1
            # the nodes keep serving the templates they can run
            async with client.sandbox(pool="default", template="base", timeout=30) as sb:
                assert (await sb.exec(["echo", "fine"])).stdout == "fine\n"


@pytest.mark.asyncio(loop_scope="module")
async def test_a_node_stopped_while_commands_run_removes_its_sandboxes_and_exits(
    pool: LocalPool, client: Client, docker_client
):
    """SIGTERM while a client's command runs on the node, and another streams: the agent
    cuts both short (dsec.httpkit.REQUESTS_GRACE_S), removes every sandbox and exits by
    itself, well within its supervisor's grace. Before, it waited 60 s for the requests
    in progress, the whole grace: the SIGKILL that ended it left its containers behind."""
    node = await start_agent(
        pool, f"{pool.spec.name}-stop-{uuid.uuid4().hex[:4]}", host=PRIVATE_HOST, slots=2
    )
    held: list[Sandbox] = []
    try:
        sandbox = await acquire_on(client, node.node_id, held)
        running = asyncio.create_task(sandbox.exec(["sleep", "1001"], timeout=1000))
        async with sandbox.exec_stream(["sleep", "1002"]) as stream:
            container = docker_client.containers.get(f"dsec-{sandbox.id}")

            async def both_run() -> bool:
                args = await commands_running(container)
                return "sleep 1001" in args and "sleep 1002" in args

            await eventually(both_run, "both commands to run")
            node.proc.send_signal(signal.SIGTERM)
            exit_code = await asyncio.wait_for(node.proc.wait(), STOP_GRACE_S / 2)
            assert exit_code == 0  # by itself, not the supervisor's SIGKILL
            assert not pool_containers(docker_client, node.node_id)
            # the connections ended, unanswered; their client learns from the control
            # plane that the node went with its sandboxes
            with pytest.raises(SandboxLost) as lost:
                await running
            assert isinstance(lost.value.__cause__, aiohttp.ClientError), lost.value
            assert (lost.value.cause, lost.value.infra_fault) == ("node_lost", True)
            with pytest.raises(SandboxLost) as cut:
                async for _ in stream:
                    pass
            assert cut.value.code == "stream_closed", cut.value
            assert (cut.value.cause, cut.value.infra_fault) == ("node_lost", True)
    finally:
        await node.stop()
        for sandbox in held:
            with contextlib.suppress(DsecError):
                await sandbox.release()


@pytest.mark.asyncio(loop_scope="module")
async def test_a_stopping_node_removes_its_containers_it_has_no_record_of(
    pool: LocalPool, docker_client
):
    """A container labelled with the node but in none of its records (a create whose
    answer never came back, or a sandbox whose removal something stuck held up) goes
    with the node's other containers when it stops."""
    node = await start_agent(
        pool, f"{pool.spec.name}-sweep-{uuid.uuid4().hex[:4]}", host=PRIVATE_HOST, slots=1
    )
    try:
        unrecorded = docker_client.containers.run(
            BASE_IMAGE, ["sleep", "1000"], detach=True, network_mode="none",
            labels={LABEL_NODE: node.node_id},
        )  # fmt: skip
        node.proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(node.proc.wait(), STOP_GRACE_S / 2) == 0
        with pytest.raises(docker.errors.NotFound):
            unrecorded.reload()
    finally:
        await node.stop()
