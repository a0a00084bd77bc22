"""Trust boundaries: who may call what, on the control plane and on the agents, and the
audit log every command leaves behind.

The pool here has two client tokens, Alice's and Bob's, beside the operators' (admin)
token and the pool's join token. Every refusal is checked for its status and its
JSON error body.
"""

from __future__ import annotations

import json
import os
import signal
import stat
from collections.abc import AsyncIterator

import aiohttp
import pytest
import pytest_asyncio
from conftest import assert_stopped_then_removed, eventually, make_spec, started_pool
from inprocess import InProcessControlPlane, inprocess_controlplane

from agent.docker_driver import LABEL_SANDBOX
from dsec.client import Client, Sandbox
from dsec.launch.local import LocalPool
from dsec.tokens import new_token

pytestmark = pytest.mark.asyncio(loop_scope="module")

ALICE, BOB = new_token(), new_token()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pool(docker_client, tmp_path_factory) -> AsyncIterator[LocalPool]:
    # the agents look for dead containers once a minute, not every 2 s: a sandbox whose
    # container a test kills is still there for the command that finds it dead
    spec = make_spec(tmp_path_factory.mktemp("auth"), nodes=2, container_check_s=60.0)
    # the control plane takes a comma-separated list of client tokens from DSEC_TOKEN
    with pytest.MonkeyPatch.context() as env:
        env.setenv("DSEC_TOKEN", f"{ALICE},{BOB}")
        async with started_pool(spec, docker_client) as p:
            yield p


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def controlplane_app() -> AsyncIterator[InProcessControlPlane]:
    """Alice's and Bob's tokens on a control plane in this process: no agents, no Docker."""
    async with inprocess_controlplane(ALICE, BOB) as cp:
        yield cp


@pytest_asyncio.fixture(loop_scope="module")
async def alice(pool: LocalPool) -> AsyncIterator[Client]:
    async with Client(pool.url, token=ALICE) as c:
        yield c


@pytest_asyncio.fixture(loop_scope="module")
async def bob(pool: LocalPool) -> AsyncIterator[Client]:
    async with Client(pool.url, token=BOB) as c:
        yield c


async def call(
    method: str, url: str, token: str | None, json_body: dict | None = None, raw_auth: str = ""
) -> tuple[int, dict]:
    headers = {"Authorization": raw_auth or f"Bearer {token}"} if token or raw_auth else {}
    async with aiohttp.ClientSession() as http:
        async with http.request(method, url, headers=headers, json=json_body) as resp:
            return resp.status, await resp.json(content_type=None)


def assert_refused(answer: tuple[int, dict], status: int, code: str, what: str) -> None:
    got, body = answer
    assert got == status, (what, got, body)
    assert body["error"]["code"] == code and body["error"]["message"], (what, body)


def exec_url(sb: Sandbox) -> str:
    return f"{sb.lease.agent_url}/v1/sandboxes/{sb.id}/exec"


def control_plane_of(pool: LocalPool, sb: Sandbox) -> str:
    """The control plane's credential on the agent of `sb`'s node (its call token)."""
    assert pool.identities is not None
    return pool.identities.call_token(sb.node)


async def test_the_control_plane_refuses_missing_and_wrong_tokens(pool, alice):
    async with alice.sandbox() as sb:
        routes = [
            ("POST", "/v1/sandboxes", {"timeout_s": 1}),
            ("GET", "/v1/sandboxes", None),
            ("GET", f"/v1/sandboxes/{sb.id}", None),
            ("DELETE", f"/v1/sandboxes/{sb.id}", None),
            ("GET", "/v1/nodes", None),
            ("GET", "/v1/pools", None),
            ("PUT", "/v1/pools/default", {}),
        ]
        for method, path, body in routes:
            url, what = f"{pool.url}{path}", f"{method} {path}"
            assert_refused(await call(method, url, None, body), 401, "unauthenticated", what)
            for scheme in ("Basic " + ALICE, "Bearer", ALICE):  # not a bearer token
                answer = await call(method, url, None, body, raw_auth=scheme)
                assert_refused(answer, 401, "unauthenticated", f"{what} with {scheme[:6]}")
            # neither a guess, nor the join token, nor a lease token is a client token
            for token in ("not-a-token", pool.tokens.agent, sb.lease.lease_token):
                assert_refused(await call(method, url, token, body), 403, "forbidden", what)
        # after all that, the sandbox is still leased and works
        assert (await alice.get(sb.id)).state == "leased"
        assert (await sb.exec(["echo", "ok"])).stdout == "ok\n"


