"""Bursts of acquires on a live 3-node pool, against a container per request made
directly on the engine in the same run (issue 12's targets).

    python -m bench.burst [--size 200] [--window-s 1] [--announce-s 30] [--json]

One local pool, 3 nodes, each with room for 100 sandboxes (64 CPUs and 64 GiB, so
slots bind: 300 in all). `--size` acquires spread evenly over `--window-s` (request i
arrives at i * window / size; its latency runs from its arrival to its answer):
- floor: the burst served without a pool, a container per request created with the
  Docker SDK from 32 threads (`bench.engine_floor`: the agents' own create, base
  template), then all removed; measured with the pool up and idle;
- fresh: the same burst on pool `default` on its default parameters (`PoolParams()`),
  once it holds its default warm target; target: every acquire served (one that
  times out after `--acquire-timeout-s` is a failure) and p99 <= the floor's;
- refill: a pool with min_warm 40, full, from which `--warm-samples` sandboxes are taken
  one at a time (kept) every `--warm-interval-s` while it refills behind; target: p99 of
  the acquires served warm <= 5 ms, with creates running meanwhile (counted from
  `dsec_scale_events_total`, and `creating` in `GET /v1/pools` just before each acquire).
  That read is timed too (`round_trip_ms`): the same moments' floor, what a request
  that does nothing costs the client on this machine while the engine creates;
- announced: a fresh pool on default parameters (max_warm raised to the burst size, as
  a prewarm beyond max_warm is refused) told `client.prewarm(pool, size, announce_s,
  hold_s)`, then, `--announce-s` later, the burst; target: no failure, p99 <= 100 ms.
In that order; between phases the pool just used is drained (the announced one, last,
is ended with a prewarm of count 0 and removed by the stop). Exits 1 when a target is
missed (a feature not there yet is a miss, said as such), or a container is left behind.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from bench.engine_floor import BURST_THREADS, EngineFloor
from bench.soak import Teardown, drain, local_pool, run_to_report
from bench.stats import summary_ms
from dsec.client import Client, DsecError, Sandbox
from dsec.launch.local import LocalPoolSpec
from dsec.models import Capacity, PoolParams
from dsec.processes import interrupt_on_termination
from dsec.tables import format_table

NODES = 3
# Per node: 100 slots; 64 CPUs and 64 GiB hold 128 and 113 base sandboxes (0.5 CPU and
# 576 MB each), so the slots are what binds.
NODE_CAPACITY = Capacity(cpus=64, memory_mb=65536, slots=100)
ANNOUNCED_P99_MS = 100.0
ANNOUNCED_WARM_SHARE = 0.99  # of a prewarmed burst's acquires, when it promised
WARM_P99_MS = 5.0
REFILL_MIN_WARM = 40
WARM_TIMEOUT_S = 180.0
CALL_ERRORS = (DsecError, aiohttp.ClientError, TimeoutError)


# --- shared with bench.churn --------------------------------------------------------


def issue_spec(kind: str) -> LocalPoolSpec:
    """Issue 12's pool: 3 nodes with room for 300, pool `default` on default parameters."""
    return LocalPoolSpec(
        name=f"bench-{kind}-{uuid.uuid4().hex[:6]}", nodes=NODES, port=0,
        capacity=NODE_CAPACITY, pool=PoolParams(), state_dir=Path(tempfile.mkdtemp()),
    )  # fmt: skip


async def wait_warm(
    client: Client, pool: str, want: int, timeout_s: float = WARM_TIMEOUT_S
) -> float:
    """Until `pool` holds `want` warm sandboxes; returns the seconds it took."""
    started = time.perf_counter()
    while True:
        info = next(p for p in (await client.pools()).pools if p.name == pool)
        if info.sandboxes.get("warm", 0) >= want:
            return time.perf_counter() - started
        if time.perf_counter() - started > timeout_s:
            raise RuntimeError(
                f"pool {pool} never reached {want} warm sandboxes in {timeout_s:.0f} s"
            )
        await asyncio.sleep(0.1)


async def pool_state(client: Client, pool: str) -> dict[str, int]:
    return dict(next(p for p in (await client.pools()).pools if p.name == pool).sandboxes)


