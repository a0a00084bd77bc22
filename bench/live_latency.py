"""Acquire and exec latency on a live pool, each against a baseline in the same run.

- Acquire seen by the client when a warm sandbox is ready, against acquire when none
  is (a pool kept at zero warm: every request is a cold create).
- Exec of `true` through the agent (HTTP, lease check, Docker exec), against the
  `docker` SDK's own `exec_run` on the same container, interleaved so both see the
  same machine.

    python -m bench.live_latency [--samples 300] [--json]

Starts its own 3-node pool unless --url is given (then DSEC_ADMIN_TOKEN is needed to
create the benchmark's pools).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

import docker

from bench.stats import summary_ms
from dsec.client import Client
from dsec.launch.local import LocalPool, LocalPoolSpec
from dsec.models import Capacity, PoolParams
from dsec.processes import interrupt_on_termination

WARM_BATCH = 20


async def _wait_warm(client: Client, pool: str, want: int) -> None:
    for _ in range(600):
        info = next(p for p in (await client.pools()).pools if p.name == pool)
        if info.sandboxes.get("warm", 0) >= want:
            return
        await asyncio.sleep(0.05)
    raise RuntimeError(f"pool {pool} never reached {want} warm sandboxes")


async def acquire_latencies(client: Client, pool: str, samples: int, warm: int) -> dict:
    """Acquire one at a time; with `warm` > 0, each batch starts from a full warm pool."""
    seconds: list[float] = []
    server_ms: list[float] = []
    paths: dict[str, int] = {}
    while len(seconds) < samples:
        if warm:
            await _wait_warm(client, pool, warm)
        held = []
        for _ in range(min(warm or 10, samples - len(seconds))):
            started = time.perf_counter()
            sb = await client.acquire(pool=pool, timeout=60)
            seconds.append(time.perf_counter() - started)
            server_ms.append(sb.lease.schedule_ms)
            paths[sb.lease.path] = paths.get(sb.lease.path, 0) + 1
            held.append(sb)
        await asyncio.gather(*(sb.release() for sb in held))
    return {
        "client_ms": summary_ms(seconds),
        "server_ms": summary_ms([m / 1000 for m in server_ms]),
        "paths": paths,
    }


async def exec_latencies(client: Client, samples: int) -> dict:
    docker_client = docker.from_env()
    async with client.sandbox(timeout=60) as sb:
        container = docker_client.containers.get(f"dsec-{sb.id}")
        via_agent, via_sdk = [], []
        for _ in range(samples):
            started = time.perf_counter()
            result = await sb.exec(["true"])
            via_agent.append(time.perf_counter() - started)
            assert result.exit_code == 0
            started = time.perf_counter()
            code, _ = await asyncio.to_thread(container.exec_run, ["true"])
            via_sdk.append(time.perf_counter() - started)
            assert code == 0
    return {"agent_ms": summary_ms(via_agent), "docker_sdk_ms": summary_ms(via_sdk)}


async def run(url: str | None, admin: str | None, token: str | None, samples: int) -> dict:
    async with contextlib.AsyncExitStack() as stack:
        if url is None:
            spec = LocalPoolSpec(
                name="bench-latency", nodes=3, port=0,
                capacity=Capacity(cpus=64, memory_mb=65536, slots=80),
                pool=PoolParams(min_warm=0), state_dir=Path(tempfile.mkdtemp()),
            )  # fmt: skip
            pool = await stack.enter_async_context(LocalPool(spec))
            url, admin, token = pool.url, pool.tokens.admin, pool.tokens.client
        async with Client(url, token=admin) as operator:
            await operator.set_pool("bench-warm", PoolParams(min_warm=WARM_BATCH, max_warm=64))
            # no warm tier at all: every acquire waits for its own create
            await operator.set_pool("bench-cold", PoolParams(min_warm=0, max_warm=0, templates=[]))
        async with Client(url, token=token) as client:
            warm = await acquire_latencies(client, "bench-warm", samples, WARM_BATCH)
            cold = await acquire_latencies(client, "bench-cold", max(30, samples // 5), 0)
            exec_ = await exec_latencies(client, samples)
        async with Client(url, token=admin) as operator:
            await operator.set_pool("bench-warm", PoolParams(min_warm=0, templates=[]))
    return {
        "acquire_warm": warm,
        "acquire_cold": cold,
        "exec": exec_,
        "ratios": {
            "warm_p50_over_cold_p50": round(
                warm["client_ms"]["p50"] / cold["client_ms"]["p50"], 4),
            "warm_p99_over_cold_p50": round(
                warm["client_ms"]["p99"] / cold["client_ms"]["p50"], 4),
            "exec_agent_p50_over_sdk_p50": round(
                exec_["agent_ms"]["p50"] / exec_["docker_sdk_ms"]["p50"], 4),
            "exec_agent_overhead_p50_ms": round(
                exec_["agent_ms"]["p50"] - exec_["docker_sdk_ms"]["p50"], 3),
        },
    }  # fmt: skip


def render(report: dict) -> str:
    rows = [
        ("acquire, warm (client)", report["acquire_warm"]["client_ms"]),
        ("acquire, warm (server)", report["acquire_warm"]["server_ms"]),
        ("acquire, cold (client)", report["acquire_cold"]["client_ms"]),
        ("exec true, via agent", report["exec"]["agent_ms"]),
        ("exec true, docker SDK", report["exec"]["docker_sdk_ms"]),
    ]
    lines = [f"{'':26}{'n':>6}{'p50 ms':>10}{'p95 ms':>10}{'p99 ms':>10}{'max ms':>10}"]
    for name, s in rows:
        lines.append(
            f"{name:26}{s['n']:>6}{s['p50']:>10.2f}{s['p95']:>10.2f}{s['p99']:>10.2f}{s['max']:>10.2f}"
        )
    lines.append("")
    lines.extend(f"{k}: {v}" for k, v in report["ratios"].items())
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running control plane (default: start a pool)")
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.samples < 20:
        print("live_latency: --samples must be at least 20", file=sys.stderr)
        return 2
    import os

    report = asyncio.run(
        run(
            args.url, os.environ.get("DSEC_ADMIN_TOKEN"), os.environ.get("DSEC_TOKEN"), args.samples
        )
    )
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


if __name__ == "__main__":
    interrupt_on_termination()  # the pool it starts is stopped on SIGTERM, SIGHUP
    sys.exit(main())
