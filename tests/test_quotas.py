"""Per-client quotas in the harness (the real scheduler, simulated agents, virtual
time): a client's leases and waiting acquires are bounded, and so are the pools and the
priority it may ask for; refusals name the limit, and other clients are not affected."""

from __future__ import annotations

import asyncio

import pytest
from harness import Harness

from controlplane.config import ClientQuota, ClientSpec, ControlPlaneConfig
from dsec.httpkit import ApiError
from dsec.models import PoolParams
from dsec.tokens import client_id

LIMITED = "limited-client-token-0001"
OTHER = "another-client-token-0002"
COLD = PoolParams(min_warm=0, max_warm=0, templates=[])
POOLS = {"default": COLD, "other": COLD}


def harness(**quota) -> Harness:
    return Harness(
        nodes=1,
        slots=20,
        pools=POOLS,
        clients=[ClientSpec(token=LIMITED, quota=ClientQuota(**quota))],
        client_tokens=[OTHER],
        # every other client unlimited, to show the limited one's quota is its own
        default_quota=ClientQuota(max_leases=None, max_priority=None),
    )


async def refused(h: Harness, owner: str, **fields) -> ApiError:
    with pytest.raises(ApiError) as e:
        await h.acquire(owner=owner, **fields)
    return e.value


def test_a_flood_of_acquires_from_one_client_stops_at_its_pending_quota():
    async def scenario(h: Harness) -> None:
        for node in h.agents.nodes.values():
            node.down = True  # nothing is served: every acquire waits
        me, other = client_id(LIMITED), client_id(OTHER)
        waiting = [asyncio.ensure_future(h.acquire(owner=me, timeout_s=30)) for _ in range(5)]
        await h.settle(0.5)
        e = await refused(h, me, timeout_s=30)
        assert (e.status, e.code) == (429, "pending_quota") and "max_pending 5" in e.message
        others = asyncio.ensure_future(h.acquire(owner=other, timeout_s=30))  # not limited
        await h.settle(0.5)
        assert len(h.scheduler.queues.by_id) == 6
        for node in h.agents.nodes.values():
            node.down = False
        leases = await asyncio.gather(*waiting, others)
        assert len({lease.id for lease in leases}) == 6

    harness(max_pending=5).run(scenario)


def test_a_client_holds_at_most_its_lease_quota_and_a_retry_of_a_held_lease_is_no_new_one():
    async def scenario(h: Harness) -> None:
        me = client_id(LIMITED)
        first = await h.acquire(owner=me, idempotency_key="a")
        await h.acquire(owner=me, idempotency_key="b")
        e = await refused(h, me, idempotency_key="c")
        assert (e.status, e.code) == (429, "lease_quota") and "max_leases 2" in e.message
        again = await h.acquire(owner=me, idempotency_key="a")  # a retry: the same lease
        assert again.id == first.id
        await h.release(first)
        assert (await h.acquire(owner=me, idempotency_key="c")).id != first.id
        assert await h.acquire(owner=client_id(OTHER))  # another client is not limited

    harness(max_leases=2).run(scenario)


def test_a_client_may_use_only_its_pools_and_priorities():
    async def scenario(h: Harness) -> None:
        me = client_id(LIMITED)
        e = await refused(h, me, pool="other")
        assert (e.status, e.code) == (403, "pool_not_allowed")
        e = await refused(h, me, priority=6)
        assert (e.status, e.code) == (403, "priority_not_allowed")
        assert await h.acquire(owner=me, priority=5)
        assert await h.acquire(owner=client_id(OTHER), pool="other", priority=100)
        assert not h.scheduler.queues.by_id

    harness(pools=["default"], max_priority=5).run(scenario)


def test_a_token_listed_with_a_quota_is_a_client_token_and_others_get_the_default():
    config = ControlPlaneConfig(
        admin_tokens=["a" * 16],
        agent_token="b" * 16,
        clients=[ClientSpec(token=LIMITED, quota=ClientQuota(max_leases=1))],
        default_quota=ClientQuota(max_leases=7),
        client_tokens=[OTHER],
    )
    assert set(config.client_tokens) == {LIMITED, OTHER}
    assert config.quota_of(client_id(LIMITED)).max_leases == 1
    assert config.quota_of(client_id(OTHER)).max_leases == 7


def test_dsec_up_takes_pools_templates_and_quotas_from_a_config_file(tmp_path):
    from dsec.cli.common import UsageError
    from dsec.cli.up import _apply_config_file
    from dsec.launch.local import LocalPoolSpec

    path = tmp_path / "pool.json"
    path.write_text(
        '{"pools": {"default": {"min_warm": 1}, "batch": {"min_warm": 0, "priority": -5}},'
        f' "clients": [{{"token": "{LIMITED}", "quota": {{"max_leases": 3}}}}],'
        ' "default_quota": {"max_pending": 10}}'
    )
    spec = LocalPoolSpec()
    _apply_config_file(spec, path)
    assert spec.pool.min_warm == 1 and spec.more_pools["batch"].priority == -5
    assert spec.clients[0].quota.max_leases == 3 and spec.default_quota.max_pending == 10
    path.write_text('{"pools": {"x": {"min_warm": -1}}, "extra": 1}')
    with pytest.raises(UsageError) as e:
        _apply_config_file(spec, path)
    assert "min_warm" in str(e.value) and "extra" in str(e.value)