async def scale_events(url: str, token: str, pool: str) -> Counter[str]:
    """The control plane's `dsec_scale_events_total` for `pool`, by action."""
    headers = {"Authorization": f"Bearer {token}"}
    async with (
        aiohttp.ClientSession() as http,
        http.get(
            f"{url}/metrics", headers=headers, timeout=aiohttp.ClientTimeout(total=30)
        ) as resp,
    ):
        resp.raise_for_status()
        text = await resp.text()
    events: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "dsec_scale_events_total" and sample.labels.get("pool") == pool:
                events[sample.labels["action"]] += int(sample.value)
    return events


def delta(after: Counter[str], before: Counter[str]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in sorted(after) if after[k] - before[k]}


def target(
    name: str, value: float | None, limit: float, note: str = "", ok: bool = True, op: str = "<="
) -> dict:
    """A target `value <= limit` (or `>=`); `ok` False, or no value, makes it a miss."""
    passed = ok and value is not None and (value <= limit if op == "<=" else value >= limit)
    verdict = "PASS" if passed else "MISS"
    return {"target": name, "value": value, "op": op, "limit": limit, "verdict": verdict,
            "note": note}  # fmt: skip


def exit_status(report: dict) -> int:
    """A benchmark's exit code once its report is printed: 1 if a target missed."""
    return 1 if any(t["verdict"] == "MISS" for t in report["targets"]) else 0


def skipped(name: str, limit: float, why: str, op: str = "<=") -> dict:
    return {"target": name, "value": None, "op": op, "limit": limit, "verdict": "SKIP",
            "note": why}  # fmt: skip


def missing(name: str, limit: float, why: str, op: str = "<=") -> dict:
    return {"target": name, "value": None, "op": op, "limit": limit, "verdict": "MISS",
            "note": why}  # fmt: skip


def render_leftovers_and_targets(report: dict) -> list[str]:
    """The last lines of a burst or churn report: what was left behind, then the verdicts."""
    lo = report["leftovers"]
    return [
        f"containers: pool swept at stop {lo['pool_swept_at_stop']}, left {lo['pool_left']}; "
        f"floor swept at close {lo['floor_swept_at_close']}, left {lo['floor_left']}",
        "",
        *render_targets(report["targets"]),
    ]


def render_targets(targets: list[dict]) -> list[str]:
    rows = [
        [
            t["target"],
            "-" if t["value"] is None else t["value"],
            f"{t['op']} {t['limit']}",
            t["verdict"],
            t["note"],
        ]
        for t in targets
    ]
    return [format_table(["target", "value", "limit", "verdict", "note"], rows)]


def leftovers(teardown: Teardown, floor: EngineFloor) -> dict:
    return {
        "pool_swept_at_stop": teardown.swept,
        "pool_left": teardown.left,
        "floor_swept_at_close": floor.swept_at_close,
        "floor_left": floor.left_after_close,
    }


# --- the burst on a pool ------------------------------------------------------------


async def pool_burst(
    client: Client, pool: str, size: int, window_s: float, timeout_s: float
) -> tuple[dict, list[Sandbox]]:
    """The burst on `pool`; returns its figures and the sandboxes served (still held)."""
    started = time.perf_counter()

    async def one(i: int) -> tuple[float, Sandbox] | str:
        arrival = started + i * window_s / size
        await asyncio.sleep(max(0.0, arrival - time.perf_counter()))
        try:
            sb = await client.acquire(pool=pool, timeout=timeout_s)
        except CALL_ERRORS as e:
            return f"request {i}: {type(e).__name__}: {e}"
        return time.perf_counter() - arrival, sb

    results = await asyncio.gather(*(one(i) for i in range(size)))
    served = [r for r in results if not isinstance(r, str)]
    failures = [r for r in results if isinstance(r, str)]
    paths = Counter(sb.lease.path for _, sb in served)
    return {
        "served": len(served),
        "failures": len(failures),
        "failure_samples": failures[:5],
        "client_ms": summary_ms([s for s, _ in served]),
        "server_ms": summary_ms([sb.lease.schedule_ms / 1000 for _, sb in served]),
        "paths": dict(sorted(paths.items())),
    }, [sb for _, sb in served]


