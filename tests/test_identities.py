"""Identities (issue 14): a credential per node, bound to its node id; a separate call
token for the control plane's calls to each agent; lease tokens made with the key of
the node that holds the sandbox, bound to sandbox, lease, client and expiry.

Each attack is made by a node that holds what a node holds (its own credentials), or by
a client holding a lease token: impersonating another node, reporting another node's
sandboxes, reporting an address the operator did not allow, calling another node's
agent, forging an exec token, and using a token after its lease ended or expired. All
but the last test run in this process (tests/inprocess.py, the scheduler harness); the
last one runs them against a live pool.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from conftest import eventually, make_spec, started_pool
from harness import ALICE, BOB, Harness
from inprocess import (
    InProcessAgent,
    InProcessControlPlane,
    inprocess_agent,
    inprocess_controlplane,
)
from pydantic import ValidationError

from agent.node import Agent
from agent.sandboxes import Sandbox
from agent.store import SandboxRecord
from controlplane.app import SCHEDULER
from controlplane.config import ControlPlaneConfig
from controlplane.identities import Identities, check_agent_url
from dsec.client import Client
from dsec.httpkit import ApiError
from dsec.image import BASE_IMAGE
from dsec.models import (
    Capacity,
    LeaseGrant,
    NodeIdentity,
    NodeReport,
    PoolParams,
    SandboxRow,
    SandboxTable,
    TemplateSpec,
    Usage,
)
from dsec.states import SandboxState
from dsec.tokens import (
    LEASE_TOKEN_HEADER,
    NO_EXPIRY,
    LeaseClaim,
    client_id,
    lease_token,
    lease_token_claim,
    lease_token_expiry,
    new_lease_id,
    new_token,
)

OWNER, OTHER_OWNER = "0123456789abcdef", "fedcba9876543210"


def bearer(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def report(node_id: str, url: str, *sandbox_ids: str, seq: int = 1, **fields) -> dict:
    """A full heartbeat of `node_id` at `url`, holding warm sandboxes `sandbox_ids`, each
    just used (no policy acts on them while a test runs); `fields` replace the body's."""
    now = time.monotonic()
    rows = [
        SandboxRow(
            id=sandbox_id,
            pool="default",
            template="base",
            state=SandboxState.WARM,
            created_at=0.0,
            cpus=0.5,
            memory_mb=256,
            lease_id=None,
            idempotency_key=None,
            owner=None,
            busy_s=0.0,
            active_at=now,
            frozen_at=None,
        )
        for sandbox_id in sandbox_ids
    ]
    body = NodeReport(
        node_id=node_id,
        kind="local",
        url=url,
        capacity=Capacity(cpus=4, memory_mb=4096, slots=4),
        usage=Usage(),
        incarnation=f"{node_id}-1",
        clock=now,
        seq=seq,
        sandboxes=SandboxTable.of(rows),
    ).model_dump(mode="json")
    return body | fields


@contextlib.asynccontextmanager
async def controlplane(**config) -> AsyncIterator[InProcessControlPlane]:
    """A control plane in this process that keeps no sandbox warm: the nodes that report
    here are never called (no placement)."""
    async with inprocess_controlplane(pools={"default": PoolParams(min_warm=0)}, **config) as cp:
        yield cp


async def heartbeat(cp: InProcessControlPlane, node_id: str, token: str | None, body: dict):
    return await cp.http.put(f"/v1/agents/{node_id}", json=body, headers=bearer(token))


async def view_of(cp: InProcessControlPlane) -> tuple[dict, dict]:
    """What the control plane tells its operators: nodes (id -> url), sandboxes (id -> node)."""
    admin = bearer(cp.tokens.admin)
    nodes = (await (await cp.http.get("/v1/nodes", headers=admin)).json())["nodes"]
    sandboxes = (await (await cp.http.get("/v1/sandboxes", headers=admin)).json())["sandboxes"]
    return {n["node_id"]: n["url"] for n in nodes}, {s["id"]: s["node"] for s in sandboxes}


# --- joining -----------------------------------------------------------------------------


