"""The control plane's HTTP API (docs/contracts.md, 'HTTP') and its app factory.

It only decides: acquire and release are answered here, but commands and files go
straight to the agent named in the acquire answer.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections import Counter
from collections.abc import AsyncIterator

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from controlplane.agents import AgentClient, HttpAgents
from controlplane.claims import MAX_TAR_MEMBERS, acquire_of_form
from controlplane.cloud import CloudProvider
from controlplane.config import ControlPlaneConfig
from controlplane.identities import Identities, check_agent_url
from controlplane.images import ImageDistributor
from controlplane.metrics import UNKNOWN_POOL
from controlplane.outcomes import status_of
from controlplane.scheduler import Scheduler, build_scheduler
from controlplane.view import NodeEntry, SandboxEntry
from dsec.addresses import is_loopback, is_loopback_address, unroutable
from dsec.clock import Clock
from dsec.httpkit import (
    MAX_BODY_BYTES,
    Api,
    ApiError,
    bearer_token,
    body_limit_with_files,
    cancel_and_wait,
    is_form,
    model_response,
    new_app,
    parse_json,
    parse_model,
    read_body,
    read_form,
    read_model,
    require_token,
    sandbox_id_param,
    token_header,
    token_matches,
)
from dsec.models import (
    MAX_REPORT_BYTES,
    NAME_PATTERN,
    AcquireRequest,
    Capacity,
    Forked,
    ForkRequest,
    Lease,
    LeaseRenewed,
    LeaseStatus,
    NodeIdentity,
    NodeInfo,
    NodeList,
    NodeReport,
    PoolInfo,
    PoolList,
    PoolParams,
    PoolPatch,
    PrewarmInfo,
    PrewarmRequest,
    Released,
    ReportAck,
    SandboxInfo,
    SandboxList,
    TemplateBody,
    TemplateInfo,
    TemplateList,
    TemplateRemoved,
    TemplateSpec,
    Usage,
    validation_details,
)
from dsec.states import ASSIGNED, SandboxState
from dsec.tokens import LEASE_ID_PATTERN, LEASE_TOKEN_HEADER, client_id

log = logging.getLogger(__name__)
SCHEDULER = web.AppKey("scheduler", Scheduler)
IDENTITIES = web.AppKey("identities", Identities)


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


def _metrics_reader(request: web.Request) -> Scheduler:
    """Prometheus: the metrics token (or an admin token) when one is required."""
    s = _scheduler(request)
    readers = s.config.metrics_readers(*s.config.admin_tokens)
    if readers is not None:
        require_token(request, readers)
    return s


async def acquire(request: web.Request) -> web.Response:
    s = _scheduler(request)
    pool = UNKNOWN_POOL  # until the body names a pool that exists
    raw = b""
    try:
        _client(request)
        if is_form(request):
            parts = await read_form(
                request, MAX_BODY_BYTES + s.config.max_claim_files_bytes, MAX_TAR_MEMBERS + 1
            )
            raw, body = acquire_of_form(parts)
        else:
            raw = await read_body(request, body_limit_with_files(s.config.max_claim_files_bytes))
            body = parse_model(raw or b"{}", AcquireRequest)
        if body.pool in s.config.pools:
            pool = body.pool
        lease = await s.leases.acquire(body, client_id(bearer_token(request)))
    except (ApiError, web.HTTPClientError) as e:
        if 400 <= e.status < 500:
            if pool == UNKNOWN_POOL and raw:
                pool = _named_pool(raw, s.config.pools) or UNKNOWN_POOL
            s.metrics.acquires.labels(pool, "rejected").inc()
        raise
    return model_response(lease, 201)


def _named_pool(raw: bytes, pools: dict) -> str | None:
    """The existing pool an invalid acquire body named, so its refusal counts there."""
    try:
        data = parse_json(raw) if raw else {}
    except ApiError:
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


def _visible_entry(request: web.Request, s: Scheduler) -> SandboxEntry:
    """The sandbox named in the path, if the caller may see it; else why not."""
    sandbox_id = sandbox_id_param(request)
    entry = s.view.sandboxes.get(sandbox_id)
    if entry is not None and not _visible_to(request, s)(entry):
        entry = None  # another client's: as if it did not exist
    if entry is None:
        s.leases.check_not_expired(sandbox_id)
        if sandbox_id in s.view.released:
            raise ApiError(410, "released", f"sandbox {sandbox_id} was released")
        raise ApiError(404, "unknown_sandbox", f"no sandbox {sandbox_id}")
    return entry


async def get_sandbox(request: web.Request) -> web.Response:
    s = _client(request)
    return model_response(s.leases.info_of(_visible_entry(request, s)))


async def renew_lease(request: web.Request) -> web.Response:
    s = _client(request)
    return model_response(s.leases.renew(_visible_entry(request, s)))


async def get_lease(request: web.Request) -> web.Response:
    """The lease of a sandbox the caller holds, token included: a process that did not
    acquire it (the CLI) can then run commands in it. `path` and `schedule_ms` are not
    kept past the acquire: this answer says "warm" and 0, as a repeated acquire does."""
    s = _client(request)
    sandbox_id = sandbox_id_param(request)
    entry = s.view.sandboxes.get(sandbox_id)
    if entry is not None and not _visible_to(request, s)(entry):
        entry = None  # another client's: as if it did not exist, as GET answers
    if entry is None:
        if sandbox_id in s.view.released:
            raise ApiError(410, "released", f"sandbox {sandbox_id} was released")
        raise ApiError(404, "unknown_sandbox", f"no sandbox {sandbox_id}")
    # a lost sandbox's lease still stands: its holder needs the token to release it
    if entry.lease_id is None or not (entry.state in ASSIGNED or entry.state == SandboxState.LOST):
        raise ApiError(409, "not_leased", f"sandbox {sandbox_id} is {entry.state}, not leased")
    return model_response(s.leases.lease_of(entry, "warm", 0.0))


async def lease_status(request: web.Request) -> web.Response:
    """A lease the caller holds or held (an operator: any), running or ended: how it
    ended is kept an hour past its end (controlplane/outcomes.py)."""
    s = _client(request)
    lease_id = request.match_info["lease_id"]
    if not re.fullmatch(LEASE_ID_PATTERN, lease_id):
        raise ApiError(400, "invalid_lease_id", f"{lease_id[:80]!r} is not a lease id")
    visible = _visible_to(request, s)
    lost_within_s = s.config.heartbeat_timeout_s + s.config.tick_s
    end = s.leases.outcomes.get(lease_id)
    if end is not None and visible(end):
        return model_response(status_of(end, lost_within_s))
    entry = s.leases.holding(lease_id)
    if entry is None or not visible(entry):
        raise ApiError(404, "unknown_lease", f"no lease {lease_id} of this caller's")
    return model_response(
        LeaseStatus(
            lease_id=lease_id,
            sandbox_id=entry.id,
            pool=entry.pool,
            ended=False,
            lost_within_s=lost_within_s,
        )
    )


async def fork(request: web.Request) -> web.Response:
    """Copies of a leased sandbox's work dir and /tmp, each on a lease of its own
    (controlplane/forks.py): the caller's lease token on the source, or an admin token."""
    s = _client(request)
    token = bearer_token(request)
    proof = (
        None
        if token_matches(token, s.config.admin_tokens)
        else token_header(request, LEASE_TOKEN_HEADER)
    )
    sandbox_id = sandbox_id_param(request)
    body = await read_model(request, ForkRequest)
    return model_response(await s.forks.fork(sandbox_id, proof, client_id(token), body), 201)


