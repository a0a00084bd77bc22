"""Tune a pool's parameters for a latency target at the least cost, then check it live.

    dsec bench tune --trace FILE --target p99_ms=500[,queue_wait=0.1] [--budget 40]
        [--space NAME=LO:HI[:log] | NAME=V1,V2,...]... [--seeds 3] [--jobs 1]
        [--live-s 120 | --no-live] [--docker-lock FILE] [--nodes 3] [--slots-per-node 64]
        [--profile FILE | --calibrate] [--seed S] [--time-scale X] [--out DIR] [--json]

`--calibrate` measures the profile first (`dsec bench calibrate`, under `--docker-lock`):
the search and the live check then see the engine as it is this run, not as it was when
a saved profile was measured (on this shared machine its create rate moved by a third
from one session to the next).

Cost is sandbox-seconds (what the pool holds, by the control plane's own count). A
setting meets the target when the whole trace does in the simulator, and so do its busiest
`--live-s` seconds, simulated as the live check replays them (a fresh pool whose nodes
share one engine): an hour's p99 can hide a busiest minute far above it, and that minute is
what the live check runs. In the simulator, with the seed `--seed`:

1. The pool's defaults and a coarse grid over the search space (by default min_warm,
   warm_fraction and recycle; `--space` gives others): as many levels per range as half
   of `--budget` allows, at least its two ends, and every value of a list.
2. Refinement, until `--budget` runs are spent: around the cheapest points that meet the
   target (the closest to it while none does), one step either way along each parameter;
   the step is halved after a round that found nothing cheaper.
3. Confirmation: the cheapest few that met it run again with `--seeds` seeds in all. The
   winner is the cheapest that meets the target with every seed; its latency is the worst
   of its seeds', its cost their mean.
4. The pool's defaults and every baseline (each at its best reasonable configuration for
   the trace and cluster, as `bench.policies` runs them) run once, for comparison.
5. The live check (Docker): the busiest `--live-s` seconds of the trace, replayed on a
   local pool of the same nodes with the winner's parameters, and simulated as that pool
   is (its nodes share one engine; the median of the seeds). They agree when each target
   figure is within 15% of its limit of the simulator's, and sandbox-seconds within 15%.
   With `--calibrate`, the engine is measured again just before the replay (saved as
   profile-live.json) and the check's simulation uses that: the check asks whether the
   simulator predicts the pool on the engine of the moment, and this machine's engine
   moves by a third within minutes. The simulation with the search's profile is reported
   beside it.

Writes to `--out`: tune.json (what `--json` prints), tune.md, pareto.png (every run of
the search with the winner, the defaults and each baseline marked) and pool.json, the
winner as pool parameters that `PUT` or `PATCH /v1/pools/{name}` takes as they are (all
but `templates`, which stays the pool's own); tune.md gives them as a `dsec pool set`
command. Exit status: 0 with a winner, 1 when no setting meets the target (the closest
is shown) or the live check cannot run or disagrees, 2 on bad input.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import itertools
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import UnionType
from typing import TYPE_CHECKING, Any, get_args

from pydantic import ValidationError

from bench.generate import summarize
from bench.policies import policy_params
from bench.report import build_report
from bench.runargs import add_run_arguments, load_run, measure_profile
from bench.sweep import figures, measure, pareto_front, plot_pareto
from dsec.models import PoolParams
from dsec.policies import POLICIES
from dsec.progress import progress_bar
from dsec.trace import Episode, TraceError

if TYPE_CHECKING:
    from dsec.launch.local import LocalPoolSpec

# what a target may bound: the run's figures (bench.sweep.figures), each at most its limit
TARGETS = {
    "p50_ms": "p50 schedule latency, ms",
    "p95_ms": "p95 schedule latency, ms",
    "p99_ms": "p99 schedule latency, ms",
    "queue_wait": "share of episodes' time spent waiting for a sandbox",
}
# pool parameters a search may move: all but the templates a pool keeps warm
TUNABLE = tuple(name for name in PoolParams.model_fields if name != "templates")
# max_warm bounds what the pool creates ahead of demand, its scale-up steps included: at
# 0 (with min_warm 0) the pool keeps nothing warm and creates per request, as cold does,
# the cheapest setting where cold creates meet the target
DEFAULT_SPACE = ("min_warm=0:16", "max_warm=0:64", "warm_fraction=0:0.2", "recycle=false,true")
CENTRES = 2  # points refined around in each round
CONFIRMED = 3  # the cheapest points run again with every seed
MIN_STEP = 1 / 256  # of a range: the refinement stops below it
AGREEMENT = 0.15  # live and simulated within this of each other
DEFAULT_BUDGET = 40


@dataclass(frozen=True)
class Dimension:
    """One pool parameter of the search: a range (lo to hi, on a log scale if `log`) or
    a list of `choices`. A point sits at a position in [0, 1] along each dimension."""

    name: str
    lo: float = 0.0
    hi: float = 0.0
    log: bool = False
    choices: tuple = ()

    @property
    def integer(self) -> bool:
        return _field_type(self.name) is int

    def value(self, u: float) -> Any:
        if self.choices:
            return self.choices[round(u * (len(self.choices) - 1))]
        if self.log:
            v = math.exp(math.log(self.lo) + u * (math.log(self.hi) - math.log(self.lo)))
        else:
            v = self.lo + u * (self.hi - self.lo)
        return round(v) if self.integer else round(v, 4)

    def position(self, value: Any) -> float:
        """Where `value` sits along the dimension (clipped to it; a value not in a list
        is its first)."""
        if self.choices:
            i = self.choices.index(value) if value in self.choices else 0
            return i / (len(self.choices) - 1) if len(self.choices) > 1 else 0.0
        if value is None:
            return 1.0
        if self.log:
            u = (math.log(max(value, self.lo)) - math.log(self.lo)) / (
                math.log(self.hi) - math.log(self.lo)
            )
        else:
            u = (value - self.lo) / (self.hi - self.lo)
        return min(1.0, max(0.0, u))

    def grid(self, levels: int) -> list[float]:
        n = len(self.choices) if self.choices else levels
        return [i / (n - 1) for i in range(n)] if n > 1 else [0.0]

    def moves(self, u: float, step: float) -> list[float]:
        """Positions one step away: the next choice either way, or `step` along a range."""
        if self.choices:
            n = len(self.choices) - 1
            i = round(u * n)
            return [j / n for j in (i - 1, i + 1) if 0 <= j <= n]
        return [min(1.0, max(0.0, u + d)) for d in (-step, step)]


def _field_type(name: str) -> type:
    annotation = PoolParams.model_fields[name].annotation
    if isinstance(annotation, UnionType):  # `float | None`
        annotation = next(a for a in get_args(annotation) if a is not type(None))
    return annotation


def _unknown(what: str, name: str, known: Sequence[str]) -> ValueError:
    return ValueError(f"unknown {what} {name!r}; known: {', '.join(known)}")


def parse_target(text: str) -> dict[str, float]:
    """`p99_ms=500,queue_wait=0.1` -> {"p99_ms": 500.0, "queue_wait": 0.1}."""
    target = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, sep, raw = item.partition("=")
        if name not in TARGETS:
            raise _unknown("target", name, list(TARGETS))
        try:
            limit = float(raw) if sep else math.nan
        except ValueError:
            limit = math.nan
        if not (math.isfinite(limit) and limit > 0):
            raise ValueError(f"--target {name} wants a number > 0, got {raw!r}")
        target[name] = limit
    if not target:
        raise ValueError(f"--target wants NAME=LIMIT[,NAME=LIMIT], NAME one of {list(TARGETS)}")
    return target


def _checked(name: str, raw: str) -> Any:
    """A value of pool parameter `name`, as JSON, checked as PoolParams checks it."""
    try:
        value = json.loads(raw)
    except ValueError:
        raise ValueError(f"--space {name}: {raw!r} is not a value") from None
    try:
        # alone, beside the defaults: min_warm and max_warm are checked together later
        PoolParams.model_validate({name: value, "max_warm": 100_000})
    except ValidationError as e:
        raise ValueError(f"--space {name}={raw}: {e.errors()[0]['msg']}") from None
    return value


def parse_space(text: str) -> Dimension:
    """`NAME=LO:HI`, `NAME=LO:HI:log` (a range) or `NAME=V1,V2,...` (a list)."""
    name, sep, spec = text.partition("=")
    if name not in TUNABLE:
        raise _unknown("pool parameter", name, TUNABLE)
    if not sep or not spec:
        raise ValueError(f"--space {name}: wants {name}=LO:HI[:log] or {name}=V1,V2,...")
    if ":" not in spec:
        choices = tuple(dict.fromkeys(_checked(name, v) for v in spec.split(",") if v.strip()))
        if not choices:
            raise ValueError(f"--space {name}: no values")
        return Dimension(name, choices=choices)
    if _field_type(name) is bool:
        raise ValueError(f"--space {name}: a switch takes a list (false,true), not a range")
    lo, hi, *scale = spec.split(":")
    if scale not in ([], ["log"]):
        raise ValueError(f"--space {name}: wants LO:HI or LO:HI:log, got {spec!r}")
    dim = Dimension(name, float(_checked(name, lo)), float(_checked(name, hi)), bool(scale))
    if not dim.lo < dim.hi:
        raise ValueError(f"--space {name}: LO must be below HI, got {spec!r}")
    if dim.log and dim.lo <= 0:
        raise ValueError(f"--space {name}: a log range starts above 0, got {spec!r}")
    return dim


def violation(row: dict, target: dict[str, float]) -> float:
    """How far a run is from the target: the sum of each figure's excess over its limit,
    relative to it, plus 1 when an episode failed, over the whole trace and its busiest
    slice (when the run has one); 0 when it meets the target."""
    excess = sum(
        math.inf if row[name] is None else max(0.0, row[name] / limit - 1)
        for name, limit in target.items()
    )
    busiest = violation(row["busiest"], target) if "busiest" in row else 0.0
    return excess + (1.0 if row["failed"] else 0.0) + busiest


def meets(row: dict, target: dict[str, float]) -> bool:
    return violation(row, target) == 0


def _grid_levels(space: Sequence[Dimension], budget: int) -> int:
    """The most levels per range whose grid takes at most half the budget (two at least),
    with a run to spare for the defaults."""
    fixed = math.prod(len(d.choices) for d in space if d.choices)
    ranges = sum(1 for d in space if not d.choices)
    levels = 2
    while ranges and fixed * (levels + 1) ** ranges + 1 <= budget // 2:
        levels += 1
    size = fixed * levels**ranges + 1
    if size > budget:
        raise ValueError(
            f"the coarse grid of this space takes {size} runs: give --budget {size} or more, "
            "or fewer or shorter --space dimensions"
        )
    return levels


# --- running simulations -------------------------------------------------------------

_worker: dict = {}


@dataclass(frozen=True)
class Workload:
    """What each point of a search is simulated on: the whole trace (`sim`, simulate's
    keywords) and its busiest slice as the live check runs it (`busiest_sim`)."""

    episodes: list[Episode]
    sim: dict
    busiest: list[Episode]
    busiest_sim: dict


def _init_worker(workload: Workload) -> None:
    _worker["workload"] = workload


def _run(job: tuple[str, dict, int]) -> dict:
    policy, params, seed = job
    w: Workload = _worker["workload"]
    pool = PoolParams.model_validate(params)
    row = measure(w.episodes, pool, **w.sim, policy=policy, seed=seed)
    return {**row, "busiest": _figures(measure(w.busiest, pool, **w.busiest_sim,
                                               policy=policy, seed=seed))}  # fmt: skip


def busiest_sim(spec: LocalPoolSpec, *, time_scale: float, profile, trace_name: str) -> dict:
    """simulate's keywords for the pool that `spec` starts live (its nodes share one
    engine), as the live check replays a slice on it."""
    return {"nodes": spec.nodes, "slots_per_node": spec.capacity.slots, "profile": profile,
            "time_scale": time_scale, "shared_engine": True, "tick_s": spec.tick_s,
            "trace_name": trace_name}  # fmt: skip


class Runner:
    """Runs simulations of one workload, `jobs` at a time (in worker processes past one),
    with a progress bar of them on stderr: a search of a long trace runs for many minutes,
    and the only output otherwise comes at its end."""

    def __init__(self, workload: Workload, jobs: int, expected: int) -> None:
        self.runs = 0
        # simulations the tune will run, at most: the bar's end, and its estimate of the rest
        self.bar = progress_bar(expected, "dsec bench tune: simulations", "sim")
        self.pool = ProcessPoolExecutor(jobs, initializer=_init_worker,
                                        initargs=(workload,)) if jobs > 1 else None  # fmt: skip
        if self.pool is None:
            _init_worker(workload)

    def __call__(self, jobs: Sequence[tuple[str, dict, int]]) -> list[dict]:
        rows = []
        for row in self.pool.map(_run, jobs) if self.pool else map(_run, jobs):
            rows.append(row)
            self.runs += 1
            self.bar.update(1)
        return rows

    def close(self) -> None:
        self.bar.close()
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)


# --- the search ------------------------------------------------------------------------


@dataclass
class Search:
    space: Sequence[Dimension]
    target: dict[str, float]
    budget: int
    seed: int
    run: Callable[[Sequence[tuple[str, dict, int]]], list[dict]]

    def __post_init__(self) -> None:
        self.rows: dict[tuple, dict] = {}  # by the point's values
        self.positions: dict[tuple, tuple[float, ...]] = {}

    def values(self, position: Sequence[float]) -> tuple:
        return tuple(d.value(u) for d, u in zip(self.space, position, strict=True))

    def evaluate(self, positions: Sequence[Sequence[float]], stage: str) -> int:
        """Simulate the points not seen yet (within the budget left); how many ran."""
        fresh: dict[tuple, tuple[float, ...]] = {}
        for position in positions:
            key = self.values(position)
            if key in self.rows or key in fresh:
                continue
            try:
                PoolParams.model_validate(self.params_of(key))
            except ValidationError:
                continue  # a pair no pool takes (max_warm below min_warm): not a point
            fresh[key] = tuple(position)
        keys = list(fresh)[: self.budget - len(self.rows)]
        found = self.run([("dsec", self.params_of(k), self.seed) for k in keys])
        for key, row in zip(keys, found, strict=True):
            self.rows[key] = {**dict(zip(self.names, key, strict=True)), **row, "stage": stage}
            self.positions[key] = fresh[key]
        return len(keys)

    @property
    def names(self) -> list[str]:
        return [d.name for d in self.space]

    def params_of(self, key: tuple) -> dict:
        return PoolParams().model_dump() | dict(zip(self.names, key, strict=True))

    def ranked(self) -> list[tuple]:
        """Points that meet the target, cheapest first, then the others, closest first."""
        return sorted(self.rows, key=lambda k: (violation(self.rows[k], self.target),
                                                self.rows[k]["sandbox_seconds"]))  # fmt: skip

    def centres(self) -> list[tuple]:
        """The points to refine around: the cheapest that meet the target (the closest
        while none does), one per outcome (points that ran alike are one place to look)."""
        ranked = self.ranked()
        chosen: dict[tuple, tuple] = {}
        for key in [k for k in ranked if meets(self.rows[k], self.target)] or ranked:
            row = self.rows[key]
            chosen.setdefault((row["p99_ms"], row["sandbox_seconds"]), key)
        return list(chosen.values())[:CENTRES]

    def search(self) -> None:
        levels = _grid_levels(self.space, self.budget)
        defaults = PoolParams().model_dump()
        self.evaluate([[d.position(defaults[d.name]) for d in self.space]], "defaults")
        self.evaluate(list(itertools.product(*(d.grid(levels) for d in self.space))), "grid")
        step = 1 / (levels - 1) / 2
        while len(self.rows) < self.budget and step >= MIN_STEP:
            best = self.ranked()[0]
            around = [self.positions[k] for k in self.centres()]
            moves = [
                (*p[:i], u, *p[i + 1 :])
                for p in around
                for i, d in enumerate(self.space)
                for u in d.moves(p[i], step)
            ]
            ran = self.evaluate(moves, "refine")
            if not ran or self.ranked()[0] == best:
                step /= 2  # nothing new, or nothing better: look closer


def confirm(search: Search, seeds: Sequence[int]) -> list[dict]:
    """The cheapest points that met the target, each over every seed, cheapest first:
    p99 and each target figure the worst of its seeds', sandbox-seconds their mean."""
    keys = [k for k in search.ranked() if meets(search.rows[k], search.target)][:CONFIRMED]
    extra = [s for s in seeds if s != search.seed]
    found = search.run([("dsec", search.params_of(k), s) for k in keys for s in extra])
    confirmed = []
    for i, key in enumerate(keys):
        runs = [search.rows[key], *found[i * len(extra) : (i + 1) * len(extra)]]
        confirmed.append({
            "params": search.params_of(key), "seeds": [search.seed, *extra],
            **combine(runs, search.target), "per_seed": [_figures(r) for r in runs],
        })  # fmt: skip
    return sorted(confirmed, key=lambda c: (not meets(c, search.target), c["sandbox_seconds"]))


