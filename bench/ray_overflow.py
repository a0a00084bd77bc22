"""Cloud overflow through Ray's autoscaler (issue 15), against the local cloud provider
in the same run.

    python -m bench.ray_overflow [--local-slots 5] [--burst 7] [--idle-release-s 5]
                                 [--ray-idle-timeout-s 6] [--json]

Each phase has one local sandbox node with `--local-slots` slots and room for one cloud
node of the same size; pool `default` keeps nothing warm, so every acquire is a create.
- local, the baseline: `dsec up --nodes 1 --cloud-nodes 1` (LocalCloudProvider with no
  boot delay: an agent process started on 127.0.1.1 when overflow needs one);
- ray: `dsec ray up` on Ray's AutoscalingCluster (the real autoscaler and its fake
  local node provider, bench/ray_clusters.py), one sandbox node kept up and a node type
  for one cloud node, which the autoscaler launches only when asked.
In each, acquires taken one at a time bring local utilisation to 80%; the rest of the
burst is then sent at once, and the first of those is the first overflowing request
(t0). Each sandbox runs one tool call (`echo`), all are released together, and the pool
is left idle. Reported, from t0: the first sandbox served on a cloud node; the cloud node
given back by the control plane (`--idle-release-s` after it went empty); on Ray, the
node's removal by the autoscaler (`--ray-idle-timeout-s` after that), and the ratio of
each to the baseline's. Checks: a sandbox served on a cloud node, none lost (every
release answered, no sandbox in state `lost`), the cloud node gone, no container left.
Exits 1 on a failed check. Ray's cluster start and stop run `ray stop --force`: no other
Ray may run on this machine meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import docker

from agent.docker_driver import LABEL_NODE
from dsec.client import Client
from dsec.launch.local import LocalPool, LocalPoolSpec
from dsec.models import Capacity, PoolParams
from dsec.processes import interrupt_on_termination
from dsec.tables import format_table

ACQUIRE_TIMEOUT_S = 120.0
GONE_TIMEOUT_S = 180.0
OVERFLOW_AT = 0.8  # PoolParams.overflow_threshold's default
COLD = PoolParams(min_warm=0, max_warm=0, templates=[])


def phase_spec(spec_type: type[LocalPoolSpec], args: argparse.Namespace, **fields):
    slots = args.local_slots
    return spec_type(
        name=f"bench-{uuid.uuid4().hex[:6]}",
        port=0,
        capacity=Capacity(cpus=slots, memory_mb=slots * 2048, slots=slots),
        pool=COLD,
        state_dir=Path(tempfile.mkdtemp(prefix="dsec-ray-overflow-")),
        heartbeat_s=0.5,
        cloud_nodes=1,
        cloud_idle_release_s=args.idle_release_s,
        **fields,
    )


async def overflow(
    pool: LocalPool,
    args: argparse.Namespace,
    node_gone: Callable[[str], Awaitable[bool]] | None = None,
) -> dict:
    """The burst on a started pool, timed from the first overflowing request; `node_gone`
    says whether the cloud node has left its cluster (Ray's autoscaler removed it)."""
    async with (
        Client(pool.url, token=pool.tokens.client) as client,
        Client(pool.url, token=pool.tokens.admin) as operator,
    ):
        held = [
            await client.acquire(timeout=ACQUIRE_TIMEOUT_S)
            for _ in range(math.ceil(OVERFLOW_AT * args.local_slots))
        ]
        t0 = time.monotonic()
        served_s: dict[str, float] = {}

        async def acquire():
            sb = await client.acquire(timeout=ACQUIRE_TIMEOUT_S)
            served_s[sb.id] = time.monotonic() - t0
            return sb

        burst = list(await asyncio.gather(*(acquire() for _ in range(args.burst - len(held)))))
        cloud = {n.node_id for n in (await operator.nodes()).nodes if n.kind == "cloud"}
        on_cloud = [sb for sb in burst if sb.node in cloud]
        outputs = await asyncio.gather(*(sb.exec(["echo", "tool"]) for sb in held + burst))
        released = await asyncio.gather(*(sb.release() for sb in held + burst))
        empty_s = time.monotonic() - t0
        report = {
            "sandboxes": len(held) + len(burst),
            "on_cloud": len(on_cloud),
            "cloud_paths": sorted({sb.lease.path for sb in on_cloud}),
            "tool_calls_ok": sum(o.stdout == "tool\n" for o in outputs),
            "released": len(released),
            "first_cloud_sandbox_s": min((served_s[sb.id] for sb in on_cloud), default=None),
            "empty_s": empty_s,
            "given_back_s": None,
            "node_removed_s": None,
        }
        if not on_cloud:
            return report
        node_id = on_cloud[0].node

        async def given_back() -> bool:
            return node_id not in {n.node_id for n in (await operator.nodes()).nodes}

        report["given_back_s"] = await _until(given_back, t0)
        if node_gone is not None:
            report["node_removed_s"] = await _until(lambda: node_gone(node_id), t0)
        report["lost"] = sum(1 for s in await operator.list() if s.state == "lost")
    return report


async def _until(check: Callable[[], Awaitable[bool]], t0: float) -> float | None:
    """Seconds from t0 until `check` holds; None if it did not within GONE_TIMEOUT_S."""
    deadline = time.monotonic() + GONE_TIMEOUT_S
    while time.monotonic() < deadline:
        if await check():
            return time.monotonic() - t0
        await asyncio.sleep(0.25)
    return None


def containers_left(pool: LocalPool) -> int:
    client = docker.from_env()
    found = client.containers.list(all=True, sparse=True, filters={"label": LABEL_NODE})
    return sum(1 for c in found if pool.owns_node((c.attrs.get("Labels") or {})[LABEL_NODE]))


async def run_pool(pool: LocalPool, args, node_gone=None) -> dict:
    try:
        async with pool:
            report = await overflow(pool, args, node_gone)
        report["swept"] = pool.swept
        report["left"] = await asyncio.to_thread(containers_left, pool)
        return report
    finally:
        shutil.rmtree(pool.spec.state_dir, ignore_errors=True)


async def local_phase(args: argparse.Namespace) -> dict:
    spec = phase_spec(LocalPoolSpec, args, nodes=1, cloud_boot_delay_s=0.0)
    return await run_pool(LocalPool(spec), args)


async def ray_phase(args: argparse.Namespace) -> dict:
    # first: it sets the loopback environment before Ray is imported
    from bench.ray_clusters import (
        GCS_PORT,
        LOOPBACK,
        NODE_RESOURCE,
        live_nodes,
        overflow_cluster,
        unwatch,
        watch,
    )
    from dsec.launch.ray import RayPool, RayPoolSpec

    cluster = overflow_cluster(1, 1, idle_timeout_s=args.ray_idle_timeout_s)
    address = f"{LOOPBACK}:{GCS_PORT}"
    await asyncio.to_thread(cluster.start)
    try:
        await asyncio.to_thread(watch, address)

        async def local_node_up() -> bool:
            return bool(await asyncio.to_thread(live_nodes, NODE_RESOURCE))

        if await _until(local_node_up, time.monotonic()) is None:
            raise RuntimeError("the autoscaler did not start the local sandbox node")

        async def node_gone(node_id: str) -> bool:
            suffix = node_id.rsplit("-", 1)[1]  # ray_node_id: the Ray id's last 12 hex
            return not any(r.endswith(suffix) for r in await asyncio.to_thread(live_nodes))

        spec = phase_spec(RayPoolSpec, args, address=address, expected_nodes=1)
        return await run_pool(RayPool(spec), args, node_gone)
    finally:
        with contextlib.suppress(Exception):
            await asyncio.to_thread(unwatch)
        await asyncio.to_thread(cluster.shutdown)


def failures(report: dict, removal: bool = False) -> list[str]:
    """What a phase got wrong: no cloud sandbox, a lost one, a node kept (given back by
    the control plane; with `removal`, also removed from its cluster), a leftover."""
    found = []
    if not report["on_cloud"]:
        found.append("no sandbox was served on a cloud node")
    if report["tool_calls_ok"] != report["sandboxes"]:
        found.append("a tool call failed")
    if report.get("lost"):
        found.append(f"{report['lost']} sandboxes lost")
    if report["on_cloud"] and report["given_back_s"] is None:
        found.append("the control plane did not give the cloud node back")
    if removal and report["on_cloud"] and report["node_removed_s"] is None:
        found.append("the autoscaler did not remove the cloud node")
    if report.get("left") or report.get("swept"):
        found.append(f"containers left behind (swept {report['swept']}, left {report['left']})")
    return found


async def run(args: argparse.Namespace) -> dict:
    return {"local": await local_phase(args), "ray": await ray_phase(args)}


def render(report: dict) -> str:
    def s(value):
        return "-" if value is None else f"{value:.1f}"

    def ratio(key):
        a, b = report["ray"].get(key), report["local"].get(key)
        return "-" if a is None or not b else f"{a / b:.2f}"

    rows = [
        [
            key.removesuffix("_s").replace("_", " "),
            s(report["local"][key]),
            s(report["ray"][key]),
            ratio(key),
        ]
        for key in ("first_cloud_sandbox_s", "empty_s", "given_back_s", "node_removed_s")
    ]
    lines = [
        "seconds from the first overflowing request",
        format_table(["", "local provider", "ray autoscaler", "ray / local"], rows),
    ]
    for name in ("local", "ray"):
        r = report[name]
        lines.append(
            f"{name}: {r['sandboxes']} sandboxes, {r['on_cloud']} on the cloud node "
            f"(paths {r['cloud_paths']}), lost {r.get('lost')}, containers left {r['left']}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--local-slots", type=int, default=5)
    parser.add_argument("--burst", type=int, default=7, help="acquires held at once, in all")
    parser.add_argument("--idle-release-s", type=float, default=5.0)
    parser.add_argument("--ray-idle-timeout-s", type=float, default=6.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.burst <= math.ceil(OVERFLOW_AT * args.local_slots) + 1:
        parser.error("--burst must exceed 80% of --local-slots by 2 or more")
    report = asyncio.run(run(args))
    if args.json:
        import json

        print(json.dumps(report))
    else:
        print(render(report))
    bad = [f"local: {f}" for f in failures(report["local"])]
    bad += [f"ray: {f}" for f in failures(report["ray"], removal=True)]
    for line in bad:
        print(f"MISS {line}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    interrupt_on_termination()  # the pool it starts is stopped on SIGTERM, SIGHUP
    raise SystemExit(main())
