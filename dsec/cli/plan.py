"""`dsec plan`: the planner's flags, its table and JSON, and `--simulate`.

The arithmetic is dsec/plan.py; the check in the simulator is bench/plan_check.py,
imported only when asked to run it (it is slow to import).
"""

from __future__ import annotations

import argparse
import json
import sys

from pydantic import BaseModel, ValidationError

from dsec.plan import SIM_AUTO_MAX_IN_FLIGHT, PlanInput, PlanResult, SimulateSettings, plan
from dsec.policies import POLICIES

# (figure, label, unit, format) in the order the table prints them.
_TABLE_ROWS: tuple[tuple[str, str, str, str], ...] = (
    ("trajectories_total", "trajectories in the run", "", ",d"),
    ("trajectories_per_s", "effective trajectories/s", "1/s", ".2f"),
    ("raw_trajectories_per_s", "raw trajectories/s", "1/s", ".2f"),
    ("deadline_trajectories_per_s", "trajectories/s the deadline asks", "1/s", ".2f"),
    ("cadence_trajectories_per_s", "trajectories/s the cadence asks", "1/s", ".2f"),
    ("capacity_trajectories_per_s", "trajectories/s the GPUs produce", "1/s", ".2f"),
    ("rate_over_deadline_share", "rate above the deadline's", "", ".1%"),
    ("iteration_period_s", "iteration period (cadence)", "s", ",.1f"),
    ("deadline_cadence_s", "slowest cadence in time", "s", ",.1f"),
    ("capacity_cadence_s", "fastest cadence the GPUs feed", "s", ",.1f"),
    ("run_time_s", "run time at the cadence", "s", ",.0f"),
    ("time_slack_s", "time slack at the cadence", "s", ",.0f"),
    ("time_slack_share", "time slack share", "", ".1%"),
    ("meets_deadline", "cadence meets the deadline", "", ""),
    ("output_tokens_per_s", "output tokens/s", "tok/s", ",.0f"),
    ("tokens_per_gpu_s_threshold_lossless", "tokens/s per GPU, lossless", "tok/s", ".2f"),
    ("tokens_per_gpu_s_threshold", "tokens/s per GPU threshold", "tok/s", ".2f"),
    ("inference_demand_share_lossless", "demand / measured, lossless", "", ".1%"),
    ("inference_demand_share", "demand / measured throughput", "", ".1%"),
    ("gpus_needed", "GPUs needed at measured rate", "GPUs", ",d"),
    ("gpu_gap", "GPU gap, moved from training", "GPUs", ",d"),
    ("training_gpus_after_gap", "training GPUs left", "GPUs", ",d"),
    ("update_time_stretch", "update time stretch", "", ".1%"),
    ("lifetime_mean_s", "mean sandbox occupancy", "s", ",.0f"),
    ("decode_tokens_per_s_median", "tokens/s a stream (median)", "tok/s", ".1f"),
    ("decode_tokens_per_s_mean", "tokens/s a stream (mean)", "tok/s", ".1f"),
    ("in_flight_median", "in flight (median occupancy)", "sandboxes", ",.0f"),
    ("in_flight_mean", "in flight (mean occupancy)", "sandboxes", ",.0f"),
    ("in_flight_mean_raw", "in flight (mean, raw rate)", "sandboxes", ",.0f"),
    ("nodes_median", "nodes (median occupancy)", "nodes", "d"),
    ("nodes_mean", "nodes (mean occupancy)", "nodes", "d"),
    ("nodes_mean_raw", "nodes (mean, raw rate)", "nodes", "d"),
    ("dsec_node_cores", "cores of an average DSec node", "cores", ",.1f"),
    ("dsec_node_memory_tb", "memory of an average DSec node", "TB", ".2f"),
    ("version_lag_median", "version lag (median occupancy)", "versions", ".2f"),
    ("version_lag_mean", "version lag (mean occupancy)", "versions", ".2f"),
    ("version_lag_at_median", "version lag of a median trajectory", "", ""),
    ("release_periods_p99", "release periods of a p99 lifetime", "periods", ".1f"),
    ("lag_over_cap_share", "trajectories over lag cap", "", ".1%"),
    ("group_over_cap_share_lower", "groups over lag cap, at least", "", ".1%"),
    ("group_over_cap_share_upper", "groups over lag cap, at most", "", ".1%"),
    ("loss_budget_share", "loss budget, 1 - p", "", ".1%"),
)


def _shown(value: object, fmt: str) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, dict):  # a lag's distribution: lag -> probability
        return ", ".join(f"{lag}: {share:.0%}" for lag, share in value.items())
    return format(value, fmt)


