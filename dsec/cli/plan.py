"""`dsec plan`: the planner's flags, its table and JSON, and `--simulate`.

The arithmetic is dsec/plan.py; the check in the simulator is bench/plan_check.py,
imported only when asked to run it (it is slow to import).
"""

from __future__ import annotations

import argparse
import json
import sys

from pydantic import BaseModel, ValidationError

from dsec.baselines import POLICIES
from dsec.plan import SIM_AUTO_MAX_IN_FLIGHT, PlanInput, PlanResult, SimulateSettings, plan

# (figure, label, unit, format) in the order the table prints them.
_TABLE_ROWS: tuple[tuple[str, str, str, str], ...] = (
    ("trajectories_per_s", "effective trajectories/s", "1/s", ".2f"),
    ("raw_trajectories_per_s", "raw trajectories/s", "1/s", ".2f"),
    ("tokens_per_gpu_s_threshold_lossless", "tokens/s per GPU, lossless", "tok/s", ".2f"),
    ("tokens_per_gpu_s_threshold", "tokens/s per GPU threshold", "tok/s", ".2f"),
    ("inference_demand_share", "demand / measured throughput", "", ".1%"),
    ("gpus_needed", "GPUs needed at measured rate", "GPUs", ",d"),
    ("lifetime_mean_s", "mean sandbox occupancy", "s", ",.0f"),
    ("in_flight_median", "in flight (median occupancy)", "sandboxes", ",.0f"),
    ("in_flight_mean", "in flight (mean occupancy)", "sandboxes", ",.0f"),
    ("in_flight_mean_raw", "in flight (mean, raw rate)", "sandboxes", ",.0f"),
    ("nodes_median", "nodes (median occupancy)", "nodes", "d"),
    ("nodes_mean", "nodes (mean occupancy)", "nodes", "d"),
    ("nodes_mean_raw", "nodes (mean, raw rate)", "nodes", "d"),
    ("version_lag_median", "version lag (median occupancy)", "versions", ".2f"),
    ("version_lag_mean", "version lag (mean occupancy)", "versions", ".2f"),
    ("lag_over_cap_share", "trajectories over lag cap", "", ".1%"),
    ("time_slack_share", "time slack at cadence", "", ".1%"),
)