async def release_all(held: list[Sandbox]) -> int:
    """Release them all; returns how many releases failed."""
    answers = await asyncio.gather(*(sb.release() for sb in held), return_exceptions=True)
    return sum(1 for a in answers if isinstance(a, BaseException))


async def burst_phase(
    client: Client, url: str, admin: str, pool: str, args: argparse.Namespace
) -> dict:
    before = await scale_events(url, admin, pool)
    figures, held = await pool_burst(client, pool, args.size, args.window_s, args.acquire_timeout_s)
    figures["scale_events"] = delta(await scale_events(url, admin, pool), before)
    figures["release_failures"] = await release_all(held)
    return figures


# --- the phases ---------------------------------------------------------------------


async def floor_phase(floor: EngineFloor, args: argparse.Namespace) -> dict:
    result = await asyncio.to_thread(floor.burst, args.size, args.window_s, args.acquire_timeout_s)
    return {
        "threads": floor.threads,
        "served": len(result.latencies_s),
        "failures": len(result.failures),
        "failure_samples": result.failures[:5],
        "client_ms": summary_ms(result.latencies_s),
        "removed": result.removed,
        "remove_s": round(result.remove_s, 2),
    }


async def announced_phase(
    client: Client, operator: Client, url: str, admin: str, args: argparse.Namespace
) -> dict:
    """Prewarm then burst; a dict with `unavailable` when prewarm cannot be called."""
    if not hasattr(Client, "prewarm"):
        return {"unavailable": "Client.prewarm is not in dsec/client.py yet"}
    pool = "announced"
    defaults = PoolParams()
    await operator.set_pool(pool, PoolParams(max_warm=max(defaults.max_warm, args.size)))
    await wait_warm(client, pool, defaults.min_warm)
    announced, announced_wall = time.perf_counter(), time.time()
    by = "client"
    try:
        try:
            answer = await client.prewarm(pool, args.size, args.announce_s, hold_s=args.hold_s)
        except DsecError as e:
            if e.status != 403:
                raise
            by = "operator"  # the route is for operators only
            answer = await operator.prewarm(pool, args.size, args.announce_s, hold_s=args.hold_s)
    except DsecError as e:
        return {"unavailable": f"prewarm refused: {e}"}
    await asyncio.sleep(max(0.0, announced + args.announce_s - time.perf_counter()))
    at_burst = await pool_state(client, pool)
    figures = await burst_phase(client, url, admin, pool, args)
    # ended (count 0), so the pool makes no more for it; not drained: the stop removes it
    with contextlib.suppress(DsecError):
        await (client if by == "client" else operator).prewarm(pool, 0, 0.0)
    accepted = answer.model_dump(mode="json") if hasattr(answer, "model_dump") else answer
    return {"prewarm_by": by, "prewarm": accepted, "prewarm_wall": announced_wall,
            "sandboxes_at_burst": at_burst, **figures}  # fmt: skip


async def refill_phase(
    client: Client, operator: Client, url: str, admin: str, args: argparse.Namespace
) -> dict:
    """Warm sandboxes taken one at a time, kept, while the pool refills behind."""
    pool = "refill"
    await operator.set_pool(pool, PoolParams(min_warm=REFILL_MIN_WARM))
    fill_s = await wait_warm(client, pool, REFILL_MIN_WARM)
    before = await scale_events(url, admin, pool)
    held: list[Sandbox] = []
    warm_s: list[float] = []
    warm_server_s: list[float] = []
    other: Counter[str] = Counter()
    creating_at: list[int] = []
    round_trip_s: list[float] = []
    started = time.perf_counter()
    try:
        for _ in range(args.warm_samples):
            await asyncio.sleep(args.warm_interval_s)
            t0 = time.perf_counter()
            creating_at.append((await pool_state(client, pool)).get("creating", 0))
            round_trip_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            sb = await client.acquire(pool=pool, timeout=args.acquire_timeout_s)
            took = time.perf_counter() - t0
            held.append(sb)
            if sb.lease.path == "warm":
                warm_s.append(took)
                warm_server_s.append(sb.lease.schedule_ms / 1000)
            else:
                other[sb.lease.path] += 1
        took_s = time.perf_counter() - started
        events = delta(await scale_events(url, admin, pool), before)
    finally:
        release_failures = await release_all(held)
    await drain(operator, pool)
    return {
        "min_warm": REFILL_MIN_WARM,
        "fill_s": round(fill_s, 1),
        "samples": args.warm_samples,
        "interval_s": args.warm_interval_s,
        "measured_s": round(took_s, 2),
        "warm_ms": summary_ms(warm_s),
        "warm_server_ms": summary_ms(warm_server_s),
        "round_trip_ms": summary_ms(round_trip_s),
        "not_warm": dict(other),
        "creates_during": events.get("create", 0),
        "scale_events": events,
        "acquires_with_creates_in_flight": sum(1 for c in creating_at if c > 0),
        "creating_max": max(creating_at, default=0),
        "release_failures": release_failures,
    }