async def release(request: web.Request) -> web.Response:
    s = _client(request)
    operator = token_matches(bearer_token(request), s.config.admin_tokens)
    proof = None if operator else token_header(request, LEASE_TOKEN_HEADER)
    entry = await s.leases.release(sandbox_id_param(request), proof)
    # recycled (pool parameter `recycle`): the sandbox is warm again, for another lease
    recycled = entry.state == SandboxState.WARM
    return model_response(
        Released(id=entry.id, state=SandboxState.WARM if recycled else SandboxState.GONE)
    )


def _name_param(request: web.Request, key: str, what: str) -> str:
    """The path's `key`, a name as NAME_PATTERN has it, or 400 `invalid_<what>`."""
    value = request.match_info[key]
    if not re.match(NAME_PATTERN, value):
        raise ApiError(400, f"invalid_{what.replace(' ', '_')}", f"not a {what}: {value!r}")
    return value


def _node_id_param(request: web.Request) -> str:
    return _name_param(request, "node_id", "node id")


async def agent_join(request: web.Request) -> web.Response:
    """A node's credentials (controlplane/identities.py), for its own node token or the
    pool's join token."""
    identities = request.app[IDENTITIES]
    require_token(request, identities.may_join_as(request.match_info["node_id"]))
    return model_response(identities.issue(_node_id_param(request)))