def render_table(result: PlanResult) -> str:
    """The plan as an aligned text table: figure, value, unit, formula."""
    rows = []
    for key, label, unit, fmt in _TABLE_ROWS:
        value = getattr(result, key)
        shown = "n/a" if value is None else format(value, fmt)
        rows.append((label, shown, unit, result.formulas[key]))
    label_width = max(len(row[0]) for row in rows)
    value_width = max(len(row[1]) for row in rows)
    unit_width = max(len(row[2]) for row in rows)
    return "\n".join(
        f"{label:<{label_width}}  {value:>{value_width}}  {unit:<{unit_width}}  {formula}"
        for label, value, unit, formula in rows
    )


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `dsec plan` flags; defaults are left to PlanInput (the seed's base case)."""
    flags: tuple[tuple[str, type, str], ...] = (
        ("--iterations", int, "outer training iterations (1000)"),
        ("--trajectories-per-iteration", int, "trajectories consumed per iteration (4096)"),
        ("--days", float, "deadline in days (7)"),
        ("--tokens-per-trajectory", int, "output tokens per trajectory (32768)"),
        ("--gpus", int, "inference GPUs (3000)"),
        ("--tokens-per-gpu-s", float, "measured rollout tokens/s per GPU (200)"),
        ("--availability", float, "share of time inference serves, a in (0, 1] (0.9)"),
        ("--acceptance", float, "share of trajectories entering a batch, p in (0, 1] (0.8)"),
        ("--lifetime-p50-s", float, "median sandbox occupancy in seconds (1044)"),
        ("--lifetime-p99-s", float, "99th percentile sandbox occupancy in seconds (13900)"),
        ("--lifetime-mean-s", float, "mean sandbox occupancy, instead of p50 and p99"),
        ("--sandboxes-per-node", int, "sandboxes one node holds (1048)"),
        ("--cadence-s", float, "seconds between weight releases, one per iteration (600)"),
        ("--lag-cap", int, "largest tolerated version lag (10)"),
    )
    for flag, kind, help_text in flags:
        parser.add_argument(flag, type=kind, default=None, help=help_text)
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")

    check = parser.add_argument_group(
        "simulation (--simulate): check the node count in the simulator"
    )
    check.add_argument(
        "--simulate",
        action="store_true",
        help="play the planned load through the scheduler; report latency, queue wait and "
        "the node count that meets the targets",
    )
    sim_flags: tuple[tuple[str, type, str], ...] = (
        ("--policy", str, f"pool policy: {', '.join(sorted(POLICIES))} (dsec)"),
        ("--seed", int, "seed of the trace and the simulator (0)"),
        ("--nodes", int, "node count to simulate first (the plan's)"),
        ("--load", str, "effective (R, nodes_mean) or raw (R/p, nodes_mean_raw) (effective)"),
        ("--sim-scale", float, "share of the load simulated, in (0, 1] (automatic: all of it "
         f"up to {SIM_AUTO_MAX_IN_FLIGHT:,} sandboxes in flight)"),
        ("--warmup-s", float, "simulated seconds before measuring (600)"),
        ("--window-s", float, "simulated seconds of measured arrivals (600)"),
        ("--max-runs", int, "simulations the node search may run (8)"),
    )  # fmt: skip
    for flag, kind, help_text in sim_flags:
        check.add_argument(flag, type=kind, default=None, help=help_text)


def _describe(error: ValidationError) -> str:
    """One line naming the offending flags, for a person at a terminal."""
    parts = []
    for detail in error.errors():
        message = detail["msg"].removeprefix("Value error, ")
        if detail["loc"]:
            flag = "--" + str(detail["loc"][0]).replace("_", "-")
            parts.append(f"{flag}: {message} (got {detail['input']!r})")
        else:
            parts.append(message)
    return "; ".join(parts)


def _given(args: argparse.Namespace, model: type[BaseModel]) -> dict[str, object]:
    return {
        name: getattr(args, name)
        for name in model.model_fields
        if getattr(args, name, None) is not None
    }


def run_plan(args: argparse.Namespace) -> int:
    """Run `dsec plan`: print the table, or JSON with --json; 2 on bad input.

    With --simulate, the simulator's check follows the table (in the JSON: "simulation").
    """
    simulating = getattr(args, "simulate", False)
    sim_given = _given(args, SimulateSettings)
    try:
        if sim_given and not simulating:
            flags = ", ".join("--" + name.replace("_", "-") for name in sim_given)
            raise ValueError(f"{flags} only apply with --simulate")
        result = plan(PlanInput(**_given(args, PlanInput)))
        settings = SimulateSettings(**sim_given) if simulating else None
        check = None
        if settings is not None:
            # imported here: the simulator is the bench's, and slow to import
            from bench.plan_check import check_plan, render_check

            check = check_plan(result, settings, on_run=_print_run)
    except ValidationError as error:
        print(f"dsec plan: {_describe(error)}", file=sys.stderr)
        return 2
    except ValueError as error:
        print(f"dsec plan: {error}", file=sys.stderr)
        return 2
    if args.json:
        dumped = result.model_dump(mode="json")
        if check is not None:
            dumped["simulation"] = check.model_dump(mode="json")
        print(json.dumps(dumped, indent=2, ensure_ascii=False))
    else:
        print(render_table(result))
        if check is not None:
            print()
            print(render_check(check))
    return 0


def _print_run(line: str) -> None:
    """Progress of the simulations, on stderr: stdout carries only the result."""
    print(f"dsec plan: {line}", file=sys.stderr, flush=True)


def register(sub: argparse._SubParsersAction) -> None:
    """Add `dsec plan`."""
    pl = sub.add_parser(
        "plan", help="size a sandbox pool for a training run (--simulate: check it in the sim)"
    )
    add_plan_arguments(pl)
    pl.set_defaults(run=run_plan)
