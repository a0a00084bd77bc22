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
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from pydantic import ValidationError

from bench.report import build_report, new_figure
from bench.runargs import add_run_arguments, load_run
from bench.sim import simulate
from dsec.models import PoolParams
from dsec.progress import progress_bar
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


def p99_of(row: dict) -> float:
    """A run's p99 schedule latency; inf for a run that scheduled nothing, which is then
    never the better one."""
    return math.inf if row["p99_ms"] is None else row["p99_ms"]


def pareto_front(rows: list[dict]) -> list[dict]:
    """Runs no other run beats on both p99 latency and sandbox-seconds."""
    return [
        r for r in rows
        if not any(
            p99_of(o) <= p99_of(r) and o["sandbox_seconds"] <= r["sandbox_seconds"]
            and (p99_of(o), o["sandbox_seconds"]) != (p99_of(r), r["sandbox_seconds"])
            for o in rows
        )
    ]  # fmt: skip


FIGURES = ("p50_ms", "p95_ms", "p99_ms", "queue_wait", "sandbox_seconds", "utilisation",
           "episodes_per_hour", "failed")  # fmt: skip


def figures(report: dict) -> dict:
    """What a sweep or a tune compares runs on, from a run's report.json (latencies are
    None when nothing was scheduled)."""
    latency = report["schedule_latency_ms"]
    return {
        "p50_ms": latency["p50"], "p95_ms": latency["p95"], "p99_ms": latency["p99"],
        "queue_wait": report["queue_wait_share"] or 0.0,
        "sandbox_seconds": round(sum(report["sandbox_seconds"].values()), 1),
        "utilisation": report["utilisation"],
        "episodes_per_hour": report["episodes_per_hour"],
        "failed": report["episodes"]["failed"],
    }  # fmt: skip


def measure(episodes, params: PoolParams, **sim) -> dict:
    """One simulated run of `episodes` with pool parameters `params`: its figures."""
    return figures(build_report(simulate(episodes, params=params, **sim)))


def sweep(
    episodes, grid: dict[str, list[float]], base: PoolParams, *, progress: bool = False, **sim
) -> list[dict]:
    rows = []
    names = sorted(grid)
    combos = list(itertools.product(*(grid[n] for n in names)))
    with progress_bar(len(combos), "dsec bench sweep", "run", shown=progress) as bar:
        for values in combos:
            combo = dict(zip(names, values, strict=True))
            params = PoolParams.model_validate(base.model_dump() | combo)
            rows.append({**combo, **measure(episodes, params, **sim)})
            bar.update(1)
    front = pareto_front(rows)
    for r in rows:
        r["pareto"] = r in front
    return rows


def plot_pareto(rows: list[dict], path: Path, *, marks: Sequence[tuple[str, dict]] = (),
                target_ms: float | None = None,
                title: str = "Parameter sweep: latency against cost") -> Path:  # fmt: skip
    """Every run, the Pareto front, and `marks`: (label, run) drawn apart (the first as a
    star), with the latency target as a line. Runs that scheduled nothing are left out."""
    drawn = [r for r in rows if r["p99_ms"] is not None]
    fig, (ax,) = new_figure(height=5)
    front = sorted((r for r in drawn if r["pareto"]), key=lambda r: r["sandbox_seconds"])
    ax.scatter([r["sandbox_seconds"] for r in drawn], [r["p99_ms"] for r in drawn],
               color="0.6", label="runs")  # fmt: skip
    ax.plot([r["sandbox_seconds"] for r in front], [r["p99_ms"] for r in front], "o-",
            color="tab:red", label="Pareto front")  # fmt: skip
    for (label, row), marker in zip(marks, itertools.cycle("*sDv^<>PX"), strict=False):
        if row["p99_ms"] is not None:
            ax.scatter([row["sandbox_seconds"]], [row["p99_ms"]], marker=marker, zorder=3,
                       s=220 if marker == "*" else 70, label=label)  # fmt: skip
    if target_ms is not None:
        ax.axhline(target_ms, linestyle="--", color="tab:green", label=f"target {target_ms:g} ms")
    latencies = [r["p99_ms"] for r in drawn] + [row["p99_ms"] for _, row in marks
                                                if row["p99_ms"] is not None]  # fmt: skip
    if latencies and min(latencies) > 0 and max(latencies) > 100 * min(latencies):
        ax.set_yscale("log")  # dsec's few ms beside a queueing baseline's minutes
    ax.set_xlabel("sandbox-seconds (cost)")
    ax.set_ylabel("p99 schedule latency (ms)")
    ax.set_title(title)
    ax.legend(fontsize="small")
    fig.savefig(path, dpi=110)
    return path


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def render(rows: list[dict]) -> str:
    names = [k for k in rows[0] if k not in (*FIGURES, "pareto")]
    headers = [*names, "p50 ms", "p99 ms", "sandbox-s", "utilisation", "episodes/h", "pareto"]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for r in sorted(rows, key=lambda r: (r["sandbox_seconds"], p99_of(r))):
        cells = [*(f"{r[n]:g}" for n in names), _ms(r["p50_ms"]), _ms(r["p99_ms"]),
                 f"{r['sandbox_seconds']:.0f}", f"{r['utilisation'] or 0:.3f}",
                 f"{r['episodes_per_hour'] or 0:.0f}", "*" if r["pareto"] else ""]  # fmt: skip
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
            progress=True,
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