async def test_a_node_joins_with_its_own_token_or_the_join_token_and_gets_its_own_credentials():
    async with controlplane() as cp:
        ids = cp.identities
        for token in (ids.node_token("n1"), cp.tokens.agent):
            resp = await cp.http.post("/v1/agents/n1/join", headers=bearer(token))
            assert resp.status == 200, await resp.text()
            assert NodeIdentity.model_validate(await resp.json()) == ids.issue("n1")
        # another node's token does not join as n1; no client or operator token joins
        for token, status in (
            (ids.node_token("n2"), 403),
            (ids.call_token("n1"), 403),
            (cp.tokens.client, 403),
            (cp.tokens.admin, 403),
            (None, 401),
        ):
            resp = await cp.http.post("/v1/agents/n1/join", headers=bearer(token))
            assert resp.status == status, await resp.text()
        resp = await cp.http.post("/v1/agents/Bad!/join", headers=bearer(cp.tokens.agent))
        assert resp.status == 400 and (await resp.json())["error"]["code"] == "invalid_node_id"
    # every credential differs per node and per use
    n1, n2 = ids.issue("n1"), ids.issue("n2")
    secrets = [n1.node_token, n1.call_token, n1.lease_key, n2.node_token, n2.call_token]
    assert len({*secrets, n2.lease_key, cp.tokens.agent}) == 7


async def test_an_agent_joins_reports_with_what_it_was_issued_and_joins_again(tmp_path):
    """The agent's own loop (agent/runtime.py) against a control plane in this process:
    it joins with the join token, registers, takes the control plane's calls with its
    call token, and joins again when its heartbeat is refused for its credentials (as
    after a control plane starts with another key)."""
    async with (
        controlplane() as cp,
        inprocess_agent(
            tmp_path, controlplane_url=cp.url, agent_token=cp.tokens.agent, heartbeat_s=0.05
        ) as a,
    ):
        a.agent.listening_at(a.url)  # what `dsec agent` does once it listens
        await eventually(lambda: a.agent.identity == cp.identities.issue("n1"), "the join", 5)
        nodes, _ = await eventually(lambda: registered(cp), "the first report", 5)
        assert nodes == {"n1": a.url}
        scheduler = cp.http.server.app[SCHEDULER]
        answer = await scheduler.agents.pause(scheduler.view.nodes["n1"], "n1.0123456789abcdef")
        assert (answer.status, answer.code) == (404, "unknown_sandbox")  # past the token
        # credentials that no longer hold (issued under another key): refused, it joins again
        a.agent.identity = Identities(new_token(), cp.tokens.agent).issue("n1")
        await eventually(lambda: a.agent.identity == cp.identities.issue("n1"), "a new join", 5)


async def registered(cp: InProcessControlPlane):
    view = await view_of(cp)
    return view if view[0] else None


# --- heartbeats: own id, own sandboxes, allowed address ------------------------------------


async def test_a_node_cannot_heartbeat_as_another_node():
    async with controlplane() as cp:
        ids = cp.identities
        victims = report("n2", "http://127.0.0.3:8701", "n2.00000000000000a1")
        assert (await heartbeat(cp, "n2", ids.node_token("n2"), victims)).status == 200
        before = await view_of(cp)
        # n1, with its own credentials, reports for n2: its own address, none of n2's
        # sandboxes (they would be lost), a larger capacity to draw placements
        forged = report(
            "n2",
            "http://127.0.0.2:8701",
            incarnation="forged",
            capacity={"cpus": 999, "memory_mb": 1 << 30, "slots": 10_000},
        )
        for token in (ids.node_token("n1"), ids.call_token("n2"), cp.tokens.agent):
            resp = await heartbeat(cp, "n2", token, forged)
            assert resp.status == 403, await resp.text()
            assert (await resp.json())["error"]["code"] == "forbidden"
        assert (
            await view_of(cp)
            == before
            == ({"n2": "http://127.0.0.3:8701"}, {"n2.00000000000000a1": "n2"})
        )


async def test_a_node_cannot_report_another_nodes_sandboxes():
    async with controlplane() as cp:
        ids, theirs = cp.identities, "n2.00000000000000a1"
        for node, url, sandboxes in (
            ("n2", "http://127.0.0.3:1", [theirs]),
            ("n1", "http://127.0.0.2:1", []),
        ):
            resp = await heartbeat(cp, node, ids.node_token(node), report(node, url, *sandboxes))
            assert resp.status == 200, await resp.text()
        before = await view_of(cp)
        # n1, with its own token and id, claims n2's sandbox, or that it is gone
        claimed = report("n1", "http://127.0.0.2:1", "n1.00000000000000b1", seq=2)
        claimed["sandboxes"]["id"].append(theirs)
        for column in claimed["sandboxes"]:
            if column != "id":
                claimed["sandboxes"][column].append(claimed["sandboxes"][column][0])
        removed = report("n1", "http://127.0.0.2:1", seq=2, base=1, removed=[theirs])
        for body in (claimed, removed):
            resp = await heartbeat(cp, "n1", ids.node_token("n1"), body)
            assert resp.status == 422, await resp.text()
            assert "every sandbox id must be of node n1" in await resp.text()
        assert await view_of(cp) == before
        assert before[1] == {theirs: "n2"}


