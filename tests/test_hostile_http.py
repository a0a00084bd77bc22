"""What anyone who can open a connection (or a tenant with a client token) sends that a
well-behaved client never would, against both services over real sockets (issue 28,
attacks 4, 6 and 9): a token that is not UTF-8, a body nested without end, and one
address holding thousands of connections.

The services run in this process: the control plane with no agents, the agent with no
Docker engine, since all of this is refused (or served) before either is needed. To the
services each loopback source address (127.0.0.x) is another peer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from conftest import eventually, make_spec, started_pool
from inprocess import (
    controlplane_app,
    inprocess_agent,
    inprocess_controlplane,
    joined_agent,
    served,
)
from rawhttp import RawConnection

from agent.app import create_agent_app
from dsec.cli.services import agent_server_limits
from dsec.client import Client
from dsec.httpkit import MAX_JSON_DEPTH, ServerLimits
from dsec.tls import client_ssl, make_local_pool_tls
from dsec.tokens import LEASE_TOKEN_HEADER

NOT_UTF8 = b"\xff\xfe\xc3(" + b"x" * 40  # invalid start bytes, then a broken sequence
SANDBOX = "base.0123456789abcdef"


def bearer(token: str | bytes) -> dict[str, bytes]:
    return {"Authorization": b"Bearer " + (token if isinstance(token, bytes) else token.encode())}


async def raw_request(
    url: str, method: str, path: str, headers: dict[str, bytes], body: bytes = b"", **to
) -> tuple[int, dict]:
    """One request on a connection of its own (`to`: RawConnection.to's source, TLS)."""
    connection = await RawConnection.to(url, **to)
    try:
        return await connection.request(method, path, headers, body)
    finally:
        await connection.close()


def no_tracebacks(caplog: pytest.LogCaptureFixture) -> None:
    logged = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not logged, [r.getMessage() for r in logged]


# --- attack 4: a bearer token that is not valid UTF-8 ------------------------------

CONTROLPLANE_ROUTES = [
    ("GET", "/v1/sandboxes"),
    ("POST", "/v1/sandboxes"),
    ("GET", f"/v1/sandboxes/{SANDBOX}"),
    ("DELETE", f"/v1/sandboxes/{SANDBOX}"),
    ("GET", "/v1/nodes"),
    ("GET", "/v1/pools"),
    ("POST", "/v1/agents/n1/join"),
    ("PUT", "/v1/agents/n1"),
]
AGENT_ROUTES = [
    ("GET", "/v1/node"),
    ("GET", "/v1/audit"),
    ("POST", "/v1/sandboxes"),
    ("DELETE", f"/v1/sandboxes/{SANDBOX}"),
    ("POST", f"/v1/sandboxes/{SANDBOX}/exec"),
    ("GET", f"/v1/sandboxes/{SANDBOX}/exec/stream"),
    ("PUT", f"/v1/sandboxes/{SANDBOX}/files?path=/work/a"),
    ("GET", f"/v1/sandboxes/{SANDBOX}/files/list?path=/work"),
]


def assert_malformed_token(status: int, answer: dict, where: str) -> None:
    assert status == 401, (where, status, answer)
    assert answer["error"]["code"] == "malformed_token", (where, answer)
    assert "UTF-8" in answer["error"]["message"], (where, answer)


async def test_attack_4_a_token_that_is_not_utf8_is_refused_401_on_every_route(caplog):
    async with inprocess_controlplane() as cp:
        for method, path in CONTROLPLANE_ROUTES:
            status, answer = await raw_request(cp.url, method, path, bearer(NOT_UTF8), b"{}")
            assert_malformed_token(status, answer, f"control plane {method} {path}")
        # a release's lease token, beside a client token that is good
        headers = bearer(cp.tokens.client) | {LEASE_TOKEN_HEADER: NOT_UTF8}
        status, answer = await raw_request(cp.url, "DELETE", f"/v1/sandboxes/{SANDBOX}", headers)
        assert_malformed_token(status, answer, f"the {LEASE_TOKEN_HEADER} header")
    no_tracebacks(caplog)


async def test_attack_4_the_agent_refuses_a_token_that_is_not_utf8_and_audits_it(tmp_path, caplog):
    async with inprocess_agent(tmp_path) as node:
        for method, path in AGENT_ROUTES:
            status, answer = await raw_request(node.url, method, path, bearer(NOT_UTF8), b"{}")
            assert_malformed_token(status, answer, f"agent {method} {path}")
        call_token = node.agent.identity.call_token
        status, audit = await raw_request(node.url, "GET", "/v1/audit", bearer(call_token))
        assert status == 200, audit
    refused = {
        (r["method"], r["route"])
        for r in audit["records"]
        if r["event"] == "refused" and (r["status"], r["code"]) == (401, "malformed_token")
    }
    routes = {(m, p.split("?")[0].replace(SANDBOX, "{sandbox_id}")) for m, p in AGENT_ROUTES}
    assert refused == routes
    no_tracebacks(caplog)


# --- attack 6: a JSON body nested without end --------------------------------------


@pytest.fixture
def tls(tmp_path: Path):
    return make_local_pool_tls(tmp_path / "tls", "test", ["127.0.0.1"])


def nested_bodies() -> list[bytes]:
    return [
        b"[" * 1000,
        b"[" * 100_000,
        b"[" * 1000 + b"]" * 1000,
        b'{"pool": "default", "labels": {"a": ' + b"[" * 1000 + b"]" * 1000 + b"}}",
        b'{"pool": ' + b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1) + b"}",
    ]


