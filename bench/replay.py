"""`dsec bench replay` and `dsec bench compare`.

    dsec bench replay --trace FILE --mode live|sim [--url URL] [--policy NAME] [--nodes N]
        [--slots-per-node S] [--cloud-nodes M] [--time-scale X] [--seed S] [--horizon-s T]
        [--out DIR] [--json]
    dsec bench compare --reports DIR1 DIR2 ... [--out DIR] [--json]

A replay writes its report directory (report.json, latencies.json, report.md and PNG plots;
see `bench.report`) and prints the report: as JSON with ``--json``, else as its Markdown
table. A comparison overlays several reports' latency CDFs and tabulates them.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import get_args

from bench.generate import summarize
from bench.policies import policy_params
from bench.records import RunResult
from bench.report import (
    COMPARE_MARKDOWN_FILE,
    MARKDOWN_FILE,
    REPORT_FILE,
    compare_reports,
    write_report,
)
from bench.sim.profile import Profile
from controlplane.config import ControlPlaneConfig
from dsec.models import PoolParams
from dsec.trace import Episode, TraceError, load_trace

POLICIES: tuple[str, ...] = get_args(ControlPlaneConfig.model_fields["policy"].annotation)
DEFAULT_OUT_DIR = Path("out")


def add_replay_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``dsec bench replay``."""
    parser.add_argument("--trace", required=True, help="trace file (JSON Lines)")
    parser.add_argument(
        "--mode",
        choices=("live", "sim"),
        required=True,
        help="live: against real sandboxes; sim: the discrete-event simulator",
    )
    parser.add_argument(
        "--url", help="live: a running control plane (default: start a local pool for the run)"
    )
    parser.add_argument("--policy", choices=POLICIES, default="dsec")
    parser.add_argument("--nodes", type=int, default=3, help="local nodes of the pool")
    parser.add_argument("--slots-per-node", type=int, default=64)
    parser.add_argument(
        "--cloud-nodes", type=int, default=0, help="cloud nodes the pool may overflow to"
    )
    parser.add_argument(
        "--time-scale", type=float, default=1.0, help="multiply every trace time; 0.1 is 10x faster"
    )
    parser.add_argument("--seed", type=int, default=0, help="sim: the simulator's seed")
    parser.add_argument(
        "--profile",
        type=Path,
        help="sim: this engine's timings, from `dsec bench calibrate` (default: built in)",
    )
    parser.add_argument(
        "--shared-engine",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="sim: the nodes share one engine, as `dsec up`'s local pool does (the default); "
        "--no-shared-engine: an engine each, as on separate machines",
    )
    parser.add_argument(
        "--horizon-s",
        type=float,
        help="sim: stop at this simulated time (replay seconds); what still runs is unreleased",
    )
    parser.add_argument("--out", type=Path, help="report directory (default out/POLICY-MODE)")
    parser.add_argument("--json", action="store_true", help="print report.json")


def _bad_replay_flags(args: argparse.Namespace) -> str | None:
    if args.nodes < 1:
        return f"--nodes must be >= 1, got {args.nodes}"
    if args.slots_per_node < 1:
        return f"--slots-per-node must be >= 1, got {args.slots_per_node}"
    if args.cloud_nodes < 0:
        return f"--cloud-nodes must be >= 0, got {args.cloud_nodes}"
    if not (math.isfinite(args.time_scale) and args.time_scale > 0):
        return f"--time-scale must be a finite number > 0, got {args.time_scale}"
    if args.url is not None and args.mode == "sim":
        return "--url is for --mode live"
    if args.profile is not None and args.mode != "sim":
        return "--profile is for --mode sim (a live run is on the engine itself)"
    if args.horizon_s is not None:
        if args.mode != "sim":
            return "--horizon-s is for --mode sim"
        if not (math.isfinite(args.horizon_s) and args.horizon_s > 0):
            return f"--horizon-s must be a finite number > 0, got {args.horizon_s}"
    return None