async def test_a_heartbeat_from_an_address_the_operator_did_not_allow_is_refused():
    async with controlplane() as cp:
        token = cp.identities.node_token("n1")
        for url in (
            "http://10.1.2.3:8701",  # not loopback: the default allows this machine only
            "http://127.0.0.2:8701/v1/other",  # a path: calls would go elsewhere
            "http://user@127.0.0.2:8701",
            "ftp://127.0.0.2:8701",
            "http://127.0.0.2:99999",
            "127.0.0.2:8701",
        ):
            resp = await heartbeat(cp, "n1", token, report("n1", url))
            assert resp.status == 422, (url, await resp.text())
            error = (await resp.json())["error"]
            assert error["code"] == "url_not_allowed" and "agent_urls" in error["message"]
            assert "http://127.0.0.0/8" in error["message"], error  # the rules, named
        assert await view_of(cp) == ({}, {})
        ok = await heartbeat(cp, "n1", token, report("n1", "http://127.0.0.2:8701"))
        assert ok.status == 200
    # the operator's rules: here one address only, of loopback (nothing is called)
    async with controlplane(agent_urls=["http://127.0.0.2/32"]) as cp:
        token = cp.identities.node_token("n1")
        refused = await heartbeat(cp, "n1", token, report("n1", "http://127.0.0.3:8701"))
        assert refused.status == 422 and "http://127.0.0.2/32" in await refused.text()
        ok = await heartbeat(cp, "n1", token, report("n1", "http://127.0.0.2:8701"))
        assert ok.status == 200


def test_agent_url_rules_name_networks_or_hosts():
    rules = ["https://10.1.0.0/16", "http://node-7.example.org", "http://[::1]/128"]
    for url in ("https://10.1.200.3:8701", "http://node-7.example.org:80", "http://[::1]:9"):
        check_agent_url(url, rules)
    for url in ("http://10.1.0.1:8701", "https://10.2.0.1:1", "http://node-8.example.org"):
        with pytest.raises(ApiError) as refused:
            check_agent_url(url, rules)
        assert refused.value.status == 422 and refused.value.code == "url_not_allowed"
    for rule in ("10.0.0.0/8", "ftp://10.0.0.0/8", "http://", "http://bad host"):
        with pytest.raises(ValidationError, match="not an agent URL rule"):
            ControlPlaneConfig(
                admin_tokens=[new_token()], agent_token=new_token(), agent_urls=[rule]
            )


# --- the control plane's calls ---------------------------------------------------------------


async def test_an_agent_takes_control_calls_only_with_its_own_call_token(tmp_path):
    ids = Identities(new_token(), new_token())
    async with inprocess_agent(tmp_path, node_id="n2", identities=ids) as a:
        for token in (
            ids.call_token("n1"),  # what node n1 knows: its own call token ...
            ids.node_token("n2"),  # ... or n2's heartbeat token, were it to learn it
            ids.join_token,
            ids.lease_key("n2"),
        ):
            for method, path in (
                ("GET", "/v1/node"),
                ("DELETE", "/v1/sandboxes/n2.0123456789abcdef"),
            ):
                resp = await a.http.request(method, path, headers=bearer(token))
                assert resp.status == 403, (method, path, await resp.text())
        resp = await a.http.get("/v1/node", headers=bearer(ids.call_token("n2")))
        assert resp.status == 200 and (await resp.json())["node_id"] == "n2"


# --- lease tokens ----------------------------------------------------------------------------


def sandbox_on(
    agent: Agent,
    sandbox_id: str,
    state: SandboxState = SandboxState.WARM,
    lease_id: str | None = None,
    owner: str | None = None,
) -> Sandbox:
    """A sandbox on `agent` with no container, under `lease_id` to `owner` if given."""
    spec = TemplateSpec(name="base", image=BASE_IMAGE)
    record = SandboxRecord(
        id=sandbox_id,
        container_id="c-" + sandbox_id,
        pool="default",
        template=spec.model_dump(),
        created_at=0.0,
        lease_id=lease_id,
        owner=owner,
    )
    agent.sandboxes[sandbox_id] = sandbox = Sandbox(record, spec, state, 0.0)
    return sandbox


