"""Soak: many acquire -> exec -> release cycles on a live pool, checking for leaks.

    python -m bench.soak [--cycles 1000] [--concurrency 16] [--nodes 3] [--warmup 100] [--json]

A local pool (a control plane and `--nodes` agents, real processes) serves `--cycles`
cycles, `--concurrency` at a time; each acquires a sandbox, runs `echo` in it, checks
the output and releases it (which removes its container). First come `--warmup` cycles
that are not judged, so allocator and connection-pool warm-up is not called a leak.

Measured at two quiet points, after warm-up and after the run, each time once the
pool has been drained (the policy pauses and destroys every warm sandbox): the
dsec-labelled containers of the pool's nodes, and the open file descriptors, threads
and RSS of the control plane and of each agent; peaks while the cycles run; and,
after the pool stops, the containers its final sweep had to remove (the agents should
have removed their own) and any still there.

A leak, and a non-zero exit, is any of: a failed cycle; a container of the pool left
after a drain or after the stop; a process whose fds grew by more than FD_SLACK; a
process whose RSS grew by more than RSS_FLOOR_MB + RSS_SLACK_MB per 1000 cycles it
served.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import docker
from docker.errors import DockerException

from agent.docker_driver import LABEL_NODE
from agent.node import HIBERNATED_REPOSITORY
from bench.stats import summary_ms
from dsec.cli import format_table
from dsec.cli.up import LocalPool, LocalPoolError, LocalPoolSpec
from dsec.client import Client, DsecError
from dsec.models import Capacity, PoolParams

# Socket pools (the Docker SDK's towards the engine, aiohttp's between the control plane
# and the agents) and thread pools fill lazily and keep what they opened: drained and
# idle, an agent's fd count wandered within 12 over 2000 cycles (measured, 3 nodes,
# concurrency 16). A leak of one fd per cycle shows as hundreds.
FD_SLACK = 20
# RSS may grow by RSS_FLOOR_MB plus RSS_SLACK_MB per 1000 cycles the process served (all
# for the control plane, its own sandboxes' for an agent). The floor: Python's allocator
# takes memory in 1 MiB arenas, so RSS moves in steps. The slope: by design the processes
# keep bounded tombstones (released ids and idempotency keys, 100k each: ~0.35 KB a
# cycle); measured, the Python heap grows by no more than that (tracemalloc) while RSS
# grows 1-3 MB per 1000 cycles served after a 100-cycle warm-up, the allocator's own.
RSS_FLOOR_MB = 2.0
RSS_SLACK_MB = 4.0
DRAIN_TIMEOUT_S = 180.0
SAMPLE_EVERY_S = 1.0
ACQUIRE_TIMEOUT_S = 120.0
QUIET_S = 2.0  # after a drain, for closed connections and ended tasks to be let go

# Warm sandboxes past the target are paused at once, and paused ones destroyed at
# once (before they could hibernate): the policy itself empties the pool.
DRAIN = PoolParams(
    min_warm=0, max_warm=0, templates=[], freeze_after_s=0.01, scale_down_step=1.0,
    frozen_ttl_s=0.01, hibernate_after_s=86_400,
)  # fmt: skip


# --- a pool and its containers (shared with bench.neighbour) ---------------------


@dataclass
class Teardown:
    swept: int = -1  # containers LocalPool.stop removed itself: the agents had not
    left: int = -1  # containers of the pool still present after the stop


def pool_containers(node_ids: list[str]) -> int:
    """Containers (any state, as `docker ps -a`) labelled with one of these nodes."""
    client = docker.from_env()
    found = client.containers.list(all=True, sparse=True, filters={"label": LABEL_NODE})
    nodes = set(node_ids)
    return sum(1 for c in found if (c.attrs.get("Labels") or {}).get(LABEL_NODE) in nodes)


def hibernated_images(node_ids: list[str]) -> int:
    """Snapshots of hibernated sandboxes of these nodes (tagged with the sandbox id)."""
    client = docker.from_env()
    tags = [t for img in client.images.list(name=HIBERNATED_REPOSITORY) for t in img.tags]
    prefixes = tuple(f"{HIBERNATED_REPOSITORY}:{n}." for n in node_ids)
    return sum(1 for t in tags if t.startswith(prefixes))


def bench_spec(kind: str, nodes: int, slots: int) -> LocalPoolSpec:
    """A pool of its own (unique name, fresh state dir) that serves nothing until told."""
    return LocalPoolSpec(
        name=f"bench-{kind}-{uuid.uuid4().hex[:6]}", nodes=nodes, port=0,
        capacity=Capacity(cpus=1000, memory_mb=1 << 20, slots=slots),
        pool=PoolParams(min_warm=0), state_dir=Path(tempfile.mkdtemp()),
    )  # fmt: skip


@asynccontextmanager
async def local_pool(spec: LocalPoolSpec, teardown: Teardown) -> AsyncIterator[LocalPool]:
    """A started pool, stopped on the way out however the body ends (error, Ctrl-C)."""
    pool = LocalPool(spec)
    try:
        async with pool:
            yield pool
    finally:
        teardown.swept = pool.swept
        teardown.left = await asyncio.to_thread(pool_containers, pool.node_ids)
        shutil.rmtree(spec.state_dir, ignore_errors=True)  # bench_spec's temporary dir


def run_to_report(
    name: str, bench: Coroutine[Any, Any, dict], render: Callable[[dict], str], as_json: bool
) -> dict:
    """Run a live benchmark and print its report (JSON or table). On Ctrl-C or a
    failure, the pool is stopped and the process exits: 130, or 1 with the reason."""
    try:
        report = asyncio.run(bench)
    except KeyboardInterrupt:
        print(f"{name}: interrupted; the pool was stopped", file=sys.stderr)
        raise SystemExit(130) from None
    except (LocalPoolError, RuntimeError, DsecError, aiohttp.ClientError, DockerException) as e:
        print(f"{name}: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    print(json.dumps(report, indent=2) if as_json else render(report))
    return report


# --- process figures ---------------------------------------------------------------


@dataclass
class ProcessSample:
    fds: int
    threads: int
    rss_kb: int


def sample_process(pid: int) -> ProcessSample:
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(re.findall(r"^(\w+):\s+(\d+)", status, re.MULTILINE))
    return ProcessSample(
        fds=len(os.listdir(f"/proc/{pid}/fd")),
        threads=int(fields["Threads"]),
        rss_kb=int(fields["VmRSS"]),
    )


def pool_pids(pool: LocalPool) -> dict[str, int]:
    assert pool.controlplane is not None
    return {"controlplane": pool.controlplane.proc.pid} | {a.name: a.proc.pid for a in pool.agents}


@dataclass
class Snapshot:
    containers: int
    processes: dict[str, ProcessSample]


async def snapshot(pool: LocalPool) -> Snapshot:
    containers = await asyncio.to_thread(pool_containers, pool.node_ids)
    return Snapshot(containers, {n: sample_process(p) for n, p in pool_pids(pool).items()})


@dataclass
class Peaks:
    containers: int = 0
    processes: dict[str, ProcessSample] = field(default_factory=dict)

    def add(self, snap: Snapshot) -> None:
        self.containers = max(self.containers, snap.containers)
        for name, s in snap.processes.items():
            p = self.processes.setdefault(name, s)
            self.processes[name] = ProcessSample(
                max(p.fds, s.fds), max(p.threads, s.threads), max(p.rss_kb, s.rss_kb)
            )


async def sample_until(pool: LocalPool, peaks: Peaks, done: asyncio.Event) -> None:
    while not done.is_set():
        peaks.add(await snapshot(pool))
        try:
            await asyncio.wait_for(done.wait(), SAMPLE_EVERY_S)
        except TimeoutError:
            pass


# --- the cycles ------------------------------------------------------------------


@dataclass
class CycleStats:
    acquire_s: list[float] = field(default_factory=list)
    exec_s: list[float] = field(default_factory=list)
    release_s: list[float] = field(default_factory=list)
    completed: int = 0
    by_node: Counter[str] = field(default_factory=Counter)  # cycles each node served
    errors: list[str] = field(default_factory=list)


async def one_cycle(client: Client, pool: str, i: int, stats: CycleStats) -> None:
    started = time.perf_counter()
    sb = await client.acquire(pool=pool, timeout=ACQUIRE_TIMEOUT_S)
    stats.acquire_s.append(time.perf_counter() - started)
    stats.by_node[sb.node] += 1
    try:
        started = time.perf_counter()
        result = await sb.exec(["echo", f"cycle-{i}"], timeout=30)
        stats.exec_s.append(time.perf_counter() - started)
        if (result.exit_code, result.stdout) != (0, f"cycle-{i}\n"):
            raise RuntimeError(f"exec answered {result.exit_code} {result.stdout!r}")
    finally:
        started = time.perf_counter()
        await sb.release()
        stats.release_s.append(time.perf_counter() - started)


async def run_cycles(pool: LocalPool, name: str, cycles: int, concurrency: int) -> CycleStats:
    """On a client of their own, closed at the end: the sockets its keep-alive connections
    hold open in the agents are not the agents' to answer for."""
    stats = CycleStats()
    todo = iter(range(cycles))

    async def worker(client: Client) -> None:
        while (i := next(todo, None)) is not None:
            try:
                await one_cycle(client, name, i, stats)
                stats.completed += 1
            except Exception as e:  # counted and reported: the soak goes on
                stats.errors.append(f"cycle {i}: {type(e).__name__}: {e}")

    async with Client(pool.url, token=pool.tokens.client) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return stats


