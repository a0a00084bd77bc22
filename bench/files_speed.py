"""Files through the agent's route: 64 MiB up (`PUT .../files`) and down (`GET`), bytes
compared, MiB/s each way and the agent's CPU time for each (`agent_cpu_ms`, /proc).

    python -m bench.files_speed [--mib 64] [--reps 5] [--json]

Starts its own local pool (one agent, one sandbox). Run it from two checkouts to
compare agent code (the same script copied into the older one), under the Docker lock:
`flock /tmp/dsec-docker.lock python -m bench.files_speed`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys

import aiohttp

from bench.data_plane import POOL, AgentPath, CpuProbe, acquire_all
from bench.soak import Teardown, bench_spec, local_pool
from dsec.client import Client
from dsec.models import PoolParams
from dsec.processes import interrupt_on_termination


async def measure(mib: int, reps: int) -> dict:
    data = os.urandom(mib << 20)
    rates: dict[str, list[float]] = {"upload": [], "download": []}
    cpu_ms: dict[str, list[float]] = {"upload": [], "download": []}
    teardown = Teardown()
    async with local_pool(bench_spec("files-speed", nodes=1, slots=2), teardown) as pool:
        async with contextlib.AsyncExitStack() as stack:
            operator = await stack.enter_async_context(Client(pool.url, token=pool.tokens.admin))
            await operator.set_pool(POOL, PoolParams(min_warm=0, max_warm=0, templates=[]))
            client = await stack.enter_async_context(Client(pool.url, token=pool.tokens.client))
            http = await stack.enter_async_context(aiohttp.ClientSession())
            (sb,) = await acquire_all(client, stack, 1)
            agent = AgentPath(http, sb)
            probe = CpuProbe(pool.agents[0].proc.pid)
            for rep in range(reps + 1):  # the first is a warm-up: it grows the tmpfs
                started = probe.sample()
                await agent.put("/work/f", data)
                uploaded = probe.sample()
                got = await agent.get("/work/f")
                downloaded = probe.sample()
                if got != data:
                    raise SystemExit(f"files_speed: {len(got)} other bytes came back")
                if rep:
                    for way, before, after in (
                        ("upload", started, uploaded),
                        ("download", uploaded, downloaded),
                    ):
                        rates[way].append(mib / (after.at - before.at))
                        cpu_ms[way].append(1000 * (after.agent_s - before.agent_s))
    return {
        way: {
            "median": round(statistics.median(r), 1),
            "each": [round(x, 1) for x in r],
            "agent_cpu_ms": round(statistics.median(cpu_ms[way]), 1),
        }
        for way, r in rates.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=64, help="1 to 100 (the work dir is 256 MiB)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if not (1 <= args.mib <= 100 and args.reps >= 1):
        print("files_speed: --mib 1..100, --reps >= 1", file=sys.stderr)
        return 2
    report = asyncio.run(measure(args.mib, args.reps))
    if args.json:
        print(json.dumps(report))
    else:
        for way in ("upload", "download"):
            each = report[way]
            print(
                f"{way} MiB/s: median {each['median']}, each {each['each']}; "
                f"the agent's CPU {each['agent_cpu_ms']} ms (median)"
            )
    return 0


if __name__ == "__main__":
    interrupt_on_termination()  # the pool it starts is stopped on SIGTERM, SIGHUP
    sys.exit(main())
