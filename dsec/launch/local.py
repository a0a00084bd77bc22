"""The local pool: a control plane and N agents on loopback, as child processes.

Each part is the same process `dsec controlplane` or `dsec agent` would start, so
the local pool exercises the real HTTP paths. Its stop (leaving the `async with`, on
Ctrl-C or SIGTERM in `dsec up`) stops the agents (which remove their sandboxes), then
the control plane, then sweeps Docker for any container still labelled with one of its
nodes. `dsec up`, the benchmarks and the tests all start a pool through LocalPool.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import docker

from agent.docker_driver import LABEL_NODE
from controlplane.cloud import cloud_node_host
from controlplane.config import (
    ClientQuota,
    ClientSpec,
    CloudConfig,
    ControlPlaneConfig,
    RayConfig,
    default_templates,
)
from controlplane.identities import Identities, load_or_make_key
from dsec.image import ensure_base_image
from dsec.models import Capacity, PoolParams, TemplateSpec
from dsec.policies import PolicyName
from dsec.processes import (
    agent_args,
    agent_credentials,
    child_env,
    dsec_argv,
    node_credentials,
    signalled_at_parent_death,
    stop_process,
)
from dsec.statedir import private_dir, remove_loops_of, write_private
from dsec.template_build import PYTHON_TEMPLATE_ENV, TemplateBuildError, build_python_template
from dsec.tls import TlsFiles, client_ssl, make_local_pool_tls
from dsec.tokens import new_token

READY_TIMEOUT_S = 60.0
# prints deploy/prometheus.yml for a pool's address and credentials (deploy/README.md)
PROMETHEUS_CONFIG_SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "prometheus-config"


class LocalPoolError(RuntimeError):
    pass


def agent_host(index: int) -> str:
    """Where the `index`th (from 1) agent of a local pool listens: 127.0.0.1 is the
    control plane's."""
    return f"127.0.0.{index + 1}"


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
    execs_per_sandbox: int | None = None  # the agents' own default unless set
    execs_per_node: int | None = None
    container_check_s: float | None = None  # the agents' own default unless set
    # /metrics and discovery need a metrics token (DSEC_METRICS_TOKEN, made if unset);
    # a metrics token set in the environment turns this on as well. `dsec up` sets it
    # unless --open-metrics (pool_fields); a spec made in code keeps them open
    metrics_token: bool = False
    # every service on HTTPS, with a CA made for this pool at each start (dsec/tls.py)
    tls: bool = False
    # from `dsec up --config`: more pools beside "default", client quotas
    more_pools: dict[str, PoolParams] = field(default_factory=dict)
    clients: list[ClientSpec] = field(default_factory=list)
    default_quota: ClientQuota = field(default_factory=ClientQuota)
    # `--with-python`: build the python template (a cache hit once built) and keep it warm
    # in pool "default" beside "base"
    python_template: bool = False


@dataclass
class Child:
    name: str
    args: list[str]
    proc: asyncio.subprocess.Process
    url: str = ""
    drain: asyncio.Task | None = None
    credentials: dict[str, str] = field(default_factory=dict, repr=False)  # its environment's


@dataclass
class Tokens:
    client: str
    admin: str
    agent: str
    metrics: str | None = None  # None: /metrics and discovery are open

    @classmethod
    def from_env_or_new(cls, metrics: bool = False) -> Tokens:
        """The tokens in the environment, new ones for those not there; a metrics token
        only if one is there or `metrics` asks for one."""
        metrics_token = os.environ.get("DSEC_METRICS_TOKEN") or (new_token() if metrics else None)
        return cls(
            client=os.environ.get("DSEC_TOKEN") or new_token(),
            admin=os.environ.get("DSEC_ADMIN_TOKEN") or new_token(),
            agent=os.environ.get("DSEC_AGENT_TOKEN") or new_token(),
            metrics=metrics_token,
        )

    def env(self) -> dict[str, str]:
        """Every token: the env file's, and the control plane's, which checks them all."""
        return {
            "DSEC_TOKEN": self.client,
            "DSEC_ADMIN_TOKEN": self.admin,
            **agent_credentials(self.agent, self.metrics),
        }

    def agent_env(self) -> dict[str, str]:
        """An agent's started by hand: the join token, and the metrics token; no client's
        or operator's. LocalPool's own agents get their node tokens (LocalPool.node_env)."""
        return agent_credentials(self.agent, self.metrics)


