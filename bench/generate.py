"""Seeded synthetic traces: who arrives when, and how long each episode holds its sandbox.

An episode's lifetime is lognormal, fitted to a median and a p99 (DSec's containers: p50
17.4 min, p99 231.5 min). It is cut into steps about ``mean_step_s`` long; each step is part
model think time (sandbox idle) and part tool exec time, ``exec_share`` of it on average.

Arrival processes:

- ``poisson``: a constant rate, exponential gaps.
- ``tidal``: a sinusoidally modulated rate, low at t = 0 and peaking half a period later,
  drawn by thinning a Poisson process at the peak rate.
- ``burst``: evaluation phases, ``burst_size`` episodes spread uniformly over ``burst_window_s``
  from each of the given start times.

Every parameter describes the workload at full speed; ``time_scale`` then multiplies every
time in the result (0.01 plays an hour in 36 s with the same concurrency). Only
``random.Random(seed)`` is used, so a seed gives the same trace on every machine.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import sys
from collections.abc import Iterable, Iterator, Sequence

from bench.importers import import_azure_llm, import_csv
from bench.stats import quantile
from bench.steps import (
    DEFAULT_EXEC_SHARE,
    DEFAULT_MEAN_STEP_S,
    require,
    require_fraction,
    require_non_negative,
    require_positive,
    split_lifetime,
)
from dsec.plan import lognormal_from_median_p99
from dsec.trace import Episode, dump_trace

GENERATED_KINDS = ("poisson", "tidal", "burst")
IMPORTED_KINDS = ("azure", "csv")

DSEC_LIFETIME_P50_S = 17.4 * 60
DSEC_LIFETIME_P99_S = 231.5 * 60
# With DSec's lifetimes (mean ~32 min) this keeps ~200 sandboxes busy: a live pool's size here.
DEFAULT_RATE_PER_S = 0.1


def poisson_arrivals(rng: random.Random, rate_per_s: float) -> Iterator[float]:
    """Endless arrival times of a Poisson process."""
    now = 0.0
    while True:
        now += rng.expovariate(rate_per_s)
        yield now


def tidal_rate(time_s: float, mean_rate_per_s: float, period_s: float, amplitude: float) -> float:
    """Arrival rate at ``time_s``: lowest at 0, highest at period / 2, averaging the mean."""
    return mean_rate_per_s * (1 - amplitude * math.cos(2 * math.pi * time_s / period_s))


def tidal_arrivals(
    rng: random.Random, mean_rate_per_s: float, period_s: float, amplitude: float
) -> Iterator[float]:
    """Endless arrival times at the tidal rate (Lewis-Shedler thinning)."""
    peak_rate = mean_rate_per_s * (1 + amplitude)
    for candidate in poisson_arrivals(rng, peak_rate):
        if rng.random() * peak_rate < tidal_rate(candidate, mean_rate_per_s, period_s, amplitude):
            yield candidate


def burst_arrivals(
    rng: random.Random, at_s: Sequence[float], size: int, window_s: float
) -> Iterator[float]:
    """``size`` arrivals spread uniformly over ``window_s`` from each start time, in order."""
    yield from sorted(start + rng.uniform(0, window_s) for start in at_s for _ in range(size))


def generate(
    kind: str = "poisson",
    *,
    n: int | None = None,
    duration_s: float | None = None,
    seed: int = 0,
    time_scale: float = 1.0,
    pool: str = "default",
    template: str = "base",
    priority: int = 0,
    id_prefix: str = "e",
    rate_per_s: float = DEFAULT_RATE_PER_S,
    tidal_period_s: float = 3600.0,
    tidal_amplitude: float = 0.8,
    burst_at_s: Sequence[float] = (0.0,),
    burst_size: int = 100,
    burst_window_s: float = 10.0,
    lifetime_p50_s: float = DSEC_LIFETIME_P50_S,
    lifetime_p99_s: float = DSEC_LIFETIME_P99_S,
    mean_step_s: float = DEFAULT_MEAN_STEP_S,
    exec_share: float = DEFAULT_EXEC_SHARE,
) -> list[Episode]:
    """A trace of ``kind`` arrivals, stopped after ``n`` episodes or at ``duration_s``.

    Poisson and tidal arrivals never end on their own and need one of the two bounds; bursts
    end after the last burst, and either bound cuts them short. Episode ids are
    ``{id_prefix}1``, ``{id_prefix}2``, ... in arrival order.
    """
    require(kind in GENERATED_KINDS, f"kind must be one of {', '.join(GENERATED_KINDS)}")
    require(n is None or n > 0, f"n must be > 0, got {n}")
    if duration_s is not None:
        require_positive("duration_s", duration_s)
    require(
        kind == "burst" or n is not None or duration_s is not None,
        f"{kind} arrivals never end: give n or duration_s",
    )
    require_positive("time_scale", time_scale)
    require_positive("mean_step_s", mean_step_s)
    require_fraction("exec_share", exec_share)
    require(
        0 < lifetime_p50_s < lifetime_p99_s,
        f"lifetimes need 0 < median < p99, got {lifetime_p50_s} and {lifetime_p99_s}",
    )
    mu, sigma = lognormal_from_median_p99(lifetime_p50_s, lifetime_p99_s)

    rng = random.Random(seed)
    arrivals: Iterable[float]
    if kind == "poisson":
        require_positive("rate_per_s", rate_per_s)
        arrivals = poisson_arrivals(rng, rate_per_s)
    elif kind == "tidal":
        require_positive("rate_per_s", rate_per_s)
        require_positive("tidal_period_s", tidal_period_s)
        require_fraction("tidal_amplitude", tidal_amplitude)
        arrivals = tidal_arrivals(rng, rate_per_s, tidal_period_s, tidal_amplitude)
    else:
        require(len(burst_at_s) > 0, "burst_at_s needs at least one start time")
        for start in burst_at_s:
            require_non_negative("burst_at_s", start)
        require(burst_size > 0, f"burst_size must be > 0, got {burst_size}")
        require_non_negative("burst_window_s", burst_window_s)
        arrivals = burst_arrivals(rng, burst_at_s, burst_size, burst_window_s)
    if duration_s is not None:
        arrivals = itertools.takewhile(lambda arrival: arrival < duration_s, arrivals)
    arrivals = itertools.islice(arrivals, n)

    return [
        Episode(
            episode=f"{id_prefix}{number}",
            arrival_s=arrival * time_scale,
            pool=pool,
            template=template,
            priority=priority,
            steps=split_lifetime(
                rng,
                rng.lognormvariate(mu, sigma) * time_scale,
                mean_step_s * time_scale,
                exec_share,
            ),
        )
        for number, arrival in enumerate(arrivals, start=1)
    ]


def summarize(episodes: Sequence[Episode]) -> dict[str, float | int]:
    """What a (non-empty) trace asks of a pool: size, lifetimes, exec share, concurrency."""
    lifetimes = sorted(episode.lifetime_s for episode in episodes)
    total_lifetime_s = sum(lifetimes)
    first_arrival_s = min(episode.arrival_s for episode in episodes)
    last_release_s = max(episode.arrival_s + episode.lifetime_s for episode in episodes)
    # Acquire (+1) sorts after release (-1) at the same instant: back-to-back holds don't overlap.
    changes = sorted(
        itertools.chain.from_iterable(
            ((episode.arrival_s, 1), (episode.arrival_s + episode.lifetime_s, -1))
            for episode in episodes
        )
    )
    return {
        "episodes": len(episodes),
        "steps": sum(len(episode.steps) for episode in episodes),
        "first_arrival_s": first_arrival_s,
        "last_arrival_s": max(episode.arrival_s for episode in episodes),
        "lifetime_p50_s": quantile(lifetimes, 0.50),
        "lifetime_p99_s": quantile(lifetimes, 0.99),
        "exec_share": (
            sum(episode.busy_s for episode in episodes) / total_lifetime_s
            if total_lifetime_s
            else 0.0
        ),
        "mean_concurrency": (
            total_lifetime_s / (last_release_s - first_arrival_s)
            if last_release_s > first_arrival_s
            else 0.0
        ),
        "peak_concurrency": max(itertools.accumulate(change for _, change in changes)),
    }


def _seconds_list(text: str) -> list[float]:
    try:
        return [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated seconds such as 0,1800,3600, got {text!r}"
        ) from None


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``dsec bench generate``."""
    parser.add_argument(
        "--kind",
        choices=GENERATED_KINDS + IMPORTED_KINDS,
        default="poisson",
        help="arrival process to generate, or a CSV format to import from --input",
    )
    parser.add_argument("--out", required=True, help="trace file to write (JSON Lines)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument(
        "--n", type=int, help="number of episodes (imports: the first N rows of the file)"
    )
    parser.add_argument(
        "--duration-s", type=float, help="generate arrivals up to this time (before --time-scale)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--time-scale", type=float, default=1.0, help="multiply every time; 0.1 runs 10x faster"
    )
    parser.add_argument("--pool", default="default")
    parser.add_argument("--template", default="base")
    parser.add_argument("--priority", type=int, default=0)
    parser.add_argument("--id-prefix", default="e", help="episode ids are PREFIX1, PREFIX2, ...")

    shape = parser.add_argument_group("episodes")
    shape.add_argument("--lifetime-p50-s", type=float, default=DSEC_LIFETIME_P50_S)
    shape.add_argument("--lifetime-p99-s", type=float, default=DSEC_LIFETIME_P99_S)
    shape.add_argument("--mean-step-s", type=float, default=DEFAULT_MEAN_STEP_S)
    shape.add_argument(
        "--exec-share",
        type=float,
        default=DEFAULT_EXEC_SHARE,
        help="share of each step spent executing rather than thinking",
    )

    arrivals = parser.add_argument_group("arrivals")
    arrivals.add_argument(
        "--rate-per-s", type=float, default=DEFAULT_RATE_PER_S, help="poisson or mean tidal rate"
    )
    arrivals.add_argument("--tidal-period-s", type=float, default=3600.0)
    arrivals.add_argument(
        "--tidal-amplitude", type=float, default=0.8, help="0 is flat, 1 drops to zero at ebb"
    )
    arrivals.add_argument(
        "--burst-at-s",
        type=_seconds_list,
        default=[0.0],
        help="comma-separated burst start times, e.g. 0,1800,3600",
    )
    arrivals.add_argument("--burst-size", type=int, default=100)
    arrivals.add_argument("--burst-window-s", type=float, default=10.0)

    imports = parser.add_argument_group("imports (--kind azure or csv)")
    imports.add_argument("--input", help="CSV file to import")
    imports.add_argument("--arrival-col", default="arrival_s", help="csv: arrival seconds")
    imports.add_argument("--duration-col", default="duration_s", help="csv: lifetime seconds")
    imports.add_argument("--decode-tokens-per-s", type=float, default=50.0, help="azure")
    imports.add_argument("--context-tokens-per-step", type=float, default=500.0, help="azure")
    imports.add_argument("--exec-s-per-step", type=float, default=2.0, help="azure")