async def agent_heartbeat(request: web.Request) -> web.Response:
    s = _scheduler(request)
    # that node's own token and no other: one node cannot report as another
    require_token(request, [request.app[IDENTITIES].node_token(request.match_info["node_id"])])
    # a limit of its own, past the client routes': a full report of a node's most
    # sandboxes fits (gzipped on the wire; the limit counts the unzipped bytes)
    report = await read_model(request, NodeReport, MAX_REPORT_BYTES)
    if report.node_id != request.match_info["node_id"]:
        raise ApiError(422, "node_mismatch", "the report names another node than the URL")
    _check_reachable(report, request)
    # placements and its clients' commands go there: only where the operator allows
    check_agent_url(report.url, s.config.agent_urls)
    return model_response(s.on_report(report))


def _check_reachable(report: NodeReport, request: web.Request) -> None:
    """Refuse (422 unroutable_url) a node whose URL neither we nor its clients can dial:
    an address that is no address (0.0.0.0, ::, none), or a loopback address while the
    report comes from another machine (that loopback is its own, not ours)."""
    why = unroutable(report.url)
    peer = request.remote or ""
    if why is None and is_loopback(report.url) and not _same_machine(peer, request):
        why = f"a loopback address, while its reports come from {peer}, another machine"
    if why is not None:
        raise ApiError(
            422,
            "unroutable_url",
            f"node {report.node_id} advertises {report.url}, {why}: start its agent with "
            "--advertise-url URL, an address this control plane and its clients reach",
            [{"loc": "url", "msg": why}],
        )


def _same_machine(peer: str, request: web.Request) -> bool:
    """Whether a request's peer is this machine: a loopback address, or our own end's."""
    if is_loopback_address(peer):
        return True
    sockname = request.transport.get_extra_info("sockname") if request.transport else None
    return bool(sockname) and sockname[0] == peer


def _node_info(s: Scheduler, n: NodeEntry, now: float) -> NodeInfo:
    used = s.view.used(n.id)
    return NodeInfo(
        node_id=n.id,
        kind=n.kind,
        url=n.url,
        healthy=n.healthy,
        placeable=n.placeable(now),
        engine_ok=n.engine_ok,
        failures=n.failures,
        create_limit=n.create_limit,
        engine_id=n.engine_id,
        heartbeat_age_s=max(0.0, now - n.last_seen),
        capacity=Capacity(
            cpus=n.capacity.cpus, memory_mb=n.capacity.memory_mb, slots=n.capacity.slots
        ),
        usage=Usage(cpus=used.cpus, memory_mb=used.memory_mb, slots=used.slots),
        sandboxes=used.slots,
        images=sorted(n.images),
        drain=s.view.drain_state(n),
    )


async def list_nodes(request: web.Request) -> web.Response:
    s = _client(request)
    now = s.clock.now()
    return model_response(NodeList(nodes=[_node_info(s, n, now) for n in s.view.nodes.values()]))


async def drain_node(request: web.Request) -> web.Response:
    """An operator's drain: no new placements on the node, its idle sandboxes removed,
    its leases run to their end (the policy's rule 9); then it may go."""
    return _request_drain(request, True)


async def undrain_node(request: web.Request) -> web.Response:
    return _request_drain(request, False)


def _request_drain(request: web.Request, requested: bool) -> web.Response:
    s = _admin(request)
    node_id = _node_id_param(request)
    node = s.view.request_drain(node_id, requested)
    if node is None:
        raise ApiError(404, "unknown_node", f"no node {node_id}")
    log.info("node %s: drain %s", node_id, "requested" if requested else "called off")
    s.wake()
    return model_response(_node_info(s, node, s.clock.now()))


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
    name = _name_param(request, "name", "pool name")
    params = await read_model(request, PoolParams)
    s.set_pool(name, params)
    return model_response(_pool_info(s, name))


