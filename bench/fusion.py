"""SandboxFusion's run_code through `dsec serve fusion`, against a container per request,
in the same run, rounds alternating.

    python -m bench.fusion [--requests 2000] [--baseline-requests 400] [--concurrency 32]
                           [--rounds 2] [--image IMAGE] [--json]

Each request is a short CPU task in Python (a sum of squares; its answer is checked),
`--concurrency` in flight at once on both sides:
- dsec: a local 3-node pool (`bench.burst`'s) with the python template (recycled, kept
  warm at the concurrency), `dsec serve fusion` as a process of its own with the same
  concurrency, and the requests sent by SandboxFusion's own async client
  (`sandbox_fusion.run_code_async`, a session per request, as verl's code reward does);
- docker run: `docker run --rm` of the same image per request, with the same limits
  (1 CPU, 512 MB, no network, the sandbox user), `python3 -c` the code.
The rounds split each side's requests and alternate which goes first, so the engine's
drift over the run falls on both alike. Reported per side: requests/s, latency p50/p95/p99
(from the request's send to its answer) and errors.

Targets (ratios within the run): throughput >= 5x the container per request's, p99 <=
0.3x its p99, no error, no container left. Exits 1 on a miss.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from agent.docker_driver import LABEL_NODE
from bench.burst import (
    NODE_CAPACITY,
    NODES,
    exit_status,
    issue_spec,
    leftovers,
    render_leftovers_and_targets,
    target,
    wait_warm,
)
from bench.engine_floor import EngineFloor
from bench.rollout import CPUS, MEMORY_MB, TEMPLATE, USER, python_image, python_template
from bench.soak import Teardown, local_pool, run_to_report
from bench.stats import summary_ms
from dsec.client import Client
from dsec.models import PoolParams
from dsec.processes import (
    dsec_argv,
    interrupt_on_termination,
    signalled_at_parent_death,
    stop_process,
)
from dsec.tables import format_table

THROUGHPUT_RATIO = 5.0  # dsec requests/s >= this x the container per request's
P99_RATIO = 0.3  # dsec p99 <= this x its p99
REQUEST_TIMEOUT_S = 120.0
SIDES = ("dsec", "docker run")


def task(i: int) -> tuple[str, str]:
    """Request i's code and the output it must print."""
    n = 20_000 + i
    return f"print(sum(k * k for k in range({n})))\n", f"{sum(k * k for k in range(n))}\n"


@dataclass
class Phase:
    """One side's requests, added up over the rounds."""

    latencies_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    errors: list[str] = field(default_factory=list)

    def figures(self) -> dict:
        served = len(self.latencies_s)
        return {
            "requests": served + len(self.errors),
            "errors": len(self.errors),
            "first_errors": self.errors[:5],
            "requests_per_s": round(served / self.wall_s, 2) if self.wall_s else None,
            "latency_ms": summary_ms(self.latencies_s),
        }


