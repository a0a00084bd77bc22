"""The live pool end to end: real processes, real HTTP, real Docker containers."""

from __future__ import annotations

import asyncio
import signal

import docker
import pytest
from conftest import assert_stopped_then_removed, make_spec, pool_containers, started_pool

from agent.docker_driver import LABEL_NODE, LABEL_POOL, LABEL_SANDBOX, LABEL_TEMPLATE
from dsec.client import Client, DsecError
from dsec.models import Capacity, PoolParams

pytestmark = pytest.mark.asyncio(loop_scope="module")


def container_of(docker_client: docker.DockerClient, sandbox_id: str):
    # sparse, then one inspect: a full listing inspects each, racing with removals
    found = docker_client.containers.list(
        all=True, sparse=True, filters={"label": f"{LABEL_SANDBOX}={sandbox_id}"}
    )
    try:
        return docker_client.containers.get(found[0].id) if found else None
    except docker.errors.NotFound:
        return None


async def test_thirty_concurrent_acquires_spread_over_three_nodes(client, docker_client, pool):
    sandboxes = await asyncio.gather(*(client.acquire(timeout=60) for _ in range(30)))
    try:
        assert len({sb.id for sb in sandboxes}) == 30
        nodes_by_label = set()
        for sb in sandboxes:
            c = container_of(docker_client, sb.id)
            assert c is not None and c.status == "running"
            assert c.labels[LABEL_NODE] == sb.node
            assert c.labels[LABEL_POOL] == "default"
            assert c.labels[LABEL_TEMPLATE] == "base"
            nodes_by_label.add(c.labels[LABEL_NODE])
        assert nodes_by_label == set(pool.node_ids)
        paths = {sb.lease.path for sb in sandboxes}
        assert paths <= {"warm", "cold"} and "cold" in paths  # 30 > the warm floor of 2/pool
    finally:
        await asyncio.gather(*(sb.release() for sb in sandboxes))
    for sb in sandboxes:
        await assert_stopped_then_removed(docker_client, sb.id)


async def test_exec_returns_output_and_exit_code(client):
    async with client.sandbox() as sb:
        result = await sb.exec(["sh", "-c", "echo out; echo err >&2; exit 7"])
        assert (result.exit_code, result.stdout, result.stderr) == (7, "out\n", "err\n")
        assert not result.timed_out and not result.truncated
        env = await sb.exec(["sh", "-c", "echo $GREETING; pwd"], env={"GREETING": "hi"})
        assert env.stdout == "hi\n/work\n"
        written = await sb.exec(["sh", "-c", "echo data > f && cat /work/f"])
        assert written.stdout == "data\n"


async def test_exec_honours_its_timeout(client, docker_client):
    async with client.sandbox() as sb:
        result = await sb.exec(["sh", "-c", "echo started; sleep 30"], timeout=1)
        assert result.timed_out and result.exit_code == 124
        assert result.stdout == "started\n"
        assert result.duration_ms < 10_000
        # the command is gone from the sandbox, not left running
        ps = await sb.exec(["ps", "-o", "args"])
        assert "sleep 30" not in ps.stdout


async def test_exec_caps_its_output(client):
    async with client.sandbox() as sb:
        result = await sb.exec(
            ["sh", "-c", "yes abcdefgh | head -c 200000; echo tail >&2"], max_output_bytes=1000
        )
        assert result.truncated
        assert len(result.stdout) == 1000 and result.stdout.startswith("abcdefgh\n")
        assert result.stderr == "tail\n" and result.exit_code == 0


async def test_release_removes_the_container(client, docker_client):
    sb = await client.acquire()
    assert container_of(docker_client, sb.id) is not None
    await sb.release()
    await assert_stopped_then_removed(docker_client, sb.id)
    info = await client.list()
    assert sb.id not in {s.id for s in info}