def write_env_file(path: Path, env: dict[str, str]) -> None:
    """`export NAME=value` lines for sh's `.` or `source`, 0600 (they are credentials);
    each value quoted, so one with spaces or shell syntax is taken as it is, never run."""
    lines = "".join(f"export {name}={shlex.quote(value)}\n" for name, value in env.items())
    write_private(path, lines.encode())


class LocalPool:
    def __init__(self, spec: LocalPoolSpec) -> None:
        self.spec = spec
        self.dir = spec.state_dir / spec.name
        self.tokens = Tokens.from_env_or_new(spec.metrics_token)
        self.controlplane: Child | None = None
        self.agents: list[Child] = []
        self.node_ids = [f"{spec.name}-{i}" for i in range(1, spec.nodes + 1)]
        self.cloud_prefix = f"{spec.name}-cloud"
        self.cloud_node_ids = [f"{self.cloud_prefix}-{i}" for i in range(1, spec.cloud_nodes + 1)]
        self.swept = 0  # leftover containers the last stop() removed
        # what the last stop() could not remove, and why, in one line each: a sweep whose
        # engine had gone, a container the engine would not remove
        self.sweep_failures: list[str] = []
        self.identities: Identities | None = None  # every node's credentials, once started
        self.tls: TlsFiles | None = None  # with spec.tls, once started
        self.registered: list[dict] = []  # GET /v1/nodes once the start was done

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
    def metrics_token_file(self) -> Path:
        """The metrics token alone, for Prometheus' `credentials_file`."""
        return self.dir / "metrics-token"

    @property
    def prometheus_config_file(self) -> Path:
        """A Prometheus configuration for this pool (`prometheus --config.file=...`)."""
        return self.dir / "prometheus.yml"

    @property
    def url(self) -> str:
        assert self.controlplane is not None
        return self.controlplane.url

    @property
    def ca(self) -> Path | None:
        """The CA bundle clients verify this pool with (DSEC_CA); None: plain HTTP."""
        return self.tls.ca if self.tls else None

    def addresses(self, controlplane_host: str) -> list[str]:
        """Every address a service of this pool listens on: what its certificate names."""
        cloud = range(1, self.spec.cloud_nodes + 1)
        return [
            controlplane_host,
            *(agent_host(i) for i in range(1, self.spec.nodes + 1)),
            *(cloud_node_host(i) for i in cloud),
        ]

    async def start(self) -> None:
        await asyncio.to_thread(self._prepare_docker)
        private_dir(self.dir)  # credentials, stores and audit logs: ours alone
        config = ControlPlaneConfig(
            port=self.spec.port,
            client_tokens=[self.tokens.client],
            admin_tokens=[self.tokens.admin],
            agent_token=self.tokens.agent,
            # the control plane reads it from the same file: restarts keep it
            identity_key=load_or_make_key(self.dir),
            pools={"default": self.spec.pool, **self.spec.more_pools},
            clients=self.spec.clients,
            default_quota=self.spec.default_quota,
            templates=self.spec.templates,
            state_dir=self.dir,
            tick_s=self.spec.tick_s,
            policy=self.spec.policy,
            cloud=self.cloud_config(),
            **self.controlplane_settings(),
        )
        config_path = self.dir / "controlplane.json"
        # tokens reach the children through the environment, not the config file
        write_private(
            config_path,
            config.model_dump_json(
                indent=2,
                exclude={
                    "client_tokens",
                    "admin_tokens",
                    "agent_token",
                    "metrics_token",
                    "identity_key",
                },
            ).encode(),
        )
        self.identities = Identities.of(config)
        if self.spec.tls:
            self.tls = make_local_pool_tls(
                self.dir / "tls", self.spec.name, self.addresses(config.host)
            )
        self.controlplane = await self._spawn(
            "controlplane",
            [
                "controlplane",
                "--config",
                str(config_path),
                *(self.tls.args() if self.tls else []),
                *self.controlplane_args(),
            ],
            self.tokens.env(),
        )
        for i, node_id in enumerate(self.node_ids, start=1):
            args = agent_args(
                node_id,
                host=agent_host(i),
                controlplane=self.url,
                capacity=self.spec.capacity,
                state_dir=self.dir,
                heartbeat_s=self.spec.heartbeat_s,
                execs_per_sandbox=self.spec.execs_per_sandbox,
                execs_per_node=self.spec.execs_per_node,
                container_check_s=self.spec.container_check_s,
                tls=self.tls,
            )
            self.agents.append(await self._spawn(node_id, args, self.node_env(node_id)))
        await self._wait_registered()
        self._write_env_file()
        if self.tokens.metrics is not None:
            write_private(self.metrics_token_file, self.tokens.metrics.encode())
        await self._write_prometheus_config()

    async def _write_prometheus_config(self) -> None:
        """deploy/prometheus.yml for this pool, as deploy/prometheus-config makes it (its
        address, CA and metrics token file), with alerts.yml beside it; nothing when
        dsec runs without its deploy/ folder (installed from a wheel)."""
        if not PROMETHEUS_CONFIG_SCRIPT.exists():
            return
        settings = {"DSEC_CONTROLPLANE_URL": self.url}
        if self.ca:
            settings["DSEC_CA_FILE"] = str(self.ca)
        if self.tokens.metrics is not None:
            settings["DSEC_METRICS_TOKEN_FILE"] = str(self.metrics_token_file)
        proc = await asyncio.create_subprocess_exec(
            str(PROMETHEUS_CONFIG_SCRIPT),
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **settings},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        config, errors = await proc.communicate()
        if proc.returncode != 0:
            raise LocalPoolError(f"prometheus-config failed: {errors.decode(errors='replace')}")
        write_private(self.prometheus_config_file, config)
        alerts = PROMETHEUS_CONFIG_SCRIPT.with_name("alerts.yml")
        write_private(self.prometheus_config_file.with_name(alerts.name), alerts.read_bytes())

    def controlplane_settings(self) -> dict[str, Any]:
        """More of the control plane's config: where it listens, which agents it takes."""
        return {}

    def controlplane_args(self) -> list[str]:
        """More flags of `dsec controlplane`."""
        return []

    def cloud_config(self) -> CloudConfig | RayConfig | None:
        """The control plane's cloud provider: local cloud nodes, up to spec.cloud_nodes."""
        if not self.spec.cloud_nodes:
            return None
        return CloudConfig(
            max_nodes=self.spec.cloud_nodes,
            node_prefix=self.cloud_prefix,
            boot_delay_s=self.spec.cloud_boot_delay_s,
            idle_release_s=self.spec.cloud_idle_release_s,
            capacity=self.spec.capacity,
            state_dir=self.dir,
            heartbeat_s=self.spec.heartbeat_s,
        )

    def node_env(self, node_id: str) -> dict[str, str]:
        """The credentials of an agent this pool starts: its own node token, which it
        joins with (no token that speaks for another node), and the metrics token."""
        assert self.identities is not None, "the pool has not started"
        return node_credentials(self.identities.node_token(node_id), self.tokens.metrics)

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
        if self.spec.python_template:
            self._add_python_template(client)

    def _add_python_template(self, client: docker.DockerClient) -> None:
        try:
            built = build_python_template(client, progress=True)
        except TemplateBuildError as e:
            raise LocalPoolError(f"the python template: {e}") from e
        self.spec.templates["python"] = TemplateSpec(
            name="python", image=built.image, recyclable=True, env=PYTHON_TEMPLATE_ENV
        )
        warm = self.spec.pool.templates
        if "python" not in warm:
            self.spec.pool = self.spec.pool.model_copy(update={"templates": [*warm, "python"]})

    async def _spawn(self, name: str, args: list[str], credentials: dict[str, str]) -> Child:
        proc = await asyncio.create_subprocess_exec(
            *dsec_argv(*args),
            stdout=asyncio.subprocess.PIPE,
            env=child_env(credentials),  # its own credentials, none of the others'
            start_new_session=True,  # Ctrl-C reaches us alone; we stop the children in order
            # and if we die without stopping them (SIGKILL), they stop themselves: an agent
            # removes its sandboxes on SIGTERM
            preexec_fn=signalled_at_parent_death(signal.SIGTERM),
        )  # fmt: skip
        child = Child(name, args, proc, credentials=credentials)
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
        connector = aiohttp.TCPConnector(ssl=client_ssl(self.ca))
        async with aiohttp.ClientSession(headers=headers, connector=connector) as http:
            for _ in range(int(READY_TIMEOUT_S / 0.1)):
                async with http.get(f"{self.url}/v1/nodes") as resp:
                    nodes = (await resp.json())["nodes"]
                if self.all_registered({n["node_id"] for n in nodes if n["healthy"]}):
                    self.registered = nodes
                    return
                await asyncio.sleep(0.1)
        raise LocalPoolError("the agents did not register with the control plane in time")

    def all_registered(self, healthy: set[str]) -> bool:
        """Whether the start is done, once these nodes are registered and healthy."""
        return healthy >= set(self.node_ids)

    def _write_env_file(self) -> None:
        ca = {"DSEC_CA": str(self.ca)} if self.ca else {}
        write_env_file(self.env_file, {"DSEC_URL": self.url, **ca, **self.tokens.env()})

    def summary(self) -> dict:
        return {
            "url": self.url,
            "metrics": f"{self.url}/metrics",
            "service_discovery": f"{self.url}/v1/sd/prometheus",
            # None: open; else what Prometheus sends (deploy/README.md)
            "metrics_token_file": str(self.metrics_token_file) if self.tokens.metrics else None,
            # None: no deploy/ folder to make it from
            "prometheus_config": str(self.prometheus_config_file)
            if self.prometheus_config_file.exists()
            else None,
            "env_file": str(self.env_file),
            "ca": str(self.ca) if self.ca else None,  # None: plain HTTP
            "nodes": [{"node_id": a.name, "url": a.url} for a in self.agents],
            "cloud_nodes": self.spec.cloud_nodes,  # at most, started on overflow
            "templates": {name: t.image for name, t in self.spec.templates.items()},
        }

    async def restart_agent(self, child: Child) -> Child:
        """Start an agent again on the address it had (after it stopped or was killed)."""
        await self._stop_child(child)
        args = list(child.args)
        args[args.index("--port") + 1] = child.url.rsplit(":", 1)[1]
        fresh = await self._spawn(child.name, args, child.credentials)
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
        # (what an agent killed before it could clean up left in the host's memory)
        await asyncio.to_thread(remove_loops_of, self.dir)
        self.swept = await asyncio.to_thread(self._sweep_containers)
        return self.swept

    async def _stop_child(self, child: Child) -> None:
        await stop_process(child.proc)
        if child.drain is not None:
            with contextlib.suppress(Exception):
                await child.drain

    def _sweep_containers(self) -> int:
        self.sweep_failures = []
        try:
            client = docker.from_env()
            # sparse: no inspect per container, which races with removals under way
            found = client.containers.list(all=True, sparse=True, filters={"label": LABEL_NODE})
        except docker.errors.DockerException as e:
            self.sweep_failures.append(
                f"the Docker engine did not answer ({e}): this pool's containers, if any are "
                f"left, were not removed (`docker ps -a --filter label={LABEL_NODE}`)"
            )
            return 0
        removed = 0
        for c in found:
            if self.owns_node((c.attrs.get("Labels") or {}).get(LABEL_NODE, "")):
                try:
                    c.remove(force=True)
                    removed += 1
                except docker.errors.NotFound:
                    pass  # its agent removed it meanwhile
                except docker.errors.DockerException as e:
                    self.sweep_failures.append(f"container {c.id[:12]} not removed: {e}")
        return removed

    def owns_node(self, node_id: str) -> bool:
        """Whether `node_id` is one of this pool's nodes, local or cloud."""
        return node_id in self.node_ids or node_id in self.cloud_node_ids
