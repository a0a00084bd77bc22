"""Hostile tenancy (issue 28, attacks 11, 12, 13 and 16): a tenant's prewarm and priority
stay within its quota, a node reports only leases the control plane granted, and the
metrics of `dsec up` are closed by default.

Attacks 11 to 13 run on a control plane in this process over real HTTP on loopback
(tests/inprocess.py), with nodes that report with their real node credentials; attack
13's agent half on an agent in this process, and attack 16 on `dsec up`'s own pool
(Docker) scraped by Debian's Prometheus.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import re
import time
import uuid
from collections.abc import AsyncIterator
from functools import partial

import aiohttp
import pytest
from conftest import TEST_POOL_PREFIX, eventually, started_pool
from inprocess import InProcessControlPlane, inprocess_agent, inprocess_controlplane
from test_edges import (
    every_target_up,
    own_credentials,  # noqa: F401 (the fixture attack 16 uses)
    prometheus_on,
)
from test_identities import sandbox_on
from test_observability import SCRAPE_INTERVAL

from agent.report import node_report
from controlplane.config import DEFAULT_MAX_LEASES, ClientQuota, ClientSpec
from dsec.cli import build_parser
from dsec.cli.up import up_spec
from dsec.image import BASE_IMAGE
from dsec.models import (
    Capacity,
    LeaseGrant,
    NodeReport,
    PoolParams,
    SandboxRow,
    SandboxTable,
    Usage,
)
from dsec.states import SandboxState
from dsec.tokens import client_id, new_lease_id, new_token

ALICE, BOB, LIMITED, NO_PREWARM = (new_token() for _ in range(4))
NODE, NODE_URL = "n1", "http://127.0.0.2:9"  # nothing listens there: creates fail at once
# no warm pool of its own: every warm target here is a prewarm's
BARE = PoolParams(min_warm=0, warm_fraction=0)


def bearer(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


@contextlib.asynccontextmanager
async def controlplane(**config) -> AsyncIterator[InProcessControlPlane]:
    """Clients ALICE and BOB (and LIMITED, NO_PREWARM where `config` lists them), pool
    `default` with no warm pool of its own; its one node never drops out of placement
    for the creates that fail on it."""
    config.setdefault("pools", {"default": BARE})
    async with inprocess_controlplane(ALICE, BOB, node_failure_threshold=1000, **config) as cp:
        yield cp


def row(sandbox_id: str, state: SandboxState = SandboxState.WARM, **lease) -> SandboxRow:
    fields = {"lease_id": None, "idempotency_key": None, "owner": None} | lease
    return SandboxRow(
        id=sandbox_id,
        pool="default",
        template="base",
        state=state,
        created_at=0.0,
        cpus=0.5,
        memory_mb=256,
        busy_s=0.0,
        active_at=time.monotonic(),
        frozen_at=None,
        **fields,
    )


async def heartbeat(cp: InProcessControlPlane, *rows: SandboxRow, seq: int = 1) -> dict:
    """A full report of NODE with its own node token: room for 20 sandboxes, of the base
    image."""
    body = NodeReport(
        node_id=NODE,
        kind="local",
        url=NODE_URL,
        capacity=Capacity(cpus=20, memory_mb=1 << 20, slots=20),
        usage=Usage(),
        incarnation="n1-1",
        clock=time.monotonic(),
        seq=seq,
        sandboxes=SandboxTable.of(rows),
        images=[BASE_IMAGE],
    ).model_dump(mode="json")
    headers = bearer(cp.identities.node_token(NODE))
    resp = await cp.http.put(f"/v1/agents/{NODE}", json=body, headers=headers)
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def call(cp, method: str, path: str, token: str | None, **body) -> tuple[int, dict]:
    resp = await cp.http.request(method, path, json=body or None, headers=bearer(token))
    return resp.status, await resp.json()


async def prewarm(cp, token: str, **body) -> tuple[int, dict]:
    return await call(cp, "POST", "/v1/pools/default/prewarm", token, **body)


async def metric(cp, name: str, **labels: str) -> float:
    """One sample of the control plane's /metrics (open here: no metrics token)."""
    text = await (await cp.http.get("/metrics")).text()
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    match = re.search(rf"^{name}{{{wanted}}} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


# --- 11: a client's prewarm is its own, within its quota ------------------------------


async def test_attack_11_another_clients_prewarm_neither_replaces_nor_cancels_mine():
    async with controlplane() as cp:
        await heartbeat(cp)
        status, mine = await prewarm(cp, ALICE, count=5, within_s=60, hold_s=60)
        assert status == 200 and not mine["replaced"], mine
        # Bob's burst beside Alice's: the pool warms for both
        status, bobs = await prewarm(cp, BOB, count=3, within_s=60, hold_s=60)
        assert status == 200 and not bobs["replaced"], bobs
        assert await metric(cp, "dsec_prewarm_target", pool="default") == 8
        # Bob's count 0 ends his own, and only his
        status, ended = await prewarm(cp, BOB, count=0, within_s=0)
        assert status == 200 and ended["replaced"], ended
        status, ended = await prewarm(cp, BOB, count=0, within_s=0)
        assert status == 200 and not ended["replaced"], ended  # nothing of his is left
        assert await metric(cp, "dsec_prewarm_target", pool="default") == 5
        # Alice's own new prewarm replaces hers
        status, again = await prewarm(cp, ALICE, count=2, within_s=60, hold_s=60)
        assert status == 200 and again["replaced"], again
        assert await metric(cp, "dsec_prewarm_target", pool="default") == 2


async def test_attack_11_a_prewarm_held_past_the_maximum_is_refused_saying_the_maximum():
    async with controlplane() as cp:
        await heartbeat(cp)
        # 48 h in all: a day's notice, held a day
        status, body = await prewarm(cp, ALICE, count=1, within_s=86_400, hold_s=86_400)
        assert (status, body["error"]["code"]) == (422, "hold_too_long"), body
        assert "3600 s" in body["error"]["message"]
        assert "max_prewarm_hold_s" in body["error"]["message"]
        assert body["error"]["details"] == [{"loc": "hold_s", "msg": "at most 3600"}]
        assert await metric(cp, "dsec_prewarm_target", pool="default") == 0
        status, body = await prewarm(cp, ALICE, count=1, within_s=0, hold_s=3600)
        assert status == 200, body
    async with controlplane(max_prewarm_hold_s=60) as cp:
        await heartbeat(cp)
        status, body = await prewarm(cp, ALICE, count=1, within_s=0, hold_s=61)
        assert (status, body["error"]["code"]) == (422, "hold_too_long"), body
        assert "60 s" in body["error"]["message"]


async def test_attack_11_a_clients_prewarms_together_stay_within_its_lease_quota():
    pools = {"default": BARE, "other": BARE}
    clients = [ClientSpec(token=LIMITED, quota=ClientQuota(max_leases=4))]
    async with controlplane(pools=pools, clients=clients) as cp:
        await heartbeat(cp)
        status, body = await prewarm(cp, LIMITED, count=5, within_s=60)
        assert (status, body["error"]["code"]) == (422, "prewarm_over_quota"), body
        assert "max_leases is 4" in body["error"]["message"]
        status, body = await call(
            cp, "POST", "/v1/pools/other/prewarm", LIMITED, count=3, within_s=60
        )
        assert status == 200, body
        # 3 announced in pool other: 1 more here at most
        status, body = await prewarm(cp, LIMITED, count=2, within_s=60)
        assert (status, body["error"]["code"]) == (422, "prewarm_over_quota"), body
        assert body["error"]["details"] == [{"loc": "count", "msg": "at most 1"}]
        assert (await prewarm(cp, LIMITED, count=1, within_s=60))[0] == 200
        # other clients are not bounded by its quota
        assert (await prewarm(cp, ALICE, count=10, within_s=60))[0] == 200


async def test_attack_11_prewarm_is_admin_only_for_a_client_whose_quota_says_so():
    clients = [
        ClientSpec(token=NO_PREWARM, quota=ClientQuota(prewarm_pools=[])),
        ClientSpec(token=LIMITED, quota=ClientQuota(prewarm_pools=["other"])),
    ]
    pools = {"default": BARE, "other": BARE}
    async with controlplane(pools=pools, clients=clients) as cp:
        await heartbeat(cp)
        for token in (NO_PREWARM, LIMITED):
            status, body = await prewarm(cp, token, count=1, within_s=60)
            assert (status, body["error"]["code"]) == (403, "prewarm_not_allowed"), body
            assert "prewarm_pools" in body["error"]["message"]
        status, _ = await call(cp, "POST", "/v1/pools/other/prewarm", LIMITED, count=1, within_s=6)
        assert status == 200
        # an operator prewarms the pool for them
        assert (await prewarm(cp, cp.tokens.admin, count=2, within_s=60))[0] == 200
        assert await metric(cp, "dsec_prewarm_target", pool="default") == 2


# --- 12: a client's priority is bounded by its quota, 0 by default --------------------


async def test_attack_12_by_default_a_client_may_not_ask_for_a_priority_above_0():
    async with controlplane() as cp:
        status, body = await call(cp, "POST", "/v1/sandboxes", ALICE, priority=1000, timeout_s=0.5)
        assert (status, body["error"]["code"]) == (403, "priority_not_allowed"), body
        assert "max_priority" in body["error"]["message"]
        assert body["error"]["details"] == [{"loc": "priority", "msg": "at most 0"}]
        assert await metric(cp, "dsec_acquire_requests_total", outcome="rejected", pool="default")
        # priority 0 and below is anyone's: it waits in the queue (no agent serves here)
        for priority in (0, -5):
            status, body = await call(
                cp, "POST", "/v1/sandboxes", ALICE, priority=priority, timeout_s=0.3
            )
            assert (status, body["error"]["code"]) == (503, "acquire_timeout"), body
    # and so does `dsec up` plain: its control plane's default quota is the same
    spec = up_spec(build_parser(["up"]).parse_args(["up"]))
    assert spec.default_quota.max_priority == 0
    assert spec.default_quota.max_leases == DEFAULT_MAX_LEASES


# --- 13: a node reports only leases the control plane granted -------------------------


async def test_attack_13_a_node_cannot_report_a_lease_the_control_plane_did_not_grant():
    limited = [ClientSpec(token=LIMITED, quota=ClientQuota(max_leases=1))]
    async with controlplane(clients=limited) as cp:
        victim, forged = client_id(LIMITED), "n1.00000000000000f1"
        lease_id = new_lease_id()
        # the node's own credentials: its node token, and its lease key, which makes
        # the lease tokens of its sandboxes but no grant's proof
        lease_key = cp.identities.lease_key(NODE)
        message = f"{forged}|{lease_id}|{victim}||default".encode()
        made_by_node = hmac.new(lease_key.encode(), message, hashlib.sha256).hexdigest()
        for proof in ({}, {"grant_proof": made_by_node}):
            ack = await heartbeat(
                cp,
                row(forged, SandboxState.LEASED, lease_id=lease_id, owner=victim, **proof),
            )
            assert not ack.get("full_report")
            status, body = await call(cp, "GET", "/v1/sandboxes", LIMITED)
            assert status == 200 and body["sandboxes"] == [], body
            status, body = await call(cp, "GET", f"/v1/sandboxes/{forged}/lease", LIMITED)
            assert (status, body["error"]["code"]) == (404, "unknown_sandbox"), body
            # it does not count against the client's quota: an acquire waits, not 429
            status, body = await call(cp, "POST", "/v1/sandboxes", LIMITED, timeout_s=0.3)
            assert (status, body["error"]["code"]) == (503, "acquire_timeout"), body
        assert await metric(cp, "dsec_unproven_leases_total", node=NODE) >= 1


async def test_attack_13_a_granted_lease_is_learnt_again_after_a_restart_from_its_proof():
    """The control plane keeps no record of its grants: the proof its grant carried,
    reported by the agent, is what a control plane restarted with the same key takes."""
    key = new_token()
    owner, sandbox_id, lease_id = client_id(ALICE), "n1.00000000000000f2", new_lease_id()
    async with controlplane(identity_key=key) as before:
        proof = before.identities.grant_proof(NODE, sandbox_id, lease_id, owner, None, "default")
    async with controlplane(identity_key=key) as after:
        leased = row(sandbox_id, SandboxState.LEASED, lease_id=lease_id, owner=owner)
        await heartbeat(after, leased._replace(grant_proof=proof))
        status, body = await call(after, "GET", f"/v1/sandboxes/{sandbox_id}/lease", ALICE)
        assert status == 200 and body["lease_id"] == lease_id, body
        # that proof, on another sandbox, for another client, lease, key or pool, proves
        # nothing: the sandbox is not taken as a lease (it is to be removed)
        for seq, forged in enumerate(
            (
                {},
                {"owner": client_id(BOB)},
                {"lease_id": new_lease_id()},
                {"idempotency_key": "k1"},
                {"pool": "other"},
            ),
            start=2,
        ):
            other = f"n1.{seq:014x}f3"
            copied = leased._replace(id=other, grant_proof=proof, **forged)
            await heartbeat(after, leased._replace(grant_proof=proof), copied, seq=seq)
            for client in (ALICE, BOB):
                status, listed = await call(after, "GET", "/v1/sandboxes", client)
                mine = [s["id"] for s in listed["sandboxes"]]
                assert mine == ([sandbox_id] if client == ALICE else []), (forged, listed)
            status, listed = await call(after, "GET", "/v1/sandboxes", after.tokens.admin)
            assert all(s["lease_id"] is None for s in listed["sandboxes"] if s["id"] == other)


async def test_attack_13_an_agent_reports_its_grants_proof_and_keeps_it_across_a_restart(
    tmp_path,
):
    grant = LeaseGrant(
        lease_id=new_lease_id(),
        pool="default",
        owner=client_id(ALICE),
        request_id="r1",
        grant_proof="ab" * 32,
    )
    sandbox_id = "n1.00000000000000f4"
    async with inprocess_agent(tmp_path) as a:
        sandbox = sandbox_on(a.agent, sandbox_id, SandboxState.WARM, None, None)
        await a.agent.store.put(sandbox.record)
        await a.agent.lease(sandbox_id, grant)
        reported = node_report(a.agent).sandboxes.rows()
        assert [(r.lease_id, r.grant_proof) for r in reported] == [
            (grant.lease_id, grant.grant_proof)
        ]
        # on disk too: an agent that restarts adopts it, and reports the proof again
        records = {r.id: r for r in await a.agent.store.all()}
        assert records[sandbox_id].grant_proof == grant.grant_proof


# --- 16: `dsec up`'s metrics are closed by default ------------------------------------


@pytest.mark.usefixtures("own_credentials")  # the pool makes its own tokens
async def test_attack_16_dsec_up_closes_its_metrics_and_its_prometheus_scrapes_with_the_token(
    docker_client, tmp_path
):
    args = build_parser(["up"]).parse_args(
        ["up", "--nodes", "1", "--port", "0", "--state-dir", str(tmp_path / "state")]
    )
    spec = up_spec(args)
    assert spec.metrics_token  # no flag: closed
    spec.name, spec.heartbeat_s = f"{TEST_POOL_PREFIX}{uuid.uuid4().hex[:8]}", 0.5
    async with started_pool(spec, docker_client) as pool:
        agent_url = pool.agents[0].url
        async with aiohttp.ClientSession() as http:
            for url in (
                f"{pool.url}/metrics",
                f"{pool.url}/v1/sd/prometheus",
                f"{agent_url}/metrics",
            ):
                async with http.get(url) as resp:
                    assert resp.status == 401, url
                    assert (await resp.json())["error"]["code"] == "unauthenticated"
        config = pool.prometheus_config_file.read_text()
        assert config.count(f"credentials_file: {pool.metrics_token_file}") == 3
        async with prometheus_on(config.replace("15s", SCRAPE_INTERVAL), tmp_path) as url:
            await eventually(partial(every_target_up, url), "scrapes with the metrics token")
