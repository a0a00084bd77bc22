"""The `dsec` command line: up, controlplane, agent, status, plan, bench."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from pathlib import Path

import aiohttp
from pydantic import ValidationError

from bench.calibrate import add_calibrate_arguments, run_calibrate
from bench.fidelity import add_fidelity_arguments, run_fidelity
from bench.generate import add_generate_arguments, run_generate
from bench.replay import add_compare_arguments, add_replay_arguments, run_compare, run_replay
from bench.sweep import add_sweep_arguments, run_sweep
from dsec.httpkit import validation_details
from dsec.models import Capacity, PoolParams
from dsec.plan import add_plan_arguments, run_plan

DEFAULT_STATE_DIR = Path.home() / ".dsec"
DASHBOARD_HINT = (
    "http://127.0.0.1:3000/d/dsec-overview once `cd deploy && docker compose up -d` runs "
    "Grafana (deploy/README.md)"
)


class UsageError(Exception):
    """Bad input on the command line: printed as one line, exit code 2."""


def format_table(headers: list[str], rows: list[list[object]]) -> str:
    cells = [headers] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells)


def _env_token(*names: str) -> str:
    for name in names:
        if os.environ.get(name):
            return os.environ[name]
    raise UsageError(f"set {' or '.join(names)} (the credential for this command)")


def _describe(e: ValidationError) -> str:
    return "; ".join(f"{d['loc'] or 'value'}: {d['msg']}" for d in validation_details(e))


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
        admin_tokens=[_env_token("DSEC_ADMIN_TOKEN")],
        client_tokens=[t for t in os.environ.get("DSEC_TOKEN", "").split(",") if t],
        agent_token=_env_token("DSEC_AGENT_TOKEN"),
    )
    if args.host:
        data["host"] = args.host
    if args.port is not None:
        data["port"] = args.port
    try:
        config = ControlPlaneConfig.model_validate(data)
    except ValidationError as e:
        raise UsageError(f"invalid control plane config: {_describe(e)}") from e

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
            agent_token=_env_token("DSEC_AGENT_TOKEN"),
            state_dir=args.state_dir,
            heartbeat_s=args.heartbeat_s,
            cleanup_on_exit=args.cleanup_on_exit,
        )
    except ValidationError as e:
        raise UsageError(f"invalid agent settings: {_describe(e)}") from e
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


# --- dsec up -------------------------------------------------------------------


def cmd_up(args: argparse.Namespace) -> int:
    from dsec.httpkit import stop_on_signals
    from dsec.localpool import LocalPool, LocalPoolError, LocalPoolSpec

    if not 1 <= args.nodes <= 250:
        raise UsageError(f"--nodes must be between 1 and 250, got {args.nodes}")
    try:
        capacity = Capacity(
            cpus=args.cpus_per_node, memory_mb=args.memory_mb_per_node, slots=args.slots_per_node
        )
        params = PoolParams(min_warm=args.min_warm, max_warm=max(args.min_warm, 64))
    except ValidationError as e:
        raise UsageError(_describe(e)) from e
    spec = LocalPoolSpec(
        name=args.name,
        nodes=args.nodes,
        port=args.port,
        capacity=capacity,
        pool=params,
        state_dir=args.state_dir,
    )

    async def main() -> int:
        stop = stop_on_signals()
        pool = LocalPool(spec)
        try:
            async with pool:
                summary = pool.summary()
                if args.json:
                    print(json.dumps(summary), flush=True)
                else:
                    _print_summary(summary)
                why = await pool.wait(stop)
        except LocalPoolError as e:  # raised by the start only
            print(f"dsec up: {e}", file=sys.stderr)
            return 1
        print(f"dsec up: {why}; stopped (swept {pool.swept} leftover containers)", file=sys.stderr)
        return 0 if why == "stopped" else 1

    return asyncio.run(main())


def _print_summary(summary: dict) -> None:
    print(f"control plane  {summary['url']}")
    print(format_table(["node", "url"], [[n["node_id"], n["url"]] for n in summary["nodes"]]))
    print(f"metrics        {summary['metrics']}")
    print(f"prometheus sd  {summary['service_discovery']}")
    print(f"dashboard      {DASHBOARD_HINT}")
    print(f"credentials    source {summary['env_file']}")
    print("Ctrl-C stops the pool and removes every sandbox it made.", flush=True)


# --- dsec status ---------------------------------------------------------------


def cmd_status(args: argparse.Namespace) -> int:
    url = (args.url or os.environ.get("DSEC_URL") or "http://127.0.0.1:8700").rstrip("/")
    token = _env_token("DSEC_ADMIN_TOKEN", "DSEC_TOKEN")

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


# --- the parser ----------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsec", description=__doc__)
    parser.add_argument("--log-level", default=os.environ.get("DSEC_LOG_LEVEL", "WARNING"))
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run a local multi-node pool until Ctrl-C")
    up.add_argument("--nodes", type=int, default=3)
    up.add_argument("--name", default="dsec", help="prefix of the node ids; one per pool")
    up.add_argument("--port", type=int, default=8700, help="control plane port (0: any)")
    up.add_argument("--slots-per-node", type=int, default=64)
    up.add_argument("--cpus-per-node", type=float, default=16)
    up.add_argument("--memory-mb-per-node", type=int, default=65536)
    up.add_argument("--min-warm", type=int, default=4, help="warm sandboxes in pool 'default'")
    up.add_argument(
        "--cloud-nodes",
        type=int,
        default=0,
        help="cloud nodes the pool may start when local nodes pass 80%% utilisation",
    )
    up.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR)
    up.add_argument("--json", action="store_true", help="print where things are as JSON")
    up.set_defaults(run=cmd_up)

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

    pl = sub.add_parser(
        "plan", help="size a sandbox pool for a training run (--simulate: check it in the sim)"
    )
    add_plan_arguments(pl)
    pl.set_defaults(run=run_plan)

    bench = sub.add_parser("bench", help="traces, replay, simulation")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    for name, help_, add_arguments, run in (
        ("generate", "write a synthetic or imported trace", add_generate_arguments, run_generate),
        ("replay", "replay a trace live or in the simulator", add_replay_arguments, run_replay),
        ("compare", "compare replay reports", add_compare_arguments, run_compare),
        ("sweep", "sweep pool parameters in the simulator", add_sweep_arguments, run_sweep),
        ("fidelity", "the simulator against a live replay", add_fidelity_arguments, run_fidelity),
        ("calibrate", "measure Docker into a sim profile", add_calibrate_arguments, run_calibrate),
    ):
        command = bench_sub.add_parser(name, help=help_)
        add_arguments(command)
        command.set_defaults(run=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    try:
        return args.run(args)
    except UsageError as e:
        print(f"dsec {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