async def phase(
    into: Phase, first: int, count: int, concurrency: int, one: Callable[[int], Awaitable[str]]
) -> None:
    """`count` requests from number `first` on, `concurrency` at a time."""
    slots = asyncio.Semaphore(concurrency)

    async def request(i: int) -> None:
        code, expected = task(i)
        async with slots:
            sent = time.perf_counter()
            try:
                got = await asyncio.wait_for(one(i), REQUEST_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - every failure is a figure of the run
                into.errors.append(f"{i}: {type(e).__name__}: {e}"[:300])
                return
            if got != expected:
                into.errors.append(f"{i}: printed {got[:80]!r}, not {expected.strip()}")
                return
            into.latencies_s.append(time.perf_counter() - sent)

    started = time.perf_counter()
    await asyncio.gather(*(request(i) for i in range(first, first + count)))
    into.wall_s += time.perf_counter() - started


@dataclass
class FusionProcess:
    """A `dsec serve fusion` process, listening at `url`."""

    url: str
    proc: asyncio.subprocess.Process


async def start_fusion(pool_url: str, token: str, *flags: str) -> FusionProcess:
    """`dsec serve fusion` of the python template on the pool at `pool_url`, on a port
    of its own, with `flags` added; once it says where it listens."""
    proc = await asyncio.create_subprocess_exec(
        *dsec_argv("serve", "fusion", "--url", pool_url, "--template", TEMPLATE, "--port", "0",
                   *flags),
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "DSEC_TOKEN": token},
        start_new_session=True,  # stopped by us, in order; and if we die, it stops too
        preexec_fn=signalled_at_parent_death(signal.SIGTERM),
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        return FusionProcess(json.loads(line)["url"], proc)
    except (TimeoutError, ValueError, KeyError) as e:
        await stop_process(proc)
        raise RuntimeError(f"dsec serve fusion did not start (exit {proc.returncode})") from e


def fusion_request(service_url: str) -> Callable[[int], Awaitable[str]]:
    import sandbox_fusion

    async def one(i: int) -> str:
        request = sandbox_fusion.RunCodeRequest(code=task(i)[0], language="python")
        answer = await sandbox_fusion.run_code_async(request, endpoint=service_url, max_attempts=1)
        if answer.status != sandbox_fusion.RunStatus.Success:
            raise RuntimeError(f"{answer.status.value}: {answer.message} {answer.run_result}")
        return answer.run_result.stdout

    return one


def docker_run_request(image: str, floor: EngineFloor) -> Callable[[int], Awaitable[str]]:
    # the code as an argument, not on an attached stdin: `docker run -i` here now and then
    # never saw its stdin close, and hung with its container
    argv = ["docker", "run", "--rm", "--network=none", f"--cpus={CPUS}",
            f"--memory={MEMORY_MB}m", f"--user={USER}", f"--label={LABEL_NODE}={floor.node}",
            image, "python3", "-c"]  # fmt: skip

    async def one(i: int) -> str:
        proc = await asyncio.create_subprocess_exec(
            *argv, task(i)[0], stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        try:
            out, err = await proc.communicate()
        finally:
            if proc.returncode is None:  # cancelled at its timeout: not left running
                proc.kill()
                await proc.wait()
        if proc.returncode != 0:
            raise RuntimeError(f"exit {proc.returncode}: {err.decode(errors='replace')[-200:]}")
        return out.decode()

    return one


async def run(args: argparse.Namespace) -> dict:
    image = python_image(args.image)
    spec = issue_spec("fusion")
    spec.templates = {**spec.templates, TEMPLATE: python_template(image)}
    warm = args.concurrency
    spec.pool = PoolParams(templates=[TEMPLATE], recycle=True, min_warm=warm, max_warm=2 * warm)
    teardown = Teardown()
    phases = {side: Phase() for side in SIDES}
    by_round: list[dict] = []
    with EngineFloor(args.concurrency) as floor:
        async with local_pool(spec, teardown) as pool:
            async with Client(pool.url, token=pool.tokens.client) as client:
                await wait_warm(client, "default", warm)
                service = await start_fusion(
                    pool.url, pool.tokens.client, "--concurrency", str(args.concurrency)
                )
                try:
                    sides = {
                        "dsec": (fusion_request(service.url), args.requests),
                        "docker run": (docker_run_request(image, floor), args.baseline_requests),
                    }
                    for r in range(args.rounds):
                        this_round = {}
                        for side in SIDES[:: 1 if r % 2 == 0 else -1]:
                            one, total = sides[side]
                            share = total // args.rounds + (r < total % args.rounds)
                            done = Phase()
                            await phase(done, r * total, share, args.concurrency, one)
                            for name in ("latencies_s", "errors"):
                                getattr(phases[side], name).extend(getattr(done, name))
                            phases[side].wall_s += done.wall_s
                            this_round[side] = done.figures()
                        by_round.append(this_round)
                finally:
                    await stop_process(service.proc)
    report: dict = {
        "image": image, "concurrency": args.concurrency, "rounds": args.rounds,
        "nodes": NODES, "node_capacity": NODE_CAPACITY.model_dump(),
        "sides": {side: p.figures() for side, p in phases.items()}, "by_round": by_round,
        "leftovers": leftovers(teardown, floor),
    }  # fmt: skip
    report["targets"] = targets(report)
    return report


def targets(r: dict) -> list[dict]:
    dsec, base = r["sides"]["dsec"], r["sides"]["docker run"]
    rate = dsec["requests_per_s"] / base["requests_per_s"] if base["requests_per_s"] else None
    p99s = dsec["latency_ms"]["p99"], base["latency_ms"]["p99"]
    p99 = p99s[0] / p99s[1] if None not in p99s and p99s[1] else None
    errors = f"{dsec['errors']} dsec errors" if dsec["errors"] else ""
    lo = r["leftovers"]
    left = lo["pool_left"] + lo["floor_left"]
    return [
        target("requests/s vs docker run", rate and round(rate, 2), THROUGHPUT_RATIO,
               errors, not dsec["errors"], op=">="),
        target("p99 vs docker run's", p99 and round(p99, 3), P99_RATIO, errors, not dsec["errors"]),
        target("containers left", left, 0),
    ]  # fmt: skip


def render(r: dict) -> str:
    rows = []
    for side, f in r["sides"].items():
        ms = f["latency_ms"]
        rows.append([side, f["requests"], f["errors"], f["requests_per_s"], ms["p50"], ms["p95"],
                     ms["p99"]])  # fmt: skip
    lines = [
        f"run_code: {r['concurrency']} at a time, {r['rounds']} rounds alternating, "
        f"image {r['image']}",
        format_table(["side", "requests", "errors", "req/s", "p50 ms", "p95 ms", "p99 ms"], rows),
    ]
    for side, f in r["sides"].items():
        lines += [f"{side} error: {e}" for e in f["first_errors"]]
    return "\n".join([*lines, "", *render_leftovers_and_targets(r)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="through dsec")
    parser.add_argument("--baseline-requests", type=int, default=400, help="docker run's")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--image", help="the template's image (default: the project's build)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    room = NODES * NODE_CAPACITY.slots // 2  # the warm pool is at most twice the concurrency
    if min(args.requests, args.baseline_requests, args.rounds) < 1 or not (
        1 <= args.concurrency <= room
    ):
        print(
            f"fusion: --requests, --baseline-requests and --rounds must be >= 1, "
            f"--concurrency 1..{room}",
            file=sys.stderr,
        )
        return 2
    return exit_status(run_to_report("fusion", run(args), render, args.json))


if __name__ == "__main__":
    interrupt_on_termination()  # the pool it starts is stopped on SIGTERM, SIGHUP
    sys.exit(main())
