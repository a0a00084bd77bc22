"""Fork on the real engine: n new leases whose work dir and /tmp are byte-for-byte copies
of a leased sandbox's at the call, spread over nodes, read agent to agent where the copy
is on another node; no link to the source; all or none; refused when it cannot fit or
when the caller does not hold the source."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import pytest_asyncio
from conftest import eventually, make_spec, started_pool

from bench.fork import tree as digests  # every file's sha256, links and modes
from dsec.client import Client, DsecError, Sandbox
from dsec.models import Capacity, PoolParams
from dsec.tokens import LEASE_TOKEN_HEADER

pytestmark = pytest.mark.asyncio(loop_scope="module")

NODES = 3
SLOTS = 8  # per node: a fork past the pool's room is easy to ask for


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pool(docker_client, tmp_path_factory):
    spec = make_spec(
        tmp_path_factory.mktemp("fork"),
        nodes=NODES,
        capacity=Capacity(cpus=32, memory_mb=65536, slots=SLOTS),
        # more warm than two nodes hold: the warm pool is on every node
        pool=PoolParams(min_warm=2 * SLOTS + 1, max_warm=3 * SLOTS),
    )
    async with started_pool(spec, docker_client) as p:
        yield p


async def warm_on_every_node(operator: Client) -> set[str]:
    async def spread() -> set[str] | None:
        nodes = {s.node for s in await operator.list() if s.state == "warm"}
        return nodes if len(nodes) == NODES else None

    return await eventually(spread, "warm sandboxes on every node", timeout=60)


async def out(sb: Sandbox, script: str) -> str:
    result = await sb.exec(["sh", "-c", script], timeout=60)
    assert result.exit_code == 0, result
    return result.stdout


async def fill(sb: Sandbox) -> None:
    """A work dir and /tmp with what a repository has: nested files, an empty one, a
    binary one, an executable, a symlink, an empty directory."""
    await out(
        sb,
        "mkdir -p /work/repo/pkg /work/repo/empty /tmp/cache && "
        "echo 'print(1)' > /work/repo/pkg/main.py && : > /work/repo/pkg/__init__.py && "
        "head -c 3000000 /dev/urandom > /work/repo/data.bin && "
        "printf '#!/bin/sh\\necho run\\n' > /work/repo/run.sh && chmod 755 /work/repo/run.sh && "
        "chmod 600 /work/repo/pkg/main.py && ln -s pkg/main.py /work/repo/entry && "
        "head -c 100000 /dev/urandom > /tmp/cache/blob",
    )


async def test_forks_are_byte_for_byte_copies_spread_over_nodes_and_on_their_own(
    client, operator, pool
):
    await warm_on_every_node(operator)
    async with client.sandbox() as source:
        await fill(source)
        before = await digests(source)
        forks = await source.fork(3)
        try:
            assert len({sb.id for sb in forks}) == 3 and source.id not in {f.id for f in forks}
            # one on each node: two read the copy from the source's node over HTTP
            assert {sb.node for sb in forks} == {a.name for a in pool.agents}
            assert all(sb.lease.path == "warm" for sb in forks)
            for sb in forks:
                assert await digests(sb) == before
                assert await out(sb, "/work/repo/run.sh; cat /work/repo/entry") == (
                    "run\nprint(1)\n"
                )
            # no link: what one writes, no other sees; the source keeps running
            await out(forks[0], "echo fork0 > /work/repo/only-here")
            await out(source, "echo source > /work/repo/source-only")
            assert await digests(forks[1]) == before
            listed = await out(forks[0], "ls /work/repo")
            assert "only-here" in listed and "source-only" not in listed
        except BaseException:
            await asyncio.gather(*(sb.release() for sb in forks), return_exceptions=True)
            raise
    # the source released: its forks live on, and each is released on its own
    for sb in forks:
        assert await digests(sb) != ("", "")
        await sb.release()


async def test_a_fork_s_copy_is_taken_at_the_call_and_dropped_once_the_forks_have_it(
    client, operator, pool
):
    await warm_on_every_node(operator)
    async with client.sandbox() as source:
        await out(source, "echo v1 > /work/state")
        (fork,) = await source.fork(1)
        await out(source, "echo v2 > /work/state")
        assert await out(fork, "cat /work/state") == "v1\n"
        await fork.release()

        def no_copy_left() -> bool:
            return not any(pool.dir.glob("*-snapshots/*.tar"))

        await eventually(no_copy_left, "the source's node to drop the copy", timeout=10)


async def test_a_fork_past_what_fits_is_refused_saying_what_does_and_leases_nothing(client, pool):
    async with client.sandbox() as source:
        with pytest.raises(DsecError) as refused:
            await source.fork(NODES * SLOTS + 1)
        e = refused.value
        assert (e.status, e.code) == (422, "fork_too_large")
        assert "at most" in e.message and e.details[0]["loc"] == "count"
        assert [s.id for s in await client.list()] == [source.id]
        # past any fork's maximum, and not a count: the body's own checks, over HTTP
        headers = {
            "Authorization": f"Bearer {pool.tokens.client}",
            LEASE_TOKEN_HEADER: source.lease.lease_token,
        }
        async with aiohttp.ClientSession(headers=headers) as http:
            for body in ({"count": 65}, {"count": 0}, {"count": "two"}, {"pool": "nope"}):
                url = f"{pool.url}/v1/sandboxes/{source.id}/fork"
                async with http.post(url, json=body) as resp:
                    answer = await resp.json()
                    assert resp.status == 422, (body, answer)
                    assert answer["error"]["code"] == "validation_error", answer
        with pytest.raises(DsecError) as unknown_pool:
            await source.fork(1, pool="no-such-pool")
        assert (unknown_pool.value.status, unknown_pool.value.code)[0] == 422
        assert "no-such-pool" in unknown_pool.value.message
        assert [s.id for s in await client.list()] == [source.id]


async def test_a_fork_that_cannot_finish_in_time_keeps_none_of_its_copies(client, operator):
    await warm_on_every_node(operator)
    async with client.sandbox() as source:
        # copies that take longer than the fork's time: none of them is kept
        await out(source, "head -c 40000000 /dev/urandom > /work/big")
        with pytest.raises(DsecError) as failed:
            await source.fork(3, timeout=0.05)
        assert failed.value.status in (422, 503), failed.value
        assert "none is kept" in failed.value.message, failed.value

        async def only_the_source() -> bool:
            return [s.id for s in await client.list()] == [source.id]

        await eventually(only_the_source, "no lease of the failed fork left", timeout=30)


async def test_only_the_lease_s_holder_forks_it(client):
    async with client.sandbox() as source:
        other = await client.acquire()
        # another lease's token: not this one's
        with pytest.raises(DsecError) as wrong:
            await client.fork(source.id, other.lease.lease_token, 1)
        assert (wrong.value.status, wrong.value.code) == (403, "forbidden")
        with pytest.raises(DsecError) as none:
            await client.fork(source.id, None, 1)
        assert none.value.status == 403
        with pytest.raises(DsecError) as unknown:
            await client.fork(f"{source.node}.{'0' * 16}", source.lease.lease_token, 1)
        assert (unknown.value.status, unknown.value.code) == (404, "unknown_sandbox")
        assert sorted(s.id for s in await client.list()) == sorted([source.id, other.id])
        await other.release()
        with pytest.raises(DsecError) as released:  # a lease it held once: no more
            await other.fork(1)
        assert released.value.status in (403, 404, 409), released.value
        assert [s.id for s in await client.list()] == [source.id]