def combine(runs: Sequence[dict], target: dict[str, float]) -> dict:
    """Seeds' runs of one point as one: each target figure (and p99) the worst of theirs,
    sandbox-seconds their mean; the busiest slices' likewise."""
    worst = {
        name: None if any(r[name] is None for r in runs) else max(r[name] for r in runs)
        for name in {"p99_ms", *target}
    }
    busiest = [r["busiest"] for r in runs if "busiest" in r]
    return {
        **_figures(runs[0]),
        "sandbox_seconds": round(statistics.fmean(r["sandbox_seconds"] for r in runs), 1),
        "failed": max(r["failed"] for r in runs),
        **worst,
        **({"busiest": combine(busiest, target)} if len(busiest) == len(runs) else {}),
    }


def _figures(row: dict) -> dict:
    """A run's figures that a tune reports (with its busiest slice's, when it has one)."""
    figures = {k: row[k] for k in ("p50_ms", "p95_ms", "p99_ms", "queue_wait",
                                   "sandbox_seconds", "failed")}  # fmt: skip
    return figures | ({"busiest": _figures(row["busiest"])} if "busiest" in row else {})


# --- the live check ----------------------------------------------------------------------


def busiest_slice(episodes: Sequence[Episode], window_s: float) -> list[Episode]:
    """The episodes arriving in the `window_s` seconds with the most arrivals, moved to
    start at 0."""
    ordered = sorted(episodes, key=lambda e: e.arrival_s)
    best, start = (0, 0), 0
    for end in range(len(ordered)):
        while ordered[end].arrival_s - ordered[start].arrival_s >= window_s:
            start += 1
        best = max(best, (end - start + 1, -start))
    count, first = best[0], -best[1]
    t0 = ordered[first].arrival_s
    return [e.model_copy(update={"arrival_s": round(e.arrival_s - t0, 6)})
            for e in ordered[first : first + count]]  # fmt: skip


