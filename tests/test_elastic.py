"""The elastic policy on real Docker with short timers: grow, freeze, thaw, hibernate,
expire, overflow to cloud nodes, and live parameter changes."""

from __future__ import annotations

import asyncio

import pytest
from conftest import eventually, make_spec, started_pool

from agent.docker_driver import LABEL_NODE, LABEL_POOL, LABEL_SANDBOX
from dsec.client import Client
from dsec.models import Capacity, PoolParams

pytestmark = pytest.mark.asyncio(loop_scope="module")


def containers_of_pool(docker_client, pool, name: str) -> list:
    return [
        c
        for c in docker_client.containers.list(
            all=True, sparse=True, filters={"label": f"{LABEL_POOL}={name}"}
        )
        # sparse (no inspect per container, which races with removals): labels from the list
        if c.attrs["Labels"][LABEL_NODE].startswith(pool.spec.name + "-")
    ]


async def states(client: Client, pool_name: str) -> dict[str, int]:
    info = next(p for p in (await client.pools()).pools if p.name == pool_name)
    return info.sandboxes


async def test_a_burst_of_acquires_grows_the_pool(pool, client, operator, docker_client):
    await operator.set_pool("burst", PoolParams(min_warm=1, max_warm=30, templates=["base"]))
    await eventually(lambda: states(client, "burst"), timeout=20)
    held = await asyncio.gather(*(client.acquire(pool="burst", timeout=60) for _ in range(12)))
    try:
        counts = await states(client, "burst")
        # scale-up: beyond the 12 leases, extra warm sandboxes for the rest of the burst
        unassigned = counts.get("warm", 0) + counts.get("creating", 0)
        assert counts.get("leased", 0) == 12 and unassigned > 1, counts
        assert len(containers_of_pool(docker_client, pool, "burst")) >= 12
    finally:
        await asyncio.gather(*(sb.release() for sb in held))
        await operator.set_pool("burst", PoolParams(min_warm=0, max_warm=0, templates=[]))


async def test_idle_sandboxes_are_paused_then_destroyed_and_a_claim_thaws(
    pool, client, operator, docker_client
):
    name = "freeze"
    await operator.set_pool(name, PoolParams(min_warm=4, templates=["base"]))
    await eventually(lambda: _count(client, name, "warm", 4))
    # a live change: no warm floor and no share of the peak, so all four are beyond
    # the target
    short = PoolParams(min_warm=0, warm_fraction=0, freeze_after_s=1, hibernate_after_s=600,
                       frozen_ttl_s=8, templates=["base"])  # fmt: skip
    await operator.set_pool(name, short)

    def docker_paused():
        found = containers_of_pool(docker_client, pool, name)
        return len(found) == 4 and all(c.status == "paused" for c in found)

    await eventually(docker_paused, timeout=15)
    sb = await client.acquire(pool=name)
    assert sb.lease.path == "thaw"
    assert (await sb.exec(["echo", "thawed"])).stdout == "thawed\n"
    assert docker_client.containers.get(f"dsec-{sb.id}").status == "running"
    await sb.release()
    # the other three expire at frozen_ttl: gone from Docker, then from the pool (once
    # their node's next report says so)
    await eventually(lambda: not containers_of_pool(docker_client, pool, name), timeout=20)
    await eventually(lambda: _count_all(client, name, 0), "the pool empty", timeout=10)