def _aligned(rows: list[tuple[str, ...]]) -> list[str]:
    """Rows as right-aligned text columns."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]


def _pair(median: float | None, mean: float, fmt: str) -> str:
    """A figure at the median and at the mean occupancy, as "median / mean"."""
    return f"{'n/a' if median is None else format(median, fmt)} / {format(mean, fmt)}"


def _density_table(result: PlanResult) -> list[str]:
    def converted(equivalents: float | None, nodes: int | None) -> str:
        return "n/a" if nodes is None else f"{equivalents:,.2f} -> {nodes:,d}"

    header = ("sandboxes/node", "median occupancy", "mean occupancy", "mean, raw rate")
    rows = [
        (
            f"{d.sandboxes_per_node:,d}",
            converted(d.node_equivalents_median, d.nodes_median),
            converted(d.node_equivalents_mean, d.nodes_mean),
            converted(d.node_equivalents_mean_raw, d.nodes_mean_raw),
        )
        for d in result.nodes_at_densities
    ]
    title = "nodes at each density: node equivalents (in flight / density) -> nodes"
    return [title, *_aligned([header, *rows])]


def _sensitivity_table(result: PlanResult) -> list[str]:
    densities = [d.sandboxes_per_node for d in result.sensitivity[0].nodes_at_densities]
    header = ("tok/s/GPU", "demand lossless", "demand", "GPUs needed", "traj/s", "cadence s",
              "version lag", "in flight", *(f"node eq. @{d:,d}" for d in densities))  # fmt: skip
    rows = [
        (
            f"{row.tokens_per_gpu_s:,g}",
            f"{row.inference_demand_share_lossless:.1%}",
            f"{row.inference_demand_share:.1%}",
            f"{row.gpus_needed:,d}",
            f"{row.capacity_trajectories_per_s:,.2f}",
            f"{row.capacity_cadence_s:,.1f}",
            _pair(row.version_lag_median, row.version_lag_mean, ".2f"),
            _pair(row.in_flight_median, row.in_flight_mean, ",.0f"),
            *(
                _pair(d.node_equivalents_median, d.node_equivalents_mean, ",.1f")
                for d in row.nodes_at_densities
            ),
        )
        for row in result.sensitivity
    ]
    return [
        "sensitivity over tokens/s per GPU: demand and GPUs for this plan's rate; then, with",
        "the rate following the GPUs (--rate-from capacity), what it asks (median / mean)",
        *_aligned([header, *rows]),
    ]


def render_table(result: PlanResult) -> str:
    """The plan as aligned text: a row per figure (value, unit, formula); then the nodes at
    each density and the sensitivity table, when there are any."""
    rows = [
        (label, _shown(getattr(result, key), fmt), unit, result.formulas[key])
        for key, label, unit, fmt in _TABLE_ROWS
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [
        f"{label:<{widths[0]}}  {value:>{widths[1]}}  {unit:<{widths[2]}}  {formula}"
        for label, value, unit, formula in rows
    ]
    if result.nodes_at_densities:
        lines += ["", *_density_table(result)]
    if result.sensitivity:
        lines += ["", *_sensitivity_table(result)]
    return "\n".join(lines)


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
        ("--training-gpus", int, "training GPUs, from which a GPU gap is moved (7000)"),
        ("--lifetime-p50-s", float, "median sandbox occupancy in seconds (1044)"),
        ("--lifetime-p99-s", float, "99th percentile sandbox occupancy in seconds (13900)"),
        ("--lifetime-mean-s", float, "mean sandbox occupancy: instead of p50 and p99, or with "
         "them to replace the fit's mean in Little's law (the fit keeps the lag shares)"),
        ("--sandboxes-per-node", int, "sandboxes one node holds, for the nodes_* figures "
         "and --simulate (1048)"),
        ("--cadence-s", float, "seconds between weight releases, one per iteration; the plan "
         "then sizes for B/L (default: T/n, the deadline's own pace)"),
        ("--rate-from", str, "the rate sized for: deadline (n·B/T), cadence (B/L) or "
         "capacity (what the GPUs produce, G·x·a·p/K) (cadence with --cadence-s, else "
         "deadline)"),
        ("--lag-cap", int, "largest tolerated version lag (10)"),
        ("--group-size", int, "trajectories per GRPO group, dropped together (8)"),
    )  # fmt: skip
    for flag, kind, help_text in flags:
        parser.add_argument(flag, type=kind, default=None, help=help_text)
    parser.add_argument("--densities", type=int, nargs="*", default=None,
                        help="sandboxes per node to convert the in-flight counts at "
                        "(1048 3200); none: no such table")  # fmt: skip
    parser.add_argument("--sensitivity", type=float, nargs="*", default=None,
                        help="tokens/s per GPU of the sensitivity table "
                        "(60 75 200 1000 2000); none: no table")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")

    check = parser.add_argument_group(
        "simulation (--simulate): check the node count in the simulator"
    )
    check.add_argument(
        "--simulate",
        action="store_true",
        help="play the planned load through the scheduler; report latency, queue wait, "
        "version lag and the node count that meets the targets",
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

            check = check_plan(result, settings, on_run=_print_run, progress=True)
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