async def test_admin_and_agent_routes_refuse_client_tokens(controlplane_app):
    base, admin = controlplane_app.url, controlplane_app.tokens.admin
    pools_url = f"{base}/v1/pools/default"
    for token in (ALICE, BOB):
        assert_refused(await call("PUT", pools_url, token, {}), 403, "forbidden", "PUT pools")
    status, before = await call("GET", f"{base}/v1/pools", admin)
    assert status == 200
    params = next(p["params"] for p in before["pools"] if p["name"] == "default")
    status, body = await call("PUT", pools_url, admin, params)
    assert status == 200 and body["params"] == params
    # only an agent may report for a node: a forged report could steer placements (the
    # token is checked before the report is read, so no node needs to have reported)
    node = "dsec-1"
    report_url = f"{base}/v1/agents/{node}"
    for token in (ALICE, admin):
        assert_refused(await call("PUT", report_url, token, {}), 403, "forbidden", "heartbeat")
    assert_refused(await call("PUT", report_url, None, {}), 401, "unauthenticated", "heartbeat")


async def test_agent_control_routes_refuse_client_and_lease_tokens(pool, alice, docker_client):
    async with alice.sandbox() as sb:
        agent, path = sb.lease.agent_url, f"/v1/sandboxes/{sb.id}"
        routes = [
            ("POST", "/v1/sandboxes", {}),
            ("GET", path, None),
            ("DELETE", path, None),
            ("POST", f"{path}/lease", {}),
            ("POST", f"{path}/pause", None),
            ("POST", f"{path}/hibernate", None),
            ("POST", f"{path}/unpause", None),
            ("POST", f"{path}/reset", {}),
            ("GET", "/v1/node", None),
            ("GET", f"/v1/audit?sandbox={sb.id}", None),
        ]
        for method, route, body in routes:
            url, what = f"{agent}{route}", f"{method} {route}"
            assert_refused(await call(method, url, None, body), 401, "unauthenticated", what)
            for token in (ALICE, pool.tokens.admin, sb.lease.lease_token):
                assert_refused(await call(method, url, token, body), 403, "forbidden", what)
        container = docker_client.containers.get(f"dsec-{sb.id}")
        assert container.status == "running"  # not paused, not removed
        assert (await sb.exec(["echo", "ok"])).stdout == "ok\n"


async def test_a_lease_token_runs_commands_in_its_own_sandbox_only(pool, alice, bob):
    mine = await alice.acquire()
    theirs = await bob.acquire()
    try:
        body = {"cmd": ["echo", "pwned"]}
        answer = await call("POST", exec_url(theirs), mine.lease.lease_token, body)
        assert_refused(answer, 403, "forbidden", "another client's sandbox")
        assert_refused(await call("POST", exec_url(theirs), None, body), 401, "unauthenticated", "")
        # the control plane's credential and the clients' tokens run nothing either
        for token in ("0" * 64, pool.tokens.agent, ALICE, pool.tokens.admin):
            assert_refused(await call("POST", exec_url(theirs), token, body), 403, "forbidden", "")
        status, result = await call("POST", exec_url(mine), mine.lease.lease_token, body)
        assert status == 200 and result["stdout"] == "pwned\n"
    finally:
        await mine.release()
        await theirs.release()


async def test_a_client_sees_and_reaches_only_its_own_sandboxes(pool, alice, bob):
    key = "shared-looking-key"
    mine = await alice.acquire(idempotency_key=key)
    try:
        # Bob, sending the same idempotency key, gets a sandbox of his own: keys are per client
        theirs = await bob.acquire(idempotency_key=key)
        try:
            assert theirs.id != mine.id
            assert theirs.lease.lease_token != mine.lease.lease_token
            assert {s.id for s in await bob.list()} == {theirs.id}
            assert {s.id for s in await alice.list()} == {mine.id}
            for who, other in ((bob, mine), (alice, theirs)):
                status, body = await call("GET", f"{pool.url}/v1/sandboxes/{other.id}", who.token)
                assert_refused((status, body), 404, "unknown_sandbox", "another's sandbox")
            # Alice's retry still finds her own sandbox, and an operator sees both
            again = await alice.acquire(idempotency_key=key)
            assert again.id == mine.id and again.lease.lease_token == mine.lease.lease_token
            async with Client(pool.url, token=pool.tokens.admin) as operator:
                listed = {s.id for s in await operator.list()}
                assert {mine.id, theirs.id} <= listed
                assert (await operator.get(mine.id)).state == "leased"
        finally:
            await theirs.release()
    finally:
        await mine.release()


async def test_a_released_lease_token_is_refused(pool, alice):
    sb_key = "released-lease"
    sb = await alice.acquire(idempotency_key=sb_key)
    assert (await sb.exec(["true"])).exit_code == 0
    await sb.release()
    answer = await call("POST", exec_url(sb), sb.lease.lease_token, {"cmd": ["true"]})
    assert_refused(answer, 410, "released", "exec after release")
    # nor does its idempotency key get a new lease: released means gone
    answer = await call("POST", f"{pool.url}/v1/sandboxes", ALICE, {"idempotency_key": sb_key})
    assert_refused(answer, 409, "idempotency_key_spent", "a spent key")


