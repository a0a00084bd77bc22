"""Draining a node (`POST /v1/nodes/{id}/drain`, `dsec node drain ID`): no new sandboxes
there, its idle ones removed, its leases run to their end, then it may go.

The decision is the policy's (rule 9, tests/test_policy.py); here the scheduler carries it
out against simulated agents in virtual time, the HTTP routes refuse what they must, and
a live pool drains a node through the command line."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest
from conftest import make_spec, started_pool
from harness import Harness
from inprocess import inprocess_controlplane
from prometheus_client.parser import text_string_to_metric_families

from bench.multihost import first_report
from dsec.client import Client
from dsec.models import PoolParams
from dsec.policy import Create, Destroy
from dsec.states import SandboxState as S

WARM = PoolParams(min_warm=4, max_warm=16, warm_fraction=0)


def test_a_drained_node_loses_its_idle_sandboxes_keeps_its_leases_then_goes():
    async def scenario(h: Harness) -> None:
        view = h.scheduler.view
        await h.settle(5)
        assert h.states() == {S.WARM: 4}
        lease = await h.acquire()
        drained = lease.node
        other = next(n for n in view.nodes if n != drained)
        await h.settle(3)  # the warm pool refills behind the lease, on both nodes

        view.request_drain(drained, True)
        h.scheduler.wake()
        began = h.now()
        await h.settle(5)
        # idle there: removed; the lease: still there; the warm pool: on the other node
        assert h.on_agents(drained) == {lease.id: S.LEASED}
        assert h.decided(Destroy, "its node is draining")
        assert {sid: st for sid, st in h.on_agents(other).items()} == dict.fromkeys(
            [e.id for e in view.on_node(other)], S.WARM
        )
        assert len(h.on_agents(other)) == 4
        assert view.drain_state(view.nodes[drained]) == "draining"
        assert h.metric("dsec_node_draining", node=drained) == 1
        assert h.metric("dsec_node_drained", node=drained) == 0
        assert h.metric("dsec_node_placeable", node=drained) == 0
        # new work goes elsewhere, whatever the room left there
        more = [await h.acquire() for _ in range(6)]
        assert {m.node for m in more} == {other}
        assert [c for c in h.calls_of("create", node=drained) if c.started >= began] == []
        assert [
            a for t, a in h.decisions if isinstance(a, Create) and a.node == drained and t >= began
        ] == []

        await h.release(lease)  # the last lease there ends: the node is drained
        await h.settle(2)
        assert h.on_agents(drained) == {}
        assert view.drain_state(view.nodes[drained]) == "drained"
        assert h.metric("dsec_node_drained", node=drained) == 1

        del h.agents.nodes[drained]  # its operator stops it: it goes silent
        await h.settle(h.config.heartbeat_timeout_s + 2)
        assert drained not in view.nodes  # gone as meant: not a node down
        assert S.LOST not in h.states()
        assert h.metric("dsec_node_healthy", node=drained) == 0  # no series left at all
        for m in more:
            await h.release(m)

    Harness(nodes=2, slots=10, pools={"default": WARM}).run(scenario)


def test_a_drain_called_off_takes_work_again():
    async def scenario(h: Harness) -> None:
        view = h.scheduler.view
        await h.settle(5)
        for node_id in list(view.nodes):
            view.request_drain(node_id, True)
        h.scheduler.wake()
        await h.settle(3)
        assert h.on_agents() == {}  # every warm sandbox went, and none was made again
        view.request_drain("node-1", False)
        h.scheduler.wake()
        await h.settle(5)
        assert set(h.on_agents("node-1").values()) == {S.WARM}
        assert len(h.on_agents("node-1")) == 4 and h.on_agents("node-2") == {}

    Harness(nodes=2, slots=10, pools={"default": WARM}).run(scenario)


async def test_the_drain_routes_are_an_operators_and_name_a_node_that_exists():
    # no warm pool: nothing is ever placed on the node, whose address answers nothing
    async with inprocess_controlplane(pools={"default": PoolParams(min_warm=0)}) as cp:
        auth = {"Authorization": f"Bearer {cp.identities.node_token('n1')}"}
        beat = await cp.http.put(
            "/v1/agents/n1", json=first_report("n1", "http://127.0.0.2:8701"), headers=auth
        )
        assert beat.status == 200, await beat.text()
        admin = {"Authorization": f"Bearer {cp.tokens.admin}"}
        client = {"Authorization": f"Bearer {cp.tokens.client}"}
        for method in ("POST", "DELETE"):
            refused = await cp.http.request(method, "/v1/nodes/n1/drain", headers=client)
            assert refused.status == 403, await refused.text()
            anonymous = await cp.http.request(method, "/v1/nodes/n1/drain")
            assert anonymous.status == 401
            unknown = await cp.http.request(method, "/v1/nodes/n9/drain", headers=admin)
            assert unknown.status == 404
            assert (await unknown.json())["error"]["code"] == "unknown_node"
            bad = await cp.http.request(method, "/v1/nodes/Bad_Id/drain", headers=admin)
            assert bad.status == 400 and (await bad.json())["error"]["code"] == "invalid_node_id"
        # an empty node is drained at once; called off, it takes work again
        drained = await cp.http.post("/v1/nodes/n1/drain", headers=admin)
        assert drained.status == 200
        info = await drained.json()
        assert (info["node_id"], info["drain"], info["placeable"]) == ("n1", "drained", False)
        listed = await (await cp.http.get("/v1/nodes", headers=client)).json()
        assert [n["drain"] for n in listed["nodes"]] == ["drained"]
        back = await (await cp.http.delete("/v1/nodes/n1/drain", headers=admin)).json()
        assert (back["drain"], back["placeable"]) == ("none", True)


async def dsec_cli(*argv: str, env: dict[str, str]) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dsec.cli", *argv, env={**os.environ, **env},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await proc.communicate()
    return proc.returncode, out.decode(), err.decode()


@pytest.mark.docker
async def test_dsec_node_drain_on_a_live_pool(docker_client, tmp_path):
    spec = make_spec(tmp_path, nodes=2, pool=PoolParams(min_warm=4, warm_fraction=0))
    async with started_pool(spec, docker_client) as pool:
        env = {"DSEC_URL": pool.url, "DSEC_ADMIN_TOKEN": pool.tokens.admin, "DSEC_TOKEN": ""}
        async with Client(pool.url, pool.tokens.client) as client:
            sb = await client.acquire(timeout=60)
            target = sb.node
            other = next(n for n in pool.node_ids if n != target)

            code, out, err = await dsec_cli("node", "drain", target, env=env)
            assert code == 0, err
            assert target in out and "draining" in out
            # the idle sandboxes there go; the lease works on
            for _ in range(100):
                here = [s for s in await client_all(pool) if s["node"] == target]
                if [s["id"] for s in here] == [sb.id]:
                    break
                await asyncio.sleep(0.2)
            assert [s["id"] for s in here] == [sb.id], here
            assert (await sb.exec(["echo", "still here"])).stdout == "still here\n"
            more = await client.acquire(timeout=60)
            assert more.node == other
            await more.release()

            # --wait: until the node holds nothing; the release is what ends it
            waiting = asyncio.ensure_future(
                dsec_cli("node", "drain", target, "--wait", "--timeout", "60", env=env)
            )
            await asyncio.sleep(1)
            assert not waiting.done()
            await sb.release()
            code, out, err = await waiting
            assert code == 0, err
            assert "drained" in out
            (info,) = [n for n in (await client.nodes()).nodes if n.node_id == target]
            assert info.drain == "drained" and not info.placeable
            async with client._session().get(f"{pool.url}/metrics") as resp:
                scraped = text_string_to_metric_families(await resp.text())
            drained = {
                s.labels["node"]: s.value
                for family in scraped
                if family.name == "dsec_node_drained"
                for s in family.samples
            }
            assert drained == {target: 1.0, other: 0.0}

            # an unknown node: a clear message and a non-zero exit
            code, out, err = await dsec_cli("node", "drain", "nope", env=env)
            assert code == 1 and "no node nope" in err and "404" in err
            code, out, err = await dsec_cli("node", "undrain", target, env=env)
            assert code == 0 and "none" in out


async def client_all(pool) -> list[dict]:
    """Every sandbox of the pool, as its operator sees them."""
    async with Client(pool.url, pool.tokens.admin) as admin:
        return [s.model_dump() for s in await admin.list()]
