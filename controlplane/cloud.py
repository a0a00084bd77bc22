"""Cloud capacity: a provider starts and stops cloud nodes, which then register.

The policy only says how many more it wants (ProvisionCloud) and which idle one to
give back (ReleaseCloud); a provider turns that into machines. `LocalCloudProvider`
starts extra agents marked `cloud` on this machine, after a boot delay, so overflow
can be exercised without a cloud account; `RayNodes` (controlplane/ray_cloud.py, the
`ray` extra) runs the pool's nodes on a Ray cluster and asks Ray's autoscaler for cloud
nodes. The control plane's config picks one by its `cloud.provider` (their settings,
CloudConfig and RayConfig, are in controlplane/config.py).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Protocol

from controlplane.config import CloudConfig, RayConfig
from controlplane.identities import Identities
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