def lease_on(agent: Agent, sandbox_id: str, owner: str | None = OWNER) -> str:
    """A sandbox leased on `agent` to `owner`, with no container; its lease id."""
    lease_id = new_lease_id()
    sandbox_on(agent, sandbox_id, SandboxState.LEASED, lease_id, owner)
    return lease_id


async def exec_status(a: InProcessAgent, sandbox_id: str, token: str) -> tuple[int, str]:
    resp = await a.http.post(
        f"/v1/sandboxes/{sandbox_id}/exec", json={"cmd": ["true"]}, headers=bearer(token)
    )
    return resp.status, (await resp.json())["error"]["code"]


async def test_a_nodes_lease_key_cannot_make_a_token_another_node_accepts(tmp_path):
    ids = Identities(new_token(), new_token())
    async with (
        inprocess_agent(tmp_path / "n1", node_id="n1", identities=ids) as n1,
        inprocess_agent(tmp_path / "n2", node_id="n2", identities=ids) as n2,
    ):
        sid = "n2.00000000000000c1"
        lease_id = lease_on(n2.agent, sid)
        genuine = lease_token(ids.lease_key("n2"), sid, lease_id, OWNER, NO_EXPIRY)
        assert n2.agent.execs.authorize(sid, genuine)[1] == lease_id
        # n1 knows its own lease key (it joined): what it makes is refused on n2
        forged = lease_token(n1.agent.identity.lease_key, sid, lease_id, OWNER, NO_EXPIRY)
        assert forged != genuine
        for token in (forged, ids.node_token("n1"), ids.call_token("n2"), ids.join_token, "0" * 64):
            assert await exec_status(n2, sid, token) == (403, "forbidden"), token


async def test_a_lease_token_is_bound_to_its_sandbox_lease_client_and_expiry(tmp_path):
    ids = Identities(new_token(), new_token())
    key = ids.lease_key("n1")
    async with inprocess_agent(tmp_path, identities=ids) as a:
        mine, theirs = "n1.00000000000000d1", "n1.00000000000000d2"
        my_lease, their_lease = lease_on(a.agent, mine), lease_on(a.agent, theirs, OTHER_OWNER)
        my_token = lease_token(key, mine, my_lease, OWNER, NO_EXPIRY)
        for forged in (
            my_token,  # another sandbox's
            lease_token(key, theirs, my_lease, OTHER_OWNER, NO_EXPIRY),  # another lease's
            lease_token(key, theirs, their_lease, OWNER, NO_EXPIRY),  # another client's
            f"{NO_EXPIRY - 1}.{my_token.split('.', 1)[1]}",  # an expiry moved
        ):
            assert await exec_status(a, theirs, forged) == (403, "forbidden"), forged
        assert a.agent.execs.authorize(mine, my_token)[1] == my_lease
        # past its expiry, the agent refuses it on its own: no call to the control plane
        lapsed = lease_token(key, mine, my_lease, OWNER, int(time.time()) - 1)
        assert await exec_status(a, mine, lapsed) == (410, "lease_expired")
        # once the lease is over: the sandbox recycled and leased to another client ...
        recycled = a.agent.sandboxes[mine].record
        recycled.lease_id, recycled.owner = new_lease_id(), OTHER_OWNER
        assert await exec_status(a, mine, my_token) == (403, "forbidden")
        # ... or removed
        del a.agent.sandboxes[mine]
        a.agent.released.add(mine, "released")
        assert await exec_status(a, mine, my_token) == (410, "released")


def test_a_lease_token_round_trips_and_nothing_else_verifies():
    key = Identities(new_token(), new_token()).lease_key("n1")
    token = lease_token(key, "n1.00000000000000e1", "a" * 32, OWNER, 1_900_000_000)
    assert lease_token_expiry(key, token, "n1.00000000000000e1", "a" * 32, OWNER) == 1_900_000_000
    moved = "x." + token.split(".", 1)[1]
    for bad in ("", ".", "1900000000", "1900000000.", moved, "１." + token):
        assert lease_token_expiry(key, bad, "n1.00000000000000e1", "a" * 32, OWNER) is None