def relative_error(sim: float | None, live: float | None) -> float | None:
    if sim is None or live is None or live == 0:
        return None
    return round(abs(sim - live) / live, 4)


def live_check(
    piece: list[Episode],
    spec: LocalPoolSpec,
    target: dict[str, float],
    *,
    seeds: Sequence[int],
    time_scale: float,
    profile,
    trace_name: str,
    search_profile=None,
) -> dict:
    """Replay `piece` live on a local pool started from `spec` (the winner's parameters
    as its pool's), and simulate that pool with each seed. They agree when each target
    figure is within AGREEMENT of the target's limit (a p99 of 4 ms against 6 ms is no
    disagreement about a 500 ms target) and sandbox-seconds within AGREEMENT of live's.
    With `search_profile` (the search's, when `profile` was measured since), the
    simulation with it is reported too."""
    from bench.replay_live import replay_live

    live = figures(build_report(asyncio.run(
        replay_live(piece, pool_spec=spec, time_scale=time_scale, policy=spec.policy,
                    trace=trace_name, progress=False)
    )))  # fmt: skip

    def simulated(with_profile) -> dict:
        """The median over `seeds` of each figure."""
        sim = busiest_sim(spec, time_scale=time_scale, profile=with_profile,
                          trace_name=trace_name)  # fmt: skip
        runs = [measure(piece, spec.pool, policy=spec.policy, seed=s, **sim) for s in seeds]
        return {
            name: None if any(r[name] is None for r in runs)
            else statistics.median(r[name] for r in runs)
            for name in ("p50_ms", "p95_ms", "p99_ms", "queue_wait", "sandbox_seconds")
        }  # fmt: skip

    sim = simulated(profile)
    cost = relative_error(sim["sandbox_seconds"], live["sandbox_seconds"])
    errors = {
        name: None if sim[name] is None or live[name] is None
        else round(abs(sim[name] - live[name]) / limit, 4)
        for name, limit in target.items()
    } | {"sandbox_seconds": cost}  # fmt: skip
    return {
        "episodes": len(piece), "span_s": round(max(e.arrival_s for e in piece), 3),
        "live": _figures(live), "sim": sim, "sim_seeds": list(seeds),
        "meets_target": meets(live, target), "errors": errors,
        "relative_error": {n: relative_error(sim[n], live[n])
                           for n in ("p99_ms", "sandbox_seconds")},
        "agrees": all(e is not None and e <= AGREEMENT for e in errors.values()),
        "profile": profile.source if profile else "default",
        **({"sim_search_profile": simulated(search_profile)} if search_profile else {}),
    }  # fmt: skip


