"""The control plane's HTTP API (DESIGN.md, 'Contracts') and its app factory.

It only decides: acquire and release are answered here, but commands and files go
straight to the agent named in the acquire answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections import Counter
from collections.abc import AsyncIterator

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from controlplane.agents import AgentClient, HttpAgents
from controlplane.cloud import CloudProvider
from controlplane.config import ControlPlaneConfig
from controlplane.metrics import UNKNOWN_POOL
from controlplane.scheduler import Scheduler, build_scheduler
from dsec.clock import Clock
from dsec.httpkit import (
    Api,
    ApiError,
    bearer_token,
    model_response,
    new_app,
    read_model,
    require_token,
    sandbox_id_param,
    token_matches,
)
from dsec.models import (
    NAME_PATTERN,
    AcquireRequest,
    Capacity,
    Lease,
    NodeInfo,
    NodeList,
    NodeReport,
    PoolInfo,
    PoolList,
    PoolParams,
    PrewarmInfo,
    PrewarmRequest,
    Released,
    SandboxInfo,
    SandboxList,
    Usage,
)
from dsec.policy import Resources
from dsec.states import SandboxState
from dsec.tokens import LEASE_TOKEN_HEADER, client_id

SCHEDULER = web.AppKey("scheduler", Scheduler)


def _scheduler(request: web.Request) -> Scheduler:
    return request.app[SCHEDULER]


def _client(request: web.Request) -> Scheduler:
    s = _scheduler(request)
    require_token(request, [*s.config.client_tokens, *s.config.admin_tokens])
    return s


def _admin(request: web.Request) -> Scheduler:
    s = _scheduler(request)
    require_token(request, s.config.admin_tokens)
    return s


async def acquire(request: web.Request) -> web.Response:
    s = _scheduler(request)
    pool = UNKNOWN_POOL  # until the body names a pool that exists
    try:
        _client(request)
        body = await read_model(request, AcquireRequest)
        if body.pool in s.config.pools:
            pool = body.pool
        lease = await s.leases.acquire(body, client_id(bearer_token(request)))
    except (ApiError, web.HTTPClientError) as e:
        if 400 <= e.status < 500:
            if pool == UNKNOWN_POOL and not request.can_read_body:  # the body was read
                pool = _named_pool(await request.read(), s.config.pools) or UNKNOWN_POOL
            s.metrics.acquires.labels(pool, "rejected").inc()
        raise
    return model_response(lease, 201)


def _named_pool(raw: bytes, pools: dict) -> str | None:
    """The existing pool an invalid acquire body named, so its refusal counts there."""
    try:
        data = json.loads(raw or b"{}")
    except ValueError:
        return None
    pool = data.get("pool", "default") if isinstance(data, dict) else None
    return pool if isinstance(pool, str) and pool in pools else None


def _visible_to(request: web.Request, s: Scheduler):
    """What a caller may see of the sandboxes: an operator all of them, a client the
    ones it holds a lease on."""
    if token_matches(bearer_token(request), s.config.admin_tokens):
        return lambda entry: True
    me = client_id(bearer_token(request))
    return lambda entry: entry.owner == me and entry.lease_id is not None


async def list_sandboxes(request: web.Request) -> web.Response:
    s = _client(request)
    pool = request.query.get("pool")
    visible = _visible_to(request, s)
    entries = [
        e for e in s.view.sandboxes.values() if (pool is None or e.pool == pool) and visible(e)
    ]
    return model_response(SandboxList(sandboxes=[s.leases.info_of(e) for e in entries]))


async def get_sandbox(request: web.Request) -> web.Response:
    s = _client(request)
    sandbox_id = sandbox_id_param(request)
    entry = s.view.sandboxes.get(sandbox_id)
    if entry is not None and not _visible_to(request, s)(entry):
        entry = None  # another client's: as if it did not exist
    if entry is None:
        if sandbox_id in s.view.released:
            raise ApiError(410, "released", f"sandbox {sandbox_id} was released")
        raise ApiError(404, "unknown_sandbox", f"no sandbox {sandbox_id}")
    return model_response(s.leases.info_of(entry))


async def release(request: web.Request) -> web.Response:
    s = _client(request)
    operator = token_matches(bearer_token(request), s.config.admin_tokens)
    proof = None if operator else request.headers.get(LEASE_TOKEN_HEADER, "")
    entry = await s.leases.release(sandbox_id_param(request), proof)
    # recycled (pool parameter `recycle`): the sandbox is warm again, for another lease
    recycled = entry.state == SandboxState.WARM
    return model_response(
        Released(id=entry.id, state=SandboxState.WARM if recycled else SandboxState.GONE)
    )


async def agent_heartbeat(request: web.Request) -> web.Response:
    s = _scheduler(request)
    require_token(request, [s.config.agent_token])
    report = await read_model(request, NodeReport)
    if report.node_id != request.match_info["node_id"]:
        raise ApiError(422, "node_mismatch", "the report names another node than the URL")
    s.on_report(report)
    return web.json_response({"status": "ok"})


async def list_nodes(request: web.Request) -> web.Response:
    s = _client(request)
    now = s.clock.now()
    nodes = []
    used_by_node = s.view.used_by_node()
    for n in s.view.nodes.values():
        used = used_by_node.get(n.id, Resources())
        nodes.append(
            NodeInfo(
                node_id=n.id,
                kind=n.kind,
                url=n.url,
                healthy=n.healthy,
                placeable=n.placeable(now),
                engine_ok=n.engine_ok,
                failures=n.failures,
                create_limit=n.create_limit,
                heartbeat_age_s=max(0.0, now - n.last_seen),
                capacity=Capacity(
                    cpus=n.capacity.cpus, memory_mb=n.capacity.memory_mb, slots=n.capacity.slots
                ),
                usage=Usage(cpus=used.cpus, memory_mb=used.memory_mb, slots=used.slots),
                sandboxes=used.slots,
                images=sorted(n.images),
            )
        )
    return model_response(NodeList(nodes=nodes))


def _pool_info(s: Scheduler, name: str) -> PoolInfo:
    states = Counter(str(e.state) for e in s.view.sandboxes.values() if e.pool == name)
    return PoolInfo(
        name=name,
        params=s.config.pools[name],
        queue_depth=s.queues.depth(name),
        sandboxes=dict(states),
    )


async def list_pools(request: web.Request) -> web.Response:
    s = _client(request)
    return model_response(PoolList(pools=[_pool_info(s, name) for name in s.config.pools]))


async def put_pool(request: web.Request) -> web.Response:
    s = _admin(request)
    name = request.match_info["name"]
    if not re.match(NAME_PATTERN, name):
        raise ApiError(400, "invalid_pool_name", f"not a pool name: {name!r}")
    params = await read_model(request, PoolParams)
    s.set_pool(name, params)
    return model_response(_pool_info(s, name))


async def prewarm_pool(request: web.Request) -> web.Response:
    s = _client(request)  # a trainer announcing its next burst is a client
    name = request.match_info["name"]
    if name not in s.config.pools:
        raise ApiError(404, "unknown_pool", f"no pool named {name!r}")
    body = await read_model(request, PrewarmRequest)
    return model_response(s.prewarm(name, body))


async def prometheus_sd(request: web.Request) -> web.Response:
    s = _scheduler(request)
    groups = [
        {
            "targets": [n.url.removeprefix("http://")],
            "labels": {"node": n.id, "kind": n.kind, "job": "dsec-agent"},
        }
        for n in s.view.nodes.values()
        if n.healthy
    ]
    return web.json_response(groups)


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(_scheduler(request).metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def healthz(request: web.Request) -> web.Response:
    s = _scheduler(request)
    return web.json_response(
        {"status": "ok", "nodes": len(s.view.nodes), "sandboxes": len(s.view.sandboxes)}
    )


def controlplane_api() -> Api:
    api = Api("dsec control plane")
    api.route(
        "POST",
        "/v1/sandboxes",
        acquire,
        body=AcquireRequest,
        answer=Lease,
        summary="acquire a sandbox: waits in the pool's queue up to timeout_s",
    )
    api.route(
        "GET",
        "/v1/sandboxes",
        list_sandboxes,
        answer=SandboxList,
        summary="all sandboxes (?pool= to filter)",
    )
    api.route(
        "GET", "/v1/sandboxes/{sandbox_id}", get_sandbox, answer=SandboxInfo, summary="one sandbox"
    )
    api.route(
        "DELETE",
        "/v1/sandboxes/{sandbox_id}",
        release,
        answer=Released,
        summary="release a leased sandbox; it is removed (or reset and warm again, when "
        "its pool recycles)",
    )
    api.route("GET", "/v1/nodes", list_nodes, answer=NodeList, summary="registered nodes")
    api.route("GET", "/v1/pools", list_pools, answer=PoolList, summary="pools and parameters")
    api.route(
        "PUT",
        "/v1/pools/{name}",
        put_pool,
        body=PoolParams,
        answer=PoolInfo,
        summary="set a pool's parameters live (admin); a bad value changes nothing",
    )
    api.route(
        "POST",
        "/v1/pools/{name}/prewarm",
        prewarm_pool,
        body=PrewarmRequest,
        answer=PrewarmInfo,
        summary="announce a burst: count warm sandboxes within within_s, held hold_s more, "
        "then the normal warm target again; replaces the pool's last prewarm",
    )
    api.route(
        "PUT",
        "/v1/agents/{node_id}",
        agent_heartbeat,
        body=NodeReport,
        summary="an agent's registration and heartbeat (agent token)",
    )
    api.route(
        "GET",
        "/v1/sd/prometheus",
        prometheus_sd,
        summary="the agents, in Prometheus' HTTP service-discovery format",
    )
    api.route("GET", "/metrics", metrics, summary="Prometheus metrics")
    api.route("GET", "/healthz", healthz, summary="liveness")
    return api


def create_controlplane_app(
    config: ControlPlaneConfig,
    clock: Clock,
    cloud: CloudProvider | None = None,
    *,
    agents: AgentClient | None = None,
) -> web.Application:
    """The control plane, calling its agents over HTTP unless `agents` says otherwise."""
    agents = agents or HttpAgents(config.agent_token)
    scheduler = build_scheduler(config, agents, clock, cloud=cloud)
    app = new_app(controlplane_api())
    app[SCHEDULER] = scheduler

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        await agents.start()
        loop = asyncio.create_task(scheduler.run_forever(), name="scheduler")
        yield
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop
        if cloud is not None:
            await cloud.close()
        await scheduler.drain()
        await agents.close()

    app.cleanup_ctx.append(lifecycle)
    return app
