"""`PATCH /v1/pools/{name}` (only the fields sent change, the result checked as a whole)
and `GET /v1/sandboxes/{id}/lease` (the lease of a sandbox the caller holds), on a
control plane in this process (tests/inprocess.py): no agents, no Docker. The leases
are sandboxes put straight into the control plane's view, as a heartbeat would."""

from __future__ import annotations

import secrets
import uuid
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from inprocess import InProcessControlPlane, inprocess_controlplane

from controlplane.app import SCHEDULER
from controlplane.view import SandboxEntry
from dsec.client import Client, DsecError
from dsec.models import PoolParams
from dsec.states import SandboxState
from dsec.tokens import NO_EXPIRY, client_id, lease_token, new_lease_id, new_token

pytestmark = pytest.mark.asyncio(loop_scope="module")

ALICE, BOB = new_token(), new_token()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cp() -> AsyncIterator[InProcessControlPlane]:
    async with inprocess_controlplane(ALICE, BOB) as cp:
        yield cp


@pytest_asyncio.fixture(loop_scope="module")
async def admin(cp: InProcessControlPlane) -> AsyncIterator[Client]:
    async with Client(cp.url, token=cp.tokens.admin) as c:
        yield c


@pytest_asyncio.fixture(loop_scope="module")
async def alice(cp: InProcessControlPlane) -> AsyncIterator[Client]:
    async with Client(cp.url, token=ALICE) as c:
        yield c


@pytest_asyncio.fixture(loop_scope="module")
async def bob(cp: InProcessControlPlane) -> AsyncIterator[Client]:
    async with Client(cp.url, token=BOB) as c:
        yield c


@pytest_asyncio.fixture(loop_scope="module")
async def fresh_pool(admin: Client) -> str:
    """A pool of its own for each test, on default parameters (PUT makes it)."""
    name = f"p-{uuid.uuid4().hex[:8]}"
    await admin.set_pool(name, PoolParams())
    return name


async def patch(cp: InProcessControlPlane, name: str, body: object, token: str | None):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    resp = await cp.http.patch(f"/v1/pools/{name}", json=body, headers=headers)
    return resp.status, await resp.json()


async def test_patch_changes_only_the_fields_sent(admin, fresh_pool):
    before = (await admin.pool(fresh_pool)).params
    after = await admin.patch_pool(fresh_pool, min_warm=5, recycle=True, templates=["base"])
    expected = before.model_copy(update={"min_warm": 5, "recycle": True, "templates": ["base"]})
    assert after.params == expected
    assert (await admin.pool(fresh_pool)).params == expected  # and it stays so
    # an empty patch is allowed and changes nothing
    assert (await admin.patch_pool(fresh_pool)).params == expected


async def test_a_bad_patch_answers_422_and_changes_nothing(cp, admin, fresh_pool):
    before = (await admin.pool(fresh_pool)).params
    for body, loc in (
        ({"overflow_threshold": 1.5}, "overflow_threshold"),
        ({"freeze_after_s": "later"}, "freeze_after_s"),
        ({"min_warm": None}, "min_warm"),  # null is not "unchanged"
        ({"min_warm": 3, "max_warm": -1}, "max_warm"),
    ):
        status, answer = await patch(cp, fresh_pool, body, cp.tokens.admin)
        assert status == 422, (body, answer)
        assert answer["error"]["code"] == "validation_error", answer
        assert loc in [d["loc"] for d in answer["error"]["details"]], answer
    # inconsistent with a value not sent: min_warm is 2 on default parameters
    status, answer = await patch(cp, fresh_pool, {"max_warm": 1}, cp.tokens.admin)
    assert status == 422, answer
    assert "max_warm (1) is below min_warm (2)" in answer["error"]["details"][0]["msg"]
    status, answer = await patch(cp, fresh_pool, {"templates": ["nope"]}, cp.tokens.admin)
    assert (status, answer["error"]["code"]) == (422, "unknown_template"), answer
    assert (await admin.pool(fresh_pool)).params == before


async def test_an_unknown_field_is_refused(cp, admin, fresh_pool):
    before = (await admin.pool(fresh_pool)).params
    status, answer = await patch(cp, fresh_pool, {"min_warm": 3, "warmth": 9}, cp.tokens.admin)
    assert status == 422, answer
    assert answer["error"]["details"] == [
        {"loc": "warmth", "msg": "Extra inputs are not permitted"}
    ]
    assert (await admin.pool(fresh_pool)).params == before  # min_warm not applied either
    status, answer = await patch(cp, fresh_pool, ["min_warm"], cp.tokens.admin)
    assert (status, answer["error"]["code"]) == (400, "malformed_json"), answer


