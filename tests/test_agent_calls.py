"""The control plane's calls to agents over HTTP (controlplane/agents.py), against an
agent that answers slowly: a create waits its turn in the agent's engine queue and is
not given up at the other calls' timeout."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from controlplane.agents import HttpAgents
from controlplane.config import default_templates
from controlplane.identities import Identities
from dsec.models import CreateSandbox, LeaseGrant
from dsec.tokens import new_token

SLOW_S = 0.6  # how long the agent takes to answer, well past the calls' timeout below
CALL_TIMEOUT_S = 0.2
SANDBOX = "n1." + "0" * 16


@dataclass
class Node:
    id: str
    url: str


async def slowly(request: web.Request) -> web.Response:
    await asyncio.sleep(SLOW_S)
    return web.json_response({"id": request.match_info.get("sandbox_id", "made")}, status=201)


@pytest.mark.asyncio
async def test_a_create_the_agent_takes_long_over_is_waited_for_and_other_calls_time_out():
    app = web.Application()
    app.router.add_post("/v1/sandboxes", slowly)
    app.router.add_post("/v1/sandboxes/{sandbox_id}/lease", slowly)
    async with TestServer(app, host="127.0.0.1") as server:
        node = Node("n1", str(server.make_url("")).rstrip("/"))
        agents = HttpAgents(Identities(new_token(), new_token()), timeout_s=CALL_TIMEOUT_S)
        await agents.start()
        try:
            spec = CreateSandbox(
                sandbox_id=SANDBOX, pool="default", template=default_templates()["base"],
                request_id="r1",
            )  # fmt: skip
            grant = LeaseGrant(lease_id="0" * 32, pool="default", request_id="r2")
            created, leased = await asyncio.gather(
                agents.create(node, spec), agents.lease(node, SANDBOX, grant)
            )
        finally:
            await agents.close()
    assert created.ok, created
    assert not leased.ok and leased.code == "unreachable", leased
