"""An announced burst on a live pool (real agents, real Docker): prewarm 10, then 10
acquires are all served from the warm pool."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from conftest import eventually

from dsec.models import PoolParams

pytestmark = pytest.mark.asyncio(loop_scope="module")


async def prewarm_gauge(url: str, pool: str) -> float:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/metrics") as resp:
            text = await resp.text()
    line = f'dsec_prewarm_target{{pool="{pool}"}} '
    return next(float(x.removeprefix(line)) for x in text.splitlines() if x.startswith(line))


async def test_a_prewarmed_burst_is_served_warm(pool, client, operator):
    name = "announced"
    # no warm pool of its own: the warm sandboxes are the prewarm's
    await operator.set_pool(name, PoolParams(min_warm=0, warm_fraction=0, max_warm=20))
    # dsec up's agents share the machine's one engine, and say so: a prewarm's estimate
    # counts its creates once
    engines = {n.engine_id for n in (await operator.nodes()).nodes}
    assert len(engines) == 1 and "" not in engines, engines
    info = await client.prewarm(name, 10, within_s=20, hold_s=30)
    assert (info.count, info.template, info.meets_deadline) == (10, "base", True)
    assert await prewarm_gauge(pool.url, name) == 10

    async def warm() -> bool:
        info = next(p for p in (await operator.pools()).pools if p.name == name)
        return info.sandboxes.get("warm", 0) >= 10

    await eventually(warm, "10 warm sandboxes", timeout=20)
    held = await asyncio.gather(*(client.acquire(pool=name, timeout=30) for _ in range(10)))
    try:
        assert [sb.lease.path for sb in held] == ["warm"] * 10
        assert await prewarm_gauge(pool.url, name) == 0  # the burst used it up
    finally:
        await asyncio.gather(*(sb.release() for sb in held))
        await client.prewarm(name, 0, within_s=0)
        await operator.set_pool(name, PoolParams(min_warm=0, max_warm=0, templates=[]))
