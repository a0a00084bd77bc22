"""`dsec controlplane`, `dsec agent` and `dsec status`: the services alone, and a look at
a running pool."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import ssl
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
from pydantic import ValidationError

from agent.config import AgentConfig
from dsec.addresses import advertised_url, listens_everywhere
from dsec.cli.common import (
    DASHBOARD_HINT,
    DEFAULT_STATE_DIR,
    UsageError,
    checked_advertise_url,
    describe,
    env_token,
    format_table,
)
from dsec.models import Capacity
from dsec.tls import TlsFiles

if TYPE_CHECKING:  # the commands import the server kit where they serve, as they do the rest
    from dsec.httpkit import ServerLimits

# Both services hand work to threads (the agent's store, SQLite, on a thread of its
# own; file copies). Python's default 5 ms switch interval lets a woken thread keep the
# loop waiting that long for the GIL; at 0.5 ms a warm acquire's p99 fell from 15-20 ms
# to 7 ms (warm acquires one at a time from an idle 3-node pool on 2 cores).
SERVICE_SWITCH_INTERVAL_S = 0.0005


def run_service(main: Coroutine[Any, Any, None]) -> None:
    sys.setswitchinterval(SERVICE_SWITCH_INTERVAL_S)
    asyncio.run(main)


# --- dsec controlplane ---------------------------------------------------------


def cmd_controlplane(args: argparse.Namespace) -> int:
    from controlplane.agents import HttpAgents
    from controlplane.app import create_controlplane_app
    from controlplane.cloud import cloud_provider
    from controlplane.config import ControlPlaneConfig
    from controlplane.identities import Identities, load_or_make_key
    from dsec.clock import SystemClock
    from dsec.httpkit import ServerLimits, serve, stop_on_signals

    data = {}
    if args.config:
        try:
            data = json.loads(Path(args.config).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise UsageError(f"cannot read config {args.config}: {e}") from e
    data.update(
        admin_tokens=[env_token("DSEC_ADMIN_TOKEN")],
        client_tokens=[t for t in os.environ.get("DSEC_TOKEN", "").split(",") if t],
        agent_token=env_token("DSEC_AGENT_TOKEN"),
    )
    if "identity_key" not in data and isinstance(data.get("state_dir"), str):
        # kept across restarts: the nodes' credentials and the lease tokens still hold
        try:
            data["identity_key"] = load_or_make_key(Path(data["state_dir"]))
        except (OSError, ValueError) as e:
            raise UsageError(f"cannot keep the control plane's key: {e}") from e
    if os.environ.get("DSEC_METRICS_TOKEN"):
        data["metrics_token"] = os.environ["DSEC_METRICS_TOKEN"]
    if args.require_metrics_token is not None:
        data["require_metrics_token"] = args.require_metrics_token
    if args.host:
        data["host"] = args.host
    if args.port is not None:
        data["port"] = args.port
    try:
        config = ControlPlaneConfig.model_validate(data)
    except ValidationError as e:
        raise UsageError(f"invalid control plane config: {describe(e)}") from e
    tls, server_ssl = _tls(args)
    advertise = checked_advertise_url(args.advertise_url, "https" if tls.serving else "http")
    if config.cloud is not None and listens_everywhere(config.host) and advertise is None:
        # its cloud agents register where it says it is
        raise UsageError(
            f"--host {config.host} listens on every address, which is no address for cloud "
            "agents to register at: say which with --advertise-url"
        )
    limits = ServerLimits()
    _raise_open_files_limit(limits.max_connections + limits.max_unauthenticated + FDS_SPARE)

    async def main() -> None:
        cloud = None
        if config.cloud is not None:
            cloud = cloud_provider(
                config.cloud, Identities.of(config), config.metrics_token, tls=tls
            )
        agents = HttpAgents(Identities.of(config), verify=tls.client_ssl())
        app = create_controlplane_app(config, SystemClock(), cloud, agents=agents)

        def listening(url: str) -> None:
            if cloud is not None:
                # where its cloud agents register
                cloud.controlplane_url = advertised_url(url, advertise)

        await serve(
            app,
            config.host,
            config.port,
            stop_on_signals(),
            listening,
            ssl_context=server_ssl,
            limits=limits,
        )

    run_service(main())
    return 0


# --- dsec agent ----------------------------------------------------------------


# a command holds its client's connection and one to the engine; the rest is the agent's
FDS_PER_EXEC, FDS_SPARE = 2, 1024
SPARE_CONNECTIONS = 256  # an agent's beyond its commands': the control plane's (64), files


def agent_server_limits(config: AgentConfig) -> ServerLimits:
    """What `dsec agent` serves within: a command holds a connection; the rest are the
    control plane's and files'."""
    from dsec.httpkit import ServerLimits

    return ServerLimits(max_connections=config.execs_per_node + SPARE_CONNECTIONS)


def _raise_open_files_limit(wanted: int) -> None:
    """Lift the soft limit on open files towards `wanted` (up to the hard limit): many
    systems start processes at 1024, fewer than a node's commands need at once."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def cmd_agent(args: argparse.Namespace) -> int:
    import docker

    from agent.app import create_agent_app
    from agent.docker_driver import AsyncDocker
    from agent.metrics import AgentMetrics
    from agent.node import Agent
    from dsec.clock import SystemClock
    from dsec.httpkit import serve, stop_on_signals

    tls, server_ssl = _tls(args)
    if tls.serving and (args.controlplane or "").startswith("http://"):
        raise UsageError("an agent serving TLS reports over TLS: --controlplane must be https")
    advertise = checked_advertise_url(args.advertise_url, "https" if tls.serving else "http")
    try:
        config = AgentConfig(
            node_id=args.node_id,
            kind=args.kind,
            host=args.host,
            port=args.port,
            advertise_url=advertise,
            capacity=Capacity(cpus=args.cpus, memory_mb=args.memory_mb, slots=args.slots),
            controlplane_url=args.controlplane,
            # its own node token, or the pool's join token (controlplane/identities.py)
            agent_token=env_token("DSEC_NODE_TOKEN", "DSEC_AGENT_TOKEN"),
            state_dir=args.state_dir,
            loops_dir=args.loops_dir,
            heartbeat_s=args.heartbeat_s,
            cleanup_on_exit=args.cleanup_on_exit,
            execs_per_sandbox=args.execs_per_sandbox,
            execs_per_node=args.execs_per_node,
            container_check_s=args.container_check_s,
            sandbox_uid_base=args.sandbox_uid_base,
            sandbox_uid_count=args.sandbox_uid_count,
            metrics_token=os.environ.get("DSEC_METRICS_TOKEN") or None,
            require_metrics_token=args.require_metrics_token,
            audit_max_bytes=args.audit_max_bytes,
            audit_files=args.audit_files,
            output_budget_bytes=args.output_budget_bytes,
            relay_bytes_per_cpu_s=args.relay_bytes_per_cpu_s,
            ca=tls.ca,
        )
    except ValidationError as e:
        raise UsageError(f"invalid agent settings: {describe(e)}") from e
    try:
        client = docker.from_env()  # a clear message now rather than a failing node
        client.ping()
        _ensure_base_image(client)
        client.close()
    except docker.errors.DockerException as e:
        raise UsageError(f"the Docker engine is not reachable: {e}") from e

    limits = agent_server_limits(config)
    _raise_open_files_limit(
        FDS_PER_EXEC * config.execs_per_node + limits.max_unauthenticated + FDS_SPARE
    )

    async def main() -> None:
        clock = SystemClock()
        metrics = AgentMetrics(config.node_id)
        driver = AsyncDocker(clock, metrics.observe_docker)
        agent = Agent(config, driver, clock, metrics)
        app = create_agent_app(agent)
        await serve(
            app,
            config.host,
            config.port,
            stop_on_signals(),
            lambda url: agent.listening_at(config.advertised(url)),
            ssl_context=server_ssl,
            limits=limits,
        )

    run_service(main())
    return 0


