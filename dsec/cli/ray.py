"""`dsec ray up`: the pool on a Ray cluster (the `ray` extra).

It starts the control plane here, as `dsec up` does, with the Ray provider
(controlplane/ray_cloud.py): the control plane gives every Ray node that offers the
sandbox-node resource an agent, pinned there and restarted by Ray, and asks Ray's
autoscaler for cloud nodes when local ones pass the overflow threshold. It waits until
the agents of the nodes the cluster has now are registered, prints where things are,
and runs until Ctrl-C, which stops the agents (removing their sandboxes), withdraws any
request to the autoscaler, and stops the control plane.
"""

from __future__ import annotations

import argparse
import logging
import re
import socket

from pydantic import TypeAdapter, ValidationError

from controlplane.config import RAY_NODE_PREFIX
from controlplane.identities import AgentUrlRule
from dsec.addresses import listens_everywhere
from dsec.cli.common import UsageError, checked_advertise_url, describe
from dsec.cli.up import pool_flags, pool_spec, run_pool
from dsec.launch.ray import RayPool, RayPoolSpec

NEEDS_RAY = "needs Ray, which is not installed: pip install 'dsec[ray]'"
CONNECT_TIMEOUT_S = 5.0


def sandbox_nodes(address: str, node_resource: str) -> tuple[str, list[str]]:
    """The cluster's address as its nodes know it, and the addresses of its live nodes
    that offer `node_resource`: a look from a short Ray session of our own."""
    import ray

    _check_listening(address)
    try:
        ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR)
    except (ConnectionError, ValueError, RuntimeError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UsageError(f"no Ray cluster at {address!r}: {first}") from e
    try:
        gcs = ray.get_runtime_context().gcs_address
        live = [n for n in ray.nodes() if n.get("Alive")]
        offering = [n for n in live if n.get("Resources", {}).get(node_resource, 0) >= 1]
        return gcs, [n["NodeManagerAddress"] for n in offering]
    finally:
        ray.shutdown()


def _check_listening(address: str) -> None:
    """A GCS address (host:port) that nothing answers at is refused at once: ray.init
    would try it for minutes."""
    host, sep, port = address.rpartition(":")
    if not sep or "://" in address or not port.isdigit():
        return  # "auto", or a form Ray resolves itself
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise UsageError(f"no Ray cluster at {address!r}: {e.strerror or e}") from e


def cmd_ray_up(args: argparse.Namespace) -> int:
    try:
        import ray  # noqa: F401
    except ImportError:
        raise UsageError(NEEDS_RAY) from None
    if not re.match(RAY_NODE_PREFIX, args.name):
        raise UsageError(
            f"--name {args.name!r}: lowercase letters, digits and '-', 19 at most "
            "(node ids are <name>-<12 hex of the Ray node id>)"
        )
    advertise = _advertise_url(args.host, args.advertise_url)
    spec = pool_spec(
        RayPoolSpec,
        args,
        node_resource=args.node_resource,
        cloud_resource=args.cloud_resource,
        cloud_idle_release_s=args.cloud_idle_release_s,
        host=args.host,
        advertise_url=advertise,
        agent_urls=args.agent_urls,
    )
    pool = RayPool(spec)
    try:
        pool.cloud_config()
        TypeAdapter(list[AgentUrlRule]).validate_python(spec.agent_urls)
    except ValidationError as e:
        raise UsageError(describe(e)) from e
    spec.address, addresses = sandbox_nodes(args.address, args.node_resource)
    spec.expected_nodes = len(addresses)
    # the agents of the nodes there now report the address Ray knows each node by
    spec.agent_urls = [*spec.agent_urls, *sorted({f"http://{a}" for a in addresses})]
    return run_pool(pool, args.json, "dsec ray up")


def _advertise_url(host: str, url: str | None) -> str | None:
    """--advertise-url, checked; needed when --host names no one address."""
    if url is None:
        if listens_everywhere(host):
            raise UsageError(
                f"--host {host} listens on every address, which is no address for the "
                "agents on Ray's nodes to register at: say which with --advertise-url"
            )
    return checked_advertise_url(url, "http", "the control plane")


def register(sub: argparse._SubParsersAction) -> None:
    """Add `dsec ray up`."""
    ray = sub.add_parser("ray", help="the pool on a Ray cluster (the ray extra)")
    verbs = ray.add_subparsers(dest="ray_command", required=True)
    up = verbs.add_parser(
        "up",
        help="a control plane here and an agent on every Ray node that offers the "
        "sandbox-node resource, until Ctrl-C",
    )
    up.add_argument(
        "--address",
        default="auto",
        help="the Ray cluster (host:port of its GCS; default: $RAY_ADDRESS, or the one "
        "this machine runs)",
    )
    up.add_argument(
        "--node-resource",
        default="dsec_node",
        help="the custom resource a Ray node offers to be a sandbox node "
        "(ray start --resources='{\"dsec_node\": 1}')",
    )
    up.add_argument(
        "--cloud-resource",
        default="dsec_cloud",
        help="the resource of the autoscaler's node type for cloud nodes (offered beside "
        "the sandbox-node resource)",
    )
    pool_flags(
        up,
        name="ray",
        cloud_help="cloud nodes the pool may ask Ray's autoscaler for when local nodes "
        "pass 80%% utilisation",
    )
    up.add_argument(
        "--host",
        default="127.0.0.1",
        help="where the control plane listens (0.0.0.0: every address, with --advertise-url)",
    )
    up.add_argument(
        "--advertise-url",
        help="the URL the agents on Ray's nodes and the clients reach the control plane at "
        "(its port is the bound one unless given)",
    )
    up.add_argument(
        "--agent-urls",
        type=lambda v: [r for r in v.split(",") if r],
        default=[],
        help="more addresses agents may report, comma-separated (http://10.1.0.0/16): for "
        "nodes that join later from networks the cluster's nodes at the start are not in",
    )
    up.add_argument(
        "--cloud-idle-release-s",
        type=float,
        default=60.0,
        help="a cloud node empty this long is given back to the autoscaler",
    )
    up.set_defaults(run=cmd_ray_up)