async def drain(operator: Client, name: str) -> float:
    """Empty pool `name` through the policy; returns the seconds until the control plane
    knew none of its sandboxes. Docker should then show none of their containers either
    (a removal is done before it is answered): any it shows has leaked."""
    await operator.set_pool(name, DRAIN)
    started = time.perf_counter()
    while await operator.list(pool=name):
        if time.perf_counter() - started > DRAIN_TIMEOUT_S:
            raise RuntimeError(f"pool {name} still had sandboxes {DRAIN_TIMEOUT_S:.0f} s on")
        await asyncio.sleep(0.25)
    took = time.perf_counter() - started
    await asyncio.sleep(QUIET_S)
    return took


# --- the run and its verdict ------------------------------------------------------


async def soak(cycles: int, concurrency: int, nodes: int, warmup: int) -> dict:
    spec = bench_spec("soak", nodes, slots=4 * concurrency)
    serving = PoolParams(min_warm=concurrency, max_warm=2 * concurrency, templates=["base"])
    teardown = Teardown()
    async with local_pool(spec, teardown) as pool:
        async with Client(pool.url, token=pool.tokens.admin) as operator:
            initial = await snapshot(pool)
            await operator.set_pool("soak", serving)
            warm = await run_cycles(pool, "soak", warmup, concurrency)
            await drain(operator, "soak")
            start = await snapshot(pool)

            await operator.set_pool("soak", serving)
            peaks, done = Peaks(), asyncio.Event()
            sampler = asyncio.create_task(sample_until(pool, peaks, done))
            started = time.perf_counter()
            try:
                stats = await run_cycles(pool, "soak", cycles, concurrency)
            finally:
                done.set()
                await sampler
            run_s = time.perf_counter() - started
            drain_s = await drain(operator, "soak")
            end = await snapshot(pool)
            images = await asyncio.to_thread(hibernated_images, pool.node_ids)
    return report(
        cycles, concurrency, nodes, warm, stats, initial, start, peaks, end, teardown,
        images, run_s, drain_s,
    )  # fmt: skip