@contextlib.contextmanager
def held(lock_path: Path | None) -> Iterator[None]:
    """An exclusive flock on `lock_path` while the block runs (nothing without one)."""
    if lock_path is None:
        yield
        return
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


# --- the command ---------------------------------------------------------------------------


def live_spec(args: argparse.Namespace, params: dict | None = None) -> LocalPoolSpec:
    """The local pool the live check starts (with pool parameters `params`)."""
    from bench.replay_live import default_pool_spec

    spec = default_pool_spec(nodes=args.nodes, slots_per_node=args.slots_per_node)
    if params is not None:
        spec.pool = PoolParams.model_validate(params)
    return spec


def tunable_params(params: dict) -> dict:
    """Pool parameters as `PATCH /v1/pools/{name}` and `dsec pool set` take them."""
    return {k: v for k, v in PoolParams.model_validate(params).model_dump(mode="json").items()
            if k in TUNABLE}  # fmt: skip


def pool_set_command(pool: str, params: dict) -> str:
    return " ".join(["dsec pool set", pool, *(f"{k}={json.dumps(v)}" for k, v in params.items())])


def compare(winner: dict | None, runs: dict[str, dict], target: dict[str, float]) -> dict:
    """Each comparison run's figures, whether it meets the target and what the winner
    saves against it (a share of its sandbox-seconds)."""
    return {
        name: {
            **_figures(row), "meets_target": meets(row, target),
            "winner_saves": None if winner is None else
            round(1 - winner["sandbox_seconds"] / row["sandbox_seconds"], 4),
        }
        for name, row in runs.items()
    }  # fmt: skip