def test_a_lease_token_names_its_lease_and_only_its_node_makes_that_claim_good():
    ids = Identities(new_token(), new_token())
    key, sid, lease = ids.lease_key("n1"), "n1.00000000000000e1", "a" * 32
    token = lease_token(key, sid, lease, OWNER, 1_900_000_000)
    assert lease_token_claim(key, token, sid) == LeaseClaim(lease, OWNER, 1_900_000_000)
    no_owner = lease_token(key, sid, lease, None, 5)
    assert lease_token_claim(key, no_owner, sid) == LeaseClaim(lease, None, 5)
    expiry, named_lease, owner, mac = token.split(".")
    for bad in (
        lease_token(ids.lease_key("n2"), sid, lease, OWNER, 1_900_000_000),  # another node's
        lease_token(key, "n1.00000000000000e2", lease, OWNER, 1_900_000_000),  # sandbox's
        f"{expiry}.{'b' * 32}.{owner}.{mac}",  # another lease named
        f"{expiry}.{named_lease}.{OTHER_OWNER}.{mac}",  # another client named
        f"{expiry}.{named_lease}..{mac}",  # no client named
        f"{int(expiry) + 1}.{named_lease}.{owner}.{mac}",  # the expiry moved
        f"{expiry}.{mac}",  # the older form names no lease
        f"{token}.",
        "",
    ):
        assert lease_token_claim(key, bad, sid) is None, bad
    # the older form still proves the lease it is checked against
    assert lease_token_expiry(key, f"{expiry}.{mac}", sid, lease, OWNER) == 1_900_000_000


async def test_a_lease_token_takes_up_its_warm_sandbox_before_the_grant_which_completes_it(
    tmp_path,
):
    """The control plane answers a warm acquire before the agent hears of the lease:
    the client's first call, with the token, may come first."""
    ids = Identities(new_token(), new_token())
    async with inprocess_agent(tmp_path, identities=ids) as a:
        sid, lease = "n1.00000000000000f1", new_lease_id()
        sandbox = sandbox_on(a.agent, sid)
        token = lease_token(ids.lease_key("n1"), sid, lease, OWNER, NO_EXPIRY)
        assert await a.agent.execs.hold(sid, token) == (sandbox, lease)
        assert sandbox.state == SandboxState.LEASED and sandbox.record.owner == OWNER
        [stored] = await a.agent.store.all()  # kept: a restart finds the lease
        assert (stored.lease_id, stored.owner) == (lease, OWNER)
        assert await a.agent.execs.hold(sid, token) == (sandbox, lease)  # its next call
        grant = LeaseGrant(lease_id=lease, pool="other", idempotency_key="k", owner=OWNER,
                           labels={"run": "1"}, request_id="r1")  # fmt: skip
        assert await a.agent.lease(sid, grant) is sandbox
        [stored] = await a.agent.store.all()
        for record in (sandbox.record, stored):
            assert (record.lease_id, record.pool, record.idempotency_key, record.labels) == (
                lease,
                "other",
                "k",
                {"run": "1"},
            )


async def test_a_lease_token_takes_up_no_sandbox_but_the_one_it_was_made_for(tmp_path):
    ids = Identities(new_token(), new_token())
    key = ids.lease_key("n1")
    async with inprocess_agent(tmp_path, identities=ids) as a:
        mine, theirs = "n1.00000000000000f2", "n1.00000000000000f3"
        lease = new_lease_id()
        my_token = lease_token(key, mine, lease, OWNER, NO_EXPIRY)
        sandbox_on(a.agent, theirs)
        recycled = sandbox_on(a.agent, mine)
        recycled.record.ended_leases.add(lease)  # that lease ended; the sandbox lives on
        refused = {
            # a token of a lease it had before (it was recycled since)
            mine: [(my_token, 410, "released")],
            theirs: [
                (my_token, 403, "forbidden"),  # another sandbox's
                (lease_token(ids.lease_key("n2"), theirs, lease, OWNER, NO_EXPIRY), 403,
                 "forbidden"),  # another node's
                (lease_token(key, theirs, lease, OWNER, int(time.time()) - 1), 410,
                 "lease_expired"),  # lapsed
            ],
        }  # fmt: skip
        for sid, tokens in refused.items():
            for token, status, code in tokens:
                assert await exec_status(a, sid, token) == (status, code), (sid, token)
                assert a.agent.sandboxes[sid].state == SandboxState.WARM
                assert a.agent.sandboxes[sid].record.lease_id is None
        paused = sandbox_on(a.agent, "n1.00000000000000f4", SandboxState.PAUSED)
        token = lease_token(key, paused.id, lease, OWNER, NO_EXPIRY)
        assert await exec_status(a, paused.id, token) == (409, "not_leased")  # thawed by a grant
        assert paused.state == SandboxState.PAUSED
        assert not await a.agent.store.all()


