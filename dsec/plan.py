"""Capacity planner: from a training budget to trajectories/s, GPU throughput and nodes.

The arithmetic follows DSec's capacity study (sizing a sandbox pool for one RL training run), its
sections 2 to 5 and appendices A1 and A2: the effective trajectory rate comes from the
deadline (n·B/T), from the iteration cadence (B/L, which a faster cadence raises while
leaving slack in the deadline), or from what the inference GPUs produce; the inference
threshold from output tokens, and the GPUs moved from training to close a gap; sandboxes
in flight from Little's law, as nodes at each density; version lag, per trajectory and
per GRPO group, from the discrete release timeline of appendix A1; and a sensitivity
table over tokens/s per GPU (appendix A2). Defaults are the seed's base case.

`dsec plan --simulate` then checks the node count in the simulator: bench/plan_check.py
plays the planned load through the control plane's scheduler and reports whether the
schedule-latency and queue-wait targets hold, and the node count at which they do (its
docstring says how the load is built, scaled and measured), and the version lag of the
simulated trajectories against the plan's. This module holds the arithmetic and its
inputs and outputs only, the check's settings (SimulateSettings) among them; the command
(flags, table, the call to the simulator) is dsec/cli/plan.py.
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    field_validator,
    model_validator,
)

from dsec.policies import POLICIES

SECONDS_PER_DAY = 86_400.0

# The seed fits its lognormal to the container lifetime p50 and p99 (DSec, figure 7).
SEED_LIFETIME_P50_S = 1_044.0
SEED_LIFETIME_P99_S = 13_900.0
# DSec's container densities: the sample day's single-node peak and its demonstrated
# operating point (the study, section 3).
SEED_DENSITIES = (1_048, 3_200)
# The seed's throughput scan points: below, near and above the threshold (section 2),
# and appendix A2's far end.
SEED_TOKENS_PER_GPU_S = (60.0, 75.0, 200.0, 1_000.0, 2_000.0)
# DSec's production unit, on whose nodes those densities were seen.
DSEC_UNIT_NODES = 160
DSEC_UNIT_CORES = 30_000
DSEC_UNIT_MEMORY_TB = 250.0

Z_99 = NormalDist().inv_cdf(0.99)


def lognormal_from_median_p99(median: float, p99: float) -> tuple[float, float]:
    """Return (mu, sigma) of the lognormal whose median and 99th percentile are given."""
    if median <= 0 or p99 < median:
        raise ValueError(f"need 0 < median <= p99, got median={median}, p99={p99}")
    return math.log(median), math.log(p99 / median) / Z_99


def lognormal_mean(mu: float, sigma: float) -> float:
    """Mean of a lognormal with log-mean mu and log-standard-deviation sigma."""
    return math.exp(mu + sigma * sigma / 2)


def _standard_normal_cdf(x: float) -> float:
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


def _lognormal_call(mu: float, sigma: float, strike: float) -> float:
    """E[max(X - strike, 0)] for X lognormal(mu, sigma), in closed form."""
    mean = lognormal_mean(mu, sigma)
    if strike <= 0:
        return mean - strike
    if sigma == 0:
        return max(math.exp(mu) - strike, 0.0)
    d2 = (mu - math.log(strike)) / sigma
    return mean * _standard_normal_cdf(d2 + sigma) - strike * _standard_normal_cdf(d2)


def lag_over_cap_share(mu: float, sigma: float, cadence_s: float, cap: int) -> float:
    """Share of trajectories whose version lag exceeds cap (the study, appendix A1).

    Weights are released every cadence_s and a trajectory of duration W starts at a
    uniformly random phase, so its lag is floor(W / L + U) with U ~ Uniform(0, 1):
    its mean is exactly W / L, and P(lag > cap) = E[clip(W / L - cap, 0, 1)].
    """
    lag_mu = mu - math.log(cadence_s)
    return _lognormal_call(lag_mu, sigma, cap) - _lognormal_call(lag_mu, sigma, cap + 1)


RateSource = Literal["deadline", "cadence", "capacity"]


class PlanInput(BaseModel):
    """What a training run asks of the pool; field names match the CLI flags."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    iterations: int = Field(1_000, gt=0, description="outer iterations, n")
    trajectories_per_iteration: int = Field(4_096, gt=0, description="batch size, B")
    days: float = Field(7.0, gt=0, description="deadline, T")
    tokens_per_trajectory: int = Field(32_768, gt=0, description="output tokens, K")
    gpus: int = Field(3_000, gt=0, description="inference GPUs, G")
    tokens_per_gpu_s: float = Field(200.0, gt=0, description="measured rollout throughput")
    availability: float = Field(0.9, gt=0, le=1, description="share of time serving, a")
    acceptance: float = Field(0.8, gt=0, le=1, description="share entering a batch, p")
    training_gpus: int = Field(7_000, gt=0, description="training GPUs (10,000 less G)")
    lifetime_p50_s: float | None = Field(None, gt=0, description="median occupancy")
    lifetime_p99_s: float | None = Field(None, gt=0, description="99th percentile occupancy")
    lifetime_mean_s: float | None = Field(None, gt=0, description="mean occupancy")
    sandboxes_per_node: int = Field(1_048, gt=0, description="node density")
    densities: list[PositiveInt] = Field(
        list(SEED_DENSITIES), description="densities the in-flight counts are converted at"
    )
    cadence_s: float | None = Field(None, gt=0, description="iteration period L; None: T/n")
    rate_from: RateSource | None = Field(
        None, description="the rate sized for; None: cadence with --cadence-s, else deadline"
    )
    lag_cap: int = Field(10, ge=0, description="largest tolerated version lag")
    group_size: int = Field(8, gt=0, description="trajectories per GRPO group")
    sensitivity: list[PositiveFloat] = Field(
        list(SEED_TOKENS_PER_GPU_S), description="tokens/s per GPU of the sensitivity table"
    )

    @model_validator(mode="after")
    def _one_lifetime_description(self) -> Self:
        has_quantiles = self.lifetime_p50_s is not None or self.lifetime_p99_s is not None
        if self.lifetime_mean_s is None and not has_quantiles:
            self.lifetime_p50_s = SEED_LIFETIME_P50_S
            self.lifetime_p99_s = SEED_LIFETIME_P99_S
        if has_quantiles and (self.lifetime_p50_s is None or self.lifetime_p99_s is None):
            raise ValueError("--lifetime-p50-s and --lifetime-p99-s must be given together")
        if self.lifetime_p50_s is not None and self.lifetime_p99_s < self.lifetime_p50_s:
            raise ValueError(
                f"--lifetime-p99-s ({self.lifetime_p99_s:g}) is below "
                f"--lifetime-p50-s ({self.lifetime_p50_s:g})"
            )
        return self

    @model_validator(mode="after")
    def _rate_source(self) -> Self:
        if self.rate_from == "cadence" and self.cadence_s is None:
            raise ValueError("--rate-from cadence needs --cadence-s")
        if self.rate_from is None:
            self.rate_from = "cadence" if self.cadence_s is not None else "deadline"
        return self