async def run(args: argparse.Namespace) -> dict:
    teardown = Teardown()
    report: dict = {"size": args.size, "window_s": args.window_s, "nodes": NODES,
                    "slots": NODES * NODE_CAPACITY.slots}  # fmt: skip
    with EngineFloor(BURST_THREADS) as floor:
        async with local_pool(issue_spec("burst"), teardown) as pool:
            url, admin = pool.url, pool.tokens.admin
            async with (
                Client(url, token=admin) as operator,
                Client(url, token=pool.tokens.client, connection_limit=2 * args.size) as client,
            ):
                await wait_warm(client, "default", PoolParams().min_warm)  # a fresh pool, settled
                report["floor"] = await floor_phase(floor, args)
                report["fresh"] = await burst_phase(client, url, admin, "default", args)
                await drain(operator, "default")
                if not args.skip_refill:
                    report["refill"] = await refill_phase(client, operator, url, admin, args)
                if not args.skip_prewarm:
                    report["announced"] = await announced_phase(client, operator, url, admin, args)
    report["leftovers"] = leftovers(teardown, floor)
    report["targets"] = targets(report, args)
    return report


def targets(r: dict, args: argparse.Namespace) -> list[dict]:
    out = []
    floor_p99, fresh = r["floor"]["client_ms"]["p99"], r["fresh"]
    ratio = (
        round(fresh["client_ms"]["p99"] / floor_p99, 3) if fresh["served"] and floor_p99 else None
    )
    fails = f"{fresh['failures']} of {args.size} failed" if fresh["failures"] else ""
    if r["floor"]["failures"]:
        fails += f"; the floor had {r['floor']['failures']} failures"
    out.append(
        target(
            "fresh: p99 / floor p99",
            ratio,
            1.0,
            fails.strip("; ") or "aim 0.7",
            not fresh["failures"],
        )
    )
    name = f"announced: p99 ms (prewarm {args.announce_s:g} s ahead)"
    if args.skip_prewarm:
        out.append(skipped(name, ANNOUNCED_P99_MS, "--skip-prewarm"))
    elif "unavailable" in r["announced"]:
        out.append(missing(name, ANNOUNCED_P99_MS, r["announced"]["unavailable"]))
    else:
        a = r["announced"]
        promised = a["prewarm"].get("meets_deadline", True)
        note = f"{a['failures']} of {args.size} failed" if a["failures"] else ""
        warm_share = round(a["paths"].get("warm", 0) / args.size, 3)
        share_name = "announced: share of acquires warm"
        if promised:
            out.append(
                target(name, a["client_ms"]["p99"], ANNOUNCED_P99_MS, note, not a["failures"])
            )
            out.append(target(share_name, warm_share, ANNOUNCED_WARM_SHARE, note, op=">="))
        else:  # the prewarm said so: its burst was not promised a warm pool
            ready_in = round(a["prewarm"]["ready_by"] - a["prewarm_wall"], 1)
            why = f"the prewarm answered it could not be warm in time (ready in {ready_in} s)"
            out.append(skipped(name, ANNOUNCED_P99_MS, why))
            out.append(skipped(share_name, ANNOUNCED_WARM_SHARE, why, op=">="))
    name = "refill: warm acquire p99 ms"
    if args.skip_refill:
        out.append(skipped(name, WARM_P99_MS, "--skip-refill"))
    else:
        w = r["refill"]
        ok = w["creates_during"] > 0 and w["warm_ms"]["n"] > 0
        note = (
            f"{w['warm_ms']['n']} warm acquires, {w['creates_during']} creates meanwhile; "
            f"a pool read just before each: p99 {w['round_trip_ms']['p99']} ms"
        )
        out.append(
            target(
                name, w["warm_ms"]["p99"], WARM_P99_MS, note if ok else f"not measured: {note}", ok
            )
        )
    left = r["leftovers"]["pool_left"] + r["leftovers"]["floor_left"]
    out.append(target("containers left behind", left, 0))
    return out


