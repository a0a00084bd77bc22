"""Churn on a live 3-node pool: short episodes many at a time, against the engine's
own floor measured in the same run (issue 12's targets).

    python -m bench.churn [--episodes 60] [--concurrency 20] [--json]

One local pool, 3 nodes with room for 300 sandboxes (as `bench.burst`). An episode is
acquire, `--execs` execs of `sh -c 'echo hi'` (each must exit 0 and print `hi`),
release; `--episodes` of them, `--concurrency` at a time:
- floor: the same episodes without a pool, with the Docker SDK at the same concurrency
  (`bench.engine_floor`: the agents' own create from the base template, exec create,
  start and inspect, remove), with the pool up and idle;
- pool: on pool `default`, on its default parameters (it refills its warm pool as it
  goes: the creates it made are reported), once it holds its default warm target;
  targets: episodes/s >= 0.9 x the floor's, exec p50 <= 1.2 x the floor's;
- recycled: a fresh pool on default parameters with `recycle` on (a released sandbox is
  reset and goes back to the warm pool); target: episodes/s >= 3 x the floor's, in
  steady state: one wave of `--concurrency` episodes runs first, uncounted (reported as
  `warmup`), because a fresh pool's first wave is creates, which recycling cannot speed.
Episodes/s is episodes completed over the wall time from the first start to the last
release; an exec's latency is seen by its caller. A failed episode is a miss. The pool
is drained between its two runs. Exits 1 when a target is missed (a feature not there
yet is a miss, said as such), or a container is left behind.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

from bench.burst import (
    CALL_ERRORS,
    NODE_CAPACITY,
    NODES,
    delta,
    exit_status,
    issue_spec,
    leftovers,
    missing,
    render_leftovers_and_targets,
    scale_events,
    skipped,
    target,
    wait_warm,
)
from bench.engine_floor import EngineFloor
from bench.soak import Teardown, drain, local_pool, run_to_report
from bench.stats import summary_ms
from dsec.client import Client, DsecError
from dsec.models import PoolParams
from dsec.processes import interrupt_on_termination
from dsec.tables import format_table

CMD = ["sh", "-c", "echo hi"]
EXPECT = "hi\n"
ACQUIRE_TIMEOUT_S = 60.0
EPISODES_RATIO = 0.9  # pool episodes/s >= this x the floor's
EXEC_P50_RATIO = 1.2  # pool exec p50 <= this x the floor's
RECYCLED_RATIO = 3.0  # recycled episodes/s >= this x the floor's


@dataclass
class PoolChurn:
    completed: int = 0
    wall_s: float = 0.0
    acquire_s: list[float] = field(default_factory=list)
    exec_s: list[float] = field(default_factory=list)
    release_s: list[float] = field(default_factory=list)
    paths: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)


async def pool_churn(
    client: Client, pool: str, episodes: int, concurrency: int, execs: int, template: str = "base"
) -> PoolChurn:
    result = PoolChurn()
    todo = iter(range(episodes))

    async def episode() -> None:
        t0 = time.perf_counter()
        sb = await client.acquire(pool=pool, template=template, timeout=ACQUIRE_TIMEOUT_S)
        result.acquire_s.append(time.perf_counter() - t0)
        result.paths[sb.lease.path] += 1
        try:
            for _ in range(execs):
                started = time.perf_counter()
                answer = await sb.exec(CMD, timeout=30)
                result.exec_s.append(time.perf_counter() - started)
                if (answer.exit_code, answer.stdout) != (0, EXPECT):
                    raise RuntimeError(f"exec answered {answer.exit_code} {answer.stdout!r}")
        finally:
            started = time.perf_counter()
            await sb.release()
            result.release_s.append(time.perf_counter() - started)

    async def worker() -> None:
        while (i := next(todo, None)) is not None:
            try:
                await episode()
                result.completed += 1
            except (*CALL_ERRORS, RuntimeError) as e:
                result.failures.append(f"episode {i}: {type(e).__name__}: {e}")

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    result.wall_s = time.perf_counter() - started
    return result


def figures(completed: int, wall_s: float, failures: list[str], exec_s: list[float]) -> dict:
    return {
        "completed": completed,
        "failures": len(failures),
        "failure_samples": failures[:5],
        "wall_s": round(wall_s, 2),
        "episodes_per_s": round(completed / wall_s, 3) if wall_s else None,
        "exec_ms": summary_ms(exec_s),
    }


async def floor_phase(floor: EngineFloor, args: argparse.Namespace) -> dict:
    r = await asyncio.to_thread(
        floor.churn, args.episodes, args.concurrency, CMD, args.execs, EXPECT.encode()
    )
    return figures(r.completed, r.wall_s, r.failures, r.exec_s) | {
        "create_ms": summary_ms(r.create_s),
        "remove_ms": summary_ms(r.remove_s),
    }


async def pool_phase(
    client: Client, url: str, admin: str, pool: str, args: argparse.Namespace
) -> dict:
    await wait_warm(client, pool, PoolParams().min_warm)  # a fresh pool, settled
    before = await scale_events(url, admin, pool)
    r = await pool_churn(client, pool, args.episodes, args.concurrency, args.execs)
    events = delta(await scale_events(url, admin, pool), before)
    return figures(r.completed, r.wall_s, r.failures, r.exec_s) | {
        "acquire_ms": summary_ms(r.acquire_s),
        "release_ms": summary_ms(r.release_s),
        "paths": dict(sorted(r.paths.items())),
        "created": events.get("create", 0),
        "scale_events": events,
    }


async def recycled_phase(
    client: Client, operator: Client, url: str, admin: str, args: argparse.Namespace
) -> dict:
    if "recycle" not in PoolParams.model_fields:
        return {"unavailable": "PoolParams has no `recycle` parameter yet"}
    pool = "recycled"
    try:
        await operator.set_pool(pool, PoolParams(recycle=True))
    except DsecError as e:
        return {"unavailable": f"a pool with recycle on was refused: {e}"}
    warmup = await pool_churn(client, pool, args.concurrency, args.concurrency, args.execs)
    measured = await pool_phase(client, url, admin, pool, args)
    return measured | {
        "warmup": figures(warmup.completed, warmup.wall_s, warmup.failures, warmup.exec_s)
    }


async def run(args: argparse.Namespace) -> dict:
    teardown = Teardown()
    report: dict = {
        "episodes": args.episodes, "concurrency": args.concurrency, "execs": args.execs,
        "cmd": CMD, "nodes": NODES, "slots": NODES * NODE_CAPACITY.slots,
    }  # fmt: skip
    with EngineFloor(args.concurrency) as floor:
        async with local_pool(issue_spec("churn"), teardown) as pool:
            url, admin = pool.url, pool.tokens.admin
            async with (
                Client(url, token=admin) as operator,
                Client(url, token=pool.tokens.client) as client,
            ):
                await wait_warm(client, "default", PoolParams().min_warm)
                report["floor"] = await floor_phase(floor, args)
                report["pool"] = await pool_phase(client, url, admin, "default", args)
                if not args.skip_recycle:
                    await drain(operator, "default")
                    report["recycled"] = await recycled_phase(client, operator, url, admin, args)
    report["leftovers"] = leftovers(teardown, floor)
    report["targets"] = targets(report, args)
    return report


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def targets(r: dict, args: argparse.Namespace) -> list[dict]:
    floor, ours = r["floor"], r["pool"]
    note = f"the floor had {floor['failures']} failures" if floor["failures"] else ""
    fails = f"{ours['failures']} of {args.episodes} episodes failed" if ours["failures"] else ""
    out = [
        target("pool: episodes/s / floor's", ratio(ours["episodes_per_s"], floor["episodes_per_s"]),
               EPISODES_RATIO, fails or note, not ours["failures"], op=">="),
        target("pool: exec p50 / floor's", ratio(ours["exec_ms"]["p50"], floor["exec_ms"]["p50"]),
               EXEC_P50_RATIO, fails or note, not ours["failures"]),
    ]  # fmt: skip
    name = "recycled: episodes/s / floor's"
    if args.skip_recycle:
        out.append(skipped(name, RECYCLED_RATIO, "--skip-recycle", op=">="))
    elif "unavailable" in r["recycled"]:
        out.append(missing(name, RECYCLED_RATIO, r["recycled"]["unavailable"], op=">="))
    else:
        rec = r["recycled"]
        fails = f"{rec['failures']} of {args.episodes} episodes failed" if rec["failures"] else ""
        out.append(target(name, ratio(rec["episodes_per_s"], floor["episodes_per_s"]),
                          RECYCLED_RATIO, fails or note, not rec["failures"], op=">="))  # fmt: skip
    left = r["leftovers"]["pool_left"] + r["leftovers"]["floor_left"]
    out.append(target("containers left behind", left, 0))
    return out


def render(r: dict) -> str:
    lines = [
        f"churn: {r['episodes']} episodes, {r['concurrency']} at a time, each acquire + "
        f"{r['execs']} x {shlex.join(r['cmd'])} + release; {r['nodes']} nodes, "
        f"room for {r['slots']}",
        "",
    ]
    rows = []
    sides = {
        "floor": "floor (Docker SDK)",
        "pool": "pool, defaults",
        "recycled": "pool, recycle on",
    }
    for key, label in sides.items():
        p = r.get(key)
        if p is None or "unavailable" in p:
            continue
        e = p["exec_ms"]
        paths = ", ".join(f"{k} {v}" for k, v in p.get("paths", {}).items())
        rows.append([label, p["completed"], p["failures"], p["wall_s"], p["episodes_per_s"],
                     e["p50"], e["p99"], p.get("created", "-"), paths])  # fmt: skip
    headers = ["", "episodes", "failed", "wall s", "episodes/s", "exec p50 ms", "exec p99 ms",
               "created", "acquire paths"]  # fmt: skip
    lines += [format_table(headers, rows), ""]
    for key in ("pool", "recycled"):
        p = r.get(key)
        if p is not None and "unavailable" not in p:
            a, rel = p["acquire_ms"], p["release_ms"]
            lines.append(
                f"{key}: acquire p50 {a['p50']} ms p99 {a['p99']} ms; release p50 {rel['p50']} ms "
                f"p99 {rel['p99']} ms; scale events {p['scale_events']}"
            )
    f = r["floor"]
    lines.append(
        f"floor: create p50 {f['create_ms']['p50']} ms p99 {f['create_ms']['p99']} ms; "
        f"remove p50 {f['remove_ms']['p50']} ms p99 {f['remove_ms']['p99']} ms"
    )
    lines += render_leftovers_and_targets(r)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=60)
    parser.add_argument("--concurrency", type=int, default=20)
    parser.add_argument("--execs", type=int, default=3, help="execs per episode")
    parser.add_argument("--skip-recycle", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    room = NODES * NODE_CAPACITY.slots
    if args.episodes < 1 or not 1 <= args.concurrency <= room or args.execs < 1:
        print(
            f"churn: --episodes and --execs must be >= 1, --concurrency 1..{room}", file=sys.stderr
        )
        return 2
    return exit_status(run_to_report("churn", run(args), render, args.json))


if __name__ == "__main__":
    interrupt_on_termination()  # the pool it starts is stopped on SIGTERM, SIGHUP
    sys.exit(main())