async def patch_pool(request: web.Request) -> web.Response:
    s = _admin(request)
    name = request.match_info["name"]
    if name not in s.config.pools:
        raise ApiError(404, "unknown_pool", f"no pool named {name!r}")
    patch = await read_model(request, PoolPatch)
    merged = {**s.config.pools[name].model_dump(), **patch.model_dump(exclude_unset=True)}
    try:
        params = PoolParams.model_validate(merged)
    except ValidationError as e:
        raise ApiError(
            422, "validation_error", f"pool {name!r} would be invalid", validation_details(e)
        ) from e
    s.set_pool(name, params)
    return model_response(_pool_info(s, name))


def _template_info(s: Scheduler, name: str) -> TemplateInfo:
    spec = s.config.templates[name]
    states = Counter(str(e.state) for e in s.view.sandboxes.values() if e.template == name)
    return TemplateInfo(
        name=name,
        spec=spec,
        pools=s.pools_keeping(name),
        nodes_with_image=s.nodes_with_image(spec.image),
        distributable=s.image_sent(spec.image),
        sandboxes=dict(states),
    )


def _template_name(request: web.Request) -> str:
    return _name_param(request, "name", "template name")


async def list_templates(request: web.Request) -> web.Response:
    s = _client(request)
    infos = [_template_info(s, name) for name in s.config.templates]
    return model_response(TemplateList(templates=infos))


async def get_template(request: web.Request) -> web.Response:
    s = _client(request)
    name = _template_name(request)
    if name not in s.config.templates:
        raise ApiError(404, "unknown_template", f"no template named {name!r}")
    return model_response(_template_info(s, name))


async def put_template(request: web.Request) -> web.Response:
    s = _admin(request)
    name = _template_name(request)
    body = await read_model(request, TemplateBody)
    if body.name is not None and body.name != name:
        raise ApiError(
            422,
            "template_name_mismatch",
            f"the body names template {body.name!r}, the path {name!r}",
            [{"loc": "name", "msg": "leave it out, or give the path's name"}],
        )
    spec = TemplateSpec(**body.model_dump(exclude={"name"}), name=name)
    created = name not in s.config.templates
    s.set_template(spec)
    return model_response(_template_info(s, name), 201 if created else 200)


async def delete_template(request: web.Request) -> web.Response:
    s = _admin(request)
    name = _template_name(request)
    retired = s.delete_template(name)
    leased = sum(1 for e in retired if e.state in ASSIGNED)
    return model_response(
        TemplateRemoved(name=name, sandboxes_removed=len(retired) - leased, leases_left=leased)
    )


async def prewarm_pool(request: web.Request) -> web.Response:
    s = _client(request)  # a trainer announcing its next burst is a client
    name = request.match_info["name"]
    if name not in s.config.pools:
        raise ApiError(404, "unknown_pool", f"no pool named {name!r}")
    body = await read_model(request, PrewarmRequest)
    token = bearer_token(request)
    owner = client_id(token)
    # an operator's prewarm is its own too, and no client quota bounds it
    quota = None if token_matches(token, s.config.admin_tokens) else s.config.quota_of(owner)
    return model_response(s.prewarm(name, body, owner, quota))


