"""A control plane in the test's own process, on aiohttp's test server, with no agents;
and an agent in the test's own process, with no Docker engine.

For what the control plane refuses before a request reaches its queues (bad bodies,
credentials, unknown routes, pools or ids, bad pool parameters): there, a live pool
with agents and Docker adds nothing. An acquire that passes validation waits here until
its timeout, since no agent ever reports. The same goes for what an agent refuses before
it calls its engine (credentials), and for its files on disk (stores, audit logs).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from agent.app import create_agent_app
from agent.config import AgentConfig
from agent.engine import CreateLimit, EngineQueue
from agent.metrics import AgentMetrics
from agent.node import Agent
from controlplane.app import create_controlplane_app
from controlplane.config import ControlPlaneConfig
from controlplane.identities import Identities
from dsec.clock import SystemClock
from dsec.httpkit import ServerLimits, serve
from dsec.tokens import new_token


@dataclass(frozen=True)
class Tokens:
    client: str  # the first client token
    admin: str
    agent: str  # the join token


@dataclass(frozen=True)
class InProcessControlPlane:
    url: str  # the test server's root, on 127.0.0.1, without a trailing slash
    tokens: Tokens
    http: TestClient  # aiohttp's test client for the same server, sending no credentials
    identities: Identities  # every node's credentials (node tokens for heartbeats)


def controlplane_app(*client_tokens: str, **config) -> tuple[web.Application, Tokens, Identities]:
    """A control plane's app, the tokens it takes and its nodes' credentials:
    `client_tokens` are the tokens clients may use (one new token if none); `config`
    sets other fields of its configuration."""
    clients = list(client_tokens) or [new_token()]
    tokens = Tokens(client=clients[0], admin=new_token(), agent=new_token())
    settings = ControlPlaneConfig(
        client_tokens=clients, admin_tokens=[tokens.admin], agent_token=tokens.agent, **config
    )
    return create_controlplane_app(settings, SystemClock()), tokens, Identities.of(settings)


@contextlib.asynccontextmanager
async def inprocess_controlplane(
    *client_tokens: str, **config
) -> AsyncIterator[InProcessControlPlane]:
    """A control plane (`controlplane_app`) on aiohttp's test server."""
    app, tokens, identities = controlplane_app(*client_tokens, **config)
    async with TestClient(TestServer(app, host="127.0.0.1")) as http:
        server = http.server
        url = f"http://{server.host}:{server.port}"
        yield InProcessControlPlane(url, tokens, http, identities)


@contextlib.asynccontextmanager
async def served(
    app: web.Application,
    *,
    ssl_context: ssl.SSLContext | None = None,
    limits: ServerLimits | None = None,
) -> AsyncIterator[str]:
    """`app` on 127.0.0.1 through dsec.httpkit.serve, the services' own listener (TLS,
    timeouts, the connection gate), rather than the test server: its URL while the
    block runs."""
    listening: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    stop = asyncio.Event()
    task = asyncio.create_task(
        serve(
            app,
            "127.0.0.1",
            0,
            stop,
            listening.set_result,
            ssl_context=ssl_context,
            limits=limits or ServerLimits(),
        )
    )
    try:
        yield await asyncio.wait_for(listening, 10)
    finally:
        stop.set()
        await task


class IdleEngine:
    """A Docker engine with no containers and no images: enough for an agent's start
    (adoption, its image list, the engine watch), its report, and for what it refuses
    before any call to its engine."""

    def __init__(self) -> None:
        self.engine = EngineQueue(1, CreateLimit(), time.monotonic)  # nothing ever queues

    async def list_labelled(self, node_id: str, stopped: bool = False) -> list:
        return []

    async def image_tags(self) -> list[str]:
        return []

    async def ping(self) -> None:
        return None

    async def engine_id(self) -> str:
        return "idle-engine"

    async def close(self) -> None:
        return None


@dataclass(frozen=True)
class InProcessAgent:
    url: str  # the test server's root, on 127.0.0.1, without a trailing slash
    agent: Agent  # the control plane's call token for it is agent.identity.call_token
    http: TestClient  # aiohttp's test client for the same server, sending no credentials


def joined_agent(
    state_dir: Path,
    engine: object | None = None,
    *,
    node_id: str = "n1",
    identities: Identities | None = None,
    **config,
) -> Agent:
    """Agent `node_id`, keeping its state in `state_dir`, joined to a control plane whose
    credentials are `identities` (a new key unless given); `engine` stands in for Docker
    (an IdleEngine unless given); `config` sets other fields of the agent's
    configuration."""
    config.setdefault("agent_token", new_token())
    # its loops beside its state, not in the host's /dev/shm: it is dropped, not stopped
    config.setdefault("loops_dir", state_dir)
    settings = AgentConfig(node_id=node_id, state_dir=state_dir, **config)
    agent = Agent(settings, engine or IdleEngine(), SystemClock(), AgentMetrics(node_id))  # type: ignore[arg-type]
    agent.identity = (identities or Identities(new_token(), new_token())).issue(node_id)
    return agent


@contextlib.asynccontextmanager
async def inprocess_agent(
    state_dir: Path,
    engine: object | None = None,
    *,
    node_id: str = "n1",
    identities: Identities | None = None,
    **config,
) -> AsyncIterator[InProcessAgent]:
    """Agent `node_id` (`joined_agent`) on aiohttp's test server, started and stopped as
    `dsec agent` would be."""
    agent = joined_agent(state_dir, engine, node_id=node_id, identities=identities, **config)
    async with TestClient(TestServer(create_agent_app(agent), host="127.0.0.1")) as http:
        server = http.server
        yield InProcessAgent(f"http://{server.host}:{server.port}", agent, http)
