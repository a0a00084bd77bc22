"""`dsec plan --simulate`: does the planned node count meet the targets in the simulator?

The plan's arithmetic (dsec/plan.py) sizes nodes from Little's law. This module plays
that load through the control plane's own scheduler and policy in virtual time
(bench/sim) and reports, per node count simulated, the p99 schedule latency and the
queue-wait share against the targets (docs/benchmarks.md) (p99 < 500 ms, queue wait < 10%); then it
searches for the smallest node count that meets both.

The load. Arrivals are Poisson at the plan's rate: the effective rate R with
`--load effective` (checked against nodes_mean), R/p with `--load raw` (against
nodes_mean_raw). Sandbox lifetimes are lognormal, fitted to the plan's p50 and p99;
given only a mean, the lognormal keeps the seed's shape (the sigma of its p50/p99 fit)
and takes that mean. An episode holds its sandbox for its lifetime as one exec step:
the check is about getting sandboxes, not what runs in them, and cutting lifetimes
into think and exec steps (as `dsec bench generate` does) costs most of the time of a
large run while changing nothing here (its 30 s steps never idle a lease long enough
to be frozen). Time is not compressed: compressing lifetimes would change how long a
sandbox is held against how long Docker takes to make one.

Scale. A full-size run can be too slow (the seed's base case keeps ~13,000 sandboxes
in flight), so `--sim-scale s` simulates a share of the load: each node gets
round(s x density) slots and arrivals come at s x rate, with s then taken as the slots
actually given over the density, so each node's share of occupied slots is the plan's.
The node count is not scaled. What scaling changes: in-flight counts fluctuate by
about sqrt(in flight), so a scaled-down run sees relatively larger peaks and is
stricter than the full size; and pool parameters (warm pool bounds) are absolute,
not scaled. The default, automatic, simulates the whole load up to
SIM_AUTO_MAX_IN_FLIGHT (20,000) sandboxes in flight and scales down to that beyond it.

Warm-up and measurement. The run starts in the steady state rather than empty:
during the first half of the warm-up, a population of Poisson(rate x mean lifetime)
sandboxes (what M/G/inf holds in steady state) acquires, each to be held until a
residual lifetime after the half-way point, drawn from the equilibrium distribution
(length-biased lifetime times a uniform share; for a lognormal, the length-biased
lifetime is lognormal(mu + sigma^2, sigma)). Planned arrivals start at the half-way
point, so the second half lets the policy settle at the planned rate. Measured: the
requests that arrive in the window after the warm-up. Arrivals go on TAIL_S beyond
the window and holds are cut at its end, so the run stops by itself; a measured
request still waiting then counts as having waited until then (more than 500 ms).

Figures. Schedule latency is the pool's own (request to usable sandbox), p99 over the
measured requests. Queue-wait share is bench's queue_wait_share (time from request to
sandbox over time from request to release) over the measured requests, each request's
time to release taken as its wait plus its lifetime in the trace, since most are still
held when the run ends. The trace is the same for every node count (same seed), so
counts differ only in the nodes.

Version lag. Each run also tallies the version lag of the measured requests that got a
sandbox (appendix A1 of DSec's capacity study): weights are released every iteration period L from
time zero, and a trajectory that starts (acquires) at t and holds its sandbox for its
lifetime W has lag floor((t + W) / L) - floor(t / L). Groups are runs of --group-size
consecutive measured arrivals, over the cap when their longest member is. The tallies
are checked against what the plan's arithmetic expects of those very trajectories: given
each start's phase u = frac(t / L), a trajectory is over the cap with probability
q(u) = P(W >= (cap + 1 - u) L) under the simulated lognormal, and a group of independent
lifetimes with probability 1 - prod(1 - q(u_i)); they agree when within four standard
errors. Averaged over uniform phases, q(u) is the plan's lag_over_cap_share, and the
group's probability lies between the plan's group bounds.

Search. Node counts whose slots are fewer than Little's law puts in flight (rate x
mean lifetime) miss without a simulation: no queue is stable there, waits grow
without bound. From the plan's node count (or --nodes, or that floor if higher): if
it meets the targets, fewer are tried (1, 2, 4, ... below) until one misses; if not,
more (1, 2, 4, ... above) until one meets them; then bisection between the closest
miss and meet. At most --max-runs simulations: when they run out, the result says so.

`python -m bench.plan_check [--case NAME ...] [--json]` checks the capacity study's cases
(SEED_CASES) in turn, each as `dsec plan <its flags> --simulate` would, and prints one row
per case: the arithmetic's node count and the simulation's, and the version lag against
the plan's.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Literal

from pydantic import BaseModel

from bench.generate import poisson_arrivals
from bench.records import EpisodeRecord, RunResult
from bench.report import QUEUE_WAIT_SHARE_TARGET, SCHEDULE_TARGET_MS
from bench.sim import simulate
from bench.stats import quantile
from dsec.models import PoolParams
from dsec.plan import (
    SEED_LIFETIME_P50_S,
    SEED_LIFETIME_P99_S,
    SIM_AUTO_MAX_IN_FLIGHT,
    Z_99,
    PlanInput,
    PlanResult,
    SimulateSettings,
    lag_over_cap_share,
    lognormal_from_median_p99,
    lognormal_mean,
    plan,
)
from dsec.trace import Episode, Step

# Arrivals go on this long after the window, so a measured request still waiting at the
# end has waited far beyond the latency target.
TAIL_S = 60.0
# Episode ids of the steady-state population, which acquires during the warm-up.
POPULATION_PREFIX = "steady"
# Fewer measured requests than this make the p99 a guess.
MIN_MEASURED = 200
# The largest pool PoolParams allows: a static pool fills the nodes up to it.
STATIC_POOL_LIMIT = next(
    m.le for m in PoolParams.model_fields["max_warm"].metadata if getattr(m, "le", None)
)
# Events closer than this are decided in one tick, as bench/sim_scale.py runs at scale.
MIN_TICK_GAP_S = 0.01
# Tallies within this many standard errors of what the arithmetic expects agree with it.
AGREEMENT_STANDARD_ERRORS = 4.0


class LagTally(BaseModel):
    """The version lag of one run's measured trajectories, against the arithmetic's
    expectation for those trajectories (see the module's docstring)."""

    trajectories: int
    groups: int
    version_lag_mean: float | None
    over_cap_share: float | None
    over_cap_share_expected: float | None
    over_cap_share_se: float | None
    group_over_cap_share: float | None
    group_over_cap_share_expected: float | None
    group_over_cap_share_se: float | None
    agrees: bool


class SimRun(BaseModel):
    """One simulation at one node count: what the measured requests saw."""

    nodes: int
    meets_targets: bool
    schedule_p99_ms: float
    queue_wait_share: float
    measured_requests: int
    unserved_at_end: int
    in_flight_peak: int
    in_flight_mean: float
    paths: dict[str, int]
    # the steady-state population still waiting when measuring began: the warm-up was short
    population_waiting_at_start: int
    lag: LagTally
    wall_s: float


class SimCheck(BaseModel):
    """The whole check: the simulated load, every run, and the node count found."""

    policy: str
    seed: int
    load: str
    planned_nodes: int
    start_nodes: int
    stable_from_nodes: int
    sim_scale: float
    slots_per_node: int
    arrivals_per_s: float
    lifetime_p50_s: float
    lifetime_p99_s: float
    lifetime_mean_s: float
    in_flight_little: float
    iteration_period_s: float
    lag_cap: int
    group_size: int
    # the arithmetic for the simulated lifetimes (the plan's, unless it gave a mean alone
    # or a mean beside its p50 and p99)
    version_lag_mean_planned: float
    lag_over_cap_share_planned: float
    group_over_cap_share_bounds: tuple[float, float]
    # the run whose version lag is the check's: at nodes_needed, else the most nodes run
    lag_checked_at_nodes: int
    lag_agrees: bool
    warmup_s: float
    window_s: float
    tail_s: float
    targets: dict[str, float]
    runs: list[SimRun]
    start_meets_targets: bool
    nodes_needed: int | None
    nodes_needed_is_smallest: bool
    max_runs: int
    conclusion: str
    assumptions: list[str]


def lifetime_quantiles(result: PlanResult) -> tuple[float, float]:
    """The plan's lifetime p50 and p99; from a mean alone, the seed's shape at that mean."""
    given = result.input
    if given.lifetime_p50_s is not None:
        return given.lifetime_p50_s, given.lifetime_p99_s
    _, sigma = lognormal_from_median_p99(SEED_LIFETIME_P50_S, SEED_LIFETIME_P99_S)
    p50 = given.lifetime_mean_s * math.exp(-sigma * sigma / 2)
    return p50, p50 * math.exp(sigma * Z_99)


def poisson_count(rng: random.Random, mean: float) -> int:
    """A Poisson(mean) draw: unit-rate arrivals up to `mean`."""
    return sum(1 for _ in itertools.takewhile(lambda t: t <= mean, poisson_arrivals(rng, 1.0)))


def steady_state_trace(
    rate_per_s: float, mu: float, sigma: float, warmup_s: float, end_s: float, seed: int
) -> tuple[list[Episode], dict[str, float]]:
    """The trace (see the module's docstring) and every episode's uncut lifetime by id."""
    rng = random.Random(seed)
    ramp_s = warmup_s / 2
    episodes: list[Episode] = []
    lifetimes: dict[str, float] = {}

    def add(name: str, arrival_s: float, lifetime_s: float) -> None:
        lifetimes[name] = lifetime_s
        held_s = min(lifetime_s, end_s - arrival_s)  # the run ends at end_s
        steps = [Step(think_s=0.0, exec_s=held_s)]
        episodes.append(Episode(episode=name, arrival_s=arrival_s, steps=steps))

    population = poisson_count(rng, rate_per_s * lognormal_mean(mu, sigma))
    for number, start_s in enumerate(
        sorted(rng.uniform(0, ramp_s) for _ in range(population)), start=1
    ):
        residual_s = rng.random() * rng.lognormvariate(mu + sigma * sigma, sigma)
        add(f"{POPULATION_PREFIX}{number}", start_s, ramp_s - start_s + residual_s)
    arrivals = itertools.takewhile(lambda t: t < end_s - ramp_s, poisson_arrivals(rng, rate_per_s))
    for number, offset_s in enumerate(arrivals, start=1):
        add(f"e{number}", ramp_s + offset_s, rng.lognormvariate(mu, sigma))
    return episodes, lifetimes


@dataclass(frozen=True)
class VersionModel:
    """Weight releases every period_s from time zero; lifetimes lognormal(mu, sigma)."""

    period_s: float
    lag_cap: int
    group_size: int
    mu: float
    sigma: float


def tally_lags(
    records: Sequence[EpisodeRecord], lifetimes: dict[str, float], versions: VersionModel
) -> LagTally:
    """The version lag of records (those that got a sandbox), per trajectory and per group
    of consecutive arrivals, against what the arithmetic expects given their start phases."""
    period, cap = versions.period_s, versions.lag_cap
    log_lifetime = NormalDist(versions.mu, versions.sigma)

    def over_cap_probability(start_s: float) -> float:
        phase = start_s / period - math.floor(start_s / period)
        return 1 - log_lifetime.cdf(math.log((cap + 1 - phase) * period))

    # (lag, probability over the cap) per record, None for one that never started
    tallied: list[tuple[int, float] | None] = []
    for record in sorted(records, key=lambda r: r.arrival_s):
        if record.acquired_at_s is None:
            tallied.append(None)
            continue
        start_s, end_s = record.acquired_at_s, record.acquired_at_s + lifetimes[record.episode]
        lag = math.floor(end_s / period) - math.floor(start_s / period)
        tallied.append((lag, over_cap_probability(start_s)))
    started = [t for t in tallied if t is not None]
    size = versions.group_size
    groups = [
        members
        for i in range(0, len(tallied) - size + 1, size)
        if None not in (members := tallied[i : i + size])
    ]
    if not started:
        return LagTally(trajectories=0, groups=0, version_lag_mean=None, over_cap_share=None,
                        over_cap_share_expected=None, over_cap_share_se=None,
                        group_over_cap_share=None, group_over_cap_share_expected=None,
                        group_over_cap_share_se=None, agrees=False)  # fmt: skip

    def compare(hits: list[bool], chances: list[float]) -> tuple[float, float, float, bool]:
        observed, expected = sum(hits) / len(hits), sum(chances) / len(chances)
        se = math.sqrt(sum(q * (1 - q) for q in chances)) / len(chances)
        return observed, expected, se, abs(observed - expected) <= AGREEMENT_STANDARD_ERRORS * se

    share, share_expected, share_se, share_agrees = compare(
        [lag > cap for lag, _ in started], [q for _, q in started]
    )
    group_share = group_expected = group_se = None
    group_agrees = True
    if groups:
        group_share, group_expected, group_se, group_agrees = compare(
            [any(lag > cap for lag, _ in members) for members in groups],
            [1 - math.prod(1 - q for _, q in members) for members in groups],
        )
    return LagTally(
        trajectories=len(started),
        groups=len(groups),
        version_lag_mean=round(sum(lag for lag, _ in started) / len(started), 4),
        over_cap_share=round(share, 6),
        over_cap_share_expected=round(share_expected, 6),
        over_cap_share_se=round(share_se, 6),
        group_over_cap_share=None if group_share is None else round(group_share, 6),
        group_over_cap_share_expected=None if group_expected is None else round(group_expected, 6),
        group_over_cap_share_se=None if group_se is None else round(group_se, 6),
        agrees=share_agrees and group_agrees,
    )


def measure(
    result: RunResult,
    nodes: int,
    lifetimes: dict[str, float],
    start_s: float,
    stop_s: float,
    end_s: float,
    versions: VersionModel,
) -> SimRun:
    """The figures of one run over the requests that arrived in [start_s, stop_s)."""
    measured = [r for r in result.records if start_s <= r.arrival_s < stop_s]
    late = sum(
        1
        for r in result.records
        if r.episode.startswith(POPULATION_PREFIX)
        and (r.acquired_at_s is None or r.acquired_at_s > start_s)
    )
    latencies_ms, waited_s, spent_s, unserved = [], 0.0, 0.0, 0
    paths: dict[str, int] = {}
    for record in measured:
        if record.acquired_at_s is not None and record.acquired_at_s <= end_s:
            wait_s = record.acquired_at_s - record.requested_at_s
            latencies_ms.append(record.schedule_ms)
            paths[record.path] = paths.get(record.path, 0) + 1
        else:  # still waiting at the end: it waited at least this long
            wait_s = end_s - record.requested_at_s
            latencies_ms.append(wait_s * 1000)
            unserved += 1
        waited_s += wait_s
        spent_s += wait_s + lifetimes[record.episode]
    p99_ms = quantile(latencies_ms, 0.99)
    share = waited_s / spent_s if spent_s else 0.0
    in_flight = [s.leased for s in result.timeline if start_s <= s.t_s < end_s]
    return SimRun(
        nodes=nodes,
        meets_targets=p99_ms < SCHEDULE_TARGET_MS and share < QUEUE_WAIT_SHARE_TARGET,
        schedule_p99_ms=round(p99_ms, 3),
        queue_wait_share=round(share, 6),
        measured_requests=len(measured),
        unserved_at_end=unserved,
        in_flight_peak=max(in_flight, default=0),
        in_flight_mean=round(sum(in_flight) / len(in_flight), 1) if in_flight else 0.0,
        paths=dict(sorted(paths.items())),
        population_waiting_at_start=late,
        lag=tally_lags(measured, lifetimes, versions),
        wall_s=result.meta["wall_s"],
    )


def search_nodes(
    meets: Callable[[int], bool], start: int, lowest: int, max_runs: int
) -> tuple[int | None, bool]:
    """The smallest node count `meets` accepts, found from max(start, lowest) by galloping
    then bisecting in at most max_runs calls; counts below `lowest` are refused without a
    call. Also whether it is known to be the smallest (the count below it was refused).
    (None, False) if none was accepted."""
    outcomes: dict[int, bool] = {}

    def tried(n: int) -> bool:
        outcomes[n] = meets(n)
        return outcomes[n]

    refused = accepted = None
    step = 1
    start = max(start, lowest)
    if tried(start):
        accepted = start
        while accepted > lowest and len(outcomes) < max_runs:
            n = max(lowest, accepted - step)
            if tried(n):
                accepted, step = n, step * 2
            else:
                refused = n
                break
        if accepted == lowest:
            refused = lowest - 1
    else:
        refused = start
        while len(outcomes) < max_runs:
            n = refused + step
            if tried(n):
                accepted = n
                break
            refused, step = n, step * 2
    while accepted is not None and refused is not None and accepted - refused > 1:
        if len(outcomes) >= max_runs:
            break
        n = (accepted + refused) // 2
        if tried(n):
            accepted = n
        else:
            refused = n
    if accepted is None:
        return None, False
    return accepted, refused == accepted - 1


def scaled_load(in_flight: float, density: int, sim_scale: float | None) -> tuple[float, int]:
    """(scale, slots per node): the scale asked for, or the automatic one, adjusted so that
    the slots per node are a whole number; ValueError if it leaves a node no slot."""
    if sim_scale is None:
        slots = max(1, round(density * min(1.0, SIM_AUTO_MAX_IN_FLIGHT / in_flight)))
    else:
        slots = round(density * sim_scale)
        if slots < 1:
            raise ValueError(
                f"--sim-scale {sim_scale:g} leaves no slot on a node of {density} sandboxes: "
                f"use at least {0.5 / density:.2g}"
            )
    return slots / density, slots


def check_plan(
    result: PlanResult,
    settings: SimulateSettings,
    on_run: Callable[[str], None] | None = None,
    progress: bool = False,
) -> SimCheck:
    """Simulate the plan's load at its node count and search for the count that meets the
    targets; ValueError if the settings cannot make a meaningful run. `on_run` hears one
    line per simulation; with `progress`, each draws a bar of its simulated time."""
    raw = settings.load == "raw"
    rate = result.raw_trajectories_per_s if raw else result.trajectories_per_s
    planned = result.nodes_mean_raw if raw else result.nodes_mean
    density = result.input.sandboxes_per_node
    p50, p99 = lifetime_quantiles(result)
    mu, sigma = lognormal_from_median_p99(p50, p99)
    mean_s = lognormal_mean(mu, sigma)
    scale, slots = scaled_load(rate * mean_s, density, settings.sim_scale)
    rate_sim = rate * scale
    expected = rate_sim * settings.window_s
    if expected < MIN_MEASURED:
        raise ValueError(
            f"about {expected:.0f} requests would arrive in the measured window, too few for "
            f"a p99 (at least {MIN_MEASURED}): raise --window-s or --sim-scale"
        )
    start_s = settings.warmup_s
    stop_s = start_s + settings.window_s
    end_s = stop_s + TAIL_S
    trace, lifetimes = steady_state_trace(rate_sim, mu, sigma, settings.warmup_s, end_s,
                                          settings.seed)  # fmt: skip
    period, cap, group = result.iteration_period_s, result.input.lag_cap, result.input.group_size
    versions = VersionModel(period_s=period, lag_cap=cap, group_size=group, mu=mu, sigma=sigma)
    share = lag_over_cap_share(mu, sigma, period, cap)
    runs: dict[int, SimRun] = {}

    def meets(nodes: int) -> bool:
        params = PoolParams()
        if settings.policy == "static":  # a fixed pool: as large as the nodes hold
            size = min(nodes * slots, STATIC_POOL_LIMIT)
            params = PoolParams(min_warm=size, max_warm=size)
        simulated = simulate(trace, policy=settings.policy, nodes=nodes, slots_per_node=slots,
                             seed=settings.seed, params=params, min_tick_gap_s=MIN_TICK_GAP_S,
                             trace_name="dsec plan --simulate", progress=progress)  # fmt: skip
        run = runs[nodes] = measure(simulated, nodes, lifetimes, start_s, stop_s, end_s,
                                    versions)  # fmt: skip
        if on_run is not None:
            on_run(
                f"{nodes} nodes: p99 {run.schedule_p99_ms:,.1f} ms, queue wait "
                f"{run.queue_wait_share:.2%}, {'meets' if run.meets_targets else 'misses'} "
                f"the targets; {run.lag.over_cap_share:.1%} over the lag cap "
                f"({run.wall_s:.0f} s)"
            )
        return run.meets_targets

    start = settings.nodes or planned
    in_flight = rate_sim * mean_s
    stable_from = math.floor(in_flight / slots) + 1  # the fewest nodes with more slots
    needed, smallest = search_nodes(meets, start, stable_from, settings.max_runs)
    lag_at = needed if needed is not None else max(runs)
    return SimCheck(
        policy=settings.policy,
        seed=settings.seed,
        load=settings.load,
        planned_nodes=planned,
        start_nodes=start,
        stable_from_nodes=stable_from,
        sim_scale=round(scale, 6),
        slots_per_node=slots,
        arrivals_per_s=round(rate_sim, 6),
        lifetime_p50_s=round(p50, 3),
        lifetime_p99_s=round(p99, 3),
        lifetime_mean_s=round(mean_s, 3),
        in_flight_little=round(in_flight, 1),
        iteration_period_s=period,
        lag_cap=cap,
        group_size=group,
        version_lag_mean_planned=round(mean_s / period, 4),
        lag_over_cap_share_planned=round(share, 6),
        group_over_cap_share_bounds=(round(share, 6), round(1 - (1 - share) ** group, 6)),
        lag_checked_at_nodes=lag_at,
        lag_agrees=runs[lag_at].lag.agrees,
        warmup_s=settings.warmup_s,
        window_s=settings.window_s,
        tail_s=TAIL_S,
        targets={
            "schedule_p99_ms_below": SCHEDULE_TARGET_MS,
            "queue_wait_share_below": QUEUE_WAIT_SHARE_TARGET,
        },
        runs=[runs[n] for n in sorted(runs)],
        start_meets_targets=start in runs and runs[start].meets_targets,
        nodes_needed=needed,
        nodes_needed_is_smallest=smallest,
        max_runs=settings.max_runs,
        conclusion=_conclusion(start, stable_from, runs, needed, smallest, settings.max_runs),
        assumptions=_assumptions(settings, scale, slots, density, rate, raw, result),
    )


def _conclusion(
    start: int,
    stable_from: int,
    runs: dict[int, SimRun],
    needed: int | None,
    smallest: bool,
    max_runs: int,
) -> str:
    if start < stable_from:
        head = (
            f"{start} nodes miss the targets: fewer slots than Little's law puts in flight; "
            f"searched from {stable_from}"
        )
    else:
        head = f"{start} nodes {'meet' if runs[start].meets_targets else 'miss'} the targets"
    if needed is None:
        return (
            f"{head}; no node count up to {max(runs)} met them within {max_runs} "
            "simulations (raise --max-runs, or start higher with --nodes)"
        )
    if not smallest:
        below = max((n for n, r in runs.items() if n < needed and not r.meets_targets),
                    default=stable_from - 1)  # fmt: skip
        return (
            f"{head}; {needed} meet them; {below + 1} to {needed - 1} were not simulated "
            f"within {max_runs} simulations"
        )
    why = "" if needed - 1 in runs else " (fewer cannot hold the mean in flight)"
    return f"{head}; the smallest count that meets them: {needed}{why}"


def _assumptions(
    settings: SimulateSettings,
    scale: float,
    slots: int,
    density: int,
    rate: float,
    raw: bool,
    result: PlanResult,
) -> list[str]:
    rate_name = "R/p (raw)" if raw else "R (effective)"
    given = result.input
    if given.lifetime_p50_s is None:
        lifetimes = "lognormal of the seed's shape (its p50/p99 fit) at the plan's mean"
    elif given.lifetime_mean_s is None:
        lifetimes = "lognormal from the plan's p50 and p99"
    else:
        lifetimes = (
            f"lognormal from the plan's p50 and p99, not its given mean ({given.lifetime_mean_s:g}"
            " s), which the arithmetic uses and a lognormal cannot also match"
        )
    period = result.iteration_period_s
    return [
        f"arrivals Poisson at {rate_name} = {rate:.4g}/s x scale; lifetimes {lifetimes}, "
        "each held as one exec step",
        f"scale {scale:.4g}: {slots} of {density} slots per node and arrivals x {scale:.4g}, "
        "so each node is as full as planned; node counts are not scaled; a scaled run sees "
        "relatively larger swings in flight (stricter than full size)",
        "time not compressed; Docker operation times from the simulator's default profile "
        f"(docs/benchmarks.md medians); ticks at least {MIN_TICK_GAP_S:g} s apart",
        f"starts in steady state: the Little's-law population acquires over the first "
        f"{settings.warmup_s / 2:g} s, planned arrivals from then on; measured: arrivals in "
        f"[{settings.warmup_s:g} s, {settings.warmup_s + settings.window_s:g} s); a request "
        f"still waiting {TAIL_S:g} s after the window counts its wait until then",
        f"targets: p99 schedule latency < {SCHEDULE_TARGET_MS:g} ms and queue-wait share "
        f"(wait / (wait + lifetime)) < {QUEUE_WAIT_SHARE_TARGET:.0%}; node counts with fewer "
        "slots than Little's law puts in flight miss without a simulation",
        f"policy {settings.policy} with default pool parameters"
        + (" (static: a fixed pool filling the nodes)" if settings.policy == "static" else ""),
        f"version lag: weights released every {period:g} s from time zero; a measured "
        "trajectory's lag is floor((acquired + lifetime) / L) - floor(acquired / L); groups "
        f"of {given.group_size} consecutive arrivals; agreement with the arithmetic within "
        f"{AGREEMENT_STANDARD_ERRORS:g} standard errors",
    ]


def _columns(headers: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    """A header and rows as right-aligned text columns."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    return ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True))
            for row in (headers, *rows)]  # fmt: skip


def _shown(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def render_check(check: SimCheck) -> str:
    """The check as readable text: what was simulated, a row per node count, the verdict."""
    lines = [
        f"simulation: policy {check.policy}, seed {check.seed}, {check.load} load, "
        f"scale {check.sim_scale:g} ({check.slots_per_node} slots per node, "
        f"{check.arrivals_per_s:.4g} arrivals/s, {check.in_flight_little:,.0f} in flight by "
        "Little's law)",
    ]
    lines += [f"  assumes: {line}" for line in check.assumptions]
    headers = ("nodes", "p99 schedule ms", "queue wait", "in flight peak", "in flight mean",
               "measured", "unserved", "targets", "lag mean", "over lag cap",
               "groups over", "wall s")  # fmt: skip
    rows = [
        (
            str(run.nodes),
            f"{run.schedule_p99_ms:,.1f}",
            f"{run.queue_wait_share:.2%}",
            f"{run.in_flight_peak:,d}",
            f"{run.in_flight_mean:,.0f}",
            f"{run.measured_requests:,d}",
            f"{run.unserved_at_end:,d}",
            "met" if run.meets_targets else "missed",
            _shown(run.lag.version_lag_mean, ".2f"),
            _shown(run.lag.over_cap_share, ".1%"),
            _shown(run.lag.group_over_cap_share, ".1%"),
            f"{run.wall_s:.1f}",
        )
        for run in check.runs
    ]
    lines += _columns(headers, rows)
    needed = check.nodes_needed
    lines.append(
        f"nodes by arithmetic: {check.planned_nodes}; by simulation: "
        + ("none found" if needed is None else str(needed))
        + ("" if needed is None or check.nodes_needed_is_smallest else " (at most)")
    )
    lines.append(check.conclusion)
    lag = next(run.lag for run in check.runs if run.nodes == check.lag_checked_at_nodes)
    low, high = check.group_over_cap_share_bounds
    lines.append(
        f"version lag at {check.lag_checked_at_nodes} nodes, cap {check.lag_cap}, every "
        f"{check.iteration_period_s:g} s: mean {_shown(lag.version_lag_mean, '.2f')} (arithmetic "
        f"{check.version_lag_mean_planned:.2f}); over the cap {_shown(lag.over_cap_share, '.2%')}"
        f" (expected for these starts {_shown(lag.over_cap_share_expected, '.2%')} ± "
        f"{_shown(lag.over_cap_share_se, '.2%')}; arithmetic "
        f"{check.lag_over_cap_share_planned:.2%}); groups of {check.group_size} "
        f"{_shown(lag.group_over_cap_share, '.1%')} (expected "
        f"{_shown(lag.group_over_cap_share_expected, '.1%')} ± "
        f"{_shown(lag.group_over_cap_share_se, '.1%')}; arithmetic bounds {low:.1%} to "
        f"{high:.1%}): {'agrees' if check.lag_agrees else 'DISAGREES'}"
    )
    for run in check.runs:
        if run.population_waiting_at_start and run.nodes >= check.stable_from_nodes:
            lines.append(
                f"note: at {run.nodes} nodes, {run.population_waiting_at_start:,d} of the "
                "steady-state population still waited when measuring began; a longer "
                "--warmup-s may change the result"
            )
    return "\n".join(lines)


@dataclass(frozen=True)
class SeedCase:
    """One of the capacity study's cases: the plan's inputs (PlanInput fields, as `dsec plan` flags)
    and the load (--load) its nodes are checked at. Lifetimes are the p50/p99 fit, which
    the simulation draws from (the seed rounds the fit's mean to 1,900 s for its figures)."""

    name: str
    seed_says: str
    inputs: dict[str, object]
    load: Literal["effective", "raw"] = "effective"

    def flags(self) -> list[str]:
        """The `dsec plan` flags of this case."""
        given = [(f"--{key.replace('_', '-')}", str(value)) for key, value in self.inputs.items()]
        loads = [("--load", self.load)] if self.load != "effective" else []
        return [part for pair in given + loads for part in pair]


_LOSSLESS = {"availability": 1, "acceptance": 1}
SEED_CASES: tuple[SeedCase, ...] = (
    SeedCase("base", "section 3: ~7,100 / ~13,000 in flight, 7 / 13 nodes at 1,048", {}),
    SeedCase("base-raw", "section 3: with p = 80%, ~16,100 in flight, 16 nodes", {}, "raw"),
    SeedCase("base-3200", "section 3: 3 to 5 nodes at 3,200 a node", {"sandboxes_per_node": 3200}),
    SeedCase("cadence-600", "section 4: lag 1.7 / 3.2; 5% over cap 10, groups 5% to 35%",
             {"cadence_s": 600}),
    SeedCase("cadence-600-cap-4", "section 4: about 20% over cap 4, groups up to 83%",
             {"cadence_s": 600, "lag_cap": 4}),
    SeedCase("cadence-500", "sections 3, 4: 8.19/s, 10.2/s raw, ~19,500 in flight, 19 nodes; "
             "7% over cap 10, groups up to 46%", {"cadence_s": 500}, "raw"),
    SeedCase("two-weeks", "appendix A2: two weeks at 60 tokens/s, a 746 s cadence, lag 1.4 / 2.5",
             {"days": 14, "tokens_per_gpu_s": 60, "cadence_s": 746}),
    SeedCase("capacity-200", "appendix A1: batches every 224 s at 200 tokens/s, lag 4.7 / 8.5",
             {"rate_from": "capacity", **_LOSSLESS}),
    SeedCase("capacity-1000", "appendix A2: ~96,000 / ~174,000 in flight, 91 / 166 node "
             "equivalents at 1,048", {"rate_from": "capacity", "tokens_per_gpu_s": 1000,
                                      **_LOSSLESS}),
    SeedCase("capacity-1000-3200", "appendix A2: 30 / 54 node equivalents at 3,200",
             {"rate_from": "capacity", "tokens_per_gpu_s": 1000, "sandboxes_per_node": 3200,
              **_LOSSLESS}),
    SeedCase("capacity-2000", "appendix A2: ~191,000 / ~348,000 in flight, 182 / 332 node "
             "equivalents at 1,048", {"rate_from": "capacity", "tokens_per_gpu_s": 2000,
                                      **_LOSSLESS}),
    SeedCase("capacity-2000-3200", "appendix A2: 60 / 109 node equivalents at 3,200",
             {"rate_from": "capacity", "tokens_per_gpu_s": 2000, "sandboxes_per_node": 3200,
              **_LOSSLESS}),
)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Check the capacity study's cases in the simulator; 1 if a case's version lag disagrees with
    its arithmetic or no node count met the targets, 2 on an unknown case."""
    names = [case.name for case in SEED_CASES]
    parser = argparse.ArgumentParser(prog="python -m bench.plan_check", description=main.__doc__)
    parser.add_argument("--case", action="append", choices=names, help="(all of them)")
    parser.add_argument("--json", action="store_true", help="every check as JSON")
    args = parser.parse_args(argv)
    chosen = [case for case in SEED_CASES if args.case is None or case.name in args.case]
    rows, checks = [], {}
    for case in chosen:
        result = plan(PlanInput(**case.inputs))
        print(
            f"{case.name}: {' '.join(['dsec plan', *case.flags(), '--simulate'])}", file=sys.stderr
        )
        check = check_plan(
            result,
            SimulateSettings(load=case.load),
            on_run=lambda line: print(f"  {line}", file=sys.stderr, flush=True),
        )
        checks[case.name] = check.model_dump(mode="json")
        lag = next(r.lag for r in check.runs if r.nodes == check.lag_checked_at_nodes)
        rows.append((
            case.name, f"{check.arrivals_per_s / check.sim_scale:,.2f}",
            f"{check.in_flight_little / check.sim_scale:,.0f}", f"{check.sim_scale:.3g}",
            str(check.planned_nodes), _shown(check.nodes_needed, "d"),
            f"{check.lag_over_cap_share_planned:.1%}", _shown(lag.over_cap_share, ".1%"),
            f"{check.group_over_cap_share_bounds[1]:.1%}", _shown(lag.group_over_cap_share, ".1%"),
            "agrees" if check.lag_agrees else "DISAGREES",
            f"{sum(r.wall_s for r in check.runs):.0f}",
        ))  # fmt: skip
    if args.json:
        print(json.dumps(checks, indent=2))
    else:
        headers = ("case", "rate/s", "in flight", "scale", "nodes plan", "nodes sim",
                   "over cap plan", "sim", "groups max plan", "sim", "lag", "wall s")  # fmt: skip
        print("\n".join(_columns(headers, rows)))
    failed = any(not c["lag_agrees"] or c["nodes_needed"] is None for c in checks.values())
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