async def assert_nesting_refused(url: str, token: str, **to) -> None:
    for body in nested_bodies():
        status, answer = await raw_request(url, "POST", "/v1/sandboxes", bearer(token), body, **to)
        assert (status, answer["error"]["code"]) == (400, "malformed_json"), (body[:40], answer)
        message = answer["error"]["message"]
        assert "nests deeper" in message or "not valid JSON" in message, answer


async def test_attack_6_a_nested_acquire_body_is_a_400_over_http_and_tls(tls, caplog):
    async with inprocess_controlplane() as cp:
        await assert_nesting_refused(cp.url, cp.tokens.client)
    app, tokens, _ = controlplane_app()
    async with served(app, ssl_context=tls.server_context()) as url:
        assert url.startswith("https://")
        await assert_nesting_refused(url, tokens.client, ssl_context=client_ssl(tls.ca))
    no_tracebacks(caplog)


async def test_attack_6_the_agent_refuses_a_nested_body_on_its_json_routes(tmp_path, caplog):
    async with inprocess_agent(tmp_path) as node:
        await assert_nesting_refused(node.url, node.agent.identity.call_token)
    no_tracebacks(caplog)


async def test_attack_6_a_nested_message_on_an_exec_stream_is_a_400(docker_client, tmp_path):
    async with (
        started_pool(make_spec(tmp_path, nodes=1), docker_client) as pool,
        Client(pool.url, token=pool.tokens.client) as client,
        client.sandbox() as sb,
        aiohttp.ClientSession() as http,
    ):
        url = f"{sb.lease.agent_url}/v1/sandboxes/{sb.id}/exec/stream"
        headers = {"Authorization": f"Bearer {sb.lease.lease_token}"}

        async def refused(ws: aiohttp.ClientWebSocketResponse) -> None:
            error = await ws.receive_json(timeout=10)
            assert (error["type"], error["status"], error["code"]) == (
                "error",
                400,
                "malformed_json",
            ), error

        async with http.ws_connect(url, headers=headers) as ws:
            await ws.send_str("[" * 100_000)  # as the command
            await refused(ws)
        async with http.ws_connect(url, headers=headers) as ws:
            await ws.send_str(json.dumps({"cmd": ["cat"], "stdin": True}))
            await ws.send_str("[" * 1000)  # as a control message, while it runs
            await refused(ws)
            await ws.send_bytes(b"still read")  # and its input is taken as before
            await ws.send_str(json.dumps({"type": "stdin_eof"}))
            output = b""
            while (message := await ws.receive(timeout=10)).type == aiohttp.WSMsgType.BINARY:
                output += message.data[1:]
            assert json.loads(message.data)["exit_code"] == 0, message.data
            assert output == b"still read"


# --- attack 9: one peer holding connections ----------------------------------------

FLOODER, NEIGHBOUR = "127.0.0.2", "127.0.0.3"


@contextlib.asynccontextmanager
async def held_connections(url: str, source: str, count: int) -> AsyncIterator[list]:
    """`count` connections from `source` that send nothing, opened a batch at a time
    (the listener's backlog is 1024): the (reader, writer) pairs while the block runs."""
    host, port = url.split("://", 1)[1].split(":")
    held: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        for start in range(0, count, 250):
            held += await asyncio.gather(
                *(
                    asyncio.open_connection(host, int(port), local_addr=(source, 0))
                    for _ in range(min(250, count - start))
                )
            )
        yield held
    finally:
        for _, writer in held:
            writer.close()


async def answered_503_at_once(held: list) -> int:
    """How many of `held` the server answered 503 and closed (within a second)."""

    async def refused(reader: asyncio.StreamReader) -> bool:
        with contextlib.suppress(TimeoutError):
            answer = await asyncio.wait_for(reader.read(), 1)
            return answer.startswith(b"HTTP/1.1 503 ") and b"too_many_connections" in answer
        return False

    return sum(await asyncio.gather(*(refused(reader) for reader, _ in held)))