def tune(args: argparse.Namespace, episodes: list[Episode], profile, target: dict,
         space: list[Dimension]) -> dict:  # fmt: skip
    started = time.perf_counter()
    sim = {"nodes": args.nodes, "slots_per_node": args.slots_per_node, "profile": profile,
           "time_scale": args.time_scale, "trace_name": str(args.trace)}  # fmt: skip
    workload = Workload(episodes, sim, busiest_slice(episodes, args.live_s), busiest_sim(
        live_spec(args), time_scale=args.time_scale, profile=profile, trace_name=str(args.trace)
    ))  # fmt: skip
    seeds = list(range(args.seed, args.seed + args.seeds))
    others = ["defaults", *sorted(p for p in POLICIES if p != "dsec")]
    runner = Runner(workload, args.jobs, args.budget + CONFIRMED * (len(seeds) - 1) + len(others))
    try:
        search = Search(space, target, args.budget, args.seed, runner)
        search.search()
        searched_s = time.perf_counter() - started
        confirmed = confirm(search, seeds)
        peak = int(summarize(episodes)["peak_concurrency"])
        capacity = args.nodes * args.slots_per_node
        jobs = [("dsec", PoolParams().model_dump(), args.seed)] + [
            (p, policy_params(p, peak=peak, capacity=capacity).model_dump(), args.seed)
            for p in others[1:]
        ]
        runs = dict(zip(others, runner(jobs), strict=True))
    finally:
        runner.close()
    winner = next((c for c in confirmed if meets(c, target)), None)
    closest = None
    if winner is None:
        rows = [*confirmed, *({"params": search.params_of(k), **search.rows[k]}
                              for k in search.ranked()[:1])]  # fmt: skip
        best = min(rows, key=lambda r: (violation(r, target), r["sandbox_seconds"]))
        closest = {"params": tunable_params(best["params"]), **_figures(best)}
    comparison = compare(winner, runs, target)
    search_rows = list(search.rows.values())
    front = pareto_front(search_rows)
    for row in search_rows:
        row["pareto"] = row in front
    result = {
        "trace": str(args.trace), "target": target, "met": winner is not None,
        "params": tunable_params(winner["params"]) if winner else None,
        **({k: winner[k] for k in ("p99_ms", "sandbox_seconds", "queue_wait", "p50_ms",
                                    "p95_ms", "busiest", "per_seed")} if winner else {}),
        "busiest_s": args.live_s,
        "seeds": seeds, "closest": closest,
        "pool_set": pool_set_command(episodes[0].pool, tunable_params(winner["params"]))
        if winner else None,
        "defaults": comparison.pop("defaults"), "baselines": comparison,
        "search": {"space": [d.name for d in space], "budget": args.budget,
                   "runs": len(search_rows), "rows": search_rows,
                   "confirmed": [{"params": tunable_params(c["params"]), **_figures(c)}
                                 for c in confirmed]},
        "simulation": {"nodes": args.nodes, "slots_per_node": args.slots_per_node,
                       "profile": profile.source if profile else "default",
                       "time_scale": args.time_scale, "runs": runner.runs,
                       "search_wall_s": round(searched_s, 1),
                       "wall_s": round(time.perf_counter() - started, 1)},
        "live": None,
    }  # fmt: skip
    return result


