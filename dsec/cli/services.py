"""`dsec controlplane`, `dsec agent` and `dsec status`: the services alone, and a look at
a running pool."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

import aiohttp
from pydantic import ValidationError

from dsec.cli.common import (
    DASHBOARD_HINT,
    DEFAULT_STATE_DIR,
    UsageError,
    describe,
    env_token,
    format_table,
)
from dsec.models import Capacity

# --- dsec controlplane ---------------------------------------------------------


def cmd_controlplane(args: argparse.Namespace) -> int:
    from controlplane.app import create_controlplane_app
    from controlplane.cloud import LocalCloudProvider
    from controlplane.config import ControlPlaneConfig
    from dsec.clock import SystemClock
    from dsec.httpkit import serve, stop_on_signals

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
    if args.host:
        data["host"] = args.host
    if args.port is not None:
        data["port"] = args.port
    try:
        config = ControlPlaneConfig.model_validate(data)
    except ValidationError as e:
        raise UsageError(f"invalid control plane config: {describe(e)}") from e

    async def main() -> None:
        cloud = None
        if config.cloud is not None:
            cloud = LocalCloudProvider(config.cloud, config.agent_token)
        app = create_controlplane_app(config, SystemClock(), cloud)

        def listening(url: str) -> None:
            if cloud is not None:
                cloud.controlplane_url = url  # where its cloud agents register

        await serve(app, config.host, config.port, stop_on_signals(), listening)

    asyncio.run(main())
    return 0


# --- dsec agent ----------------------------------------------------------------


def cmd_agent(args: argparse.Namespace) -> int:
    import docker

    from agent.app import Agent, AgentConfig, create_agent_app
    from agent.docker_driver import AsyncDocker, DockerDriver
    from agent.metrics import AgentMetrics
    from dsec.clock import SystemClock
    from dsec.httpkit import serve, stop_on_signals

    try:
        config = AgentConfig(
            node_id=args.node_id,
            kind=args.kind,
            host=args.host,
            port=args.port,
            capacity=Capacity(cpus=args.cpus, memory_mb=args.memory_mb, slots=args.slots),
            controlplane_url=args.controlplane,
            agent_token=env_token("DSEC_AGENT_TOKEN"),
            state_dir=args.state_dir,
            heartbeat_s=args.heartbeat_s,
            cleanup_on_exit=args.cleanup_on_exit,
        )
    except ValidationError as e:
        raise UsageError(f"invalid agent settings: {describe(e)}") from e
    try:
        client = docker.from_env(max_pool_size=48)
        client.ping()
    except docker.errors.DockerException as e:
        raise UsageError(f"the Docker engine is not reachable: {e}") from e

    async def main() -> None:
        clock = SystemClock()
        metrics = AgentMetrics(config.node_id)
        driver = AsyncDocker(DockerDriver(client), clock, metrics.observe_docker)
        agent = Agent(config, driver, clock, metrics)
        app = create_agent_app(agent)
        await serve(app, config.host, config.port, stop_on_signals(), agent.listening_at)

    asyncio.run(main())
    return 0


# --- dsec status ---------------------------------------------------------------


def cmd_status(args: argparse.Namespace) -> int:
    url = (args.url or os.environ.get("DSEC_URL") or "http://127.0.0.1:8700").rstrip("/")
    token = env_token("DSEC_ADMIN_TOKEN", "DSEC_TOKEN")

    async def fetch() -> tuple[dict, dict]:
        headers = {"Authorization": f"Bearer {token}"}
        async with aiohttp.ClientSession(headers=headers) as http:
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
            ["node", "kind", "healthy", "sandboxes", "slots", "cpus", "url"],
            [
                [
                    n["node_id"],
                    n["kind"],
                    n["healthy"],
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


def register(sub: argparse._SubParsersAction) -> None:
    """Add `dsec controlplane`, `dsec agent` and `dsec status`."""
    cp = sub.add_parser("controlplane", help="run the control plane alone")
    cp.add_argument("--config", help="JSON file: pools, templates, timers")
    cp.add_argument("--host")
    cp.add_argument("--port", type=int)
    cp.set_defaults(run=cmd_controlplane)

    ag = sub.add_parser("agent", help="run a node's launcher agent")
    ag.add_argument("--node-id", required=True)
    ag.add_argument("--kind", choices=["local", "cloud"], default="local")
    ag.add_argument("--host", default="127.0.0.2")
    ag.add_argument("--port", type=int, default=8701)
    ag.add_argument("--controlplane", help="control plane URL to register with")
    ag.add_argument("--cpus", type=float, default=16)
    ag.add_argument("--memory-mb", type=int, default=65536)
    ag.add_argument("--slots", type=int, default=64)
    ag.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR)
    ag.add_argument("--heartbeat-s", type=float, default=1.0)
    ag.add_argument(
        "--cleanup-on-exit",
        action="store_true",
        help="remove this node's sandboxes when the agent stops",
    )
    ag.set_defaults(run=cmd_agent)

    st = sub.add_parser("status", help="nodes and sandboxes of a running pool")
    st.add_argument("--url", help="control plane URL (default $DSEC_URL)")
    st.add_argument("--json", action="store_true")
    st.set_defaults(run=cmd_status)
