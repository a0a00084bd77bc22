"""The simulator at DSec's scale: how long one simulated hour takes on this machine.

    python -m bench.sim_scale [--nodes 160] [--slots-per-node 3200] [--in-flight 20000]
        [--tick-on-every-event] [--write-trace FILE]

160 nodes of 3,200 slots; an evaluation burst of 20,000 episodes in the first
minute on top of a steady arrival rate that keeps 20,000 in flight (Little's law
with DSec's lifetimes: p50 17.4 min, p99 231.5 min, so a mean of about 32 min);
one simulated hour. Reported: wall time, simulated seconds per wall second, the
peak of sandboxes in flight, and the report's figures.

The simulator runs as `dsec bench replay --mode sim` runs it, with its defaults
(events share ticks within bench.sim.ticks.SHARE); `--tick-on-every-event` ticks on
every event, as the live control plane does, to compare both runs' figures.
`--write-trace` also writes the trace, for the same run through the command line:
`dsec bench replay --mode sim --trace FILE --nodes 160 --slots-per-node 3200
--horizon-s 3600`.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from bench.generate import DSEC_LIFETIME_P50_S, DSEC_LIFETIME_P99_S, generate
from bench.report import build_report
from bench.sim import simulate
from bench.sim.ticks import SHARE
from dsec.models import PoolParams
from dsec.plan import lognormal_from_median_p99, lognormal_mean
from dsec.trace import dump_trace


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=160)
    parser.add_argument("--slots-per-node", type=int, default=3200)
    parser.add_argument("--in-flight", type=int, default=20_000)
    parser.add_argument("--hours", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--tick-on-every-event", action="store_true",
                        help="decide on every event at once, as live")  # fmt: skip
    parser.add_argument("--write-trace", type=Path, help="write the trace here too")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    mean_lifetime = lognormal_mean(*lognormal_from_median_p99(DSEC_LIFETIME_P50_S,
                                                              DSEC_LIFETIME_P99_S))  # fmt: skip
    rate = args.in_flight / mean_lifetime
    horizon = args.hours * 3600
    trace = generate(kind="burst", burst_size=args.in_flight, burst_window_s=60,
                     seed=args.seed, id_prefix="burst")  # fmt: skip
    trace += generate(kind="poisson", duration_s=horizon, rate_per_s=rate, seed=args.seed + 1,
                      id_prefix="steady")  # fmt: skip
    if args.write_trace:
        dump_trace(trace, args.write_trace)
    decide_within = 0.0 if args.tick_on_every_event else SHARE
    started = time.perf_counter()
    result = simulate(trace, nodes=args.nodes, slots_per_node=args.slots_per_node,
                      seed=args.seed, horizon_s=horizon, params=PoolParams(),
                      decide_within=decide_within)  # fmt: skip
    wall = time.perf_counter() - started
    report = build_report(result)
    out = {
        "nodes": args.nodes, "slots_per_node": args.slots_per_node,
        "decide_within": decide_within,
        "episodes_in_trace": len(trace), "arrival_rate_per_s": round(rate, 2),
        "simulated_s": result.meta["simulated_s"], "wall_s": round(wall, 1),
        "simulated_s_per_wall_s": round(result.meta["simulated_s"] / wall, 1),
        "peak_leased": max(s.leased for s in result.timeline),
        "peak_alive": max(s.alive for s in result.timeline),
        "schedule_latency_ms": {k: report["schedule_latency_ms"][k] for k in ("p50", "p99")},
        "paths": {p: v["n"] for p, v in report["schedule_latency_ms"]["by_path"].items()},
    }  # fmt: skip
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:26} {v}")
    return 0 if math.isfinite(wall) else 1


if __name__ == "__main__":
    raise SystemExit(main())