async def test_sandbox_context_releases_on_error_and_cancellation(client, docker_client):
    held: list[str] = []
    with pytest.raises(RuntimeError):
        async with client.sandbox() as sb:
            held.append(sb.id)
            raise RuntimeError("the agent crashed")

    async def hang() -> None:
        async with client.sandbox() as sb:
            held.append(sb.id)
            await asyncio.sleep(3600)

    task = asyncio.create_task(hang())
    while len(held) < 2:
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(100):  # the shielded release runs on after the cancellation
        if all(container_of(docker_client, i) is None for i in held):
            break
        await asyncio.sleep(0.05)
    assert all(container_of(docker_client, i) is None for i in held)


async def test_idempotency_key_returns_the_same_sandbox(client):
    first = await client.acquire(idempotency_key="episode-42")
    again = await client.acquire(idempotency_key="episode-42")
    assert again.id == first.id and again.lease.lease_token == first.lease.lease_token
    await first.release()
    with pytest.raises(DsecError) as e:
        await client.acquire(idempotency_key="episode-42")
    assert e.value.status == 409 and e.value.code == "idempotency_key_spent"


async def test_the_warm_pool_is_topped_up(client, pool):
    for _ in range(200):
        pools = (await client.pools()).pools
        default = next(p for p in pools if p.name == "default")
        if default.sandboxes.get("warm", 0) >= 2:
            break
        await asyncio.sleep(0.05)
    sb = await client.acquire()
    assert sb.lease.path == "warm" and sb.lease.schedule_ms < 1000
    await sb.release()


async def test_a_restarted_agent_adopts_its_containers(client, docker_client, pool):
    # lease one sandbox on the first node, keeping the others out of the way
    victim = pool.agents[0]
    mine = []
    while not mine:
        sb = await client.acquire()
        (mine if sb.node == victim.name else []).append(sb)
        if sb.node != victim.name:
            await sb.release()
    sb = mine[0]
    await sb.exec(["sh", "-c", "echo before > /work/state"])
    # a container with this node's label that no record accounts for
    stray = docker_client.containers.run(
        "dsec-base:latest",
        ["sleep", "600"],
        detach=True,
        network_mode="none",
        labels={LABEL_NODE: victim.name, LABEL_SANDBOX: f"{victim.name}.0000000000000000"},
    )
    victim.proc.send_signal(signal.SIGKILL)
    await victim.proc.wait()
    restarted = await pool.restart_agent(victim)
    assert restarted.url == victim.url
    # the lease still works, with the same token, and the sandbox kept its files
    result = await sb.exec(["cat", "/work/state"])
    assert result.stdout == "before\n"
    with pytest.raises(docker.errors.NotFound):
        stray.reload()
    assert container_of(docker_client, sb.id).status == "running"
    await sb.release()
    await assert_stopped_then_removed(docker_client, sb.id)


async def test_dsec_status_prints_nodes_and_sandboxes(pool):
    proc = await asyncio.create_subprocess_exec(
        "dsec", "status", "--url", pool.url,
        env={"DSEC_ADMIN_TOKEN": pool.tokens.admin, "PATH": __import__("os").environ["PATH"]},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await proc.communicate()
    assert proc.returncode == 0, err
    text = out.decode()
    for node_id in pool.node_ids:
        assert node_id in text
    assert "warm" in text and "sandbox" in text


async def test_a_client_with_a_bad_token_is_refused(pool):
    async with Client(pool.url, token="not-the-token") as wrong:
        with pytest.raises(DsecError) as e:
            await wrong.acquire()
    assert e.value.status == 403


async def test_an_acquire_nothing_can_serve_times_out_cleanly(docker_client, tmp_path):
    spec = make_spec(
        tmp_path, nodes=1, capacity=Capacity(cpus=4, memory_mb=4096, slots=2),
        pool=PoolParams(min_warm=0),
    )  # fmt: skip
    async with started_pool(spec, docker_client) as small:
        async with Client(small.url, token=small.tokens.client) as c:
            held = [await c.acquire(), await c.acquire()]
            with pytest.raises(DsecError) as e:
                await c.acquire(timeout=1)
            assert e.value.status == 503 and e.value.code == "acquire_timeout"
            assert len(pool_containers(docker_client, spec.name + "-")) == 2
            await held[0].release()
            # the freed slot serves the next request
            again = await c.acquire(timeout=30)
            await asyncio.gather(again.release(), held[1].release())