class DensityNodes(BaseModel):
    """In-flight counts at one density: node equivalents (the quotient, which the seed's
    appendix A2 rounds) and nodes (its ceiling, what one provisions)."""

    sandboxes_per_node: int
    node_equivalents_median: float | None
    node_equivalents_mean: float
    node_equivalents_mean_raw: float
    nodes_median: int | None
    nodes_mean: int
    nodes_mean_raw: int


class SensitivityRow(BaseModel):
    """One throughput: what the plan's rate asks of it, and (appendix A2) the load when
    the trajectory rate follows what the GPUs produce, as `--rate-from capacity` plans it."""

    tokens_per_gpu_s: float
    inference_demand_share_lossless: float
    inference_demand_share: float
    gpus_needed: int
    capacity_trajectories_per_s: float
    capacity_cadence_s: float
    version_lag_median: float | None
    version_lag_mean: float
    in_flight_median: float | None
    in_flight_mean: float
    in_flight_mean_raw: float
    nodes_at_densities: list[DensityNodes]


class PlanResult(BaseModel):
    """Every figure of the plan; `formulas` holds, per scalar figure, how it was computed.

    trajectories_per_s is the rate the plan sizes for (input.rate_from): the deadline's
    n·B/T, the cadence's B/L, or what the GPUs produce. Figures that need the lifetime
    median or its distribution are None when only a mean lifetime was given.
    """

    input: PlanInput
    trajectories_total: int
    trajectories_per_s: float
    raw_trajectories_per_s: float
    deadline_trajectories_per_s: float
    cadence_trajectories_per_s: float
    capacity_trajectories_per_s: float
    rate_over_deadline_share: float
    iteration_period_s: float
    deadline_cadence_s: float
    capacity_cadence_s: float
    run_time_s: float
    time_slack_s: float
    time_slack_share: float
    meets_deadline: bool
    output_tokens_per_s: float
    tokens_per_gpu_s_threshold_lossless: float
    tokens_per_gpu_s_threshold: float
    inference_demand_share_lossless: float
    inference_demand_share: float
    gpus_needed: int
    gpu_gap: int
    training_gpus_after_gap: int | None
    update_time_stretch: float | None
    lifetime_mean_s: float
    decode_tokens_per_s_median: float | None
    decode_tokens_per_s_mean: float
    in_flight_median: float | None
    in_flight_mean: float
    in_flight_mean_raw: float
    nodes_median: int | None
    nodes_mean: int
    nodes_mean_raw: int
    nodes_at_densities: list[DensityNodes]
    dsec_node_cores: float
    dsec_node_memory_tb: float
    version_lag_median: float | None
    version_lag_mean: float
    version_lag_at_median: dict[int, float] | None
    release_periods_p99: float | None
    lag_over_cap_share: float | None
    group_over_cap_share_lower: float | None
    group_over_cap_share_upper: float | None
    loss_budget_share: float
    sensitivity: list[SensitivityRow]
    formulas: dict[str, str]


