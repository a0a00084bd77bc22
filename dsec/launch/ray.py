"""The pool on a Ray cluster (the `ray` extra): the control plane here, with the Ray
provider (controlplane/ray_cloud.py), which gives every Ray node that offers the
sandbox-node resource an agent, pinned there and restarted by Ray, and asks Ray's
autoscaler for cloud nodes when local ones pass the overflow threshold. LocalPool's
start, env file, summary and stop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from controlplane.config import RayConfig
from controlplane.identities import LOOPBACK_AGENT_URLS
from dsec.addresses import advertised_url
from dsec.launch.local import LocalPool, LocalPoolSpec


@dataclass
class RayPoolSpec(LocalPoolSpec):
    nodes: int = 0  # none of its own: Ray's nodes have the agents
    address: str = "auto"
    node_resource: str = "dsec_node"
    cloud_resource: str = "dsec_cloud"
    # sandbox nodes the cluster has at the start: the start waits for their agents
    expected_nodes: int = 0
    # where the control plane listens, and the URL agents on other nodes register at
    host: str = "127.0.0.1"
    advertise_url: str | None = None
    # the addresses agents may report (agent_urls rules) beside loopback and the sandbox
    # nodes the cluster has at the start
    agent_urls: list[str] = field(default_factory=list)


class RayPool(LocalPool):
    """A control plane whose nodes are Ray's (RayNodes); LocalPool's start, env file,
    summary and stop."""

    spec: RayPoolSpec

    def __init__(self, spec: RayPoolSpec) -> None:
        super().__init__(spec)
        self.node_prefix = spec.name

    def cloud_config(self) -> RayConfig:
        return RayConfig(
            provider="ray",
            address=self.spec.address,
            namespace=f"dsec-{self.spec.name}",
            node_resource=self.spec.node_resource,
            cloud_resource=self.spec.cloud_resource,
            node_prefix=self.node_prefix,
            max_nodes=self.spec.cloud_nodes,
            idle_release_s=self.spec.cloud_idle_release_s,
            capacity=self.spec.capacity,
            state_dir=self.dir,
            heartbeat_s=self.spec.heartbeat_s,
        )

    def controlplane_settings(self) -> dict[str, Any]:
        return {
            "host": self.spec.host,
            "agent_urls": [*LOOPBACK_AGENT_URLS, *self.spec.agent_urls],
        }

    def controlplane_args(self) -> list[str]:
        url = self.spec.advertise_url
        return ["--advertise-url", url] if url else []

    @property
    def url(self) -> str:
        """Where clients and agents reach the control plane: its advertised URL if any."""
        return advertised_url(super().url, self.spec.advertise_url)

    def all_registered(self, healthy: set[str]) -> bool:
        return len({n for n in healthy if self.owns_node(n)}) >= self.spec.expected_nodes

    def owns_node(self, node_id: str) -> bool:
        return node_id.startswith(f"{self.node_prefix}-")

    def summary(self) -> dict:
        nodes = [{"node_id": n["node_id"], "url": n["url"]} for n in self.registered]
        return {**super().summary(), "ray": self.spec.address, "nodes": nodes}
