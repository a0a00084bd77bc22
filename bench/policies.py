"""Our policy against every baseline on one trace, in the simulator, in one run.

    python -m bench.policies --trace FILE [--nodes 3] [--slots-per-node 64] [--out DIR]

Every policy gets the pool's default parameters, except the static pool, which needs
a size: it gets the trace's peak concurrency (`--static-size` to change it), the
smallest fixed pool that never makes a request wait for capacity. Writes a report
per policy and a comparison (table, JSON, overlaid latency CDFs).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.generate import summarize
from bench.report import compare_reports, render_comparison, write_report
from bench.sim import simulate
from dsec.baselines import POLICIES
from dsec.models import PoolParams
from dsec.trace import load_trace


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, required=True)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--slots-per-node", type=int, default=64)
    parser.add_argument("--static-size", type=int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("out/policies"))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    episodes = load_trace(args.trace)
    static_size = args.static_size or int(summarize(episodes)["peak_concurrency"])
    dirs = []
    for name in sorted(POLICIES):
        params = PoolParams(min_warm=static_size, max_warm=static_size) if name == "static" \
            else PoolParams()  # fmt: skip
        result = simulate(episodes, policy=name, nodes=args.nodes, seed=args.seed,
                          slots_per_node=args.slots_per_node, params=params,
                          trace_name=str(args.trace))  # fmt: skip
        dirs.append(write_report(result, args.out / name))
    comparison = compare_reports(dirs, args.out)
    print(json.dumps(comparison) if args.json else render_comparison(comparison))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