def _ensure_base_image(client) -> None:
    """The default template's image on this node's engine, built if missing (a node of
    a multi-host pool has no `dsec up` to build it); without a static busybox the node
    serves templates of the images it has, and says so."""
    from dsec.image import ImageBuildError, ensure_base_image

    try:
        if ensure_base_image(client):
            print("dsec agent: built the base template image", file=sys.stderr, flush=True)
    except ImageBuildError as e:
        print(f"dsec agent: no base template image on this node: {e}", file=sys.stderr)


# --- dsec status ---------------------------------------------------------------


def cmd_status(args: argparse.Namespace) -> int:
    url = (args.url or os.environ.get("DSEC_URL") or "http://127.0.0.1:8700").rstrip("/")
    token = env_token("DSEC_ADMIN_TOKEN", "DSEC_TOKEN")
    tls, _ = _tls(args)

    async def fetch() -> tuple[dict, dict]:
        headers = {"Authorization": f"Bearer {token}"}
        connector = aiohttp.TCPConnector(ssl=tls.client_ssl())
        async with aiohttp.ClientSession(headers=headers, connector=connector) as http:
            out = []
            for path in ("/v1/nodes", "/v1/sandboxes"):
                async with http.get(url + path, timeout=aiohttp.ClientTimeout(total=10)) as r:
                    body = await r.json(content_type=None)
                    if r.status >= 300:
                        raise UsageError(f"{url}{path}: {r.status} {body.get('error', body)}")
                    out.append(body)
            return out[0], out[1]

    try:
        nodes, sandboxes = asyncio.run(fetch())
    except (aiohttp.ClientError, TimeoutError) as e:
        print(f"dsec status: cannot reach the control plane at {url}: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"url": url, **nodes, **sandboxes}))
        return 0
    print(f"control plane {url}")
    print(f"metrics       {url}/metrics  (agents: {url}/v1/sd/prometheus)")
    print(f"dashboard     {DASHBOARD_HINT}\n")
    print(
        format_table(
            ["node", "kind", "healthy", "drain", "sandboxes", "slots", "cpus", "url"],
            [
                [
                    n["node_id"],
                    n["kind"],
                    n["healthy"],
                    n.get("drain", "none"),
                    n["sandboxes"],
                    n["capacity"]["slots"],
                    f"{n['usage']['cpus']:g}/{n['capacity']['cpus']:g}",
                    n["url"],
                ]
                for n in nodes["nodes"]
            ],
        )
    )
    print()
    print(
        format_table(
            ["sandbox", "node", "pool", "template", "state"],
            [
                [s["id"], s["node"], s["pool"], s["template"], s["state"]]
                for s in sandboxes["sandboxes"]
            ],
        )
    )
    return 0


# --- the parsers ---------------------------------------------------------------


def _metrics_flags(parser: argparse.ArgumentParser, who_else: str) -> None:
    """--metrics-token-required and --open-metrics; neither: a token is required when
    DSEC_METRICS_TOKEN is set."""
    flags = parser.add_mutually_exclusive_group()
    flags.add_argument(
        "--metrics-token-required",
        dest="require_metrics_token",
        action="store_const",
        const=True,
        help=f"/metrics needs DSEC_METRICS_TOKEN{who_else} (the default when it is set)",
    )
    flags.add_argument(
        "--open-metrics",
        dest="require_metrics_token",
        action="store_const",
        const=False,
        help="/metrics needs no token, even when DSEC_METRICS_TOKEN is set",
    )


def _tls_flags(parser: argparse.ArgumentParser, serves: bool = True) -> None:
    """--ca, and for a service --tls-cert and --tls-key."""
    if serves:
        parser.add_argument(
            "--tls-cert", type=Path, help="serve HTTPS with this certificate (PEM, chain after it)"
        )
        parser.add_argument("--tls-key", type=Path, help="the certificate's private key (PEM)")
    else:
        parser.set_defaults(tls_cert=None, tls_key=None)
    parser.add_argument(
        "--ca",
        type=Path,
        help="CA bundle (PEM) that verifies the services called over HTTPS "
        "(default $DSEC_CA; neither: the system's roots)",
    )


def _tls(args: argparse.Namespace) -> tuple[TlsFiles, ssl.SSLContext | None]:
    """The TLS files the flags name, and the server context made of them: a missing or
    unreadable file is a usage error now, not a service that fails on its first call."""
    ca = args.ca or os.environ.get("DSEC_CA") or None
    try:
        files = TlsFiles(args.tls_cert, args.tls_key, Path(ca) if ca else None)
        server_ssl = files.server_context()
        files.client_ssl()  # the CA bundle parses
    except (ValueError, OSError) as e:  # ssl.SSLError is an OSError
        raise UsageError(f"TLS: {e}") from e
    return files, server_ssl


def register(sub: argparse._SubParsersAction) -> None:
    """Add `dsec controlplane`, `dsec agent` and `dsec status`."""
    cp = sub.add_parser("controlplane", help="run the control plane alone")
    cp.add_argument("--config", help="JSON file: pools, templates, timers")
    cp.add_argument("--host")
    cp.add_argument("--port", type=int)
    cp.add_argument(
        "--advertise-url",
        help="where agents and clients reach it (http(s)://host[:port]), when it is not the "
        "address it listens on (--host 0.0.0.0, a NAT, a proxy): its cloud agents register "
        "there",
    )
    _metrics_flags(cp, " or an admin token, and so does /v1/sd/prometheus")
    _tls_flags(cp)
    cp.set_defaults(run=cmd_controlplane)

    ag = sub.add_parser("agent", help="run a node's launcher agent")
    ag.add_argument("--node-id", required=True)
    ag.add_argument("--kind", choices=["local", "cloud"], default="local")
    ag.add_argument("--host", default="127.0.0.2", help="address it listens on")
    ag.add_argument("--port", type=int, default=8701)
    ag.add_argument(
        "--advertise-url",
        help="where the control plane and clients reach it (http(s)://host[:port]; without "
        "a port, the one it listens on): needed with --host 0.0.0.0, or behind a NAT",
    )
    ag.add_argument("--controlplane", help="control plane URL to register with")
    ag.add_argument("--cpus", type=float, default=16)
    ag.add_argument("--memory-mb", type=int, default=65536)
    ag.add_argument("--slots", type=int, default=64)
    ag.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR)
    ag.add_argument(
        "--loops-dir",
        type=Path,
        help="where the command loops' pipes and scripts go, best a tmpfs (default: a "
        "directory of the state dir's own under /dev/shm, else the state dir)",
    )
    ag.add_argument("--heartbeat-s", type=float, default=1.0)
    ag.add_argument(
        "--cleanup-on-exit",
        action="store_true",
        help="remove this node's sandboxes when the agent stops",
    )
    ag.add_argument(
        "--execs-per-sandbox",
        type=int,
        default=AgentConfig.model_fields["execs_per_sandbox"].default,
        help="commands one sandbox runs at once; more answer 429",
    )
    ag.add_argument(
        "--execs-per-node",
        type=int,
        default=AgentConfig.model_fields["execs_per_node"].default,
        help="commands this node runs at once; more answer 429",
    )
    ag.add_argument(
        "--container-check-s",
        type=float,
        default=AgentConfig.model_fields["container_check_s"].default,
        help="how often the node looks for containers that died under their sandboxes",
    )
    ag.add_argument(
        "--sandbox-uid-base",
        type=int,
        default=None,
        help="the first uid of this node's range, one uid per sandbox (default: from the node id)",
    )
    ag.add_argument(
        "--sandbox-uid-count",
        type=int,
        default=AgentConfig.model_fields["sandbox_uid_count"].default,
        help="uids in that range",
    )
    ag.add_argument(
        "--audit-max-bytes",
        type=int,
        default=AgentConfig.model_fields["audit_max_bytes"].default,
        help="the audit log's size at which it is rotated",
    )
    ag.add_argument(
        "--audit-files",
        type=int,
        default=AgentConfig.model_fields["audit_files"].default,
        help="audit log files kept, the current one included",
    )
    ag.add_argument(
        "--output-budget-bytes",
        type=int,
        default=AgentConfig.model_fields["output_budget_bytes"].default,
        help="commands' output held in memory at once, shared fairly between clients; a "
        "command with no room waits, its pipe full",
    )
    ag.add_argument(
        "--relay-bytes-per-cpu-s",
        type=int,
        default=AgentConfig.model_fields["relay_bytes_per_cpu_s"].default,
        help="a sandbox's output relayed per second for each CPU of its template",
    )
    _metrics_flags(ag, "")
    _tls_flags(ag)
    ag.set_defaults(run=cmd_agent)

    st = sub.add_parser("status", help="nodes and sandboxes of a running pool")
    st.add_argument("--url", help="control plane URL (default $DSEC_URL)")
    st.add_argument("--json", action="store_true")
    _tls_flags(st, serves=False)
    st.set_defaults(run=cmd_status)