def whole(count: float) -> int:
    """The whole number of units that hold count: its ceiling, forgiving float noise
    (a quotient that should be exactly 7 must not come out as 7.000000000000001 and 8)."""
    return math.ceil(count * (1 - 1e-12))


def nodes_at(
    density: int, in_flight_median: float | None, in_flight_mean: float, in_flight_mean_raw: float
) -> DensityNodes:
    """The in-flight counts as node equivalents and nodes at `density` sandboxes a node."""
    median = None if in_flight_median is None else in_flight_median / density
    mean, raw = in_flight_mean / density, in_flight_mean_raw / density
    return DensityNodes(
        sandboxes_per_node=density,
        node_equivalents_median=median,
        node_equivalents_mean=mean,
        node_equivalents_mean_raw=raw,
        nodes_median=None if median is None else whole(median),
        nodes_mean=whole(mean),
        nodes_mean_raw=whole(raw),
    )


def lag_split(lifetime_s: float, cadence_s: float) -> dict[int, float]:
    """The version lag of a trajectory of fixed length, by probability (appendix A1): its
    start phase is uniform, so lag ⌊W/L + U⌋ is ⌊W/L⌋ or one more, the latter with
    probability frac(W/L)."""
    periods = lifetime_s / cadence_s
    below = math.floor(periods)
    above_share = periods - below
    if above_share == 0:
        return {below: 1.0}
    return {below: 1 - above_share, below + 1: above_share}


