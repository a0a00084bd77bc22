"""`dsec up`: a control plane and N agents on loopback, as child processes.

Each part is the same process `dsec controlplane` or `dsec agent` would start, so
the local pool exercises the real HTTP paths. Ctrl-C or SIGTERM stops the agents
(which remove their sandboxes), then the control plane, then sweeps Docker for any
container still labelled with one of its nodes. LocalPool is also how the benchmarks
and the tests start a pool.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import docker
from pydantic import ValidationError

from agent.docker_driver import LABEL_NODE
from controlplane.cloud import CloudConfig
from controlplane.config import ControlPlaneConfig, default_templates
from dsec.baselines import PolicyName
from dsec.cli.common import DASHBOARD_HINT, DEFAULT_STATE_DIR, UsageError, describe, format_table
from dsec.image import ensure_base_image
from dsec.models import Capacity, PoolParams, TemplateSpec
from dsec.processes import agent_args, dsec_argv, stop_process
from dsec.tokens import new_token

READY_TIMEOUT_S = 60.0


class LocalPoolError(RuntimeError):
    pass


@dataclass
class LocalPoolSpec:
    name: str = "dsec"
    nodes: int = 3
    port: int = 8700
    capacity: Capacity = field(default_factory=lambda: Capacity(cpus=16, memory_mb=65536, slots=64))
    pool: PoolParams = field(default_factory=PoolParams)
    state_dir: Path = field(default_factory=lambda: Path.home() / ".dsec")
    heartbeat_s: float = 1.0
    tick_s: float = 0.25
    cloud_nodes: int = 0  # started by the control plane only when overflow needs them
    cloud_boot_delay_s: float = 2.0
    cloud_idle_release_s: float = 60.0
    policy: PolicyName = "dsec"  # or one of the baselines
    templates: dict[str, TemplateSpec] = field(default_factory=default_templates)


@dataclass
class Child:
    name: str
    args: list[str]
    proc: asyncio.subprocess.Process
    url: str = ""
    drain: asyncio.Task | None = None


@dataclass
class Tokens:
    client: str
    admin: str
    agent: str

    @classmethod
    def from_env_or_new(cls) -> Tokens:
        return cls(
            client=os.environ.get("DSEC_TOKEN") or new_token(),
            admin=os.environ.get("DSEC_ADMIN_TOKEN") or new_token(),
            agent=os.environ.get("DSEC_AGENT_TOKEN") or new_token(),
        )

    def env(self) -> dict[str, str]:
        return {
            "DSEC_TOKEN": self.client,
            "DSEC_ADMIN_TOKEN": self.admin,
            "DSEC_AGENT_TOKEN": self.agent,
        }


class LocalPool:
    def __init__(self, spec: LocalPoolSpec) -> None:
        self.spec = spec
        self.dir = spec.state_dir / spec.name
        self.tokens = Tokens.from_env_or_new()
        self.controlplane: Child | None = None
        self.agents: list[Child] = []
        self.node_ids = [f"{spec.name}-{i}" for i in range(1, spec.nodes + 1)]
        self.cloud_prefix = f"{spec.name}-cloud"
        self.cloud_node_ids = [f"{self.cloud_prefix}-{i}" for i in range(1, spec.cloud_nodes + 1)]
        self.swept = 0  # leftover containers the last stop() removed

    async def __aenter__(self) -> LocalPool:
        """Started. However the block ends, the pool is stopped on the way out; a start
        that fails half-way stops the children it had already started."""
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def env_file(self) -> Path:
        return self.dir / "env"

    @property
    def url(self) -> str:
        assert self.controlplane is not None
        return self.controlplane.url

    async def start(self) -> None:
        await asyncio.to_thread(self._prepare_docker)
        self.dir.mkdir(parents=True, exist_ok=True)
        config = ControlPlaneConfig(
            port=self.spec.port,
            client_tokens=[self.tokens.client],
            admin_tokens=[self.tokens.admin],
            agent_token=self.tokens.agent,
            pools={"default": self.spec.pool},
            templates=self.spec.templates,
            state_dir=self.dir,
            tick_s=self.spec.tick_s,
            policy=self.spec.policy,
            cloud=None
            if not self.spec.cloud_nodes
            else CloudConfig(
                max_nodes=self.spec.cloud_nodes,
                node_prefix=self.cloud_prefix,
                boot_delay_s=self.spec.cloud_boot_delay_s,
                idle_release_s=self.spec.cloud_idle_release_s,
                capacity=self.spec.capacity,
                state_dir=self.dir,
                heartbeat_s=self.spec.heartbeat_s,
            ),
        )
        config_path = self.dir / "controlplane.json"
        # tokens reach the children through the environment, not the config file
        config_path.write_text(
            config.model_dump_json(
                indent=2, exclude={"client_tokens", "admin_tokens", "agent_token"}
            )
        )
        self.controlplane = await self._spawn(
            "controlplane", ["controlplane", "--config", str(config_path)]
        )
        for i, node_id in enumerate(self.node_ids, start=1):
            args = agent_args(
                node_id,
                host=f"127.0.0.{i + 1}",
                controlplane=self.url,
                capacity=self.spec.capacity,
                state_dir=self.dir,
                heartbeat_s=self.spec.heartbeat_s,
            )
            self.agents.append(await self._spawn(node_id, args))
        await self._wait_registered()
        self._write_env_file()

    def _prepare_docker(self) -> None:
        try:
            client = docker.from_env()
            client.ping()
        except docker.errors.DockerException as e:
            raise LocalPoolError(
                f"the Docker engine is not reachable ({e}); start it, for example "
                "`dockerd --bridge=none --iptables=false &`"
            ) from e
        ensure_base_image(client)

    async def _spawn(self, name: str, args: list[str]) -> Child:
        proc = await asyncio.create_subprocess_exec(
            *dsec_argv(*args),
            stdout=asyncio.subprocess.PIPE,
            env={**os.environ, **self.tokens.env()},
            start_new_session=True,  # Ctrl-C reaches us alone; we stop the children in order
        )  # fmt: skip
        child = Child(name, args, proc)
        assert proc.stdout is not None
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), READY_TIMEOUT_S)
            child.url = json.loads(line)["url"]
        except (TimeoutError, ValueError, KeyError) as e:
            await self._stop_child(child)
            raise LocalPoolError(f"{name} did not start (exit code {proc.returncode})") from e
        child.drain = asyncio.create_task(proc.stdout.read())  # never let its pipe fill
        return child

    async def _wait_registered(self) -> None:
        headers = {"Authorization": f"Bearer {self.tokens.admin}"}
        async with aiohttp.ClientSession(headers=headers) as http:
            for _ in range(int(READY_TIMEOUT_S / 0.1)):
                async with http.get(f"{self.url}/v1/nodes") as resp:
                    nodes = (await resp.json())["nodes"]
                if {n["node_id"] for n in nodes if n["healthy"]} >= set(self.node_ids):
                    return
                await asyncio.sleep(0.1)
        raise LocalPoolError("the agents did not register with the control plane in time")

    def _write_env_file(self) -> None:
        lines = [f"export DSEC_URL={self.url}"] + [
            f"export {k}={v}" for k, v in self.tokens.env().items()
        ]
        self.env_file.touch(mode=0o600)
        self.env_file.write_text("\n".join(lines) + "\n")

    def summary(self) -> dict:
        return {
            "url": self.url,
            "metrics": f"{self.url}/metrics",
            "service_discovery": f"{self.url}/v1/sd/prometheus",
            "env_file": str(self.env_file),
            "nodes": [{"node_id": a.name, "url": a.url} for a in self.agents],
        }

    async def restart_agent(self, child: Child) -> Child:
        """Start an agent again on the address it had (after it stopped or was killed)."""
        await self._stop_child(child)
        args = list(child.args)
        args[args.index("--port") + 1] = child.url.rsplit(":", 1)[1]
        fresh = await self._spawn(child.name, args)
        self.agents[self.agents.index(child)] = fresh
        return fresh

    async def wait(self, stop: asyncio.Event) -> str:
        """Until `stop` is set or a child dies; returns why."""
        waits = {asyncio.create_task(stop.wait()): "stopped"}
        for child in [self.controlplane, *self.agents]:
            if child is not None:
                waits[asyncio.create_task(child.proc.wait())] = f"{child.name} exited"
        done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        return waits[done.pop()]

    async def stop(self) -> int:
        """Stop everything; returns how many leftover containers the sweep removed."""
        await asyncio.gather(*(self._stop_child(a) for a in self.agents))
        if self.controlplane is not None:
            await self._stop_child(self.controlplane)
        self.swept = await asyncio.to_thread(self._sweep_containers)
        return self.swept

    async def _stop_child(self, child: Child) -> None:
        await stop_process(child.proc)
        if child.drain is not None:
            with contextlib.suppress(Exception):
                await child.drain

    def _sweep_containers(self) -> int:
        client = docker.from_env()
        removed = 0
        for node_id in self.node_ids + self.cloud_node_ids:
            for c in client.containers.list(all=True, filters={"label": f"{LABEL_NODE}={node_id}"}):
                with contextlib.suppress(docker.errors.NotFound):
                    c.remove(force=True)
                    removed += 1
        return removed


# --- dsec up -------------------------------------------------------------------


def cmd_up(args: argparse.Namespace) -> int:
    from dsec.httpkit import stop_on_signals

    if not 1 <= args.nodes <= 250:
        raise UsageError(f"--nodes must be between 1 and 250, got {args.nodes}")
    try:
        capacity = Capacity(
            cpus=args.cpus_per_node, memory_mb=args.memory_mb_per_node, slots=args.slots_per_node
        )
        params = PoolParams(min_warm=args.min_warm, max_warm=max(args.min_warm, 64))
    except ValidationError as e:
        raise UsageError(describe(e)) from e
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


def register(sub: argparse._SubParsersAction) -> None:
    """Add `dsec up`."""
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