async def authenticated_status(url: str, path: str, token: str, source: str) -> tuple[int, dict]:
    return await raw_request(url, "GET", path, bearer(token), source=source)


async def assert_flood_keeps_no_one_out(
    url: str, limits: ServerLimits, flood: int, path: str, token: str
) -> None:
    assert flood > limits.max_connections  # as many as took every slot before
    async with held_connections(url, FLOODER, flood) as held:
        status, answer = await authenticated_status(url, path, token, NEIGHBOUR)
        assert status == 200, answer
        # its own connections past its budget were answered at once; the others wait
        assert await answered_503_at_once(held) == flood - limits.unauthenticated_per_peer


async def test_attack_9_a_peer_holding_thousands_of_connections_keeps_the_control_plane_open(
    caplog,
):
    limits = ServerLimits()  # what `dsec controlplane` serves with
    app, tokens, _ = controlplane_app()
    async with served(app, limits=limits) as url:
        await assert_flood_keeps_no_one_out(url, limits, 4250, "/v1/sandboxes", tokens.client)
    no_tracebacks(caplog)


async def test_attack_9_a_peer_holding_thousands_of_connections_keeps_an_agent_open(
    tmp_path, caplog
):
    agent = joined_agent(tmp_path)
    limits = agent_server_limits(agent.config)  # what `dsec agent` serves with
    assert agent.identity is not None
    async with served(create_agent_app(agent), limits=limits) as url:
        token = agent.identity.call_token
        await assert_flood_keeps_no_one_out(url, limits, 2500, "/v1/node", token)
    no_tracebacks(caplog)


async def test_attack_9_a_connection_that_does_not_authenticate_in_time_is_closed():
    limits = ServerLimits(authenticate_within_s=0.5, reading_per_peer=1)
    app, tokens, _ = controlplane_app()
    async with served(app, limits=limits) as url:
        silent = await RawConnection.to(url, "127.0.0.4")  # read, sends nothing
        unread = await RawConnection.to(url, "127.0.0.4")  # past its peer's reading budget
        anonymous = await RawConnection.to(url, "127.0.0.5")
        assert (await anonymous.get("/healthz")).startswith(b"HTTP/1.1 200")  # needs no token
        client = await RawConnection.to(url, "127.0.0.6")
        status, _ = await client.request("GET", "/v1/sandboxes", bearer(tokens.client))
        assert status == 200
        assert await silent.rest(timeout=5) == b""
        late = await unread.rest(timeout=5)
        assert late.startswith(b"HTTP/1.1 503 ") and b"too_many_connections" in late
        assert await anonymous.rest(timeout=5) == b""
        # one that authenticated is kept as any keep-alive connection is
        status, _ = await client.request("GET", "/v1/sandboxes", bearer(tokens.client))
        assert status == 200
        await client.close()


async def test_attack_9_a_burst_of_new_connections_from_one_peer_waits_its_turn():
    limits = ServerLimits(reading_per_peer=2)
    app, tokens, _ = controlplane_app()
    async with served(app, limits=limits) as url:
        connector = aiohttp.TCPConnector(limit=0, local_addr=("127.0.0.7", 0))
        async with aiohttp.ClientSession(connector=connector) as http:

            async def listed() -> int:
                headers = {"Authorization": f"Bearer {tokens.client}"}
                async with http.get(f"{url}/v1/sandboxes", headers=headers) as resp:
                    return resp.status

            assert await asyncio.gather(*(listed() for _ in range(100))) == [200] * 100


async def test_attack_9_authenticated_connections_past_the_shared_limit_are_answered_503():
    limits = ServerLimits(max_connections=2)
    app, tokens, _ = controlplane_app()
    async with served(app, limits=limits) as url:
        held = [await RawConnection.to(url, f"127.0.0.{8 + i}") for i in range(2)]
        for connection in held:
            status, _ = await connection.request("GET", "/v1/sandboxes", bearer(tokens.client))
            assert status == 200  # both counted
        third = await RawConnection.to(url, "127.0.0.10")
        status, answer = await third.request("GET", "/v1/sandboxes", bearer(tokens.client))
        assert (status, answer["error"]["code"]) == (503, "too_many_connections")
        assert await third.rest() == b""  # and closed
        # what needs no credential needs no shared slot
        anonymous = await RawConnection.to(url, "127.0.0.10")
        assert (await anonymous.get("/healthz")).startswith(b"HTTP/1.1 200")
        status, _ = await held[0].request("GET", "/v1/sandboxes", bearer(tokens.client))
        assert status == 200  # those within it: served
        await held[0].close()

        async def served_again() -> bool:
            status, _ = await authenticated_status(
                url, "/v1/sandboxes", tokens.client, "127.0.0.11"
            )
            return status == 200

        await eventually(served_again, "a connection once one was closed", timeout=5)
        await held[1].close()
        await anonymous.close()