async def test_hibernation_keeps_files_and_releases_the_container(
    pool, client, operator, docker_client
):
    name = "hibernate"
    await operator.set_pool(name, PoolParams(min_warm=1, templates=["base"]))
    [sandbox_id] = await eventually(lambda: _ids(operator, name, "warm", 1))
    # what a previous tenant of the template left in its work dir (written from outside)
    container = docker_client.containers.get(f"dsec-{sandbox_id}")
    owner = container.exec_run(["stat", "-c", "%u:%g", "/work"]).output.decode().strip()
    container.exec_run(["sh", "-c", "echo kept > /work/state"], user=owner)  # its own uid
    await operator.set_pool(
        name,
        PoolParams(min_warm=0, warm_fraction=0, freeze_after_s=0.5, hibernate_after_s=1,
                   frozen_ttl_s=600, templates=["base"]),
    )  # fmt: skip
    await eventually(lambda: _count(client, name, "hibernated", 1), timeout=20)
    assert not containers_of_pool(docker_client, pool, name)  # no container, no memory
    assert docker_client.images.list(name="dsec-hibernated")
    sb = await client.acquire(pool=name)
    assert sb.id == sandbox_id and sb.lease.path == "thaw"
    assert (await sb.exec(["cat", "/work/state"])).stdout == "kept\n"
    await sb.release()
    # its snapshot image goes with its container, once the engine is quiet
    await eventually(
        lambda: not [
            i for i in docker_client.images.list(name="dsec-hibernated")
            if any(sandbox_id in t for t in i.tags)
        ],
        "its snapshot image removed",
        40,
    )  # fmt: skip


async def test_an_idle_lease_is_frozen_and_the_next_exec_thaws_it(
    pool, client, operator, docker_client
):
    name = "lease-idle"
    await operator.set_pool(name, PoolParams(min_warm=0, lease_idle_freeze_s=1, templates=[]))
    async with client.sandbox(pool=name) as sb:
        container = docker_client.containers.get(f"dsec-{sb.id}")

        def paused():
            container.reload()
            return container.status == "paused"

        await eventually(paused, timeout=15)
        result = await sb.exec(["echo", "awake"])
        assert result.stdout == "awake\n" and result.exit_code == 0
        container.reload()
        assert container.status == "running"


async def test_bad_pool_parameters_keep_the_old_ones(client, operator):
    await operator.set_pool("kept", PoolParams(min_warm=0, freeze_after_s=42, templates=[]))
    bad = {"min_warm": 0, "freeze_after_s": -1, "templates": []}
    async with operator._http.put(
        f"{operator.url}/v1/pools/kept", json=bad,
        headers={"Authorization": f"Bearer {operator.token}"},
    ) as resp:  # fmt: skip
        assert resp.status == 422
    info = next(p for p in (await client.pools()).pools if p.name == "kept")
    assert info.params.freeze_after_s == 42


async def test_local_nodes_past_80_percent_overflow_to_a_cloud_node(docker_client, tmp_path):
    spec = make_spec(
        tmp_path, nodes=1, capacity=Capacity(cpus=16, memory_mb=16384, slots=5),
        pool=PoolParams(min_warm=0, max_warm=0, templates=[]), cloud_nodes=1,
        cloud_boot_delay_s=0.5, cloud_idle_release_s=2,
    )  # fmt: skip
    async with started_pool(spec, docker_client) as small:
        async with Client(small.url, token=small.tokens.client) as c:
            held = await asyncio.gather(*(c.acquire(timeout=60) for _ in range(7)))
            on_cloud = [sb for sb in held if sb.node.startswith(f"{spec.name}-cloud-")]
            assert on_cloud, [sb.node for sb in held]
            assert {sb.lease.path for sb in on_cloud} == {"overflow"}
            for sb in on_cloud:
                found = docker_client.containers.list(filters={"label": f"{LABEL_SANDBOX}={sb.id}"})
                assert found and found[0].labels[LABEL_NODE] == sb.node
                assert (await sb.exec(["echo", "cloud"])).stdout == "cloud\n"
            local = [sb for sb in held if sb not in on_cloud]
            assert 4 <= len(local) <= 5  # local took work until it passed 80%
            await asyncio.gather(*(sb.release() for sb in held))

            async def cloud_released():
                return not any(n.kind == "cloud" for n in (await c.nodes()).nodes)

            await eventually(cloud_released, timeout=30)


async def _count_all(client, pool_name, n) -> bool:
    return sum((await states(client, pool_name)).values()) == n


async def _count(client, pool_name, state, n) -> bool:
    return (await states(client, pool_name)).get(state, 0) == n


async def _ids(client, pool_name, state, n) -> list[str] | None:
    ids = [s.id for s in await client.list(pool=pool_name) if s.state == state]
    return ids if len(ids) == n else None
