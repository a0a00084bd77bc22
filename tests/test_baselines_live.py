"""Every policy in `dsec.policies.POLICIES` running a real local pool on Docker: each
acquires, runs a command and releases, and shows the behaviour that makes it that policy.

The baselines' timers are their controllers' (HPA syncs every 15 s, KEDA polls every
30 s), so the scenarios are built around a first sync or poll rather than waiting out
many of them. One node and a handful of slots per pool keep the file fast.
"""

from __future__ import annotations

import asyncio

import pytest
from conftest import (
    assert_stopped_then_removed,
    eventually,
    make_spec,
    pool_containers,
    started_pool,
)

from agent.docker_driver import LABEL_SANDBOX
from dsec.client import Client, DsecError
from dsec.models import Capacity, PoolParams
from dsec.policies import POLICIES

SLOTS = 8
TICK_S = 0.1


async def states(client: Client) -> dict[str, int]:
    [info] = [p for p in (await client.pools()).pools if p.name == "default"]
    return info.sandboxes


def containers(docker_client, pool) -> set[str]:
    """The ids of the sandboxes whose containers exist in Docker for this pool."""
    found = pool_containers(docker_client, pool.spec.name + "-")
    return {c.attrs["Labels"][LABEL_SANDBOX] for c in found}


async def use(sb) -> None:
    """What an episode does with its sandbox: run something in it."""
    assert (await sb.exec(["echo", sb.id])).stdout == f"{sb.id}\n"


async def _only(client: Client, **counts: int) -> bool:
    """The pool holds exactly these sandboxes, by state."""
    return await states(client) == counts


async def settle() -> None:
    """Let the policy run a few ticks (the pools here tick every TICK_S)."""
    await asyncio.sleep(8 * TICK_S)


async def cold(client, pool, docker_client) -> None:
    await settle()
    assert await states(client) == {}, "no pool: nothing exists before a request"
    assert containers(docker_client, pool) == set()
    sb = await client.acquire(timeout=60)
    assert sb.lease.path == "cold"
    await use(sb)
    await sb.release()
    # no pool to return it to: the container is removed and nothing replaces it
    await eventually(lambda: not containers(docker_client, pool), "container removed", 20)
    await settle()
    assert await states(client) == {}


async def static(client, pool, docker_client) -> None:
    size = pool.spec.pool.min_warm
    await eventually(lambda: _only(client, warm=size), f"{size} warm", 30)
    before = containers(docker_client, pool)
    sb = await client.acquire(timeout=60)
    assert sb.lease.path == "warm" and sb.id in before
    await use(sb)
    await settle()
    # the pool holds its size: the lease counts, no replacement while it is held
    assert await _only(client, leased=1, warm=size - 1)
    await sb.release()
    await eventually(lambda: _only(client, warm=size), "replaced after the release", 30)
    await assert_stopped_then_removed(docker_client, sb.id)
    after = containers(docker_client, pool)
    assert sb.id not in after and len(after) == size


async def autoscaled(client, pool, docker_client, *, idle_before: int) -> None:
    """HPA and KPA: three requests against one replica; both controllers want
    ceil(3 / 0.7) = 5 replicas, so two idle ones stand beside the three leases."""
    await eventually(lambda: _only(client, warm=idle_before), f"{idle_before} warm", 30)
    held = await asyncio.gather(*(client.acquire(timeout=60) for _ in range(3)))
    try:
        await asyncio.gather(*(use(sb) for sb in held))
        await eventually(lambda: _only(client, leased=3, warm=2), "scaled to 5 replicas", 30)
    finally:
        await asyncio.gather(*(sb.release() for sb in held))


async def hpa(client, pool, docker_client) -> None:
    await autoscaled(client, pool, docker_client, idle_before=1)  # minReplicas 1
    # the 300 s stabilisation window keeps 5 replicas: the released leases are replaced
    await eventually(lambda: _only(client, warm=5), "5 replicas kept after the release", 30)


async def kpa(client, pool, docker_client) -> None:
    await autoscaled(client, pool, docker_client, idle_before=1)  # min-scale 1


async def keda(client, pool, docker_client) -> None:
    await settle()
    assert await states(client) == {}, "no pending work, no job"
    # the first poll of a work queue sees this request: one job is started for it
    sb = await client.acquire(timeout=60)
    await use(sb)
    assert containers(docker_client, pool) == {sb.id}
    # the next poll is ~30 s after the first: work that arrives between polls waits
    with pytest.raises(DsecError) as waited:
        await client.acquire(timeout=2)
    assert waited.value.code == "acquire_timeout"
    await sb.release()
    # a job ends with its work: nothing is kept
    await eventually(lambda: not containers(docker_client, pool), "job removed", 20)
    await settle()
    assert await states(client) == {}


async def dsec(client, pool, docker_client) -> None:
    target = pool.spec.pool.min_warm
    await eventually(lambda: _only(client, warm=target), f"{target} warm", 30)
    sb = await client.acquire(timeout=60)
    assert sb.lease.path == "warm"
    await use(sb)
    # the warm pool refills to its target beside the lease
    await eventually(lambda: _only(client, leased=1, warm=target), "refilled", 30)
    await sb.release()
    await eventually(lambda: _only(client, warm=target), "the lease removed", 30)
    await assert_stopped_then_removed(docker_client, sb.id)
    assert sb.id not in containers(docker_client, pool)


SCENARIOS = {
    "cold": (cold, PoolParams()),
    "static": (static, PoolParams(min_warm=3, max_warm=3)),
    "hpa": (hpa, PoolParams(min_warm=1, max_warm=SLOTS)),
    "kpa": (kpa, PoolParams(min_warm=1, max_warm=SLOTS)),
    # templates=[]: no queue to poll until work arrives, so the first poll sees it
    "keda": (keda, PoolParams(min_warm=0, max_warm=SLOTS, templates=[])),
    "dsec": (dsec, PoolParams(min_warm=2, warm_fraction=0)),
}


def test_every_policy_has_a_live_scenario():
    assert set(SCENARIOS) == set(POLICIES)


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("policy", sorted(POLICIES))
async def test_policy_on_a_live_pool(policy, docker_client, tmp_path):
    scenario, params = SCENARIOS[policy]
    spec = make_spec(
        tmp_path, nodes=1, capacity=Capacity(cpus=8, memory_mb=8192, slots=SLOTS),
        pool=params, policy=policy, tick_s=TICK_S,
    )  # fmt: skip
    async with started_pool(spec, docker_client) as pool:
        async with Client(pool.url, token=pool.tokens.client) as client:
            await scenario(client, pool, docker_client)
