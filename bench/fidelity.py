"""How far the simulator is from the live pool, on one trace in one run.

    dsec bench fidelity --trace FILE [--time-scale X] [--nodes 3] [--slots-per-node S]
                        [--profile profile.json] [--out DIR] [--json]

The same (time-scaled) trace is replayed live, on a local pool this command starts,
and in the simulator with the same policy, nodes, slots and pool parameters. The
local pool's agents share one Docker engine, so the simulator queues every node's
creates on one engine too. Reported: the relative error of p50 and p95 schedule
latency and of utilisation, |sim - live| / live.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from bench.replay_live import default_pool_spec, replay_live
from bench.report import build_report, write_report
from bench.runargs import add_run_arguments, load_run
from bench.sim import simulate
from bench.sim.profile import Profile
from dsec.trace import TraceError


def relative_error(sim: float | None, live: float | None) -> float | None:
    if sim is None or live is None or live == 0:
        return None
    return round(abs(sim - live) / abs(live), 4)


def fidelity(episodes, *, policy: str, nodes: int, slots_per_node: int, time_scale: float,
             seed: int, profile: Profile | None, trace_name: str, out: Path) -> dict:  # fmt: skip
    spec = default_pool_spec(policy, nodes=nodes, slots_per_node=slots_per_node)
    live = asyncio.run(
        replay_live(episodes, pool_spec=spec, time_scale=time_scale, policy=policy,
                    trace=trace_name, seed=seed, progress=False)
    )  # fmt: skip
    sim = simulate(
        episodes, policy=policy, nodes=nodes, slots_per_node=slots_per_node, seed=seed,
        time_scale=time_scale, params=spec.pool, profile=profile, shared_engine=True,
        tick_s=spec.tick_s, trace_name=trace_name,
    )  # fmt: skip
    reports = {"live": build_report(live), "sim": build_report(sim)}
    write_report(live, out / "live")
    write_report(sim, out / "sim")
    figures = {
        side: {
            "p50_ms": r["schedule_latency_ms"]["p50"],
            "p95_ms": r["schedule_latency_ms"]["p95"],
            "utilisation": r["utilisation"],
        }
        for side, r in reports.items()
    }
    errors = {
        name: relative_error(figures["sim"][name], figures["live"][name])
        for name in ("p50_ms", "p95_ms", "utilisation")
    }
    return {"trace": trace_name, "policy": policy, "time_scale": time_scale, **figures,
            "relative_error": errors, "sim_wall_s": sim.meta["wall_s"],
            "live_wall_s": live.meta.get("wall_s")}  # fmt: skip


def render(result: dict) -> str:
    lines = ["| | p50 schedule ms | p95 schedule ms | utilisation |", "|---|---|---|---|"]
    for side in ("live", "sim"):
        f = result[side]
        lines.append(f"| {side} | {f['p50_ms']} | {f['p95_ms']} | {f['utilisation']} |")
    e = result["relative_error"]
    lines.append(f"| relative error | {e['p50_ms']} | {e['p95_ms']} | {e['utilisation']} |")
    return "\n".join(lines)


def add_fidelity_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_arguments(parser, out="out/fidelity")


def run_fidelity(args: argparse.Namespace) -> int:
    try:
        episodes, profile = load_run(args)
    except (TraceError, ValueError, OSError) as e:
        print(f"dsec bench fidelity: {e}", file=sys.stderr)
        return 2
    result = fidelity(
        episodes, policy=args.policy, nodes=args.nodes, slots_per_node=args.slots_per_node,
        time_scale=args.time_scale, seed=args.seed, profile=profile,
        trace_name=str(args.trace), out=args.out,
    )  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fidelity.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result) if args.json else render(result))
    return 0
