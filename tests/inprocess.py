"""A control plane in the test's own process, on aiohttp's test server, with no agents.

For what the control plane refuses before a request reaches its queues (bad bodies,
credentials, unknown routes, pools or ids, bad pool parameters): there, a live pool
with agents and Docker adds nothing. An acquire that passes validation waits here until
its timeout, since no agent ever reports.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from aiohttp.test_utils import TestClient, TestServer

from controlplane.app import create_controlplane_app
from controlplane.config import ControlPlaneConfig
from dsec.clock import SystemClock
from dsec.tokens import new_token


@dataclass(frozen=True)
class Tokens:
    client: str  # the first client token
    admin: str
    agent: str


@dataclass(frozen=True)
class InProcessControlPlane:
    url: str  # the test server's root, on 127.0.0.1, without a trailing slash
    tokens: Tokens
    http: TestClient  # aiohttp's test client for the same server, sending no credentials


@contextlib.asynccontextmanager
async def inprocess_controlplane(
    *client_tokens: str, **config
) -> AsyncIterator[InProcessControlPlane]:
    """`client_tokens` are the tokens clients may use (one new token if none); `config`
    sets other fields of the control plane's configuration."""
    clients = list(client_tokens) or [new_token()]
    tokens = Tokens(client=clients[0], admin=new_token(), agent=new_token())
    app = create_controlplane_app(
        ControlPlaneConfig(
            client_tokens=clients, admin_tokens=[tokens.admin], agent_token=tokens.agent, **config
        ),
        SystemClock(),
    )
    async with TestClient(TestServer(app, host="127.0.0.1")) as http:
        server = http.server
        yield InProcessControlPlane(f"http://{server.host}:{server.port}", tokens, http)
