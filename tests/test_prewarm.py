"""Announced bursts (`POST /v1/pools/{name}/prewarm`): the scheduler in the harness
(virtual time), then the route's validation and credentials on the control plane in
process (no agents, so no room: any count above 0 is beyond capacity)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from harness import Harness

from controlplane.prewarm import time_to_make
from controlplane.view import ClusterView, NodeEntry
from dsec.client import Client, DsecError
from dsec.httpkit import ApiError
from dsec.image import BASE_IMAGE
from dsec.models import PoolParams, TemplateSpec, normalise_image_ref
from dsec.policy import PREWARM_REASON, Create, Pause, Resources
from dsec.states import SandboxState as S

# no warm pool of its own (min_warm 0, no share of the peak): every warm sandbox here
# is the prewarm's
BARE = PoolParams(min_warm=0, max_warm=64, warm_fraction=0, freeze_after_s=10)


def warm(h: Harness, pool: str = "default") -> int:
    return h.states(pool).get(S.WARM, 0)


async def sleep_until(h: Harness, at: float) -> None:
    assert at >= h.now(), f"{at} is in the past ({h.now()})"
    await h.settle(at - h.now())


# --- the scheduler --------------------------------------------------------------------


def test_a_prewarm_is_ready_within_its_time_and_its_burst_is_served_warm():
    async def scenario(h: Harness) -> None:
        await h.settle(1.5)  # the nodes have reported
        start = h.now()
        info = h.prewarm(count=30, within_s=10, hold_s=30)
        assert (info.pool, info.template, info.count, info.warm) == ("default", "base", 30, 0)
        assert not info.replaced and info.meets_deadline
        assert info.ready_by <= h.clock.wall() + 10 and info.until == h.clock.wall() + 40
        assert h.metric("dsec_prewarms_total", pool="default", meets_deadline="true") == 1
        assert h.metric("dsec_prewarm_target", pool="default") == 30
        await h.settle(0.01)
        # not paced at refill_concurrency (2): every create the nodes can start, at once
        creates = [t for t, a in h.decisions if isinstance(a, Create)]
        assert creates.count(creates[0]) > BARE.refill_concurrency
        await sleep_until(h, start + 10)
        assert warm(h) == 30
        leases = await asyncio.gather(*(h.acquire() for _ in range(30)))
        assert {lease.path for lease in leases} == {"warm"}
        assert max(lease.schedule_ms for lease in leases) < 50  # a lease call, no create
        # the burst used the prewarm up: nothing more is made behind it
        assert h.metric("dsec_prewarm_target", pool="default") == 0
        await h.settle(10)
        assert len(h.calls_of("create")) == 30 and warm(h) == 0
        assert h.metric("dsec_scale_events_total", action="prewarm") == 30
        assert h.metric("dsec_scale_events_total", action="create") == 30
        assert all(a.reason == PREWARM_REASON for a in h.decided(Create))

    Harness(nodes=3, slots=20, pools={"default": BARE}).run(scenario)


def test_a_prewarm_that_cannot_be_warm_in_time_says_by_when_it_can_and_still_holds():
    async def scenario(h: Harness) -> None:
        await h.settle(1.5)
        h.prewarm(count=6, within_s=10, hold_s=5)  # creates measured on these engines
        await h.settle(10)
        create_s = h.scheduler.actuator.create_times.means["base"]
        at_once = sum(n.create_limit for n in h.scheduler.view.nodes.values())
        wall = h.clock.wall()
        rounds = 5
        info = h.prewarm(count=6 + rounds * at_once, within_s=create_s, hold_s=30)
        # 5 rounds of creates on every engine, in the time of one
        assert not info.meets_deadline
        assert info.ready_by == pytest.approx(wall + rounds * create_s)
        assert h.metric("dsec_prewarms_total", pool="default", meets_deadline="false") == 1
        await h.settle(0.01)
        assert h.metric("dsec_prewarm_target", pool="default") == info.count  # held
        # what is warm already needs nothing: it is ready now
        again = h.prewarm(count=warm(h), within_s=1, hold_s=30)
        assert (again.meets_deadline, again.ready_by) == (True, h.clock.wall())

    Harness(nodes=3, slots=100, pools={"default": BARE}).run(scenario)


def test_a_prewarm_holds_its_sandboxes_until_it_expires_then_they_are_paused():
    async def scenario(h: Harness) -> None:
        await h.settle(1.5)
        start = h.now()
        h.prewarm(count=10, within_s=5, hold_s=20)
        await sleep_until(h, start + 24)  # idle past freeze_after (10 s), still held
        assert warm(h) == 10 and not h.decided(Pause)
        assert h.metric("dsec_prewarm_target", pool="default") == 10
        await sleep_until(h, start + 26)  # expired: the normal target (0) rules again
        assert h.metric("dsec_prewarm_target", pool="default") == 0
        await h.settle(5)
        assert h.states().get(S.PAUSED, 0) == 10 and warm(h) == 0
        assert all(t >= start + 25 for t, a in h.decisions if isinstance(a, Pause))

    Harness(nodes=2, slots=10, pools={"default": BARE}).run(scenario)


def test_a_new_prewarm_replaces_the_last_and_count_zero_ends_it():
    async def scenario(h: Harness) -> None:
        await h.settle(1.5)
        h.prewarm(count=10, within_s=2, hold_s=600)
        await h.settle(5)
        assert warm(h) == 10
        info = h.prewarm(count=4, within_s=0, hold_s=600)
        assert info.replaced and info.warm == 10
        assert h.metric("dsec_prewarm_target", pool="default") == 4
        await h.settle(20)  # past freeze_after: the 6 beyond the new count are paused
        assert warm(h) == 4 and h.states().get(S.PAUSED, 0) == 6
        assert h.prewarm(count=0, within_s=0).replaced
        assert h.metric("dsec_prewarm_target", pool="default") == 0
        await h.settle(20)
        assert warm(h) == 0

    Harness(nodes=2, slots=10, pools={"default": BARE}).run(scenario)


def test_a_prewarm_may_name_a_template_the_pool_does_not_keep_warm():
    async def scenario(h: Harness) -> None:
        await h.settle(1.5)
        info = h.prewarm("eval", count=3, within_s=1, template="base")
        assert info.template == "base"
        await h.settle(3)
        assert warm(h, "eval") == 3

    pools = {"default": BARE, "eval": PoolParams(min_warm=0, max_warm=8, templates=[])}
    Harness(nodes=1, slots=10, pools=pools).run(scenario)


def test_a_prewarm_beyond_max_warm_or_the_room_on_the_nodes_is_refused_saying_what_fits():
    async def scenario(h: Harness) -> None:
        await h.settle(2)  # the nodes have reported: 2 x 5 slots
        with pytest.raises(ApiError) as beyond_max:
            h.prewarm("small", count=9, within_s=5)
        e = beyond_max.value
        assert (e.status, e.code) == (422, "prewarm_too_large")
        assert "at most 8" in e.message and "max_warm is 8" in e.message, e.message
        with pytest.raises(ApiError) as beyond_room:
            h.prewarm(count=11, within_s=5)
        e = beyond_room.value
        assert (e.status, e.code) == (422, "prewarm_too_large")
        assert "at most 10" in e.message and "room for 10 more" in e.message, e.message
        assert not h.scheduler.prewarms.by_client  # nothing was accepted
        h.prewarm(count=10, within_s=5)
        await h.settle(5)
        # the 10 the pool holds count as its own: the same count again still fits
        assert h.prewarm(count=10, within_s=5).warm == 10
        with pytest.raises(ApiError) as unknown:
            h.prewarm("nope", count=1, within_s=5)
        assert (unknown.value.status, unknown.value.code) == (404, "unknown_pool")
        with pytest.raises(ApiError) as no_template:
            h.prewarm(count=1, within_s=5, template="ghost")
        assert (no_template.value.status, no_template.value.code) == (422, "unknown_template")

    pools = {"default": BARE, "small": PoolParams(min_warm=0, max_warm=8)}
    Harness(nodes=2, slots=5, pools=pools).run(scenario)


# --- the HTTP route, in process ---------------------------------------------------------


async def post(url: str, token: str | None, data: bytes) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as http:
        async with http.post(url, headers=headers, data=data) as resp:
            return resp.status, await resp.json(content_type=None)


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize(
    ("payload", "status", "code", "field"),
    [
        (b"{not json", 400, "malformed_json", None),
        (b"{}", 422, "validation_error", "count"),
        (b'{"count": 1}', 422, "validation_error", "within_s"),
        (b'{"count": -1, "within_s": 5}', 422, "validation_error", "count"),
        (b'{"count": 1e9, "within_s": 5}', 422, "validation_error", "count"),
        (b'{"count": 1, "within_s": -5}', 422, "validation_error", "within_s"),
        (b'{"count": 1, "within_s": 5, "hold_s": 1e9}', 422, "validation_error", "hold_s"),
        (b'{"count": 1, "within_s": 5, "colour": "blue"}', 422, "validation_error", "colour"),
        (b'{"count": 1, "within_s": 5, "template": "../x"}', 422, "validation_error", "template"),
        (b'{"count": 1, "within_s": 5, "template": "ghost"}', 422, "unknown_template", None),
        (b'{"count": 65, "within_s": 5}', 422, "prewarm_too_large", "count"),
        (b'{"count": 1, "within_s": 5}', 422, "prewarm_too_large", "count"),  # no agents
    ],
)
async def test_bad_prewarm_bodies(controlplane_app, payload, status, code, field):
    url = f"{controlplane_app.url}/v1/pools/default/prewarm"
    got, body = await post(url, controlplane_app.tokens.client, payload)
    assert got == status and body["error"]["code"] == code, body
    assert body["error"]["message"]
    if field:
        assert any(field in d["loc"] for d in body["error"].get("details") or []), body


@pytest.mark.asyncio(loop_scope="module")
async def test_prewarm_says_what_fits_and_needs_a_pool_and_a_token(controlplane_app):
    cp = controlplane_app
    async with Client(cp.url, token=cp.tokens.client) as client:
        with pytest.raises(DsecError) as beyond:
            await client.prewarm("default", 65, within_s=5)
        assert beyond.value.status == 422
        assert "max_warm is 64" in beyond.value.message
        assert "room for 0 more of template base" in beyond.value.message
        with pytest.raises(DsecError) as unknown:
            await client.prewarm("nope", 1, within_s=5)
        assert (unknown.value.status, unknown.value.code) == (404, "unknown_pool")
        ended = await client.prewarm("default", 0, within_s=0)  # nothing to end: fine
        assert (ended.count, ended.replaced, ended.template) == (0, False, "base")
    url = f"{cp.url}/v1/pools/default/prewarm"
    got, body = await post(url, None, b'{"count": 0, "within_s": 0}')
    assert (got, body["error"]["code"]) == (401, "unauthenticated")
    got, body = await post(url, cp.tokens.agent, b'{"count": 0, "within_s": 0}')
    assert (got, body["error"]["code"]) == (403, "forbidden")
    got, _ = await post(url, cp.tokens.admin, b'{"count": 0, "within_s": 0}')
    assert got == 200
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{cp.url}/openapi.json") as resp:
            doc = await resp.json()
    assert "post" in doc["paths"]["/v1/pools/{name}/prewarm"]


def test_nodes_that_share_an_engine_count_its_creates_once():
    spec = TemplateSpec(name="base", image=BASE_IMAGE)
    view = ClusterView(confirm_grace_s=0.0)
    for i, engine in enumerate(["e1", "e1", "e1", "e2", ""]):
        view.nodes[f"n{i}"] = NodeEntry(
            id=f"n{i}", kind="local", url="", capacity=Resources(8.0, 8192, 8),
            images=frozenset({normalise_image_ref(BASE_IMAGE)}), incarnation="i",
            last_seen=0.0, create_limit=3 + i, engine_id=engine,
        )  # fmt: skip
    # e1's three nodes are one engine of at most 5 at once, e2 6, and n4 (no id yet) 7
    assert time_to_make(18, spec, view, 0.0, 2.0) == 2.0
    assert time_to_make(19, spec, view, 0.0, 2.0) == 4.0
    assert time_to_make(0, spec, view, 0.0, 2.0) == 0.0
    view.nodes = {}
    assert time_to_make(1, spec, view, 0.0, 2.0) == float("inf")
