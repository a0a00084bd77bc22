"""Noisy neighbour: a sandbox's exec latency with and without hostile sandboxes burning
CPU beside it on the same node, in one invocation.

    python -m bench.neighbour [--samples 300] [--rounds 3] [--hostile 1] [--burners 16]
                              [--work 1000] [--json]

One node, so the neighbour and the hostile sandboxes share the agent, the Docker
engine and the host. The neighbour, one sandbox held throughout, runs a fixed small
piece of work (a shell loop of `--work` steps that prints its count, checked) one exec
after another. The phases alternate, A B A B ... for `--rounds` rounds, so background
load on a shared machine falls on both alike:
- A (baseline): no hostile sandbox;
- B (hostile): `--hostile` sandboxes, each acquired for the round, start `--burners`
  processes spinning `while :; do :; done` (the template's pids limit is the bound),
  and are released at the end of the round; release removes the container, and with
  it every process, which is checked in Docker.
Reported: p50/p99 of the neighbour's exec in each phase, hostile over baseline, and
the CPU the hostile sandboxes got (their cgroup's usage), which the template caps.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import docker

from agent.docker_driver import LABEL_SANDBOX
from bench.soak import Teardown, bench_spec, cpu_ns, local_pool, run_to_report
from bench.stats import SUMMARY_COLUMNS, summary_ms, summary_rows
from controlplane.config import default_templates
from dsec.client import Client, Sandbox
from dsec.models import PoolParams
from dsec.processes import interrupt_on_termination
from dsec.tables import format_table

SETTLE_S = 1.0  # after the burners start, before sampling: they are all running by then


def burn_cmd(burners: int) -> list[str]:
    # detached from the exec's output, so the exec returns while they spin
    spin = 'sh -c "while :; do :; done" </dev/null >/dev/null 2>&1 &'
    return ["sh", "-c", f"for i in $(seq {burners}); do {spin} done; echo started"]


def work_cmd(steps: int) -> list[str]:
    return ["sh", "-c", f"i=0; while [ $i -lt {steps} ]; do i=$((i+1)); done; echo $i"]


async def checked(sb: Sandbox, cmd: list[str], expect: str | None = None) -> str:
    result = await sb.exec(cmd, timeout=60)
    if result.exit_code != 0 or (expect is not None and result.stdout != expect):
        raise RuntimeError(
            f"{cmd[-1][:40]!r} in {sb.id} answered {result.exit_code} "
            f"{result.stdout[:200]!r} {result.stderr[:200]!r}"
        )
    return result.stdout


async def neighbour_execs(neighbour: Sandbox, samples: int, steps: int) -> list[float]:
    seconds = []
    for _ in range(samples):
        started = time.perf_counter()
        await checked(neighbour, work_cmd(steps), f"{steps}\n")
        seconds.append(time.perf_counter() - started)
    return seconds


def sandbox_containers(sandbox_id: str) -> int:
    client = docker.from_env()
    return len(client.containers.list(all=True, filters={"label": f"{LABEL_SANDBOX}={sandbox_id}"}))


async def hostile_round(
    client: Client, neighbour: Sandbox, args: argparse.Namespace, samples: int
) -> tuple[list[float], float, int]:
    """The neighbour's exec times while hostile sandboxes burn; the CPU cores they used
    meanwhile; their containers left after release (0 when release cleaned up)."""
    hostile = [await client.acquire(pool="neighbour", timeout=120) for _ in range(args.hostile)]
    try:
        await asyncio.gather(*(checked(h, burn_cmd(args.burners), "started\n") for h in hostile))
        await asyncio.sleep(SETTLE_S)
        before = await asyncio.gather(*(cpu_ns(h) for h in hostile))
        started = time.perf_counter()
        seconds = await neighbour_execs(neighbour, samples, args.work)
        elapsed = time.perf_counter() - started
        after = await asyncio.gather(*(cpu_ns(h) for h in hostile))
    finally:
        await asyncio.gather(*(h.release() for h in hostile))
    left = sum([await asyncio.to_thread(sandbox_containers, h.id) for h in hostile])
    return seconds, (sum(after) - sum(before)) / 1e9 / elapsed, left


async def run(args: argparse.Namespace) -> dict:
    spec = bench_spec("neighbour", nodes=1, slots=args.hostile + 8)
    teardown = Teardown()
    per_round = -(-args.samples // args.rounds)
    baseline: list[float] = []
    hostile: list[float] = []
    rounds = []
    left_after_release = 0
    async with local_pool(spec, teardown) as pool:
        async with (
            Client(pool.url, token=pool.tokens.admin) as operator,
            Client(pool.url, token=pool.tokens.client) as client,
        ):
            # warm sandboxes for the hostile ones, so each round starts at once
            await operator.set_pool(
                "neighbour", PoolParams(min_warm=args.hostile, max_warm=args.hostile + 2)
            )
            async with client.sandbox(pool="neighbour", timeout=120) as neighbour:
                await neighbour_execs(neighbour, 10, args.work)  # connections, page cache
                for _ in range(args.rounds):
                    a = await neighbour_execs(neighbour, per_round, args.work)
                    b, cores, left = await hostile_round(client, neighbour, args, per_round)
                    baseline += a
                    hostile += b
                    left_after_release += left
                    rounds.append({
                        "baseline_p50_ms": summary_ms(a)["p50"],
                        "hostile_p50_ms": summary_ms(b)["p50"],
                        "hostile_cpu_cores": round(cores, 3),
                    })  # fmt: skip
    base, hot = summary_ms(baseline), summary_ms(hostile)
    return {
        "node": "1 node (neighbour and hostile sandboxes share agent, engine and host)",
        "rounds": args.rounds,
        "order": "A B " * args.rounds,
        "hostile_sandboxes": args.hostile,
        "burners_per_sandbox": args.burners,
        "template_cpus": default_templates()["base"].cpus,
        "neighbour_cmd": work_cmd(args.work),
        "baseline_ms": base,
        "hostile_ms": hot,
        "ratios": {
            "p50_hostile_over_baseline": round(hot["p50"] / base["p50"], 3),
            "p99_hostile_over_baseline": round(hot["p99"] / base["p99"], 3),
        },
        "per_round": rounds,
        "hostile_cpu_cores": round(sum(r["hostile_cpu_cores"] for r in rounds) / len(rounds), 3),
        "hostile_containers_left_after_release": left_after_release,
        "containers_swept_at_stop": teardown.swept,
        "containers_left_after_stop": teardown.left,
    }


def render(r: dict) -> str:
    lines = [
        f"noisy neighbour, {r['node']}",
        f"phases {r['order'].strip()}; B: {r['hostile_sandboxes']} hostile sandbox(es) x "
        f"{r['burners_per_sandbox']} spinning processes; neighbour runs "
        f"{r['neighbour_cmd'][-1]!r}",
        "",
    ]
    rows = summary_rows((("A baseline", r["baseline_ms"]), ("B hostile", r["hostile_ms"])))
    lines += [format_table(["neighbour exec ms", *SUMMARY_COLUMNS], rows), ""]
    lines.extend(f"{k}: {v}" for k, v in r["ratios"].items())
    lines.append(
        f"hostile CPU used: {r['hostile_cpu_cores']} cores in all "
        f"(template cap {r['template_cpus']} per sandbox)"
    )
    lines.append(
        f"containers: hostile left after release {r['hostile_containers_left_after_release']}, "
        f"swept at stop {r['containers_swept_at_stop']}, "
        f"left after stop {r['containers_left_after_stop']}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=300, help="neighbour execs per phase")
    parser.add_argument("--rounds", type=int, default=3, help="A B pairs")
    parser.add_argument("--hostile", type=int, default=1, help="hostile sandboxes in phase B")
    parser.add_argument("--burners", type=int, default=16, help="spinning processes in each")
    parser.add_argument("--work", type=int, default=1000, help="loop steps of the neighbour")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    pids_limit = default_templates()["base"].pids_limit
    if not (
        args.samples >= 20 and 1 <= args.rounds <= args.samples and 1 <= args.hostile <= 32
        and 1 <= args.burners < pids_limit - 4 and args.work >= 0
    ):  # fmt: skip
        print(
            f"neighbour: --samples must be >= 20, --rounds 1..samples, --hostile 1..32, "
            f"--burners 1..{pids_limit - 5} (the template's pids limit), --work >= 0",
            file=sys.stderr,
        )
        return 2
    report = run_to_report("neighbour", run(args), render, args.json)
    left = (
        report["hostile_containers_left_after_release"]
        + report["containers_swept_at_stop"]
        + report["containers_left_after_stop"]
    )
    return 1 if left else 0


if __name__ == "__main__":
    interrupt_on_termination()  # the pool it starts is stopped on SIGTERM, SIGHUP
    sys.exit(main())