async def test_patch_needs_an_existing_pool_and_the_admin_token(cp, admin, fresh_pool):
    status, answer = await patch(cp, "nosuchpool", {"min_warm": 1}, cp.tokens.admin)
    assert (status, answer["error"]["code"]) == (404, "unknown_pool"), answer
    assert "nosuchpool" not in [p.name for p in (await admin.pools()).pools]  # not made
    status, answer = await patch(cp, fresh_pool, {"min_warm": 1}, ALICE)
    assert (status, answer["error"]["code"]) == (403, "forbidden"), answer
    status, answer = await patch(cp, fresh_pool, {"min_warm": 1}, None)
    assert (status, answer["error"]["code"]) == (401, "unauthenticated"), answer
    with pytest.raises(DsecError) as refused:
        async with Client(cp.url, token=ALICE) as alice:
            await alice.patch_pool(fresh_pool, min_warm=1)
    assert (refused.value.status, refused.value.code) == (403, "forbidden")


async def test_the_sdk_checks_names_before_sending(admin, fresh_pool):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="warmth"):
        await admin.patch_pool(fresh_pool, warmth=9)
    with pytest.raises(DsecError) as unknown:
        await admin.pool("nosuchpool")
    assert (unknown.value.status, unknown.value.code) == (404, "unknown_pool")


async def test_the_routes_are_in_the_openapi_document(cp):
    document = await (await cp.http.get("/openapi.json")).json()
    assert "patch" in document["paths"]["/v1/pools/{name}"]
    assert "get" in document["paths"]["/v1/sandboxes/{sandbox_id}/lease"]


# --- GET /v1/sandboxes/{id}/lease -----------------------------------------------------


def put_sandbox(cp: InProcessControlPlane, state: SandboxState, owner: str | None) -> SandboxEntry:
    """A sandbox in the control plane's view; leased (to `owner`) unless warm."""
    now = cp.http.server.app[SCHEDULER].clock.now()
    entry = SandboxEntry(
        id=f"node-x.{secrets.token_hex(8)}",
        node="node-x",
        pool="default",
        template="base",
        state=state,
        since=now,
        created_at=now,
        cpus=0.5,
        memory_mb=256,
        lease_id=None if state == SandboxState.WARM else new_lease_id(),
        owner=owner,
    )
    cp.http.server.app[SCHEDULER].view.add(entry)
    return entry


async def test_a_client_gets_the_lease_it_holds(cp, alice):
    entry = put_sandbox(cp, SandboxState.LEASED, client_id(ALICE))
    sb = await alice.lease(entry.id)
    assert (sb.id, sb.lease.lease_id) == (entry.id, entry.lease_id)
    key, owner = cp.identities.lease_key(entry.node), entry.owner
    assert sb.lease.lease_token == lease_token(key, entry.id, entry.lease_id, owner, NO_EXPIRY)
    # not kept past the acquire: the answer says so as a repeated acquire does
    assert (sb.lease.path, sb.lease.schedule_ms) == ("warm", 0.0)
    paused = put_sandbox(cp, SandboxState.LEASED_PAUSED, client_id(ALICE))
    assert (await alice.lease(paused.id)).lease.lease_id == paused.lease_id


async def test_another_clients_lease_is_not_found(cp, alice, bob, admin):
    entry = put_sandbox(cp, SandboxState.LEASED, client_id(ALICE))
    with pytest.raises(DsecError) as refused:
        await bob.lease(entry.id)
    # as GET /v1/sandboxes/{id} answers another's: its existence is not Bob's to learn
    assert (refused.value.status, refused.value.code) == (404, "unknown_sandbox")
    # an operator may have any lease
    assert (await admin.lease(entry.id)).lease.lease_id == entry.lease_id


async def test_a_sandbox_without_a_lease(cp, alice, admin):
    warm = put_sandbox(cp, SandboxState.WARM, None)
    with pytest.raises(DsecError) as refused:
        await admin.lease(warm.id)
    assert (refused.value.status, refused.value.code) == (409, "not_leased")
    with pytest.raises(DsecError) as hidden:
        await alice.lease(warm.id)  # a client does not see unleased sandboxes at all
    assert (hidden.value.status, hidden.value.code) == (404, "unknown_sandbox")
    # a lost sandbox keeps its lease: its holder needs the token to release it
    lost = put_sandbox(cp, SandboxState.LOST, client_id(ALICE))
    assert (await alice.lease(lost.id)).lease.lease_id == lost.lease_id


async def test_unknown_released_and_malformed_ids(cp, alice):
    entry = put_sandbox(cp, SandboxState.LEASED, client_id(ALICE))
    cp.http.server.app[SCHEDULER].view.forget(entry.id)  # released: a tombstone stays
    for sandbox_id, status, code in (
        (entry.id, 410, "released"),
        (f"node-x.{secrets.token_hex(8)}", 404, "unknown_sandbox"),
        ("not-an-id", 400, "invalid_sandbox_id"),
    ):
        with pytest.raises(DsecError) as refused:
            await alice.lease(sandbox_id)
        assert (refused.value.status, refused.value.code) == (status, code), sandbox_id
    resp = await cp.http.get(f"/v1/sandboxes/{entry.id}/lease")  # no credential
    assert resp.status == 401
