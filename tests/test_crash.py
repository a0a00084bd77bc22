"""Crashes on real processes and real Docker: kill -9 of an agent, kill -9 of the
control plane in the middle of a burst of acquires.

What must hold after each: no lease is lost (every client's sandbox runs commands
again, with the token it already had), no sandbox is handed out twice or made twice
for one idempotency key, and no container is left that the pool does not account for.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from functools import partial
from urllib.parse import urlsplit

import aiohttp
import docker
import pytest
import pytest_asyncio
from conftest import eventually, make_spec, started_pool

from agent.docker_driver import LABEL_NODE, LABEL_SANDBOX
from dsec.client import Client, DsecError, Sandbox, SandboxLost
from dsec.launch.local import Child, LocalPool

pytestmark = pytest.mark.asyncio(loop_scope="module")

HEARTBEAT_TIMEOUT_S = 5.0  # the control plane's default heartbeat_timeout_s
# a silent node is noticed by the first tick past the timeout; its last heartbeat may
# have left up to one heartbeat interval before the kill
LOST_WITHIN_S = HEARTBEAT_TIMEOUT_S + 0.5 + 0.25 + 1.0
RESTART_TIMEOUT_S = 60.0


@pytest_asyncio.fixture(loop_scope="module")
async def pool(docker_client, tmp_path) -> AsyncIterator[LocalPool]:
    """A pool of its own for each test: each one breaks it."""
    async with started_pool(make_spec(tmp_path, nodes=3), docker_client) as p:
        yield p


@pytest_asyncio.fixture(loop_scope="module")
async def client(pool: LocalPool) -> AsyncIterator[Client]:
    # no retries inside the SDK: the test retries itself, to see every refusal
    async with Client(pool.url, token=pool.tokens.client, acquire_retries=0) as c:
        yield c


async def states(client: Client) -> dict[str, str]:
    return {s.id: s.state for s in await client.list()}


async def all_in_state(client: Client, sandboxes: list[Sandbox], state: str) -> bool:
    now = await states(client)
    return all(now.get(sb.id) == state for sb in sandboxes)


def containers_by_sandbox(docker_client: docker.DockerClient, pool: LocalPool) -> dict[str, int]:
    """Containers per sandbox id, from one listing: no inspect per container, which
    would race with the removals the pool is making meanwhile."""
    counts: dict[str, int] = {}
    for row in docker_client.api.containers(all=True, filters={"label": LABEL_NODE}):
        labels = row.get("Labels") or {}
        if labels.get(LABEL_NODE, "").startswith(pool.spec.name + "-"):
            counts[labels[LABEL_SANDBOX]] = counts.get(labels[LABEL_SANDBOX], 0) + 1
    return counts


async def assert_every_container_accounted_for(operator, docker_client, pool) -> None:
    """One container per sandbox, and every container is one the control plane knows:
    nothing orphaned, nothing doubled. Waits out removals and creates under way."""

    async def settled() -> bool:
        known = await states(operator)
        counts = containers_by_sandbox(docker_client, pool)
        moving = {"creating", "destroying"}
        return set(counts) == set(known) and not moving & set(known.values())

    await eventually(settled, "the containers and the control plane's view to agree", timeout=20)
    assert all(n == 1 for n in containers_by_sandbox(docker_client, pool).values())


async def write_ids(sandboxes: list[Sandbox]) -> None:
    """Each sandbox keeps its own id in a file: proof, later, that it is the same one."""
    results = await asyncio.gather(
        *(sb.exec(["sh", "-c", f"echo {sb.id} > /work/id"]) for sb in sandboxes)
    )
    assert [(r.exit_code, r.stderr) for r in results] == [(0, "")] * len(sandboxes)


async def assert_same_sandboxes(sandboxes: list[Sandbox]) -> None:
    results = await asyncio.gather(*(sb.exec(["cat", "/work/id"]) for sb in sandboxes))
    assert [(r.exit_code, r.stdout, r.stderr) for r in results] == [
        (0, f"{sb.id}\n", "") for sb in sandboxes
    ]


async def test_a_killed_agent_is_reported_lost_then_adopts_its_sandboxes(
    pool, client, operator, docker_client
):
    leases = list(await asyncio.gather(*(client.acquire() for _ in range(9))))
    await write_ids(leases)
    victim = next(a for a in pool.agents if a.name == leases[0].node)
    on_victim = [sb for sb in leases if sb.node == victim.name]
    elsewhere = [sb for sb in leases if sb.node != victim.name]

    killed_at = time.monotonic()
    victim.proc.send_signal(signal.SIGKILL)
    await victim.proc.wait()
    lost = partial(all_in_state, operator, on_victim, "lost")
    await eventually(lost, "the dead node's sandboxes to be lost", timeout=LOST_WITHIN_S + 5)
    lost_after_s = time.monotonic() - killed_at
    assert lost_after_s <= LOST_WITHIN_S, f"reported lost after {lost_after_s:.1f} s"
    for sb in on_victim:
        assert (await client.get(sb.id)).state == "lost"
        # its agent is gone: no answer at all, so the SDK asks the control plane,
        # which has ended the lease as an infrastructure fault the trainer masks
        with pytest.raises(SandboxLost) as lost_call:
            await sb.exec(["true"])
        assert (lost_call.value.cause, lost_call.value.infra_fault) == ("node_lost", True)
        assert isinstance(lost_call.value.__cause__, aiohttp.ClientConnectionError)

    # the other nodes keep serving: their leases, and new acquires
    await assert_same_sandboxes(elsewhere)
    fresh = list(await asyncio.gather(*(client.acquire() for _ in range(4))))
    assert victim.name not in {sb.node for sb in fresh}
    await write_ids(fresh)
    await assert_same_sandboxes(fresh)

    restarted = await pool.restart_agent(victim)
    assert restarted.url == victim.url
    leased_again = partial(all_in_state, operator, on_victim, "leased")
    await eventually(leased_again, "the restarted node to report its leases", timeout=10)
    # same containers, same files, same tokens: adopted, not recreated; the outcome
    # told stands (docs/contracts.md, "Lease outcomes"): its sample was masked already
    await assert_same_sandboxes(leases)
    for sb in on_victim:
        status = await client.lease_status(sb.lease.lease_id)
        assert (status.ended, status.outcome) == (True, "node_lost")
    await assert_every_container_accounted_for(operator, docker_client, pool)
    await asyncio.gather(*(sb.release() for sb in leases + fresh))
    await assert_every_container_accounted_for(operator, docker_client, pool)
    assert "leased" not in (await states(operator)).values()


async def respawn_controlplane(pool: LocalPool) -> None:
    """Start the control plane again on its old address, as its supervisor would.

    LocalPool restarts agents only; this runs the same command with the same
    configuration and credentials, on the same port, so the agents' heartbeats (which
    keep going to that address) reach the new process.
    """
    old = pool.controlplane
    assert old is not None and old.proc.returncode is not None
    args = [*old.args, "--port", str(urlsplit(old.url).port)]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dsec.cli", *args,
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, **pool.tokens.env()},
        start_new_session=True,
    )  # fmt: skip
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), RESTART_TIMEOUT_S)
    url = json.loads(line)["url"]
    assert url == old.url
    # LocalPool.stop() stops whatever pool.controlplane is: from now on, this process
    pool.controlplane = Child(old.name, args, proc, url, asyncio.create_task(proc.stdout.read()))


async def acquire_until_answered(client: Client, key: str) -> Sandbox:
    """What a client does when its control plane goes away: retry with the same key."""
    deadline = time.monotonic() + RESTART_TIMEOUT_S
    while True:
        try:
            return await client.acquire(idempotency_key=key, timeout=30)
        except aiohttp.ClientConnectionError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


async def test_a_control_plane_killed_mid_burst_loses_no_lease(
    pool, client, operator, docker_client
):
    released = await client.acquire(idempotency_key="released-before-the-crash")
    await released.release()
    held = [await client.acquire(idempotency_key=f"held-{i}") for i in range(3)]
    await write_ids(held)
    keys = [f"burst-{i}" for i in range(24)]
    burst = [asyncio.create_task(client.acquire(idempotency_key=k, timeout=30)) for k in keys]
    # kill it once the burst is under way: some served, the rest waiting
    while sum(t.done() for t in burst) < 3:
        await asyncio.sleep(0.01)
    pool.controlplane.proc.send_signal(signal.SIGKILL)
    await pool.controlplane.proc.wait()
    outcomes = await asyncio.gather(*burst, return_exceptions=True)
    answered = {k: o for k, o in zip(keys, outcomes, strict=True) if isinstance(o, Sandbox)}
    unanswered = [o for o in outcomes if not isinstance(o, Sandbox)]
    assert answered and unanswered, "the kill was meant to land mid-burst"
    assert all(isinstance(e, aiohttp.ClientConnectionError) for e in unanswered), unanswered

    await respawn_controlplane(pool)
    # a key spent before the crash stays spent: its retry gets no second sandbox
    with pytest.raises(DsecError) as spent_before:
        await client.acquire(idempotency_key="released-before-the-crash")
    assert spent_before.value.code == "idempotency_key_spent"
    assert released.id in spent_before.value.message
    # every client retries its key: the answered ones get their sandbox again, and those
    # that never heard back get exactly one
    retried = await asyncio.gather(*(acquire_until_answered(client, k) for k in keys))
    for key, sb in zip(keys, retried, strict=True):
        if key in answered:
            assert sb.id == answered[key].id, f"{key} got a second sandbox"
            assert sb.lease.lease_token == answered[key].lease.lease_token
    leased = {i for i, state in (await states(operator)).items() if state == "leased"}
    assert leased == {sb.id for sb in held + retried}, "leases nobody holds, or doubles"
    # the leases made before the crash work with the tokens their clients hold
    await assert_same_sandboxes(held)
    await write_ids(retried)
    await assert_same_sandboxes(retried)

    await assert_every_container_accounted_for(operator, docker_client, pool)
    await asyncio.gather(*(sb.release() for sb in held + retried))
    await assert_every_container_accounted_for(operator, docker_client, pool)
    assert "leased" not in (await states(operator)).values()
    with pytest.raises(DsecError) as spent:
        await client.acquire(idempotency_key=keys[0])
    assert spent.value.code == "idempotency_key_spent"