def render(result: dict) -> str:
    target = ", ".join(f"{k} <= {v:g}" for k, v in result["target"].items())
    lines = [f"# dsec bench tune: {result['trace']}", "", f"Target: {target}.", ""]
    if result["met"]:
        lines += [
            f"Winner (confirmed over seeds {', '.join(map(str, result['seeds']))}): p99 "
            f"{result['p99_ms']:.1f} ms (worst seed), {_ms(result['busiest']['p99_ms'])} ms "
            f"in the busiest {result['busiest_s']:g} s, {result['sandbox_seconds']:,.0f} "
            "sandbox-seconds (mean).", "", "Apply it:", "", f"    {result['pool_set']}", "",
        ]  # fmt: skip
        defaults = PoolParams().model_dump(mode="json")
        changed = {k: v for k, v in result["params"].items() if defaults[k] != v}
        lines += ["| parameter | chosen | default |", "|---|---|---|"]
        lines += [f"| {k} | {json.dumps(v)} | {json.dumps(defaults[k])} |"
                  for k, v in changed.items()]  # fmt: skip
    else:
        c = result["closest"]
        lines += [f"No setting met the target. The closest: p99 {_ms(c['p99_ms'])} ms "
                  f"({_ms(c['busiest']['p99_ms'])} ms in the busiest {result['busiest_s']:g} s), "
                  f"queue wait {c['queue_wait']}, {c['sandbox_seconds']:,.0f} sandbox-seconds, "
                  f"with {json.dumps(c['params'])}."]  # fmt: skip
    lines += [
        "",
        f"| run | p99 ms | p99 ms, busiest {result['busiest_s']:g} s | queue wait "
        "| sandbox-s | meets target | winner saves |",
        "|---|---|---|---|---|---|---|",
    ]
    if result["met"]:
        lines.append(
            f"| winner | {result['p99_ms']:.1f} | {_ms(result['busiest']['p99_ms'])} "
            f"| {result['queue_wait']} | {result['sandbox_seconds']:,.0f} | yes | |"
        )
    for name, r in {"defaults": result["defaults"], **result["baselines"]}.items():
        saves = "" if r["winner_saves"] is None else f"{r['winner_saves']:.2%}"
        lines.append(f"| {name} | {_ms(r['p99_ms'])} | {_ms(r['busiest']['p99_ms'])} | "
                     f"{r['queue_wait']} | {r['sandbox_seconds']:,.0f} | "
                     f"{'yes' if r['meets_target'] else 'no'} | {saves} |")  # fmt: skip
    live = result["live"]
    if live:
        e = live["errors"]
        sides = {"live": "live", "sim": f"sim (profile: {live['profile']})"}
        if "sim_search_profile" in live:
            sides["sim_search_profile"] = "sim (the search's profile)"
        lines += [
            "", f"Live check: the busiest {live['span_s']:.0f} s of the trace "
            f"({live['episodes']} episodes) on a local pool, against the simulator "
            f"(median of seeds {live['sim_seeds']}).", "",
            "| | p50 ms | p99 ms | queue wait | sandbox-s |", "|---|---|---|---|---|",
            *(f"| {label} | {_ms(live[side]['p50_ms'])} | {_ms(live[side]['p99_ms'])} | "
              f"{live[side]['queue_wait']} | {live[side]['sandbox_seconds']:,.0f} |"
              for side, label in sides.items()), "",
            f"Errors (target figures: |sim - live| / limit; sandbox-s: / live): {e}. They "
            f"{'agree' if live['agrees'] else 'do not agree'} within {AGREEMENT:.0%}; live "
            f"{'meets' if live['meets_target'] else 'misses'} the target.",
        ]  # fmt: skip
    s = result["simulation"]
    lines += ["", f"Search: {result['search']['runs']} runs over "
              f"{', '.join(result['search']['space'])}; {s['runs']} simulations in all, "
              f"{s['wall_s']:.0f} s (profile: {s['profile']})."]  # fmt: skip
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def add_tune_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_arguments(parser, out="out/tune", calibrate=True)
    parser.add_argument("--target", required=True, metavar="NAME=LIMIT[,NAME=LIMIT]",
                        help=f"what must hold, at most: {', '.join(TARGETS)}")  # fmt: skip
    parser.add_argument("--budget", type=int, default=DEFAULT_BUDGET,
                        help="simulations the search may run (confirmation and comparison "
                             "runs come on top)")  # fmt: skip
    parser.add_argument("--space", action="append", default=[],
                        metavar="NAME=LO:HI[:log]|NAME=V1,V2,...",
                        help=f"a pool parameter to search (repeat; default: "
                             f"{' '.join(DEFAULT_SPACE)})")  # fmt: skip
    parser.add_argument("--seeds", type=int, default=3, help="seeds the winner is confirmed on")
    parser.add_argument("--jobs", type=int, default=1, help="simulations at once")
    parser.add_argument("--live-s", type=float, default=120.0,
                        help="seconds of the trace (its busiest) replayed live")  # fmt: skip
    parser.add_argument("--no-live", action="store_true", help="skip the live check")
    parser.add_argument("--docker-lock", type=Path,
                        help="hold an flock on this file during the live check, so that "
                             "benchmarks sharing one Docker engine take turns")  # fmt: skip