def report(
    cycles: int,
    concurrency: int,
    nodes: int,
    warm: CycleStats,
    stats: CycleStats,
    initial: Snapshot,
    start: Snapshot,
    peaks: Peaks,
    end: Snapshot,
    teardown: Teardown,
    images: int,
    run_s: float,
    drain_s: float,
) -> dict:
    processes = {}
    leaks = []
    for name, s in start.processes.items():
        e, p, i = end.processes[name], peaks.processes.get(name, s), initial.processes[name]
        growth_mb = (e.rss_kb - s.rss_kb) / 1024
        served = stats.completed if name == "controlplane" else stats.by_node[name]
        per_1000 = growth_mb * 1000 / max(1, served)
        allowed_mb = RSS_FLOOR_MB + RSS_SLACK_MB * served / 1000
        processes[name] = {
            "cycles_served": served,
            "fds": {"start": s.fds, "peak": p.fds, "end": e.fds},
            "threads": {"start": s.threads, "peak": p.threads, "end": e.threads},
            "rss_mb": {
                "before_warmup": round(i.rss_kb / 1024, 1),
                "start": round(s.rss_kb / 1024, 1),
                "peak": round(p.rss_kb / 1024, 1),
                "end": round(e.rss_kb / 1024, 1),
                "growth": round(growth_mb, 2),
                "growth_per_1000_served": round(per_1000, 2),
                "allowed_growth": round(allowed_mb, 2),
            },
        }
        if e.fds - s.fds > FD_SLACK:
            leaks.append(f"{name}: fds {s.fds} -> {e.fds} (more than +{FD_SLACK})")
        if growth_mb > allowed_mb:
            leaks.append(f"{name}: RSS +{growth_mb:.1f} MB (over {allowed_mb:.1f} allowed)")
    if stats.errors or warm.errors:
        leaks.append(f"{len(stats.errors) + len(warm.errors)} cycles failed")
    if end.containers:
        leaks.append(f"{end.containers} containers left after the drain")
    if teardown.swept or teardown.left:
        leaks.append(
            f"at stop: {teardown.swept} containers swept (not removed by their agent), "
            f"{teardown.left} left"
        )
    if images:
        leaks.append(f"{images} hibernated images left")
    return {
        "cycles": cycles,
        "concurrency": concurrency,
        "nodes": nodes,
        "warmup_cycles": warm.completed,
        "completed": stats.completed,
        "errors": len(stats.errors) + len(warm.errors),
        "error_samples": (warm.errors + stats.errors)[:10],
        "run_s": round(run_s, 1),
        "cycles_per_s": round(stats.completed / run_s, 2) if run_s else None,
        "containers": {
            "start": start.containers,
            "peak": peaks.containers,
            "end_after_drain": end.containers,
            "drain_s": round(drain_s, 1),
            "swept_at_stop": teardown.swept,
            "left_after_stop": teardown.left,
            "hibernated_images_left": images,
        },
        "processes": processes,
        "latency_ms": {
            "acquire": summary_ms(stats.acquire_s),
            "exec": summary_ms(stats.exec_s),
            "release": summary_ms(stats.release_s),
        },
        "thresholds": {
            "fd_slack": FD_SLACK,
            "rss_floor_mb": RSS_FLOOR_MB,
            "rss_slack_mb_per_1000_served": RSS_SLACK_MB,
        },
        "leaks": leaks,
    }


