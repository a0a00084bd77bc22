"""A steady stream of short leases against a null request at the same moments.

    python -m bench.steady [--rate 10] [--seconds 60] [--lease-ms 100] [--json]

What code-reward calls look like: acquire, run one command, release, `--rate` times a
second, each on its own, on a default 3-node pool (`bench.burst`'s: default pool
parameters, nothing sized for the stream). Beside each acquire, at the same moment, a
null request (`GET /healthz` of the control plane, on a session of its own): what the
machine's own noise costs a request at that instant, the baseline the acquires are held
to. The warm pool has to follow the stream's rate (its flow target, docs/policy.md):
the recent peak of concurrency alone stays at 1 or 2.

Targets (issue 33): warm-acquire p99 <= 1.5x the null request's p99 over the same
moments, no cold acquire after the first 10 s, no error, no container left.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections import Counter

import aiohttp

from bench.burst import exit_status, issue_spec, render_targets, target
from bench.soak import Teardown, local_pool, run_to_report
from bench.stats import summary_ms
from dsec.client import Client
from dsec.processes import interrupt_on_termination
from dsec.tables import format_table

NULL_RATIO = 1.5
SETTLING_S = 10.0  # the stream's first seconds: the pool learns its rate
ACQUIRE_TIMEOUT_S = 60.0


async def run(args: argparse.Namespace) -> dict:
    teardown = Teardown()
    # (since start, path, seconds, the control plane's own schedule_ms)
    acquires: list[tuple[float, str, float, float]] = []
    nulls: list[float] = []
    errors: list[str] = []
    async with local_pool(issue_spec("steady"), teardown) as pool:
        async with (
            Client(pool.url, token=pool.tokens.client) as client,
            aiohttp.ClientSession() as http,
        ):
            await asyncio.sleep(3)  # min_warm made, as a pool that has been up a while

            async def null() -> None:
                sent = time.perf_counter()
                async with http.get(f"{pool.url}/healthz") as resp:
                    await resp.read()
                nulls.append(time.perf_counter() - sent)

            async def cycle(at: float) -> None:
                sent = time.perf_counter()
                try:
                    sb = await client.acquire(timeout=ACQUIRE_TIMEOUT_S)
                except Exception as e:  # noqa: BLE001 - every failure is a figure
                    errors.append(f"{type(e).__name__}: {e}"[:300])
                    return
                took = time.perf_counter() - sent
                acquires.append((at, sb.lease.path, took, sb.lease.schedule_ms / 1000))
                try:
                    await sb.exec(["true"], timeout=30)
                    await asyncio.sleep(args.lease_ms / 1000)
                finally:
                    await sb.release()

            started = time.perf_counter()
            running = []
            for i in range(int(args.rate * args.seconds)):
                at = i / args.rate
                await asyncio.sleep(max(0.0, started + at - time.perf_counter()))
                running += [asyncio.ensure_future(cycle(at)), asyncio.ensure_future(null())]
            await asyncio.gather(*running)
    settled = [(path, s, server) for at, path, s, server in acquires if at >= SETTLING_S]
    report: dict = {
        "rate": args.rate, "seconds": args.seconds, "lease_ms": args.lease_ms,
        "acquires": len(acquires), "errors": len(errors), "first_errors": errors[:5],
        "paths": dict(Counter(path for _, path, _, _ in acquires)),
        "cold_after_settling": sum(1 for path, _, _ in settled if path != "warm"),
        "warm_ms": summary_ms([s for path, s, _ in settled if path == "warm"]),
        # of it, the control plane's own time from the request's arrival to its answer
        "warm_schedule_ms": summary_ms([server for path, _, server in settled if path == "warm"]),
        "null_ms": summary_ms(nulls),
        "containers_left": teardown.left,
    }  # fmt: skip
    report["targets"] = targets(report)
    return report


def targets(r: dict) -> list[dict]:
    warm, null = r["warm_ms"]["p99"], r["null_ms"]["p99"]
    ratio = round(warm / null, 3) if warm is not None and null else None
    note = f"{r['errors']} errors" if r["errors"] else ""
    return [
        target("warm acquire p99 / null request p99", ratio, NULL_RATIO, note, not r["errors"]),
        target(f"acquires not warm after the first {SETTLING_S:g} s", r["cold_after_settling"], 0),
        target("containers left", r["containers_left"], 0),
    ]


def render(r: dict) -> str:
    rows = [
        [name, f["n"], f["p50"], f["p95"], f["p99"], f["max"]]
        for name, f in (
            ("warm acquire", r["warm_ms"]),
            ("of it, the control plane's schedule_ms", r["warm_schedule_ms"]),
            ("null request", r["null_ms"]),
        )
    ]
    paths = ", ".join(f"{p} {n}" for p, n in sorted(r["paths"].items()))
    return "\n".join(
        [
            f"{r['rate']:g} acquire-exec-release cycles a second for {r['seconds']:g} s "
            f"(leases of {r['lease_ms']:g} ms): {r['acquires']} acquires ({paths}), "
            f"{r['errors']} errors",
            format_table(
                ["after the first 10 s", "n", "p50 ms", "p95 ms", "p99 ms", "max ms"], rows
            ),  # fmt: skip
            *[f"error: {e}" for e in r["first_errors"]],
            "",
            *render_targets(r["targets"]),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=10.0, help="cycles a second")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--lease-ms", type=float, default=100.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if not 0 < args.rate <= 100 or not SETTLING_S < args.seconds <= 3600 or args.lease_ms < 0:
        print("steady: --rate 0..100, --seconds 10..3600, --lease-ms >= 0", file=sys.stderr)
        return 2
    return exit_status(run_to_report("steady", run(args), render, args.json))


if __name__ == "__main__":
    interrupt_on_termination()  # the pool it starts is stopped on SIGTERM, SIGHUP
    sys.exit(main())