def _bad_flags(args: argparse.Namespace) -> str | None:
    if not 1 <= args.budget <= 10_000:
        return f"--budget must be between 1 and 10000, got {args.budget}"
    if not 1 <= args.seeds <= 100:
        return f"--seeds must be between 1 and 100, got {args.seeds}"
    if not 1 <= args.jobs <= 64:
        return f"--jobs must be between 1 and 64, got {args.jobs}"
    if not (math.isfinite(args.live_s) and args.live_s > 0):
        return f"--live-s must be a number > 0, got {args.live_s}"
    if args.policy != "dsec":
        return "--policy: tune searches dsec's own parameters; baselines run for comparison"
    return None


def _check_capacity(episodes: list[Episode], args: argparse.Namespace) -> None:
    """A trace holding more sandboxes at once than the nodes have slots queues at its peak
    whatever the pool's parameters: said before a search that could only find that out."""
    peak = int(summarize(episodes)["peak_concurrency"])
    capacity = args.nodes * args.slots_per_node
    if peak > capacity:
        raise ValueError(
            f"{args.trace}: its peak is {peak} sandboxes at once, more than the "
            f"{capacity} slots of {args.nodes} nodes x {args.slots_per_node}: no pool "
            "parameters serve it without queueing (raise --nodes or --slots-per-node)"
        )