def render(r: dict) -> str:
    c = r["containers"]
    lines = [
        f"soak: {r['completed']}/{r['cycles']} cycles ({r['warmup_cycles']} warm-up before), "
        f"concurrency {r['concurrency']}, {r['nodes']} nodes, {r['run_s']} s "
        f"({r['cycles_per_s']} cycles/s), errors {r['errors']}",
        f"containers: start {c['start']}, peak {c['peak']}, after drain {c['end_after_drain']} "
        f"(drain {c['drain_s']} s), swept at stop {c['swept_at_stop']}, "
        f"left after stop {c['left_after_stop']}, hibernated images {c['hibernated_images_left']}",
        "",
    ]
    rows = []
    for name, p in r["processes"].items():
        fds, th, rss = p["fds"], p["threads"], p["rss_mb"]
        rows.append([
            name, f"{fds['start']}/{fds['peak']}/{fds['end']}",
            f"{th['start']}/{th['peak']}/{th['end']}",
            rss["before_warmup"], rss["start"], rss["peak"], rss["end"],
            f"{rss['growth']:+.2f}", rss["allowed_growth"], p["cycles_served"],
            f"{rss['growth_per_1000_served']:+.2f}",
        ])  # fmt: skip
    headers = ["process", "fds s/pk/e", "threads s/pk/e", "RSS MB: pre-warm", "start",
               "peak", "end", "growth", "allowed", "served", "per 1000"]  # fmt: skip
    lines += [format_table(headers, rows), ""]
    rows = [
        [op, s["n"], s["p50"], s["p95"], s["p99"], s["max"]] for op, s in r["latency_ms"].items()
    ]
    lines += [format_table(["latency ms", "n", "p50", "p95", "p99", "max"], rows), ""]
    t = r["thresholds"]
    lines.append(
        f"leak thresholds: fds end-start > {t['fd_slack']}; RSS growth > {t['rss_floor_mb']} MB "
        f"+ {t['rss_slack_mb_per_1000_served']} MB per 1000 cycles served; any container left "
        "or failed cycle"
    )
    lines += [f"LEAK: {x}" for x in r["leaks"]] or ["no leak found"]
    lines += [f"  {e}" for e in r["error_samples"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=100, help="cycles before the judged run")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.cycles < 1 or args.concurrency < 1 or not 1 <= args.nodes <= 200 or args.warmup < 0:
        print("soak: --cycles, --concurrency and --nodes (<= 200) must be >= 1, "
              "--warmup >= 0", file=sys.stderr)  # fmt: skip
        return 2
    result = run_to_report(
        "soak", soak(args.cycles, args.concurrency, args.nodes, args.warmup), render, args.json
    )
    return 1 if result["leaks"] else 0


if __name__ == "__main__":
    sys.exit(main())
