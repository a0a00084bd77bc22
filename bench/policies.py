"""Our policy against every baseline on one trace, in the simulator, in one run.

    python -m bench.policies --trace FILE [--nodes 3] [--slots-per-node 64]
        [--dsec LABEL:NAME=V,NAME=V ...] [--seed S] [--out DIR] [--json]

Each baseline runs at its best reasonable configuration for the trace and the cluster
(`policy_params`): the static pool is the size of the trace's peak concurrency
(`--static-size` to change it), the smallest fixed pool that never makes a request wait
for capacity; the autoscalers' max is the cluster's capacity, so no max binds before
the nodes are full. dsec runs with the pool defaults, and once more per `--dsec`
variant (for instance `lean8:min_warm=8,warm_fraction=0,refill_concurrency=4`).

Writes a report per run and a comparison (table, JSON, overlaid latency CDFs), then
says for each baseline which dsec runs match its p99 schedule latency at no more
sandbox-seconds, and how long each run took.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pydantic import ValidationError

from bench.generate import summarize
from bench.report import compare_reports, render_comparison, write_report
from bench.sim import simulate
from dsec.models import PoolParams
from dsec.policies import POLICIES
from dsec.trace import TraceError, load_trace

# the baselines whose max (max_warm) caps how far they scale
BOUNDED = ("hpa", "keda", "kpa")


def policy_params(policy: str, *, peak: int, capacity: int) -> PoolParams:
    """The pool parameters that run `policy` at its best reasonable configuration on a
    trace whose peak concurrency is `peak`, on a cluster of `capacity` slots."""
    if policy == "static":
        return PoolParams(min_warm=peak, max_warm=peak)
    if policy in BOUNDED:
        return PoolParams(max_warm=capacity)
    return PoolParams()


def parse_variant(text: str) -> tuple[str, PoolParams]:
    """`LABEL:NAME=V,NAME=V` -> (label, dsec's pool defaults with those values)."""
    label, sep, assignments = text.partition(":")
    if not sep or not label.strip():
        raise ValueError(f"--dsec wants LABEL:NAME=V,NAME=V, got {text!r}")
    values = {}
    for item in filter(None, (a.strip() for a in assignments.split(","))):
        name, sep, value = item.partition("=")
        if not sep or name not in PoolParams.model_fields or name == "templates":
            raise ValueError(f"--dsec {label}: {item!r} is not NAME=V with a pool parameter")
        values[name] = value
    try:
        return label.strip(), PoolParams.model_validate(values)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())
        raise ValueError(f"--dsec {label}: {problems}") from None


def verdicts(rows: list[dict]) -> list[dict]:
    """For each baseline: the dsec runs at its p99 or lower with no more sandbox-seconds."""
    mine = [r for r in rows if r["policy"] == "dsec"]
    return [
        {
            "baseline": b["run"],
            "p99_ms": b["p99_ms"],
            "sandbox_seconds": b["sandbox_seconds"],
            "matched_by": [
                d["run"]
                for d in mine
                if d["p99_ms"] <= b["p99_ms"] and d["sandbox_seconds"] <= b["sandbox_seconds"]
            ],
        }
        for b in rows
        if b["policy"] != "dsec"
    ]


def render_verdicts(found: list[dict], walls: dict[str, float]) -> str:
    lines = [
        "| baseline | p99 ms | sandbox-s | dsec runs with p99 <= and sandbox-s <= |",
        "|---|---|---|---|",
    ]
    for v in found:
        matched = ", ".join(v["matched_by"]) or "none"
        lines.append(
            f"| {v['baseline']} | {v['p99_ms']:.1f} | {v['sandbox_seconds']:,.0f} | {matched} |"
        )
    lines += ["", "| run | wall s |", "|---|---|"]
    lines += [f"| {run} | {wall:.1f} |" for run, wall in walls.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, required=True)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--slots-per-node", type=int, default=64)
    parser.add_argument("--static-size", type=int)
    parser.add_argument("--dsec", action="append", default=[], metavar="LABEL:NAME=V,...",
                        help="another dsec run with these pool parameters (repeat)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("out/policies"))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        if args.nodes < 1 or args.slots_per_node < 1:
            raise ValueError("--nodes and --slots-per-node must be >= 1")
        variants = dict(parse_variant(v) for v in args.dsec)
        episodes = load_trace(args.trace)
    except (TraceError, ValueError, OSError) as e:
        print(f"bench.policies: {e}", file=sys.stderr)
        return 2
    peak = args.static_size or int(summarize(episodes)["peak_concurrency"])
    capacity = args.nodes * args.slots_per_node
    runs = [(name, name, policy_params(name, peak=peak, capacity=capacity))
            for name in sorted(POLICIES)]  # fmt: skip
    runs += [("dsec", f"dsec-{label}", params) for label, params in variants.items()]
    dirs, walls = [], {}
    for policy, run, params in runs:
        result = simulate(episodes, policy=policy, nodes=args.nodes, seed=args.seed,
                          slots_per_node=args.slots_per_node, params=params,
                          trace_name=str(args.trace))  # fmt: skip
        walls[run] = result.meta["wall_s"]
        dirs.append(write_report(result, args.out / run))
    comparison = compare_reports(dirs, args.out)
    for row, run in zip(comparison["reports"], walls, strict=True):
        row["run"] = run
        row["sandbox_seconds"] = row["sandbox_seconds_local"] + row["sandbox_seconds_cloud"]
    found = verdicts(comparison["reports"])
    (args.out / "verdicts.json").write_text(json.dumps({"verdicts": found, "wall_s": walls}))
    if args.json:
        print(json.dumps({**comparison, "verdicts": found, "wall_s": walls}))
    else:
        print(render_comparison(comparison) + "\n\n" + render_verdicts(found, walls))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
