"""`dsec bench`: traces, replay, simulation; the commands themselves live in bench/."""

from __future__ import annotations

import argparse

from bench.calibrate import add_calibrate_arguments, run_calibrate
from bench.fidelity import add_fidelity_arguments, run_fidelity
from bench.generate import add_generate_arguments, run_generate
from bench.replay import add_compare_arguments, add_replay_arguments, run_compare, run_replay
from bench.report_scale import add_report_scale_arguments, run_report_scale
from bench.rollout import add_rollout_arguments, run_rollout
from bench.sweep import add_sweep_arguments, run_sweep
from bench.tune import add_tune_arguments, run_tune


def register(sub: argparse._SubParsersAction) -> None:
    """Add `dsec bench` and its subcommands."""
    bench = sub.add_parser("bench", help="traces, replay, simulation")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    for name, help_, add_arguments, run in (
        ("generate", "write a synthetic or imported trace", add_generate_arguments, run_generate),
        ("replay", "replay a trace live or in the simulator", add_replay_arguments, run_replay),
        ("compare", "compare replay reports", add_compare_arguments, run_compare),
        ("sweep", "sweep pool parameters in the simulator", add_sweep_arguments, run_sweep),
        (
            "tune",
            "search pool parameters for a latency target at the least cost, then check live",
            add_tune_arguments,
            run_tune,
        ),
        ("fidelity", "the simulator against a live replay", add_fidelity_arguments, run_fidelity),
        ("calibrate", "measure Docker into a sim profile", add_calibrate_arguments, run_calibrate),
        (
            "report-scale",
            "a node's heartbeat of 5,000 sandboxes, applied by the control plane",
            add_report_scale_arguments,
            run_report_scale,
        ),
        (
            "rollout",
            "a GRPO-like rollout step on a Python template: dsec against a container per "
            "rollout and llm-sandbox, in the same run",
            add_rollout_arguments,
            run_rollout,
        ),
    ):
        command = bench_sub.add_parser(name, help=help_)
        add_arguments(command)
        command.set_defaults(run=run)
