"""What a Prometheus scrape of the control plane's `/metrics` costs, against a baseline.

Two control planes run in this process, each on its own loopback port: one that
knows nothing (the baseline), and one that agents' heartbeats have told about
`--sandboxes` sandboxes on `--nodes` nodes. Both answer the same `GET /metrics`
over HTTP, interleaved so they see the same machine; the report gives p50 and p99
of each and their ratios. The gauges that describe the view are computed at scrape
time, so this is where a big pool would show up.

    python -m bench.scrape_cost [--sandboxes 500] [--nodes 3] [--runs 500] [--json]

No agent process runs: the heartbeats are sent by this script, the sandboxes are
leased (so the policy has nothing to do) and no node is ever called.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
from aiohttp import web

from bench.stats import summary_ms
from controlplane.app import create_controlplane_app
from controlplane.config import ControlPlaneConfig
from controlplane.identities import Identities
from dsec.clock import SystemClock
from dsec.models import Capacity, NodeReport, PoolParams, SandboxRow, SandboxTable, Usage
from dsec.states import SandboxState
from dsec.tokens import new_lease_id, new_token

POOLS = ("train", "eval")
# A leased sandbox is either running commands or frozen while its agent thinks.
LEASED_STATES = (SandboxState.LEASED, SandboxState.LEASED_PAUSED)
WARMUP_RUNS = 20


def node_reports(sandboxes: int, nodes: int, identities: Identities) -> list[NodeReport]:
    """Heartbeats from `nodes` nodes that hold `sandboxes` leased sandboxes between them,
    each lease with its grant's proof from the control plane of `identities`."""
    reports = []
    for n in range(nodes):
        node_id = f"bench-{n + 1}"
        mine = []
        for i in range(n, sandboxes, nodes):
            sandbox_id, lease_id = f"{node_id}.{secrets.token_hex(8)}", new_lease_id()
            pool = POOLS[i % len(POOLS)]
            mine.append(
                SandboxRow(
                    id=sandbox_id,
                    pool=pool,
                    template="base",
                    state=LEASED_STATES[i % len(LEASED_STATES)],
                    created_at=time.time(),
                    cpus=0.5,
                    memory_mb=256,
                    lease_id=lease_id,
                    idempotency_key=None,
                    owner=None,
                    busy_s=float(i % 60),
                    active_at=time.monotonic(),
                    frozen_at=None,
                    grant_proof=identities.grant_proof(
                        node_id, sandbox_id, lease_id, None, None, pool
                    ),
                )
            )
        reports.append(
            NodeReport(
                node_id=node_id,
                kind="cloud" if n == nodes - 1 and nodes > 1 else "local",
                url=f"http://127.0.0.{n + 2}:9",  # never called: nothing is asked of it
                capacity=Capacity(cpus=1000, memory_mb=1 << 20, slots=10_000),
                usage=Usage(cpus=0.5 * len(mine), memory_mb=256 * len(mine), slots=len(mine)),
                sandboxes=SandboxTable.of(mine),
                incarnation=secrets.token_hex(8),
                clock=time.monotonic(),
                seq=1,
            )
        )
    return reports


@asynccontextmanager
async def control_plane() -> AsyncIterator[tuple[str, Identities]]:
    """A control plane on a free loopback port; yields its URL and its nodes' credentials."""
    config = ControlPlaneConfig(
        port=0,
        admin_tokens=[new_token()],
        agent_token=new_token(),
        pools={name: PoolParams(min_warm=0, templates=[]) for name in POOLS},
        heartbeat_timeout_s=3600,  # one heartbeat must last the whole run
    )
    runner = web.AppRunner(create_controlplane_app(config, SystemClock()), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", Identities.of(config)
    finally:
        await runner.cleanup()


async def register(http: aiohttp.ClientSession, url: str, identities: Identities, reports) -> None:
    for report in reports:
        headers = {
            "Authorization": f"Bearer {identities.node_token(report.node_id)}",
            "Content-Type": "application/json",
        }
        async with http.put(
            f"{url}/v1/agents/{report.node_id}", data=report.model_dump_json(), headers=headers
        ) as resp:
            resp.raise_for_status()
    async with http.get(f"{url}/healthz") as resp:
        known = (await resp.json())["sandboxes"]
    expected = sum(len(r.sandboxes.id) for r in reports)
    if known != expected:
        raise RuntimeError(f"the control plane knows {known} sandboxes, not {expected}")


async def scrape_once(http: aiohttp.ClientSession, url: str) -> tuple[float, int]:
    started = time.perf_counter()
    async with http.get(f"{url}/metrics") as resp:
        body = await resp.read()
        resp.raise_for_status()
    return time.perf_counter() - started, len(body)


def series_count(body: bytes) -> int:
    return sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))


async def run(sandboxes: int, nodes: int, runs: int) -> dict:
    async with (
        control_plane() as (empty_url, _),
        control_plane() as (full_url, identities),
        aiohttp.ClientSession() as http,
    ):
        await register(http, full_url, identities, node_reports(sandboxes, nodes, identities))
        for _ in range(WARMUP_RUNS):
            await scrape_once(http, empty_url)
            await scrape_once(http, full_url)
        empty_s, full_s = [], []
        for _ in range(runs):
            seconds, _ = await scrape_once(http, empty_url)
            empty_s.append(seconds)
            seconds, _ = await scrape_once(http, full_url)
            full_s.append(seconds)
        async with http.get(f"{empty_url}/metrics") as resp:
            empty_body = await resp.read()
        async with http.get(f"{full_url}/metrics") as resp:
            full_body = await resp.read()
    empty, full = summary_ms(empty_s), summary_ms(full_s)
    return {
        "sandboxes": sandboxes,
        "nodes": nodes,
        "runs": runs,
        "empty": {**empty, "bytes": len(empty_body), "series": series_count(empty_body)},
        "loaded": {**full, "bytes": len(full_body), "series": series_count(full_body)},
        "ratios": {
            "p50_loaded_over_empty": round(full["p50"] / empty["p50"], 3),
            "p99_loaded_over_empty": round(full["p99"] / empty["p99"], 3),
        },
    }


def render(report: dict) -> str:
    lines = [
        f"GET /metrics, {report['runs']} runs each, "
        f"{report['sandboxes']} sandboxes on {report['nodes']} nodes",
        f"{'':22}{'p50 ms':>9}{'p95 ms':>9}{'p99 ms':>9}{'max ms':>9}{'bytes':>9}{'series':>8}",
    ]
    for name, key in (("empty control plane", "empty"), ("loaded control plane", "loaded")):
        s = report[key]
        lines.append(
            f"{name:22}{s['p50']:>9.3f}{s['p95']:>9.3f}{s['p99']:>9.3f}{s['max']:>9.3f}"
            f"{s['bytes']:>9}{s['series']:>8}"
        )
    lines.append("")
    lines.extend(f"{k}: {v}" for k, v in report["ratios"].items())
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sandboxes", type=int, default=500)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--runs", type=int, default=500)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.sandboxes < 0 or not 1 <= args.nodes <= 250 or args.runs < 10:
        print(
            "scrape_cost: need --sandboxes >= 0, 1 <= --nodes <= 250, --runs >= 10", file=sys.stderr
        )
        return 2
    report = asyncio.run(run(args.sandboxes, args.nodes, args.runs))
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