async def prometheus_sd(request: web.Request) -> web.Response:
    s = _metrics_reader(request)  # it lists every agent's address
    groups = [
        {
            # Prometheus takes host:port, and the scheme (https with TLS) as a label
            "targets": [n.url.partition("://")[2]],
            "labels": {
                "__scheme__": n.url.partition("://")[0],
                "node": n.id,
                "kind": n.kind,
                "job": "dsec-agent",
            },
        }
        for n in s.view.nodes.values()
        if n.healthy
    ]
    return web.json_response(groups)


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(_metrics_reader(request).metrics.registry)
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
        "GET",
        "/v1/sandboxes/{sandbox_id}/lease",
        get_lease,
        answer=Lease,
        summary="the lease of a sandbox the caller holds (an operator: any), with its token; "
        'path and schedule_ms say "warm" and 0: the acquire\'s own are not kept',
    )
    api.route(
        "GET",
        "/v1/leases/{lease_id}",
        lease_status,
        answer=LeaseStatus,
        summary="a lease the caller holds or held, and how it ended (kept an hour past its "
        "end): released, expired, idle_timeout, node_lost, engine_lost, container_died, "
        "oom_killed, evicted or setup_failed, and whether that is an infrastructure fault",
    )
    api.route(
        "DELETE",
        "/v1/sandboxes/{sandbox_id}",
        release,
        answer=Released,
        summary="release a leased sandbox; it is removed (or reset and warm again, when "
        "its pool recycles)",
    )
    api.route(
        "POST",
        "/v1/sandboxes/{sandbox_id}/renew",
        renew_lease,
        answer=LeaseRenewed,
        summary="the lease's client is alive: its idle timeout starts again (client token "
        "holding the lease)",
    )
    api.route(
        "POST",
        "/v1/sandboxes/{sandbox_id}/fork",
        fork,
        body=ForkRequest,
        answer=Forked,
        summary="count new leases on copies of the sandbox's work dir and /tmp as they are "
        "now, spread over nodes; all or none (client token with the lease token, or admin)",
    )
    api.route("GET", "/v1/nodes", list_nodes, answer=NodeList, summary="registered nodes")
    api.route(
        "POST",
        "/v1/nodes/{node_id}/drain",
        drain_node,
        answer=NodeInfo,
        summary="drain a node (admin): no new sandboxes there, its idle ones removed, its "
        "leases run to their end; `drain` says drained once it holds none and may go",
    )
    api.route(
        "DELETE",
        "/v1/nodes/{node_id}/drain",
        undrain_node,
        answer=NodeInfo,
        summary="call a node's drain off (admin): it takes new sandboxes again",
    )
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
        "PATCH",
        "/v1/pools/{name}",
        patch_pool,
        body=PoolPatch,
        answer=PoolInfo,
        summary="change some of a pool's parameters (admin): only the fields sent; the "
        "result is checked as a whole, and a bad value changes nothing",
    )
    api.route(
        "GET",
        "/v1/templates",
        list_templates,
        answer=TemplateList,
        summary="templates: each one's settings, the pools keeping it warm, the nodes holding "
        "its image",
    )
    api.route(
        "GET", "/v1/templates/{name}", get_template, answer=TemplateInfo, summary="one template"
    )
    api.route(
        "PUT",
        "/v1/templates/{name}",
        put_template,
        body=TemplateBody,
        answer=TemplateInfo,
        summary="add or change a template live (admin): 201 when new; a change retires the "
        "old one's sandboxes (idle ones go, leases run to their end); 422 when no node holds "
        "its image and the control plane's host has none to send",
    )
    api.route(
        "DELETE",
        "/v1/templates/{name}",
        delete_template,
        answer=TemplateRemoved,
        summary="remove a template live (admin): its idle sandboxes go, its leases run to "
        "their end; 409 while a pool keeps it warm",
    )
    api.route(
        "POST",
        "/v1/pools/{name}/prewarm",
        prewarm_pool,
        body=PrewarmRequest,
        answer=PrewarmInfo,
        summary="announce a burst: count warm sandboxes within within_s, held hold_s more, "
        "then the normal warm target again; replaces this client's last prewarm of the "
        "pool (never another client's), within the client's quota",
    )
    api.route(
        "PUT",
        "/v1/agents/{node_id}",
        agent_heartbeat,
        body=NodeReport,
        answer=ReportAck,
        summary="an agent's registration and heartbeat (that node's own node token): a full "
        "report or a delta, from an address agent_urls allows; the answer says which report "
        "the control plane has applied",
    )
    api.route(
        "POST",
        "/v1/agents/{node_id}/join",
        agent_join,
        answer=NodeIdentity,
        summary="a node joins (its own node token, or the join token): its credentials, "
        "bound to its node id",
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
    identities = Identities.of(config)
    agents = agents or HttpAgents(identities)
    scheduler = build_scheduler(config, agents, clock, cloud=cloud)
    # images go to the agents as their calls do, trusting what those trust (TLS)
    verify = agents.verify if isinstance(agents, HttpAgents) else True
    images = scheduler.images = ImageDistributor(scheduler, identities, verify)
    app = new_app(controlplane_api())
    app[SCHEDULER] = scheduler
    app[IDENTITIES] = identities

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        await agents.start()
        await images.start()
        loops = [
            asyncio.create_task(scheduler.run_forever(), name="scheduler"),
            asyncio.create_task(images.run_forever(), name="images"),
        ]
        yield
        await cancel_and_wait(*loops)
        await images.close()
        if cloud is not None:
            await cloud.close()
        await scheduler.drain()
        await agents.close()

    app.cleanup_ctx.append(lifecycle)
    return app
