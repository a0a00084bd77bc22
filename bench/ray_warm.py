"""What the Ray path adds to a warm acquire: `dsec ray up` against `dsec up` on the same
machine, in the same run (issue 15's target: a warm acquire p99 at most 1.1 times).

    python -m bench.ray_warm [--rounds 20] [--acquires 20] [--json]

Both pools run at once, each with two sandbox nodes on this machine's one Docker engine:
`dsec up --nodes 2` (agents as child processes on 127.0.0.x), and `dsec ray up` on Ray's
local multi-node test cluster (bench/ray_clusters.py: a head and two nodes offering
`dsec_node`, on loopback; agents as Ray actors). A round is the namespace benchmark's
(bench/multihost.py): `--acquires` at once from a full warm pool, a command in each
sandbox on its agent, every sandbox released. Rounds alternate between the pools and each
starts with both warm pools full, so that neither is measured while the other refills;
the first round of each opens its client's connections and is not counted. Exits 1 on a
miss. Ray's cluster runs `ray stop --force` when it stops: no other Ray may run here.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import sys
import tempfile
import uuid
from pathlib import Path

from bench.multihost import WARMUP_ROUNDS, acquire_round, ready, warm_figures
from dsec.client import Client
from dsec.launch.local import LocalPool, LocalPoolSpec
from dsec.models import Capacity, PoolParams
from dsec.processes import interrupt_on_termination
from dsec.tables import format_table

TARGET_RATIO = 1.1
NODES = 2


def pool_fields(acquires: int, state_dir: Path) -> dict:
    slots = acquires + 4  # room for a full warm pool and what a round's refill adds
    return dict(
        name=f"bench-{uuid.uuid4().hex[:6]}",
        port=0,
        capacity=Capacity(cpus=slots, memory_mb=slots * 512, slots=slots),
        pool=PoolParams(min_warm=acquires, max_warm=acquires),
        state_dir=state_dir,
    )


async def measure(args: argparse.Namespace, work: Path, ray_address: str) -> dict:
    from dsec.launch.ray import RayPool, RayPoolSpec

    local = LocalPool(LocalPoolSpec(nodes=NODES, **pool_fields(args.acquires, work / "up")))
    on_ray = RayPool(
        RayPoolSpec(
            address=ray_address, expected_nodes=NODES, **pool_fields(args.acquires, work / "ray")
        )
    )
    async with local, on_ray:
        return await alternate({"dsec up": local, "dsec ray up": on_ray}, args)


async def alternate(pools: dict[str, LocalPool], args: argparse.Namespace) -> dict:
    async with contextlib.AsyncExitStack() as stack:
        clients = {
            name: await stack.enter_async_context(Client(pool.url, pool.tokens.admin))
            for name, pool in pools.items()
        }
        names = list(pools)
        samples: dict[str, list[dict]] = {name: [] for name in names}
        for r in range(-WARMUP_ROUNDS, args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                for each in clients.values():  # both full: no refill beside the round
                    await ready(each, [], args.acquires)
                answer = await acquire_round(clients[name], args.acquires)
                if r >= 0:
                    samples[name] += answer["samples"]
    return summarise(samples, args)


def summarise(samples: dict[str, list[dict]], args: argparse.Namespace) -> dict:
    pools = {name: warm_figures(got) for name, got in samples.items()}
    p99 = {name: figures["warm_acquire_ms"]["p99"] for name, figures in pools.items()}
    ratio = p99["dsec ray up"] / p99["dsec up"]
    return {
        "rounds": args.rounds,
        "acquires": args.acquires,
        "pools": pools,
        "p99_ratio": round(ratio, 3),
        "target_ratio": TARGET_RATIO,
        "met": ratio <= TARGET_RATIO
        and not any(p["execs_failed"] or p["not_warm"] for p in pools.values()),
    }


def render(report: dict) -> str:
    rows = []
    for name, figures in report["pools"].items():
        ms = figures["warm_acquire_ms"]
        rows.append(
            [name, ms["n"], ms["p50"], ms["p99"], figures["not_warm"], figures["execs_failed"]]
        )
    verdict = "met" if report["met"] else "MISSED"
    return "\n".join(
        [
            format_table(
                ["", "warm acquires", "p50 ms", "p99 ms", "not warm", "execs failed"], rows
            ),
            f"ray / up p99: {report['p99_ratio']} (target <= {report['target_ratio']}): {verdict}",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ray_warm", description=__doc__)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--acquires", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    # first: it sets the loopback environment before Ray is imported
    from bench.ray_clusters import sandbox_cluster

    work = Path(tempfile.mkdtemp(prefix="dsec-ray-warm-"))
    cluster = sandbox_cluster(NODES)  # in the main thread: Ray sets a signal handler
    try:
        report = asyncio.run(measure(args, work, cluster.address))
    finally:
        cluster.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(report) if args.json else render(report))
    return 0 if report["met"] else 1


if __name__ == "__main__":
    interrupt_on_termination()  # the pool it starts is stopped on SIGTERM, SIGHUP
    sys.exit(main())