def _episodes_for(args: argparse.Namespace) -> list[Episode]:
    common = {
        "time_scale": args.time_scale,
        "pool": args.pool,
        "template": args.template,
        "priority": args.priority,
        "id_prefix": args.id_prefix,
    }
    if args.kind in GENERATED_KINDS:
        return generate(
            args.kind,
            n=args.n,
            duration_s=args.duration_s,
            seed=args.seed,
            rate_per_s=args.rate_per_s,
            tidal_period_s=args.tidal_period_s,
            tidal_amplitude=args.tidal_amplitude,
            burst_at_s=args.burst_at_s,
            burst_size=args.burst_size,
            burst_window_s=args.burst_window_s,
            lifetime_p50_s=args.lifetime_p50_s,
            lifetime_p99_s=args.lifetime_p99_s,
            mean_step_s=args.mean_step_s,
            exec_share=args.exec_share,
            **common,
        )
    require(args.input is not None, f"--kind {args.kind} imports a CSV: give --input FILE")
    require(args.duration_s is None, "--duration-s applies to generated kinds; use --n")
    if args.kind == "azure":
        return import_azure_llm(
            args.input,
            decode_tokens_per_s=args.decode_tokens_per_s,
            context_tokens_per_step=args.context_tokens_per_step,
            exec_s_per_step=args.exec_s_per_step,
            limit=args.n,
            **common,
        )
    return import_csv(
        args.input,
        args.arrival_col,
        args.duration_col,
        mean_step_s=args.mean_step_s,
        exec_share=args.exec_share,
        seed=args.seed,
        limit=args.n,
        **common,
    )


def run_generate(args: argparse.Namespace) -> int:
    """Write the trace to ``--out`` and print a summary; 2 on bad input."""
    try:
        episodes = _episodes_for(args)
        require(len(episodes) > 0, "no episodes: the bounds given leave nothing to generate")
        dump_trace(episodes, args.out)
    except (ValueError, OSError) as error:
        print(f"dsec bench generate: {error}", file=sys.stderr)
        return 2
    summary = {"trace": args.out, "kind": args.kind, "seed": args.seed, **summarize(episodes)}
    if args.json:
        print(json.dumps(summary))
    else:
        print(
            "wrote {episodes} episodes ({steps} steps) to {trace}: "
            "arrivals {first_arrival_s:.1f}-{last_arrival_s:.1f} s, "
            "lifetime p50 {lifetime_p50_s:.1f} s p99 {lifetime_p99_s:.1f} s, "
            "exec share {exec_share:.2f}, "
            "concurrency mean {mean_concurrency:.1f} peak {peak_concurrency}".format(**summary)
        )
    return 0
