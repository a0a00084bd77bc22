"""Ray's own local test clusters on loopback, for the tests and the benchmark of the pool
on Ray (controlplane/ray_cloud.py): `ray.cluster_utils.Cluster` for a multi-node pool,
and `AutoscalingCluster`, the real autoscaler with its fake local node provider, for
overflow.

Nothing binds or sends beyond loopback: every node is given 127.0.0.1, and
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 makes Ray's own look-up of this machine's address
answer 127.0.0.1 (the fake provider starts its nodes with that look-up); usage stats are
off. Importing this module sets both in our environment, before Ray reads them, for us
and every process we start.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
from collections.abc import Iterator

LOOPBACK = "127.0.0.1"
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
os.environ.update(LOOPBACK_ENV)

import ray  # noqa: E402
from ray.cluster_utils import AutoscalingCluster, Cluster  # noqa: E402

NODE_RESOURCE, CLOUD_RESOURCE = "dsec_node", "dsec_cloud"  # dsec ray up's defaults
GCS_PORT = 6379  # AutoscalingCluster's head listens on Ray's default port


def sandbox_cluster(nodes: int) -> Cluster:
    """A head (no sandbox node: the control plane's place) and `nodes` sandbox nodes."""
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"node_ip_address": LOOPBACK, "num_cpus": 2, "include_dashboard": False},
    )
    for _ in range(nodes):
        add_sandbox_node(cluster)
    cluster.wait_for_nodes()
    return cluster


def add_sandbox_node(cluster: Cluster):
    """One more node offering the sandbox-node resource; returns Ray's Node."""
    return cluster.add_node(node_ip_address=LOOPBACK, num_cpus=0, resources={NODE_RESOURCE: 1})


# the fake provider's settings, as Ray's fake_multi_node/example.yaml has them (the wheel
# does not ship that file, which AutoscalingCluster reads its base config from)
FAKE_PROVIDER_CONFIG = {
    "cluster_name": "dsec-overflow",
    "provider": {
        "type": "fake_multinode",
        "use_node_id_as_ip": True,
        "disable_node_updaters": True,
        "disable_launch_config_check": True,
        "gcs_address": f"{LOOPBACK}:{GCS_PORT}",  # its nodes join here, not at our own address
    },
    "head_node_type": "ray.head.default",
    "auth": {},
    "upscaling_speed": 1.0,
    "docker": {},
    "initialization_commands": [],
    "setup_commands": [],
    "head_setup_commands": [],
    "worker_setup_commands": [],
    "head_start_ray_commands": [],
    "worker_start_ray_commands": [],
    "file_mounts": {},
    "cluster_synced_files": [],
    "file_mounts_sync_continuously": False,
    "rsync_exclude": [],
    "rsync_filter": [],
}


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Our stdout, file descriptor and all, on stderr meanwhile: `ray start` and `ray stop`
    print pages there, which would mix with a report (`--json`) on stdout."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


class LoopbackAutoscalingCluster(AutoscalingCluster):
    """AutoscalingCluster with its config made here (above). Its start and shutdown run
    `ray stop --force`, which stops every Ray process on this machine."""

    def start(self, *args, **kwargs) -> None:
        with _stdout_to_stderr():
            super().start(*args, **kwargs)

    def shutdown(self) -> None:
        with _stdout_to_stderr():
            super().shutdown()

    def _generate_config(self, head_resources, worker_node_types, autoscaler_v2=False, **kw):
        config = copy.deepcopy(FAKE_PROVIDER_CONFIG)
        config["available_node_types"] = {
            **worker_node_types,
            "ray.head.default": {"resources": head_resources, "node_config": {}, "max_workers": 0},
        }
        config.update(kw)
        return config


def overflow_cluster(
    local_nodes: int = 1, cloud_nodes: int = 1, idle_timeout_s: float = 6.0
) -> LoopbackAutoscalingCluster:
    """`local_nodes` sandbox nodes kept up (min_workers), and a node type for up to
    `cloud_nodes` cloud nodes that the autoscaler launches only when asked, and removes
    once idle for `idle_timeout_s`. The head runs the control plane."""
    sandbox = {"node_config": {}}
    return LoopbackAutoscalingCluster(
        # custom resources on the head would go through a `ray start` quoting bug of
        # AutoscalingCluster: the head has none, the sandbox nodes are workers
        head_resources={"CPU": 2},
        worker_node_types={
            "sandbox-local": {
                **sandbox,
                "resources": {NODE_RESOURCE: 1},
                "min_workers": local_nodes,
                "max_workers": local_nodes,
            },
            "sandbox-cloud": {
                **sandbox,
                "resources": {NODE_RESOURCE: 1, CLOUD_RESOURCE: 1},
                "min_workers": 0,
                "max_workers": cloud_nodes,
            },
        },
        max_workers=local_nodes + cloud_nodes,
        idle_timeout_minutes=idle_timeout_s / 60,
    )


def watch(address: str) -> None:
    """Connect this process to the cluster as a driver of its own, to see its nodes."""
    ray.init(address=address, log_to_driver=False)


def unwatch() -> None:
    ray.shutdown()


def live_nodes(resource: str | None = None) -> list[str]:
    """The Ray ids of the live nodes (that offer `resource`, if given)."""
    return [
        n["NodeID"]
        for n in ray.nodes()
        if n["Alive"] and (resource is None or n["Resources"].get(resource, 0) > 0)
    ]