def render(r: dict) -> str:
    lines = [f"burst of {r['size']} acquires in {r['window_s']:g} s, {r['nodes']} nodes, "
             f"room for {r['slots']}", ""]  # fmt: skip
    rows = []
    phases = {
        "floor": f"floor (SDK, {r['floor']['threads']} threads)",
        "fresh": "fresh pool, defaults",
        "announced": "announced (prewarm)",
    }
    for key, label in phases.items():
        p = r.get(key)
        if p is None or "unavailable" in p:
            continue
        s = p["client_ms"]
        paths = ", ".join(f"{k} {v}" for k, v in p.get("paths", {}).items())
        creates = p.get("scale_events", {}).get("create", "-")
        rows.append(
            [
                label,
                p["served"],
                p["failures"],
                s["p50"],
                s["p95"],
                s["p99"],
                s["max"],
                creates,
                paths,
            ]
        )
    if (w := r.get("refill")) is not None:
        s = w["warm_ms"]
        paths = ", ".join(f"{k} {v}" for k, v in {"warm": s["n"], **w["not_warm"]}.items())
        rows.append(
            ["refill, one at a time", w["samples"], 0, s["p50"], s["p95"], s["p99"], s["max"],
             w["creates_during"], paths]
        )  # fmt: skip
    headers = ["", "served", "failed", "p50 ms", "p95 ms", "p99 ms", "max ms", "creates", "paths"]
    lines += [format_table(headers, rows), ""]
    if w is not None:
        lines.append(
            f"refill: min_warm {w['min_warm']} (full after {w['fill_s']} s), an acquire every "
            f"{w['interval_s']:g} s for {w['measured_s']} s, all kept; "
            f"{w['acquires_with_creates_in_flight']} of {w['samples']} with a create in flight "
            f"(at most {w['creating_max']}); percentiles of the warm ones"
        )
        trip = w["round_trip_ms"]
        lines.append(
            f"refill: the same moments' floor, a read of the pool's state just before each "
            f"acquire (GET /v1/pools): p50 {trip['p50']} ms, p95 {trip['p95']} ms, "
            f"p99 {trip['p99']} ms"
        )
    if (a := r.get("announced")) is not None and "unavailable" not in a:
        promise = a["prewarm"]
        lines.append(
            f"announced: prewarm by the {a['prewarm_by']}, ready in "
            f"{promise['ready_by'] - a['prewarm_wall']:.1f} s by its own estimate (meets its "
            f"deadline: {promise['meets_deadline']}); sandboxes at the burst "
            f"{a['sandboxes_at_burst']}; paths {a['paths']}"
        )
    lines += render_leftovers_and_targets(r)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=200)
    parser.add_argument("--window-s", type=float, default=1.0)
    parser.add_argument(
        "--acquire-timeout-s", type=float, default=30.0, help="a longer wait is a failure"
    )
    parser.add_argument("--announce-s", type=float, default=30.0, help="prewarm's within_s")
    parser.add_argument("--hold-s", type=float, default=60.0, help="prewarm's hold_s")
    parser.add_argument("--warm-samples", type=int, default=60)
    parser.add_argument("--warm-interval-s", type=float, default=0.1)
    parser.add_argument("--skip-prewarm", action="store_true")
    parser.add_argument("--skip-refill", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    room = NODES * NODE_CAPACITY.slots
    if not 1 <= args.size <= room or args.window_s <= 0 or args.warm_samples < 1:
        print(
            f"burst: --size must be 1..{room}, --window-s > 0, --warm-samples >= 1", file=sys.stderr
        )
        return 2
    return exit_status(run_to_report("burst", run(args), render, args.json))


if __name__ == "__main__":
    interrupt_on_termination()  # the pool it starts is stopped on SIGTERM, SIGHUP
    sys.exit(main())
