"""Cloud capacity: a provider starts and stops cloud nodes, which then register.

The policy only says how many more it wants (ProvisionCloud) and which idle one to
give back (ReleaseCloud); a provider turns that into machines. `LocalCloudProvider`
starts extra agents marked `cloud` on this machine, after a boot delay, so overflow
can be exercised without a cloud account; `RayNodes` (controlplane/ray_cloud.py, the
`ray` extra) runs the pool's nodes on a Ray cluster and asks Ray's autoscaler for cloud
nodes. The control plane's config picks one by its `cloud.provider`.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import signal
from pathlib import Path
from typing import Annotated, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from controlplane.identities import Identities
from dsec.models import Capacity, Name
from dsec.processes import (
    agent_args,
    child_env,
    dsec_argv,
    node_credentials,
    signalled_at_parent_death,
    stop_process,
)
from dsec.tls import TlsFiles

log = logging.getLogger(__name__)


def cloud_node_host(index: int) -> str:
    """Where the `index`th (from 1) local cloud node listens."""
    return f"127.0.1.{index}"


class NodeSettings(BaseModel):
    """What every provider gives the agents it starts, and when it gives a node back."""

    model_config = ConfigDict(extra="forbid")

    idle_release_s: float = Field(
        60.0, gt=0, le=86_400, description="a cloud node empty this long is given back"
    )
    capacity: Capacity = Capacity(cpus=16, memory_mb=65536, slots=64)
    state_dir: Path = Path.home() / ".dsec" / "cloud"
    heartbeat_s: float = Field(1.0, gt=0, le=60)


class CloudConfig(NodeSettings):
    """Cloud nodes as agent processes on this machine's 127.0.1.x (LocalCloudProvider)."""

    provider: Literal["local"] = "local"
    max_nodes: int = Field(ge=1, le=200)
    node_prefix: Name = "cloud"
    boot_delay_s: float = Field(2.0, ge=0, le=3600)


# a Ray node's id is "<prefix>-<12 hex of its Ray node id>": a Name, 32 characters at most
RAY_NODE_PREFIX = r"^[a-z0-9][a-z0-9-]{0,18}$"


class RayConfig(NodeSettings):
    """The pool on a Ray cluster (RayNodes, controlplane/ray_cloud.py): an agent on every
    node that offers `node_resource`; cloud nodes, those that also offer
    `cloud_resource`, asked of Ray's autoscaler when local utilisation passes the
    overflow threshold."""

    provider: Literal["ray"]
    address: str = Field("auto", description="the Ray cluster, as ray.init takes it")
    namespace: str = Field("dsec", min_length=1, description="the Ray namespace of its actors")
    node_resource: str = Field(
        "dsec_node", min_length=1, description="the resource a Ray node offers to be a sandbox node"
    )
    cloud_resource: str = Field(
        "dsec_cloud",
        min_length=1,
        description="the resource a node type of the autoscaler offers to be a cloud node",
    )
    node_prefix: str = Field("ray", pattern=RAY_NODE_PREFIX)
    max_nodes: int = Field(
        0, ge=0, le=200, description="cloud nodes the autoscaler may be asked for (0: none)"
    )
    poll_s: float = Field(1.0, gt=0, le=60, description="how often the cluster's nodes are listed")
    agent_restarts: int = Field(
        -1, ge=-1, description="how often Ray restarts a node's agent that died (-1: always)"
    )

    @model_validator(mode="after")
    def _ray_installed(self) -> RayConfig:
        if importlib.util.find_spec("ray") is None:
            raise ValueError("the ray provider needs Ray: pip install 'dsec[ray]'")
        return self


def _provider(data: object) -> str:
    if isinstance(data, dict):
        return data.get("provider", "local")
    return getattr(data, "provider", "local")


# the control plane's `cloud` setting: {"provider": "ray", ...}, else the local provider
CloudSettings = Annotated[
    Annotated[CloudConfig, Tag("local")] | Annotated[RayConfig, Tag("ray")],
    Discriminator(_provider),
]


class CloudProvider(Protocol):
    max_nodes: int
    idle_release_s: float
    controlplane_url: str  # set once the control plane listens: where its nodes register

    def booting(self, registered: set[str]) -> int:
        """Nodes asked for that have not registered yet."""

    async def start_node(self) -> str: ...

    async def stop_node(self, node_id: str) -> None: ...

    async def close(self) -> None: ...


class LocalCloudProvider:
    """Cloud nodes as agent processes on 127.0.1.x, for `dsec up --cloud-nodes M`."""

    def __init__(
        self,
        config: CloudConfig,
        identities: Identities,
        metrics_token: str | None = None,
        tls: TlsFiles | None = None,
    ) -> None:
        self.config = config
        self.tls = tls  # the control plane's own: its certificate names these addresses too
        self.max_nodes = config.max_nodes
        self.idle_release_s = config.idle_release_s
        self.identities = identities
        self.metrics_token = metrics_token
        self.controlplane_url = ""  # known once the control plane listens
        self.procs: dict[str, asyncio.subprocess.Process] = {}
        self.starting: set[str] = set()

    def node_ids(self) -> list[str]:
        return [f"{self.config.node_prefix}-{i}" for i in range(1, self.max_nodes + 1)]

    def booting(self, registered: set[str]) -> int:
        return len(self.starting - registered)

    async def start_node(self) -> str:
        free = [n for n in self.node_ids() if n not in self.procs and n not in self.starting]
        if not free:
            raise RuntimeError("every cloud node is already running")
        node_id = free[0]
        self.starting.add(node_id)
        try:
            await asyncio.sleep(self.config.boot_delay_s)  # a VM takes a while to come up
            index = self.node_ids().index(node_id) + 1
            args = agent_args(
                node_id,
                kind="cloud",
                host=cloud_node_host(index),
                controlplane=self.controlplane_url,
                capacity=self.config.capacity,
                state_dir=self.config.state_dir,
                heartbeat_s=self.config.heartbeat_s,
                tls=self.tls,
            )
            self.procs[node_id] = await asyncio.create_subprocess_exec(
                *dsec_argv(*args),
                stdout=asyncio.subprocess.DEVNULL,
                # its own node token: not the control plane's tokens, nor the join token
                env=child_env(
                    node_credentials(self.identities.node_token(node_id), self.metrics_token)
                ),
                start_new_session=True,
                # ended with the control plane that started it, however it ends: it
                # removes its sandboxes on SIGTERM
                preexec_fn=signalled_at_parent_death(signal.SIGTERM),
            )
            log.info("cloud node %s started", node_id)
        except BaseException:
            self.starting.discard(node_id)
            raise
        return node_id

    async def stop_node(self, node_id: str) -> None:
        self.starting.discard(node_id)
        proc = self.procs.pop(node_id, None)
        if proc is None or proc.returncode is not None:
            return
        await stop_process(proc)  # it removes its sandboxes on the way out
        log.info("cloud node %s stopped", node_id)

    async def close(self) -> None:
        await asyncio.gather(*(self.stop_node(n) for n in list(self.procs)))


def cloud_provider(
    config: CloudConfig | RayConfig,
    identities: Identities,
    metrics_token: str | None = None,
    tls: TlsFiles | None = None,
) -> CloudProvider:
    """The provider `config` names; the Ray one needs the `ray` extra."""
    if isinstance(config, RayConfig):
        from controlplane.ray_cloud import RayNodes  # imports ray

        return RayNodes(config, identities, metrics_token, tls=tls)
    return LocalCloudProvider(config, identities, metrics_token, tls=tls)
