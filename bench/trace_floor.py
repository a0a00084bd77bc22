"""A trace played straight onto this machine's Docker engine, with no pool: what the
engine alone makes of it, the floor for a pool's replay of the same trace.

    python -m bench.trace_floor --trace FILE [--busiest-s 120] [--time-scale 1]
                                [--threads 300] [--json]

Each episode, at its arrival, is a container made on one of `--threads` threads with
the agents' own create (`bench.engine_floor`), its steps (think, then an exec of
`sleep EXEC_S` through the Docker SDK), and a remove. With `--busiest-s`, only the
trace's busiest that many seconds are played (`bench.tune.busiest_slice`, as a tune's
live check plays them). It prints the start latency (arrival to container started),
the wall time, each exec's time past its command's, and the removes' times; and what
the engine completes a second of creates, removes and execs is asked of it (from a
profile's `engine_rates_per_s` with `--profile`): past 1, no pool can keep up.
Exits 1 when an episode failed or a container was left behind.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.engine_floor import ENGINE_ERRORS, EngineFloor
from bench.sim.profile import Profile
from bench.stats import summary_ms
from bench.tune import busiest_slice
from dsec.processes import interrupt_on_termination
from dsec.trace import Episode, TraceError, load_trace


def engine_demand(episodes: list[Episode], rates: dict[str, float], time_scale: float) -> float:
    """Engine-seconds a second the episodes ask for over their arrivals' span: a create,
    a remove and an exec per step each, at the engine's measured rates."""
    arrivals = [e.arrival_s for e in episodes]
    span = (max(arrivals) - min(arrivals)) * time_scale
    work = sum(
        1 / rates["create"] + 1 / rates["remove"] + len(e.steps) / rates["exec"] for e in episodes
    )
    return work / span if span > 0 else float("inf")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, required=True)
    parser.add_argument("--busiest-s", type=float, help="play only the busiest this many seconds")
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=300)
    parser.add_argument("--profile", type=Path, help="a profile from `dsec bench calibrate`")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.time_scale <= 0 or not 1 <= args.threads <= 2000 or (args.busiest_s or 1) <= 0:
        print("trace_floor: --time-scale and --busiest-s must be > 0, --threads 1..2000",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        episodes = load_trace(args.trace)
        profile = Profile.load(args.profile) if args.profile else None
    except (TraceError, ValueError, OSError) as e:
        print(f"trace_floor: {e}", file=sys.stderr)
        return 2
    if args.busiest_s:
        episodes = busiest_slice(episodes, args.busiest_s)
    rates = profile.engine_rates_per_s if profile else {}
    try:
        with EngineFloor(threads=args.threads) as floor:
            played = floor.trace(episodes, args.time_scale)
    except ENGINE_ERRORS as e:
        print(f"trace_floor: {e}", file=sys.stderr)
        return 1
    report = {
        "episodes": len(episodes),
        "time_scale": args.time_scale,
        "wall_s": round(played.wall_s, 3),
        "start_ms": summary_ms(played.start_s),
        "exec_overhead_ms": summary_ms(played.exec_overhead_s),
        "remove_ms": summary_ms(played.remove_s),
        "failures": played.failures,
        "left_behind": floor.left_after_close,
        "engine_demand": round(engine_demand(episodes, rates, args.time_scale), 3)
        if {"create", "remove", "exec"} <= rates.keys()
        else None,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        start, overhead = report["start_ms"], report["exec_overhead_ms"]
        print(f"{len(episodes)} episodes in {report['wall_s']} s: start p50 {start['p50']} ms, "
              f"p99 {start['p99']} ms; exec overhead p50 {overhead['p50']} ms; engine "
              f"demand {report['engine_demand']}; {len(played.failures)} failed")  # fmt: skip
    return 1 if played.failures or floor.left_after_close else 0


if __name__ == "__main__":
    interrupt_on_termination()  # the pool it starts is stopped on SIGTERM, SIGHUP
    sys.exit(main())
