"""The flags every simulated bench command shares, and loading what they name."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.sim.profile import Profile
from dsec.trace import Episode, load_trace


def add_run_arguments(parser: argparse.ArgumentParser, out: str) -> None:
    parser.add_argument("--trace", type=Path, required=True)
    parser.add_argument("--policy", default="dsec")
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--slots-per-node", type=int, default=64)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", type=Path, help="a profile from `dsec bench calibrate`")
    parser.add_argument("--out", type=Path, default=Path(out))
    parser.add_argument("--json", action="store_true")


def load_run(args: argparse.Namespace) -> tuple[list[Episode], Profile | None]:
    """The trace and profile the flags name; TraceError, ValueError or OSError if bad."""
    if args.nodes < 1 or args.slots_per_node < 1 or args.time_scale <= 0:
        raise ValueError("--nodes and --slots-per-node must be >= 1, --time-scale > 0")
    episodes = load_trace(args.trace)
    return episodes, Profile.load(args.profile) if args.profile else None