def run_tune(args: argparse.Namespace) -> int:
    try:
        if problem := _bad_flags(args):
            raise ValueError(problem)
        target = parse_target(args.target)
        space = [parse_space(s) for s in args.space or DEFAULT_SPACE]
        if len({d.name for d in space}) < len(space):
            raise ValueError("--space names a parameter twice")
        _grid_levels(space, args.budget)
        episodes, profile = load_run(args)
        if not episodes:
            raise ValueError(f"{args.trace}: no episodes")
        _check_capacity(episodes, args)
    except (TraceError, ValueError, OSError) as e:
        print(f"dsec bench tune: {e}", file=sys.stderr)
        return 2
    if args.calibrate:
        from bench.calibrate import CALIBRATE_ERRORS

        try:
            with held(args.docker_lock):
                profile = measure_profile(args)
        except CALIBRATE_ERRORS as e:
            print(f"dsec bench tune: the calibration failed: {type(e).__name__}: {e}",
                  file=sys.stderr)  # fmt: skip
            return 1
    result = tune(args, episodes, profile, target, space)
    args.out.mkdir(parents=True, exist_ok=True)
    code = 0
    if not result["met"]:
        c = result["closest"]
        print(f"dsec bench tune: no setting met {args.target}; the closest: p99 "
              f"{_ms(c['p99_ms'])} ms ({_ms(c['busiest']['p99_ms'])} ms in the busiest "
              f"{args.live_s:g} s), queue wait {c['queue_wait']}, "
              f"{c['sandbox_seconds']:,.0f} sandbox-seconds, with {json.dumps(c['params'])}",
              file=sys.stderr)  # fmt: skip
        code = 1
    elif not args.no_live:
        from bench.calibrate import CALIBRATE_ERRORS
        from bench.replay_live import ReplayError
        from dsec.launch.local import LocalPoolError

        spec = live_spec(args, result["params"])
        print(f"dsec bench tune: the live check: the busiest {args.live_s:g} s of the trace on "
              "a local pool with the winner's parameters", file=sys.stderr, flush=True)  # fmt: skip
        try:
            with held(args.docker_lock), tempfile.TemporaryDirectory() as state_dir:
                spec.state_dir = Path(state_dir)
                now = measure_profile(args, "profile-live.json") if args.calibrate else profile
                result["live"] = live_check(
                    busiest_slice(episodes, args.live_s), spec, target, seeds=result["seeds"],
                    time_scale=args.time_scale, profile=now, trace_name=str(args.trace),
                    search_profile=profile if args.calibrate else None,
                )  # fmt: skip
        except (ReplayError, LocalPoolError, OSError, *CALIBRATE_ERRORS) as e:
            print(f"dsec bench tune: the live check could not run: {e}", file=sys.stderr)
            code = 1
        else:
            if not result["live"]["agrees"]:
                print(f"dsec bench tune: the live check disagrees by more than "
                      f"{AGREEMENT:.0%}: {result['live']['errors']}; the setting is written "
                      "but not confirmed live", file=sys.stderr)  # fmt: skip
                code = 1
    if result["met"]:
        (args.out / "pool.json").write_text(json.dumps(result["params"], indent=2) + "\n")
    marks = [("winner", result)] if result["met"] else [("closest", result["closest"])]
    marks += [("defaults", result["defaults"]), *result["baselines"].items()]
    plot_pareto(result["search"]["rows"], args.out / "pareto.png", marks=marks,
                target_ms=result["target"].get("p99_ms"),
                title="dsec bench tune: the search, the winner, defaults, baselines")  # fmt: skip
    (args.out / "tune.json").write_text(json.dumps(result, indent=2))
    (args.out / "tune.md").write_text(render(result) + "\n")
    print(json.dumps(result) if args.json else render(result))
    return code
