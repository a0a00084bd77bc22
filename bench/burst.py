"""A burst of acquires against a live 3-node pool: the elastic policy against cold
create per request, in the same run.

    python -m bench.burst [--size 200] [--window-s 1] [--json]

Both sides get the same burst (`--size` acquires spread evenly over `--window-s`)
on the same pool, one after the other:
- `dsec`: a pool whose warm target covers the burst (min_warm = size, as an operator
  sizes an evaluation pool for the bursts it knows it will get), refilled at the
  policy's pace;
- `cold`: a pool with no warm sandboxes at all (min_warm = max_warm = 0), so every
  request waits for its own create: what a pool without a warm tier does.
Reported: client-observed and server-side schedule latency, and the share of claims
by path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

from bench.live_latency import _wait_warm
from bench.stats import summary_ms
from dsec.cli.up import LocalPool, LocalPoolSpec
from dsec.client import Client
from dsec.models import Capacity, PoolParams


async def burst(client: Client, pool: str, size: int, window_s: float) -> dict:
    started = time.perf_counter()

    async def one(i: int) -> tuple[float, float, str, object]:
        await asyncio.sleep(i * window_s / size - (time.perf_counter() - started))
        t0 = time.perf_counter()
        sb = await client.acquire(pool=pool, timeout=300)
        return time.perf_counter() - t0, sb.lease.schedule_ms / 1000, sb.lease.path, sb

    results = await asyncio.gather(*(one(i) for i in range(size)))
    await asyncio.gather(*(r[3].release() for r in results))
    paths: dict[str, int] = {}
    for r in results:
        paths[r[2]] = paths.get(r[2], 0) + 1
    return {
        "client_ms": summary_ms([r[0] for r in results]),
        "server_ms": summary_ms([r[1] for r in results]),
        "paths": {p: round(n / size, 4) for p, n in sorted(paths.items())},
    }


async def run(size: int, window_s: float) -> dict:
    spec = LocalPoolSpec(
        name="bench-burst", nodes=3, port=0,
        capacity=Capacity(cpus=1000, memory_mb=1 << 20, slots=2 * size),
        pool=PoolParams(min_warm=0), state_dir=Path(tempfile.mkdtemp()),
    )  # fmt: skip
    async with (
        LocalPool(spec) as pool,
        Client(pool.url, token=pool.tokens.admin) as operator,
        Client(pool.url, token=pool.tokens.client, connection_limit=2 * size) as client,
    ):
        policy = PoolParams(min_warm=size, max_warm=2 * size, templates=["base"])
        await operator.set_pool("dsec", policy)
        await operator.set_pool("cold", PoolParams(min_warm=0, max_warm=0, templates=[]))
        warmup_started = time.perf_counter()
        await _wait_warm(client, "dsec", size)
        warmup_s = time.perf_counter() - warmup_started
        ours = await burst(client, "dsec", size, window_s)
        await operator.set_pool("dsec", PoolParams(min_warm=0, max_warm=0, templates=[]))
        baseline = await burst(client, "cold", size, window_s)
    cold_ms, dsec_ms = baseline["client_ms"], ours["client_ms"]
    return {
        "size": size,
        "window_s": window_s,
        "warm_pool_fill_s": round(warmup_s, 2),
        "dsec": ours,
        "cold": baseline,
        "ratios": {
            "cold_p50_over_dsec_p50": round(cold_ms["p50"] / dsec_ms["p50"], 1),
            "cold_p99_over_dsec_p99": round(cold_ms["p99"] / dsec_ms["p99"], 1),
        },
    }  # fmt: skip


def render(report: dict) -> str:
    lines = [f"burst of {report['size']} acquires in {report['window_s']} s, 3 nodes"]
    lines.append(f"{'':24}{'p50 ms':>10}{'p95 ms':>10}{'p99 ms':>10}{'max ms':>10}  paths")
    for name in ("dsec", "cold"):
        for side in ("client_ms", "server_ms"):
            s = report[name][side]
            paths = ", ".join(f"{p} {v:.0%}" for p, v in report[name]["paths"].items())
            lines.append(
                f"{name + ' (' + side[:-3] + ')':24}{s['p50']:>10.1f}{s['p95']:>10.1f}"
                f"{s['p99']:>10.1f}{s['max']:>10.1f}  {paths if side == 'client_ms' else ''}"
            )
    lines.append("")
    lines.extend(f"{k}: {v}" for k, v in report["ratios"].items())
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=200)
    parser.add_argument("--window-s", type=float, default=1.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.size < 1 or args.window_s <= 0:
        print("burst: --size must be >= 1 and --window-s > 0", file=sys.stderr)
        return 2
    report = asyncio.run(run(args.size, args.window_s))
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