def plan(inp: PlanInput) -> PlanResult:
    """Work out the capacity plan for inp; pure arithmetic, no I/O."""
    n, b, k, g = inp.iterations, inp.trajectories_per_iteration, inp.tokens_per_trajectory, inp.gpus
    a, p, x = inp.availability, inp.acceptance, inp.tokens_per_gpu_s
    density = inp.sandboxes_per_node
    deadline_s = inp.days * SECONDS_PER_DAY

    # --- the rate: what the deadline, the cadence or the GPUs ask ---
    deadline_rate = n * b / deadline_s
    # a shortens serving time and p wastes samples: both scale what the GPUs deliver.
    capacity_rate = g * x * a * p / k
    if inp.rate_from == "cadence":
        rate = b / inp.cadence_s
    elif inp.rate_from == "capacity":
        rate = capacity_rate
    else:
        rate = deadline_rate
    raw_rate = rate / p
    if inp.cadence_s is not None:
        period = inp.cadence_s
    elif inp.rate_from == "deadline":
        period = deadline_s / n
    else:
        period = b / rate
    run_time_s = n * period
    if math.isclose(run_time_s, deadline_s, rel_tol=1e-12):
        run_time_s = deadline_s  # the deadline's own pace: no slack, not a rounding error
    slack_s = deadline_s - run_time_s

    # --- inference ---
    output_tokens_per_s = rate * k
    threshold_lossless = output_tokens_per_s / g
    threshold = threshold_lossless / (a * p)
    gpus_needed = whole(output_tokens_per_s / (x * a * p))
    gpu_gap = max(0, gpus_needed - g)
    # GPUs moved from training to close the gap; the update time scales inversely with
    # the training GPUs left (the study, section 4).
    training_left = inp.training_gpus - gpu_gap if gpu_gap < inp.training_gpus else None

    # --- sandboxes ---
    if inp.lifetime_p50_s is None:
        mu = sigma = median = None
        mean = inp.lifetime_mean_s
        mean_formula = "W̄ = --lifetime-mean-s (given)"
    else:
        median = inp.lifetime_p50_s
        mu, sigma = lognormal_from_median_p99(median, inp.lifetime_p99_s)
        fitted_mean = lognormal_mean(mu, sigma)
        fit = (
            f"exp(μ + σ²/2), μ = ln p50 = ln {median:g}, "
            f"σ = ln(p99/p50)/z₀.₉₉ = ln({inp.lifetime_p99_s:g}/{median:g})/{Z_99:.4f} "
            f"= {sigma:.4f}"
        )
        if inp.lifetime_mean_s is None:
            mean, mean_formula = fitted_mean, f"W̄ = {fit}"
        else:  # a measured (or rounded) mean for Little's law; the fit keeps the tail
            mean = inp.lifetime_mean_s
            mean_formula = (
                f"W̄ = --lifetime-mean-s (given; the p50/p99 fit's, {fit}, is "
                f"{fitted_mean:,.0f} s and gives the shares over the lag cap)"
            )
    in_flight_median = rate * median if median is not None else None
    in_flight_mean = rate * mean
    # Scaling by 1/p assumes a rejected attempt occupies a sandbox as long as an accepted one.
    in_flight_mean_raw = raw_rate * mean
    headline = nodes_at(density, in_flight_median, in_flight_mean, in_flight_mean_raw)

    # --- version lag ---
    share = lag_over_cap_share(mu, sigma, period, inp.lag_cap) if mu is not None else None
    # A group is dropped with its longest trajectory: as often as one trajectory if the
    # group's lifetimes move together, at most 1 - (1 - share)^group if independent.
    group_upper = None if share is None else 1 - (1 - share) ** inp.group_size

    formulas = {
        "trajectories_total": f"n·B = {n} × {b}",
        "trajectories_per_s": {
            "deadline": f"R = n·B / T = {n} × {b} / {deadline_s:,.0f} s (--rate-from deadline)",
            "cadence": f"R = B / L = {b} / {period:g} s (--rate-from cadence)",
            "capacity": f"R = G·x·a·p / K = {g} × {x:g} × {a:g} × {p:g} / {k} "
            "(--rate-from capacity)",
        }[inp.rate_from],
        "raw_trajectories_per_s": f"R / p = {rate:.4f} / {p:g}",
        "deadline_trajectories_per_s": f"n·B / T = {n} × {b} / {deadline_s:,.0f} s",
        "cadence_trajectories_per_s": f"B / L = {b} / {period:g} s",
        "capacity_trajectories_per_s": f"G·x·a·p / K = {g} × {x:g} × {a:g} × {p:g} / {k}",
        "rate_over_deadline_share": f"R / (n·B/T) − 1 = {rate:.4f} / {deadline_rate:.4f} − 1",
        "iteration_period_s": (
            f"L = --cadence-s = {period:g} s"
            if inp.cadence_s is not None
            else f"L = B / R = {b} / {rate:.4f}"
        ),
        "deadline_cadence_s": f"T / n = {deadline_s:,.0f} s / {n}, the slowest L in time",
        "capacity_cadence_s": (
            f"B / (G·x·a·p/K) = {b} / {capacity_rate:.4f}, the fastest L the GPUs feed"
        ),
        "run_time_s": f"n·L = {n} × {period:g} s",
        "time_slack_s": f"T − n·L = {deadline_s:,.0f} s − {run_time_s:,.0f} s",
        "time_slack_share": f"1 − n·L / T = 1 − {run_time_s:,.0f} s / {deadline_s:,.0f} s",
        "meets_deadline": f"n·L ≤ T: {run_time_s:,.0f} s ≤ {deadline_s:,.0f} s",
        "output_tokens_per_s": f"R·K = {rate:.4f} × {k}",
        "tokens_per_gpu_s_threshold_lossless": f"R·K / G = {output_tokens_per_s:,.0f} / {g}",
        "tokens_per_gpu_s_threshold": (
            f"R·K / (G·a·p) = {threshold_lossless:.2f} / ({a:g} × {p:g})"
        ),
        "inference_demand_share_lossless": (
            f"lossless threshold / measured = {threshold_lossless:.2f} / {x:g}"
        ),
        "inference_demand_share": f"threshold / measured = {threshold:.2f} / {x:g}",
        "gpus_needed": f"⌈R·K / (x·a·p)⌉ = ⌈{output_tokens_per_s:,.0f} / ({x:g} × {a:g} × {p:g})⌉",
        "gpu_gap": f"max(0, GPUs needed − G) = max(0, {gpus_needed} − {g})",
        "training_gpus_after_gap": (
            f"training GPUs − gap = {inp.training_gpus} − {gpu_gap}"
            if training_left is not None
            else f"the gap ({gpu_gap}) is all of the {inp.training_gpus} training GPUs"
        ),
        "update_time_stretch": (
            f"U ∝ 1/training GPUs: {inp.training_gpus} / {training_left} − 1"
            if training_left is not None
            else "no training GPUs left"
        ),
        "lifetime_mean_s": mean_formula,
        "decode_tokens_per_s_mean": f"K / W̄ = {k} / {mean:,.0f} s, before tool time",
        "in_flight_mean": f"Little: R × W̄ = {rate:.4f} × {mean:,.0f} s",
        "in_flight_mean_raw": f"Little: R/p × W̄ = {raw_rate:.4f} × {mean:,.0f} s",
        "nodes_mean": f"⌈R × W̄ / density⌉ = ⌈{in_flight_mean:,.0f} / {density}⌉",
        "nodes_mean_raw": f"⌈R/p × W̄ / density⌉ = ⌈{in_flight_mean_raw:,.0f} / {density}⌉",
        "dsec_node_cores": f"{DSEC_UNIT_CORES:,} cores / {DSEC_UNIT_NODES} nodes (DSec's unit)",
        "dsec_node_memory_tb": f"{DSEC_UNIT_MEMORY_TB:g} TB / {DSEC_UNIT_NODES} nodes",
        "version_lag_mean": f"W̄ / L = {mean:,.0f} s / {period:g} s",
        "loss_budget_share": f"1 − p = 1 − {p:g}",
    }
    unavailable = "needs --lifetime-p50-s and --lifetime-p99-s"
    if median is not None:
        over = f"P(⌊W/L + U⌋ > {inp.lag_cap})"
        formulas |= {
            "decode_tokens_per_s_median": f"K / p50 = {k} / {median:,.0f} s, before tool time",
            "in_flight_median": f"Little: R × p50 = {rate:.4f} × {median:,.0f} s",
            "nodes_median": f"⌈R × p50 / density⌉ = ⌈{in_flight_median:,.0f} / {density}⌉",
            "version_lag_median": f"p50 / L = {median:,.0f} s / {period:g} s",
            "version_lag_at_median": (
                f"W = p50 fixed: ⌊W/L⌋ w.p. 1 − frac(W/L), one more w.p. frac(W/L), "
                f"W/L = {median / period:.3f}"
            ),
            "release_periods_p99": f"p99 / L = {inp.lifetime_p99_s:,.0f} s / {period:g} s",
            "lag_over_cap_share": (
                f"{over} = E[clip(W/L − {inp.lag_cap}, 0, 1)], "
                f"W ~ lognormal(μ, σ = {sigma:.4f}), U ~ Uniform(0, 1)"
            ),
            "group_over_cap_share_lower": f"{over}: a group's lifetimes fully correlated",
            "group_over_cap_share_upper": (
                f"1 − (1 − {share:.4f})^{inp.group_size}: a group's lifetimes independent"
            ),
        }
    else:
        for key in ("decode_tokens_per_s_median", "in_flight_median", "nodes_median",
                    "version_lag_median", "version_lag_at_median", "release_periods_p99",
                    "lag_over_cap_share", "group_over_cap_share_lower",
                    "group_over_cap_share_upper"):  # fmt: skip
            formulas[key] = unavailable

    return PlanResult(
        input=inp,
        trajectories_total=n * b,
        trajectories_per_s=rate,
        raw_trajectories_per_s=raw_rate,
        deadline_trajectories_per_s=deadline_rate,
        cadence_trajectories_per_s=b / period,
        capacity_trajectories_per_s=capacity_rate,
        rate_over_deadline_share=rate / deadline_rate - 1,
        iteration_period_s=period,
        deadline_cadence_s=deadline_s / n,
        capacity_cadence_s=b / capacity_rate,
        run_time_s=run_time_s,
        time_slack_s=slack_s,
        time_slack_share=slack_s / deadline_s,
        meets_deadline=slack_s >= 0,
        output_tokens_per_s=output_tokens_per_s,
        tokens_per_gpu_s_threshold_lossless=threshold_lossless,
        tokens_per_gpu_s_threshold=threshold,
        inference_demand_share_lossless=threshold_lossless / x,
        inference_demand_share=threshold / x,
        gpus_needed=gpus_needed,
        gpu_gap=gpu_gap,
        training_gpus_after_gap=training_left,
        update_time_stretch=(
            inp.training_gpus / training_left - 1 if training_left is not None else None
        ),
        lifetime_mean_s=mean,
        decode_tokens_per_s_median=k / median if median is not None else None,
        decode_tokens_per_s_mean=k / mean,
        in_flight_median=in_flight_median,
        in_flight_mean=in_flight_mean,
        in_flight_mean_raw=in_flight_mean_raw,
        nodes_median=headline.nodes_median,
        nodes_mean=headline.nodes_mean,
        nodes_mean_raw=headline.nodes_mean_raw,
        nodes_at_densities=[
            nodes_at(d, in_flight_median, in_flight_mean, in_flight_mean_raw) for d in inp.densities
        ],
        dsec_node_cores=DSEC_UNIT_CORES / DSEC_UNIT_NODES,
        dsec_node_memory_tb=DSEC_UNIT_MEMORY_TB / DSEC_UNIT_NODES,
        version_lag_median=median / period if median is not None else None,
        version_lag_mean=mean / period,
        version_lag_at_median=lag_split(median, period) if median is not None else None,
        release_periods_p99=inp.lifetime_p99_s / period if median is not None else None,
        lag_over_cap_share=share,
        group_over_cap_share_lower=share,
        group_over_cap_share_upper=group_upper,
        loss_budget_share=1 - p,
        sensitivity=[
            sensitivity_row(inp, output_tokens_per_s, tokens) for tokens in inp.sensitivity
        ],
        formulas=formulas,
    )