async def _replay_live(episodes: list[Episode], args: argparse.Namespace) -> RunResult:
    from bench.replay_live import default_pool_spec, replay_live

    common = {
        "time_scale": args.time_scale,
        "policy": args.policy,
        "progress": True,
        "trace": args.trace,
        "seed": args.seed,
    }
    if args.url is not None:
        return await replay_live(episodes, url=args.url, **common)
    with tempfile.TemporaryDirectory(prefix="dsec-replay-") as state_dir:
        spec = default_pool_spec(
            args.policy,
            nodes=args.nodes,
            slots_per_node=args.slots_per_node,
            cloud_nodes=args.cloud_nodes,
            state_dir=Path(state_dir),
        )
        spec.pool = _pool_params(episodes, args)
        return await replay_live(episodes, pool_spec=spec, **common)


def _pool_params(episodes: list[Episode], args: argparse.Namespace) -> PoolParams:
    """Each policy at its best reasonable configuration for this trace and cluster (a
    static pool sized at the trace's peak, autoscalers bounded by the cluster)."""
    peak = int(summarize(episodes)["peak_concurrency"])
    return policy_params(args.policy, peak=peak, capacity=args.nodes * args.slots_per_node)


def run_replay(args: argparse.Namespace) -> int:
    """Replay the trace, write the report to ``--out`` and print it; 2 on bad input, 1 when
    the pool cannot be used."""
    problem = _bad_replay_flags(args)
    if problem is not None:
        print(f"dsec bench replay: {problem}", file=sys.stderr)
        return 2
    try:
        episodes = load_trace(args.trace)
    except TraceError as error:
        print(f"dsec bench replay: {error}", file=sys.stderr)
        return 2
    try:
        profile = Profile.load(args.profile) if args.profile is not None else None
    except (ValueError, OSError) as error:  # a JSON error is a ValueError
        print(f"dsec bench replay: --profile {args.profile}: {error}", file=sys.stderr)
        return 2
    # the trace lasts until the command ends: the cyclic collector need not go through
    # it again (a full collection of a trace at DSec's scale takes seconds)
    gc.freeze()

    if args.mode == "live":
        from bench.replay_live import ReplayError
        from dsec.launch.local import LocalPoolError

        try:
            result = asyncio.run(_replay_live(episodes, args))
        except (ReplayError, LocalPoolError) as error:
            print(f"dsec bench replay: {error}", file=sys.stderr)
            return 1
    else:
        from bench.sim import simulate

        result = simulate(
            episodes,
            policy=args.policy,
            nodes=args.nodes,
            slots_per_node=args.slots_per_node,
            cloud_nodes=args.cloud_nodes,
            seed=args.seed,
            time_scale=args.time_scale,
            params=_pool_params(episodes, args),
            profile=profile,
            shared_engine=args.shared_engine,
            horizon_s=args.horizon_s,
            progress=True,
        )
        result.meta["trace"] = args.trace  # the simulator is given episodes, not their file

    gc.freeze()  # the run's records too, while its report is written
    out = write_report(result, args.out or DEFAULT_OUT_DIR / f"{args.policy}-{args.mode}")
    if args.json:
        print((out / REPORT_FILE).read_text(), end="")
    else:
        print((out / MARKDOWN_FILE).read_text())
        print(f"report written to {out}/")
    return 0


def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``dsec bench compare``."""
    parser.add_argument(
        "--reports",
        type=Path,
        nargs="+",
        required=True,
        metavar="DIR",
        help="report directories written by `dsec bench replay`",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT_DIR / "compare",
        help="where to write the comparison",
    )
    parser.add_argument("--json", action="store_true", help="print compare.json")


def run_compare(args: argparse.Namespace) -> int:
    """Overlay the reports' latency CDFs, tabulate them, print the table; 2 on unreadable
    reports."""
    try:
        comparison = compare_reports(args.reports, args.out)
    except (OSError, ValueError, KeyError) as error:
        print(f"dsec bench compare: cannot read the reports: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(comparison, indent=2))
    else:
        print((args.out / COMPARE_MARKDOWN_FILE).read_text())
        print(f"comparison written to {args.out}/")
    return 0
