"""Capacity planner: from a training budget to trajectories/s, GPU throughput and nodes.

The arithmetic follows seed 000 (sizing a sandbox pool for one RL training run):
the effective trajectory rate comes from the budget and deadline, the inference
threshold from output tokens, sandboxes in flight from Little's law, and version lag
from the discrete release timeline of its appendix A1. Defaults are the seed's base case.

`dsec plan --simulate` then checks the node count in the simulator: bench/plan_check.py
plays the planned load through the control plane's scheduler and reports whether the
schedule-latency and queue-wait targets hold, and the node count at which they do (its
docstring says how the load is built, scaled and measured). This module holds the
arithmetic and its inputs and outputs only, the check's settings (SimulateSettings)
among them; the command (flags, table, the call to the simulator) is dsec/cli/plan.py.
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from dsec.baselines import POLICIES

SECONDS_PER_DAY = 86_400.0

# The seed fits its lognormal to the container lifetime p50 and p99 (DSec, figure 7).
SEED_LIFETIME_P50_S = 1_044.0
SEED_LIFETIME_P99_S = 13_900.0

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
    """Share of trajectories whose version lag exceeds cap (seed 000, appendix A1).

    Weights are released every cadence_s and a trajectory of duration W starts at a
    uniformly random phase, so its lag is floor(W / L + U) with U ~ Uniform(0, 1):
    its mean is exactly W / L, and P(lag > cap) = E[clip(W / L - cap, 0, 1)].
    """
    lag_mu = mu - math.log(cadence_s)
    return _lognormal_call(lag_mu, sigma, cap) - _lognormal_call(lag_mu, sigma, cap + 1)


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
    lifetime_p50_s: float | None = Field(None, gt=0, description="median occupancy")
    lifetime_p99_s: float | None = Field(None, gt=0, description="99th percentile occupancy")
    lifetime_mean_s: float | None = Field(None, gt=0, description="mean occupancy")
    sandboxes_per_node: int = Field(1_048, gt=0, description="node density")
    cadence_s: float = Field(600.0, gt=0, description="iteration period, L")
    lag_cap: int = Field(10, ge=0, description="largest tolerated version lag")

    @model_validator(mode="after")
    def _one_lifetime_description(self) -> Self:
        has_quantiles = self.lifetime_p50_s is not None or self.lifetime_p99_s is not None
        if has_quantiles and self.lifetime_mean_s is not None:
            raise ValueError(
                "give either --lifetime-p50-s with --lifetime-p99-s, or --lifetime-mean-s, not both"
            )
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


class PlanResult(BaseModel):
    """Every figure of the plan; `formulas` holds, per figure, how it was computed.

    Figures that need the lifetime median or its distribution are None when only a
    mean lifetime was given.
    """

    input: PlanInput
    trajectories_per_s: float
    raw_trajectories_per_s: float
    tokens_per_gpu_s_threshold_lossless: float
    tokens_per_gpu_s_threshold: float
    inference_demand_share: float
    gpus_needed: int
    lifetime_mean_s: float
    in_flight_median: float | None
    in_flight_mean: float
    in_flight_mean_raw: float
    nodes_median: int | None
    nodes_mean: int
    nodes_mean_raw: int
    version_lag_median: float | None
    version_lag_mean: float
    lag_over_cap_share: float | None
    time_slack_share: float
    formulas: dict[str, str]


def plan(inp: PlanInput) -> PlanResult:
    """Work out the capacity plan for inp; pure arithmetic, no I/O."""
    n, b, k, g = inp.iterations, inp.trajectories_per_iteration, inp.tokens_per_trajectory, inp.gpus
    a, p, density, cadence = inp.availability, inp.acceptance, inp.sandboxes_per_node, inp.cadence_s
    deadline_s = inp.days * SECONDS_PER_DAY
    output_tokens = n * b * k

    rate = n * b / deadline_s
    raw_rate = rate / p
    threshold_lossless = output_tokens / (deadline_s * g)
    # a shortens serving time and p wastes samples, so both divide the throughput needed.
    threshold = threshold_lossless / (a * p)
    gpus_needed = math.ceil(output_tokens / (deadline_s * inp.tokens_per_gpu_s * a * p))

    if inp.lifetime_mean_s is not None:
        mu = sigma = None
        median = None
        mean = inp.lifetime_mean_s
        mean_formula = "W̄ = --lifetime-mean-s (given)"
    else:
        median = inp.lifetime_p50_s
        mu, sigma = lognormal_from_median_p99(median, inp.lifetime_p99_s)
        mean = lognormal_mean(mu, sigma)
        mean_formula = (
            f"W̄ = exp(μ + σ²/2), μ = ln p50 = ln {median:g}, "
            f"σ = ln(p99/p50)/z₀.₉₉ = ln({inp.lifetime_p99_s:g}/{median:g})/{Z_99:.4f} "
            f"= {sigma:.4f}"
        )

    in_flight_median = rate * median if median is not None else None
    in_flight_mean = rate * mean
    # Scaling by 1/p assumes a rejected attempt occupies a sandbox as long as an accepted one.
    in_flight_mean_raw = raw_rate * mean

    formulas = {
        "trajectories_per_s": f"R = n·B / T = {n} × {b} / {deadline_s:,.0f} s",
        "raw_trajectories_per_s": f"R / p = {rate:.4f} / {p:g}",
        "tokens_per_gpu_s_threshold_lossless": (
            f"n·B·K / (T·G) = {n} × {b} × {k} / ({deadline_s:,.0f} s × {g})"
        ),
        "tokens_per_gpu_s_threshold": (
            f"n·B·K / (T·G·a·p) = {threshold_lossless:.2f} / ({a:g} × {p:g})"
        ),
        "inference_demand_share": (
            f"threshold / measured = {threshold:.2f} / {inp.tokens_per_gpu_s:g}"
        ),
        "gpus_needed": (
            f"⌈n·B·K / (T·x·a·p)⌉, x = {inp.tokens_per_gpu_s:g} tokens/s per GPU measured"
        ),
        "lifetime_mean_s": mean_formula,
        "in_flight_mean": f"Little: R × W̄ = {rate:.4f} × {mean:,.0f} s",
        "in_flight_mean_raw": f"Little: R/p × W̄ = {raw_rate:.4f} × {mean:,.0f} s",
        "nodes_mean": f"⌈R × W̄ / density⌉ = ⌈{in_flight_mean:,.0f} / {density}⌉",
        "nodes_mean_raw": f"⌈R/p × W̄ / density⌉ = ⌈{in_flight_mean_raw:,.0f} / {density}⌉",
        "version_lag_mean": f"W̄ / L = {mean:,.0f} s / {cadence:g} s",
        "time_slack_share": f"1 − n·L / T = 1 − {n} × {cadence:g} s / {deadline_s:,.0f} s",
    }
    unavailable = "needs --lifetime-p50-s and --lifetime-p99-s"
    if median is not None:
        formulas["in_flight_median"] = f"Little: R × p50 = {rate:.4f} × {median:,.0f} s"
        formulas["nodes_median"] = f"⌈R × p50 / density⌉ = ⌈{in_flight_median:,.0f} / {density}⌉"
        formulas["version_lag_median"] = f"p50 / L = {median:,.0f} s / {cadence:g} s"
        formulas["lag_over_cap_share"] = (
            f"P(⌊W/L + U⌋ > {inp.lag_cap}) = E[clip(W/L − {inp.lag_cap}, 0, 1)], "
            f"W ~ lognormal(μ, σ = {sigma:.4f}), U ~ Uniform(0, 1)"
        )
    else:
        for key in ("in_flight_median", "nodes_median", "version_lag_median"):
            formulas[key] = unavailable
        formulas["lag_over_cap_share"] = unavailable

    return PlanResult(
        input=inp,
        trajectories_per_s=rate,
        raw_trajectories_per_s=raw_rate,
        tokens_per_gpu_s_threshold_lossless=threshold_lossless,
        tokens_per_gpu_s_threshold=threshold,
        inference_demand_share=threshold / inp.tokens_per_gpu_s,
        gpus_needed=gpus_needed,
        lifetime_mean_s=mean,
        in_flight_median=in_flight_median,
        in_flight_mean=in_flight_mean,
        in_flight_mean_raw=in_flight_mean_raw,
        nodes_median=math.ceil(in_flight_median / density) if median is not None else None,
        nodes_mean=math.ceil(in_flight_mean / density),
        nodes_mean_raw=math.ceil(in_flight_mean_raw / density),
        version_lag_median=median / cadence if median is not None else None,
        version_lag_mean=mean / cadence,
        lag_over_cap_share=(
            lag_over_cap_share(mu, sigma, cadence, inp.lag_cap) if mu is not None else None
        ),
        time_slack_share=1 - n * cadence / deadline_s,
        formulas=formulas,
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
