"""The flags every simulated bench command shares, and loading what they name."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.sim.profile import Profile
from dsec.trace import Episode, load_trace


def add_run_arguments(parser: argparse.ArgumentParser, out: str, calibrate: bool = False) -> None:
    """The shared flags; with `calibrate`, also --calibrate, for a command that runs
    live beside its simulations."""
    parser.add_argument("--trace", type=Path, required=True)
    parser.add_argument("--policy", default="dsec")
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--slots-per-node", type=int, default=64)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", type=Path, help="a profile from `dsec bench calibrate`")
    parser.add_argument("--out", type=Path, default=Path(out))
    parser.add_argument("--json", action="store_true")
    if calibrate:
        parser.add_argument("--calibrate", action="store_true",
                            help="measure the profile now (`dsec bench calibrate`), on the "
                                 "engine as it is this run, and save it in --out")  # fmt: skip
        parser.add_argument("--calibrate-samples", type=int, default=30)


def load_run(args: argparse.Namespace) -> tuple[list[Episode], Profile | None]:
    """The trace and profile the flags name; TraceError, ValueError or OSError if bad."""
    if args.nodes < 1 or args.slots_per_node < 1 or args.time_scale <= 0:
        raise ValueError("--nodes and --slots-per-node must be >= 1, --time-scale > 0")
    if getattr(args, "calibrate", False):
        if args.profile:
            raise ValueError("--calibrate measures a profile: give it or --profile, not both")
        if not 5 <= args.calibrate_samples <= 1000:
            raise ValueError("--calibrate-samples must be between 5 and 1000")
    episodes = load_trace(args.trace)
    return episodes, Profile.load(args.profile) if args.profile else None


def measure_profile(args: argparse.Namespace, name: str = "profile.json") -> Profile:
    """--calibrate's profile, measured on this machine's engine now and saved in --out
    as `name`; bench.calibrate.CALIBRATE_ERRORS when the engine fails."""
    from bench.calibrate import calibrate  # the Docker SDK: only for commands that run live

    profile = calibrate(args.calibrate_samples, args.nodes)
    args.out.mkdir(parents=True, exist_ok=True)
    profile.save(args.out / name)
    return profile