async def test_a_client_cannot_release_another_clients_sandbox(pool, alice, docker_client):
    async with alice.sandbox() as sb:
        answer = await call("DELETE", f"{pool.url}/v1/sandboxes/{sb.id}", BOB)
        assert_refused(answer, 403, "forbidden", "Bob releasing Alice's sandbox")
        assert (await sb.exec(["echo", "still mine"])).stdout == "still mine\n"


async def test_every_command_is_audited_outside_the_sandbox(pool, alice, docker_client):
    sb = await alice.acquire()
    commands = [
        (["sh", "-c", "echo out; echo error >&2; exit 3"], {}),
        (["sleep", "5"], {"timeout": 0.5}),
        (["sh", "-c", "yes | head -c 5000"], {"max_output_bytes": 100}),
        (["echo", "x" * 5000], {}),
    ]
    results = [await sb.exec(cmd, **kw) for cmd, kw in commands]
    refused = await call("POST", exec_url(sb), "0" * 64, {"cmd": ["echo", "refused"]})
    assert refused[0] == 403
    await sb.release()
    await assert_stopped_then_removed(docker_client, sb.id)

    log_path = pool.dir / f"{sb.node}-audit.jsonl"
    assert stat.S_IMODE(os.stat(log_path).st_mode) == 0o600
    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    mine = [r for r in records if r["sandbox"] == sb.id and r["event"] == "exec"]
    assert len(mine) == len(commands)  # the refused command ran nothing
    # it left a record of the refusal: from where, on which route (never the token)
    [refusal] = [r for r in records if r["sandbox"] == sb.id and r["event"] == "refused"]
    assert (refusal["peer"], refusal["status"], refusal["route"]) == (
        "127.0.0.1",
        403,
        "/v1/sandboxes/{sandbox_id}/exec",
    )
    for record, result in zip(mine, results, strict=True):
        assert record["node"] == sb.node and record["pool"] == "default"
        assert record["lease_id"] == sb.lease.lease_id and record["peer"] == "127.0.0.1"
        assert record["exit_code"] == result.exit_code and record["timed_out"] == result.timed_out
        assert record["stdout_bytes"] == len(result.stdout.encode())
        assert record["stderr_bytes"] == len(result.stderr.encode())
        assert record["truncated"] == result.truncated and record["error"] is None
        assert 0 < record["duration_ms"] <= result.duration_ms + 1
    assert mine[0]["cmd"] == "sh -c 'echo out; echo error >&2; exit 3'"
    assert (mine[0]["exit_code"], mine[0]["stderr_bytes"]) == (3, len("error\n"))
    assert mine[1]["timed_out"] and mine[1]["exit_code"] == 124
    assert mine[2]["truncated"] and mine[2]["stdout_bytes"] == 100
    assert mine[3]["cmd_truncated"] and len(mine[3]["cmd"]) == 1024

    # the same records, for the operators, from the agent
    status, body = await call(
        "GET", f"{sb.lease.agent_url}/v1/audit?sandbox={sb.id}", control_plane_of(pool, sb)
    )
    assert status == 200 and body["records"] == [*mine, refusal]
    status, body = await call(
        "GET", f"{sb.lease.agent_url}/v1/audit?limit=1", control_plane_of(pool, sb)
    )
    assert status == 200 and body["records"] == records[-1:]
    for query in ("sandbox=../etc", "limit=0", "limit=x"):
        status, body = await call(
            "GET", f"{sb.lease.agent_url}/v1/audit?{query}", control_plane_of(pool, sb)
        )
        assert status == 400 and body["error"]["message"], (query, body)


async def test_a_command_in_a_dead_sandbox_is_audited_with_its_error(pool, alice, docker_client):
    sb = await alice.acquire()
    # its init killed from the host (no command of its own may signal it)
    [container] = docker_client.containers.list(filters={"label": f"{LABEL_SANDBOX}={sb.id}"})
    os.kill(container.attrs["State"]["Pid"], signal.SIGKILL)
    await eventually(
        lambda: not docker_client.api.inspect_container(container.id)["State"]["Running"],
        "its container stopped",
    )
    status, body = await call("POST", exec_url(sb), sb.lease.lease_token, {"cmd": ["true"]})
    assert_refused((status, body), 409, "sandbox_exited", "exec in a dead sandbox")
    await sb.release()
    status, body = await call(
        "GET", f"{sb.lease.agent_url}/v1/audit?sandbox={sb.id}", control_plane_of(pool, sb)
    )
    last = body["records"][-1]
    assert (last["cmd"], last["error"], last["exit_code"]) == ("true", "sandbox_exited", None)
