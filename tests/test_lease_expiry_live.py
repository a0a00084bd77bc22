"""Lease lifetimes on a live pool: a rollout worker killed with SIGKILL while it holds
10 sandboxes gets every slot back to the pool within the idle timeout, while a living
client's `sandbox()` blocks keep theirs by renewing; an expired lease's sandbox answers
410 lease_expired at its agent and at the control plane."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from conftest import eventually, make_spec, started_pool

from dsec.client import Client, DsecError
from dsec.launch.local import LocalPool
from dsec.models import PoolParams

pytestmark = pytest.mark.asyncio(loop_scope="module")

IDLE_TIMEOUT_S = 4.0
HELD = 10
WORKER = textwrap.dedent(
    """
    import asyncio, contextlib, sys
    from dsec.client import Client

    async def main():
        async with Client() as client, contextlib.AsyncExitStack() as stack:
            held = [await stack.enter_async_context(client.sandbox()) for _ in range({held})]
            print(" ".join(sb.id for sb in held), flush=True)
            await asyncio.sleep(3600)  # thinking, for ever: no command, only renewals

    asyncio.run(main())
    """
).format(held=HELD)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pool(docker_client, tmp_path_factory) -> AsyncIterator[LocalPool]:
    spec = make_spec(tmp_path_factory.mktemp("expiry"), nodes=1)
    spec.pool = PoolParams(min_warm=0, lease_idle_timeout_s=IDLE_TIMEOUT_S)
    async with started_pool(spec, docker_client) as p:
        yield p


async def leased_ids(operator: Client) -> set[str]:
    return {s.id for s in await operator.list() if s.lease_id}


async def test_a_killed_worker_s_leases_all_come_back_and_a_living_one_keeps_them(pool):
    env = {**os.environ, "DSEC_URL": pool.url, "DSEC_TOKEN": pool.tokens.client}
    worker = await asyncio.create_subprocess_exec(
        sys.executable, "-c", WORKER, env=env, stdout=asyncio.subprocess.PIPE
    )
    try:
        line = await asyncio.wait_for(worker.stdout.readline(), 120)
        held = set(line.decode().split())
        assert len(held) == HELD
        async with Client(pool.url, token=pool.tokens.admin) as operator:
            await asyncio.sleep(IDLE_TIMEOUT_S * 3)  # three timeouts without a command
            assert held <= await leased_ids(operator), "a living worker lost a lease"
            worker.send_signal(signal.SIGKILL)
            await worker.wait()
            killed_at = asyncio.get_running_loop().time()

            async def all_back() -> bool:
                return not held & await leased_ids(operator)

            await eventually(all_back, "the killed worker's leases to expire", 30)
            took = asyncio.get_running_loop().time() - killed_at
            # a timeout after the last renewal, plus a look (<= 0.5 s) and a heartbeat
            assert took <= IDLE_TIMEOUT_S + 3, f"{took:.1f} s"
            nodes = await operator.nodes()
            assert sum(n.sandboxes for n in nodes.nodes) < HELD  # the slots are free
    finally:
        if worker.returncode is None:
            worker.kill()
            await worker.wait()


async def test_an_expired_lease_answers_410_lease_expired_at_the_agent_and_control_plane(pool):
    async with Client(pool.url, token=pool.tokens.client) as client:
        sb = await client.acquire()  # not in a sandbox() block: nothing renews it
        assert (await sb.exec(["true"])).exit_code == 0
        await asyncio.sleep(IDLE_TIMEOUT_S + 3)
        with pytest.raises(DsecError) as at_agent:
            await sb.exec(["true"])
        assert (at_agent.value.status, at_agent.value.code) == (410, "lease_expired")
        with pytest.raises(DsecError) as at_release:
            await sb.release()
        assert (at_release.value.status, at_release.value.code) == (410, "lease_expired")
        with pytest.raises(DsecError) as at_renew:
            await sb.renew()
        assert at_renew.value.code == "lease_expired"