def sensitivity_row(inp: PlanInput, output_tokens_per_s: float, tokens: float) -> SensitivityRow:
    """The sensitivity table's row at `tokens` per GPU: the demand share and GPUs for the
    plan's output, and the plan of `--rate-from capacity --tokens-per-gpu-s tokens`."""
    a, p = inp.availability, inp.acceptance
    at_capacity = plan(
        inp.model_copy(
            update={
                "tokens_per_gpu_s": tokens,
                "rate_from": "capacity",
                "cadence_s": None,
                "sensitivity": [],
            }
        )
    )
    return SensitivityRow(
        tokens_per_gpu_s=tokens,
        inference_demand_share_lossless=output_tokens_per_s / (inp.gpus * tokens),
        inference_demand_share=output_tokens_per_s / (inp.gpus * tokens * a * p),
        gpus_needed=whole(output_tokens_per_s / (tokens * a * p)),
        capacity_trajectories_per_s=at_capacity.trajectories_per_s,
        capacity_cadence_s=at_capacity.iteration_period_s,
        version_lag_median=at_capacity.version_lag_median,
        version_lag_mean=at_capacity.version_lag_mean,
        in_flight_median=at_capacity.in_flight_median,
        in_flight_mean=at_capacity.in_flight_mean,
        in_flight_mean_raw=at_capacity.in_flight_mean_raw,
        nodes_at_densities=at_capacity.nodes_at_densities,
    )