def test_the_control_plane_makes_lease_tokens_per_node_with_the_pools_max_lease():
    """Tokens come from the lease key of the sandbox's node and carry the pool's lease
    deadline; a release needs a token of that very lease and client."""
    pools = {"default": PoolParams(min_warm=0), "short": PoolParams(min_warm=0, max_lease_s=600)}

    async def scenario(h: Harness) -> None:
        ids = Identities.of(h.config)
        lease = await h.acquire(owner=ALICE)
        key = ids.lease_key(lease.node)
        assert (
            lease_token_expiry(key, lease.lease_token, lease.id, lease.lease_id, ALICE) == NO_EXPIRY
        )
        other = next(n for n in h.agents.nodes if n != lease.node)
        assert (
            lease_token_expiry(
                ids.lease_key(other), lease.lease_token, lease.id, lease.lease_id, ALICE
            )
            is None
        )
        short = await h.acquire(owner=ALICE, pool="short")
        deadline = math.ceil(h.clock.wall() + 600)
        expiry = lease_token_expiry(
            ids.lease_key(short.node), short.lease_token, short.id, short.lease_id, ALICE
        )
        assert deadline - 1 <= expiry <= deadline
        # the lease asked for again (GET .../lease, a keyed retry): the same token
        assert (
            h.scheduler.leases.lease_of(h.scheduler.view.sandboxes[short.id], "warm", 0).lease_token
            == short.lease_token
        )
        # a token of this lease made for another client (Bob) does not release it
        bobs = lease_token(key, lease.id, lease.lease_id, BOB, NO_EXPIRY)
        with pytest.raises(ApiError) as refused:
            await h.scheduler.leases.release(lease.id, bobs)
        assert (refused.value.status, refused.value.code) == (403, "forbidden")
        await h.release(lease)

    Harness(nodes=2, pools=pools).run(scenario)


# --- a live pool -------------------------------------------------------------------------------


async def test_a_live_pool_joins_each_node_with_its_own_token_and_refuses_every_attack(
    docker_client, tmp_path: Path
):
    spec = make_spec(tmp_path, nodes=2, pool=PoolParams(min_warm=2))
    async with started_pool(spec, docker_client) as pool:
        ids = pool.identities
        assert ids is not None
        # every agent joined with its own node token, and holds no join token
        for agent in pool.agents:
            assert agent.credentials["DSEC_NODE_TOKEN"] == ids.node_token(agent.name)
            assert pool.tokens.agent not in agent.credentials.values()
        async with (
            Client(pool.url, token=pool.tokens.client) as client,
            aiohttp.ClientSession() as http,
        ):
            sb = await client.acquire()
            assert (await sb.exec(["echo", "ok"])).stdout == "ok\n"
            home = next(a for a in pool.agents if a.name == sb.node)
            other = next(a for a in pool.agents if a.name != sb.node)
            # the other node's credentials: no heartbeat as this node, no call to its agent,
            # no exec token for its sandbox
            body = report(home.name, other.url, incarnation="forged")
            async with http.put(
                f"{pool.url}/v1/agents/{home.name}",
                json=body,
                headers=bearer(ids.node_token(other.name)),
            ) as resp:
                assert resp.status == 403
            async with http.get(
                f"{home.url}/v1/node", headers=bearer(ids.call_token(other.name))
            ) as resp:
                assert resp.status == 403
            owner = client_id(pool.tokens.client)
            forged = lease_token(
                ids.lease_key(other.name), sb.id, sb.lease.lease_id, owner, NO_EXPIRY
            )
            exec_url = f"{home.url}/v1/sandboxes/{sb.id}/exec"
            async with http.post(exec_url, json={"cmd": ["true"]}, headers=bearer(forged)) as resp:
                assert resp.status == 403
            assert (await client.get(sb.id)).node == home.name  # still where it was
            # a stale token after release: no command, no second release
            token = sb.lease.lease_token
            await sb.release()
            async with http.post(exec_url, json={"cmd": ["true"]}, headers=bearer(token)) as resp:
                assert resp.status == 410
            release = f"{pool.url}/v1/sandboxes/{sb.id}"
            headers = bearer(pool.tokens.client) | {LEASE_TOKEN_HEADER: token}
            async with http.delete(release, headers=headers) as resp:
                assert resp.status == 409
