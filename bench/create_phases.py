"""Where a sandbox's create goes on this engine: the Engine API's create (the container's
record, its layer) against its start (runc: namespaces, mounts, cgroups, the process),
and its removal, alone and several at once.

    python -m bench.create_phases [--samples 40] [--concurrency 1,8] [--json]

Each container is a sandbox's: the base template's config as the agent makes it
(`agent.docker_driver.container_config`: image, hardening, limits, tmpfs work dir, no
network), the labels of a sandbox under a node id of its own (`bench-phases-<hex>`),
removed at the end however the run ends. What it answers is which idle tier could pay:
a container created ahead and started on demand saves only the create's share.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import sys
import time
import uuid

import aiodocker

from agent.docker_driver import (
    LABEL_NODE,
    LABEL_POOL,
    LABEL_SANDBOX,
    LABEL_TEMPLATE,
    container_config,
)
from bench.stats import summary_ms
from controlplane.config import default_templates
from dsec.processes import interrupt_on_termination
from dsec.tables import format_table

PHASES = ("create", "start", "remove")


async def measure(samples: int, concurrency: int, docker: aiodocker.Docker, node: str) -> dict:
    spec = default_templates()["base"]
    took: dict[str, list[float]] = {phase: [] for phase in PHASES}
    slots = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with slots:
            sandbox_id = f"{node}.{secrets.token_hex(8)}"
            labels = {LABEL_NODE: node, LABEL_POOL: "phases", LABEL_TEMPLATE: spec.name,
                      LABEL_SANDBOX: sandbox_id}  # fmt: skip
            config = container_config(spec, labels, spec.user, None, None)
            t0 = time.perf_counter()
            container = await docker.containers.create(config, name=f"dsec-{sandbox_id}")
            t1 = time.perf_counter()
            await container.start()
            t2 = time.perf_counter()
            await container.delete(force=True, v=True)
            t3 = time.perf_counter()
            for phase, seconds in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                took[phase].append(seconds)

    await asyncio.gather(*(one() for _ in range(samples)))
    return {phase: summary_ms(values) for phase, values in took.items()}


async def run(samples: int, levels: list[int]) -> dict:
    node = f"bench-phases-{uuid.uuid4().hex[:8]}"
    docker = aiodocker.Docker()
    try:
        report = {str(k): await measure(samples, k, docker, node) for k in levels}
    finally:
        left = await docker.containers.list(all=True, filters={"label": [f"{LABEL_NODE}={node}"]})
        for container in left:
            await container.delete(force=True, v=True)
        await docker.close()
    for figures in report.values():
        whole = sum(figures[p]["p50"] for p in ("create", "start"))
        figures["create_share_of_p50"] = round(figures["create"]["p50"] / whole, 3)
    return report


def render(report: dict) -> str:
    rows = [
        [k, phase, f[phase]["p50"], f[phase]["p95"], f[phase]["max"]]
        for k, f in report.items()
        for phase in PHASES
    ]
    shares = ", ".join(f"{k} at once {f['create_share_of_p50']:.1%}" for k, f in report.items())
    return "\n".join(
        [
            format_table(["at once", "phase", "p50 ms", "p95 ms", "max ms"], rows),
            f"the create's share of create + start (p50): {shares}",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=40)
    parser.add_argument("--concurrency", default="1,8", help="levels, comma-separated")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        levels = [int(k) for k in args.concurrency.split(",")]
    except ValueError:
        levels = []
    if not 1 <= args.samples <= 1000 or not levels or not all(1 <= k <= 64 for k in levels):
        print("create_phases: --samples 1..1000, --concurrency levels 1..64", file=sys.stderr)
        return 2
    report = asyncio.run(run(args.samples, levels))
    print(json.dumps(report) if args.json else render(report))
    return 0


if __name__ == "__main__":
    interrupt_on_termination()
    sys.exit(main())
