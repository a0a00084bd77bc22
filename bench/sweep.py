"""Sweep pool parameters in the simulator: what each choice costs.

    dsec bench sweep --trace FILE --param warm_fraction=0.05,0.1,0.2 \\
        --param freeze_after_s=10,30,60 [--nodes N] [--slots-per-node S] [--out DIR]

Every combination of the given values runs the same trace through the simulator
with the same seed. The table gives p99 schedule latency against sandbox-seconds
(what the pool costs); the Pareto front is the set no other run beats on both, and
`pareto.png` plots it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

from pydantic import ValidationError

from bench.report import build_report
from bench.runargs import add_run_arguments, load_run
from bench.sim import simulate
from dsec.models import PoolParams
from dsec.trace import TraceError

DEFAULT_GRID = {
    "warm_fraction": [0.05, 0.1, 0.2],
    "freeze_after_s": [10.0, 30.0, 60.0],
    "scale_up_k": [1.0, 2.0, 4.0],
}


def parse_param(text: str) -> tuple[str, list[float]]:
    name, sep, values = text.partition("=")
    if not sep or name not in PoolParams.model_fields or name == "templates":
        raise ValueError(f"--param wants NAME=V1,V2,... with a pool parameter name, got {text!r}")
    try:
        return name, [float(v) for v in values.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--param {name}: values must be numbers, got {values!r}") from None


def pareto_front(rows: list[dict]) -> list[dict]:
    """Runs no other run beats on both p99 latency and sandbox-seconds."""
    return [
        r for r in rows
        if not any(
            o["p99_ms"] <= r["p99_ms"] and o["sandbox_seconds"] <= r["sandbox_seconds"]
            and (o["p99_ms"], o["sandbox_seconds"]) != (r["p99_ms"], r["sandbox_seconds"])
            for o in rows
        )
    ]  # fmt: skip


def sweep(episodes, grid: dict[str, list[float]], base: PoolParams, **sim) -> list[dict]:
    rows = []
    names = sorted(grid)
    for values in itertools.product(*(grid[n] for n in names)):
        combo = dict(zip(names, values, strict=True))
        params = PoolParams.model_validate(base.model_dump() | combo)
        report = build_report(simulate(episodes, params=params, **sim))
        latency = report["schedule_latency_ms"]
        rows.append({
            **combo,
            "p50_ms": latency["p50"], "p99_ms": latency["p99"],
            "sandbox_seconds": round(sum(report["sandbox_seconds"].values()), 1),
            "utilisation": report["utilisation"],
            "episodes_per_hour": report["episodes_per_hour"],
        })  # fmt: skip
    front = pareto_front(rows)
    for r in rows:
        r["pareto"] = r in front
    return rows


def plot_pareto(rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    front = sorted((r for r in rows if r["pareto"]), key=lambda r: r["sandbox_seconds"])
    ax.scatter([r["sandbox_seconds"] for r in rows], [r["p99_ms"] for r in rows],
               color="0.6", label="runs")  # fmt: skip
    ax.plot([r["sandbox_seconds"] for r in front], [r["p99_ms"] for r in front], "o-",
            color="tab:red", label="Pareto front")  # fmt: skip
    ax.set_xlabel("sandbox-seconds (cost)")
    ax.set_ylabel("p99 schedule latency (ms)")
    ax.set_title("Parameter sweep: latency against cost")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def render(rows: list[dict]) -> str:
    measured = ("p50_ms", "p99_ms", "sandbox_seconds", "utilisation", "episodes_per_hour", "pareto")
    names = [k for k in rows[0] if k not in measured]
    headers = [*names, "p50 ms", "p99 ms", "sandbox-s", "utilisation", "episodes/h", "pareto"]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for r in sorted(rows, key=lambda r: (r["sandbox_seconds"], r["p99_ms"])):
        cells = [*(f"{r[n]:g}" for n in names), f"{r['p50_ms']:.1f}", f"{r['p99_ms']:.1f}",
                 f"{r['sandbox_seconds']:.0f}", f"{r['utilisation']:.3f}",
                 f"{r['episodes_per_hour']:.0f}", "*" if r["pareto"] else ""]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def add_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_arguments(parser, out="out/sweep")
    parser.add_argument("--param", action="append", default=[],
                        help="NAME=V1,V2,... (repeat; default: a grid of warm_fraction, "
                             "freeze_after_s and scale_up_k)")  # fmt: skip
    parser.add_argument("--cloud-nodes", type=int, default=0)


def run_sweep(args: argparse.Namespace) -> int:
    try:
        grid = dict(parse_param(p) for p in args.param) or DEFAULT_GRID
        episodes, profile = load_run(args)
        rows = sweep(
            episodes, grid, PoolParams(), policy=args.policy, nodes=args.nodes,
            slots_per_node=args.slots_per_node, cloud_nodes=args.cloud_nodes, seed=args.seed,
            time_scale=args.time_scale, profile=profile, trace_name=str(args.trace),
        )  # fmt: skip
    except (TraceError, ValueError, OSError) as e:
        print(f"dsec bench sweep: {e}", file=sys.stderr)
        return 2
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())
        print(f"dsec bench sweep: invalid parameters: {problems}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sweep.json").write_text(json.dumps(rows, indent=2))
    (args.out / "sweep.md").write_text(render(rows) + "\n")
    plot_pareto(rows, args.out / "pareto.png")
    print(json.dumps(rows) if args.json else render(rows))
    return 0
