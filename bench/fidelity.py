"""How far the simulator is from the live pool, on one trace in one run.

    dsec bench fidelity --trace FILE [--time-scale X] [--nodes 3] [--slots-per-node S]
                        [--profile profile.json | --calibrate] [--sim-seeds 10]
                        [--out DIR] [--json]

The same (time-scaled) trace is replayed live, on a local pool this command starts,
and in the simulator with the same policy, nodes, slots and pool parameters. The
local pool's agents share one machine and its Docker engine, so the simulator
counts every node's operations on one engine too. Both sides report the same
interval: the control plane's schedule time, from an acquire's arrival to its lease
made on the agent.

Timings on a shared machine move with its other load, so `--calibrate` measures the
profile (`dsec bench calibrate`) in this invocation, right before the live replay, and
again right after it, saves both in the output directory (`profile.json`,
`profile-after.json`), and simulates with each (`sim`, `sim_after`): the engine's drift
over the live run falls between the two. The simulator's figures are the median over
`--sim-seeds` seeds (its own spread is reported too): one live run against the
simulator's typical run, not against one draw of it. Reported: the relative error of
p50 and p95 schedule latency and of utilisation, |sim - live| / live; and what the
engine was asked to do over the replay (creates, starts, ends, removals, pauses,
unpauses, commits, exec starts): live from the engine's own event stream
(bench/engine_events.py), simulated from the simulator's engines (median over seeds).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path

from bench.calibrate import CALIBRATE_ERRORS
from bench.engine_events import ACTIONS, EngineEventWatch
from bench.records import RunResult
from bench.replay_live import ReplayError, default_pool_spec, replay_live
from bench.report import build_report, write_report
from bench.runargs import add_run_arguments, load_run, measure_profile
from bench.sim import simulate
from bench.sim.profile import Profile
from bench.stats import quantile
from dsec.launch.local import LocalPoolSpec
from dsec.progress import progress_bar
from dsec.trace import TraceError

FIGURES = ("p50_ms", "p95_ms", "utilisation")
RECORDS_FILE = "records.jsonl"  # every episode as played, beside each side's report


def write_records(result: RunResult, path: Path) -> None:
    """One JSON line per episode (bench.records.EpisodeRecord): when it was asked for,
    served and given back, its path and its execs, to tell where two runs part."""
    path.write_text("".join(json.dumps(dataclasses.asdict(r)) + "\n" for r in result.records))


def relative_error(sim: float | None, live: float | None) -> float | None:
    if sim is None or live is None or live == 0:
        return None
    return round(abs(sim - live) / abs(live), 4)


def figures_of(report: dict) -> dict:
    return {
        "p50_ms": report["schedule_latency_ms"]["p50"],
        "p95_ms": report["schedule_latency_ms"]["p95"],
        "utilisation": report["utilisation"],
    }


def fidelity(episodes, spec: LocalPoolSpec, *, time_scale: float, seed: int,
             profile: Profile | None, trace_name: str, out: Path,
             sim_seeds: int = 1, progress: bool = False,
             recalibrate: Callable[[], Profile] | None = None) -> dict:  # fmt: skip
    """Replay `episodes` live on a local pool started from `spec`, then simulate the
    pool `spec` describes (its policy, nodes, slots, pool parameters and tick), with
    progress bars on stderr for the episodes and the seeds if `progress`. With
    `recalibrate`, the engine is measured again right after the live run and the
    simulations are run with that profile too (`sim_after`): the engine drifts, and the
    live run happened between the two."""
    with EngineEventWatch(spec.name + "-") as engine:
        live = asyncio.run(
            replay_live(episodes, pool_spec=spec, time_scale=time_scale, policy=spec.policy,
                        trace=trace_name, seed=seed, progress=progress)
        )  # fmt: skip
    engine_events = {"live": engine.counts(live.meta["started_at_unix"],
                                           live.meta["ended_at_unix"])}  # fmt: skip
    profiles = {"sim": profile}
    if recalibrate is not None:
        profiles["sim_after"] = recalibrate()
    live_figures = figures_of(build_report(live))
    write_report(live, out / "live")
    write_records(live, out / "live" / RECORDS_FILE)
    result: dict = {"trace": trace_name, "policy": spec.policy, "time_scale": time_scale,
                    "live": live_figures, "sim_seeds": sim_seeds,
                    "live_wall_s": live.meta.get("wall_s"), "sim_wall_s": 0.0,
                    "engine_events": engine_events}  # fmt: skip
    for side, side_profile in profiles.items():
        sims = []
        what = f"dsec bench fidelity: simulations ({side})"
        with progress_bar(sim_seeds, what, "sim", shown=progress) as bar:
            for s in range(seed, seed + sim_seeds):
                sims.append(
                    simulate(episodes, policy=spec.policy, nodes=spec.nodes,
                             slots_per_node=spec.capacity.slots, seed=s, time_scale=time_scale,
                             params=spec.pool, profile=side_profile, shared_engine=True,
                             tick_s=spec.tick_s, trace_name=trace_name)
                )  # fmt: skip
                bar.update(1)
        write_report(sims[0], out / side)
        write_records(sims[0], out / side / RECORDS_FILE)
        per_seed = [figures_of(build_report(sim)) for sim in sims]
        figures = {name: round(quantile([f[name] for f in per_seed], 0.5), 4) for name in FIGURES}
        suffix = side.removeprefix("sim")
        result[side] = figures
        result[f"relative_error{suffix}"] = {
            name: relative_error(figures[name], live_figures[name]) for name in FIGURES
        }
        result[f"sim_spread{suffix}"] = {
            name: [min(f[name] for f in per_seed), max(f[name] for f in per_seed)]
            for name in FIGURES
        }
        result[f"profile{suffix}"] = side_profile.source if side_profile else "default"
        engine_events[side] = {
            action: quantile([sim.meta["engine_events"].get(action, 0) for sim in sims], 0.5)
            for action in ACTIONS
        }
        result["sim_wall_s"] = round(result["sim_wall_s"] + sum(s.meta["wall_s"] for s in sims), 3)
    return result


def render(result: dict) -> str:
    lines = ["| | p50 schedule ms | p95 schedule ms | utilisation |", "|---|---|---|---|"]
    f = result["live"]
    lines.append(f"| live | {f['p50_ms']} | {f['p95_ms']} | {f['utilisation']} |")
    for side, when in (("sim", "before"), ("sim_after", "after")):
        if side not in result:
            continue
        suffix = side.removeprefix("sim")
        f, e = result[side], result[f"relative_error{suffix}"]
        lines.append(f"| {side} | {f['p50_ms']} | {f['p95_ms']} | {f['utilisation']} |")
        lines.append(f"| relative error | {e['p50_ms']} | {e['p95_ms']} | {e['utilisation']} |")
        if suffix:
            lines.append(
                f"({side}: profile measured {when} the live run: {result['profile' + suffix]})"
            )
    lines.append(f"(sim: median of {result['sim_seeds']} seeds; profile: {result['profile']})")
    events = result["engine_events"]
    sides = list(events)
    lines += ["", f"| engine events | {' | '.join(sides)} |", "|---" * (len(sides) + 1) + "|"]
    for action in ACTIONS:
        lines.append(f"| {action} | {' | '.join(str(events[s][action]) for s in sides)} |")
    return "\n".join(lines)


def add_fidelity_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_arguments(parser, out="out/fidelity", calibrate=True)
    parser.add_argument("--sim-seeds", type=int, default=10)


def run_fidelity(args: argparse.Namespace) -> int:
    try:
        if not 1 <= args.sim_seeds <= 1000:
            raise ValueError("--sim-seeds must be between 1 and 1000")
        episodes, profile = load_run(args)
    except (TraceError, ValueError, OSError) as e:
        print(f"dsec bench fidelity: {e}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        recalibrate = None
        if args.calibrate:
            profile = measure_profile(args)

            def recalibrate() -> Profile:
                return measure_profile(args, "profile-after.json")

        spec = default_pool_spec(args.policy, nodes=args.nodes, slots_per_node=args.slots_per_node)
        result = fidelity(
            episodes, spec, time_scale=args.time_scale, seed=args.seed, profile=profile,
            trace_name=str(args.trace), out=args.out, sim_seeds=args.sim_seeds, progress=True,
            recalibrate=recalibrate,
        )  # fmt: skip
    except (*CALIBRATE_ERRORS, ReplayError) as e:
        print(f"dsec bench fidelity: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    (args.out / "fidelity.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result) if args.json else render(result))
    return 0