# Without --sim-scale, the simulation runs the whole load up to this many sandboxes in
# flight and scales it down to this beyond (bench/plan_check.py): bench/sim_scale.py runs
# 20,000 at about a simulated hour in 40 s on two cores.
SIM_AUTO_MAX_IN_FLIGHT = 20_000


class SimulateSettings(BaseModel):
    """How `dsec plan --simulate` checks the plan; field names match the CLI flags."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    policy: str = Field("dsec", description="the pool's policy in the simulation")
    seed: int = Field(0, description="seeds the trace and the simulator")
    nodes: int | None = Field(None, gt=0, le=10_000, description="first node count to simulate")
    load: Literal["effective", "raw"] = Field(
        "effective", description="effective rate R (nodes_mean) or raw R/p (nodes_mean_raw)"
    )
    sim_scale: float | None = Field(
        None, gt=0, le=1, description="share of the load simulated; None: automatic"
    )
    warmup_s: float = Field(600.0, gt=0, le=86_400, description="unmeasured start")
    window_s: float = Field(600.0, gt=0, le=86_400, description="measured arrivals")
    max_runs: int = Field(8, ge=1, le=50, description="simulations the search may run")

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, name: str) -> str:
        if name not in POLICIES:
            raise ValueError(f"unknown policy; known: {', '.join(sorted(POLICIES))}")
        return name
