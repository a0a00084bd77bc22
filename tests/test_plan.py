"""The capacity planner against the hand calculation of seed 000."""

import argparse
import json
import math

import pytest
from pydantic import ValidationError

from dsec.plan import (
    PlanInput,
    add_plan_arguments,
    lag_over_cap_share,
    lognormal_from_median_p99,
    lognormal_mean,
    plan,
    render_table,
    run_plan,
)

CONTRACT_KEYS = {
    "trajectories_per_s",
    "raw_trajectories_per_s",
    "tokens_per_gpu_s_threshold",
    "in_flight_median",
    "in_flight_mean",
    "nodes_median",
    "nodes_mean",
    "version_lag_mean",
    "lag_over_cap_share",
}


@pytest.fixture
def base_case():
    return plan(PlanInput())


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dsec plan")
    add_plan_arguments(parser)
    return parser.parse_args(argv)


# --- the seed's base case: 1,000 x 4,096 trajectories in one week ---


def test_trajectory_rate_is_6_77_per_second(base_case):
    # 4,096,000 / 604,800 s = 6.7725
    assert base_case.trajectories_per_s == pytest.approx(6.7725, abs=5e-4)
    assert base_case.raw_trajectories_per_s == pytest.approx(6.7725 / 0.8, abs=5e-4)


def test_lossless_gpu_threshold_is_73_97(base_case):
    assert base_case.tokens_per_gpu_s_threshold_lossless == pytest.approx(73.97, abs=5e-3)


def test_gpu_threshold_with_availability_and_acceptance_is_about_103(base_case):
    # 73.97 / (0.9 x 0.8) = 102.74, which the seed rounds to 103
    assert base_case.tokens_per_gpu_s_threshold == pytest.approx(103, abs=0.5)


def test_threshold_without_losses_equals_the_lossless_one():
    result = plan(PlanInput(availability=1, acceptance=1))
    assert result.tokens_per_gpu_s_threshold == pytest.approx(73.97, abs=5e-3)


def test_median_occupancy_gives_about_7100_in_flight_on_7_nodes(base_case):
    assert base_case.in_flight_median == pytest.approx(7_100, rel=0.01)
    assert base_case.nodes_median == 7


def test_lognormal_fit_has_mean_near_1900_s():
    mu, sigma = lognormal_from_median_p99(1_044, 13_900)
    assert math.exp(mu) == pytest.approx(1_044)
    assert sigma == pytest.approx(1.113, abs=1e-3)
    assert lognormal_mean(mu, sigma) == pytest.approx(1_900, rel=0.03)


def test_mean_occupancy_gives_about_13000_in_flight_on_13_nodes(base_case):
    assert base_case.lifetime_mean_s == pytest.approx(1_900, rel=0.03)
    assert base_case.in_flight_mean == pytest.approx(13_000, rel=0.02)
    assert base_case.nodes_mean == 13


def test_raw_rate_in_flight_matches_the_seeds_16_nodes(base_case):
    # the seed: with p = 0.8, about 16,100 in flight and 16 nodes
    assert base_case.in_flight_mean_raw == pytest.approx(16_100, rel=0.03)
    assert base_case.nodes_mean_raw == 16


def test_500_s_cadence_matches_the_seeds_19_nodes():
    # the seed: a 500 s cadence needs 8.19 effective, ~10.2 raw trajectories/s, 19 nodes
    result = plan(PlanInput(days=1_000 * 500 / 86_400, cadence_s=500))
    assert result.trajectories_per_s == pytest.approx(8.19, abs=0.01)
    assert result.raw_trajectories_per_s == pytest.approx(10.2, abs=0.05)
    assert result.nodes_mean_raw == 19


def test_version_lag_at_600_s_is_1_7_from_median_and_3_2_from_mean(base_case):
    assert base_case.version_lag_median == pytest.approx(1.7, abs=0.05)
    assert base_case.version_lag_mean == pytest.approx(3.2, abs=0.05)


@pytest.mark.parametrize(
    ("cadence_s", "cap", "seed_share", "seed_group_bound"),
    [
        (600, 4, 0.20, 0.83),  # "约两成", group bound 1 - 0.8^8
        (600, 10, 0.05, 0.35),  # "约 5%", group bound "约 35%"
        (500, 10, 0.07, 0.46),  # "约 7%", group bound "约 46%"
    ],
)
def test_lag_over_cap_share_matches_the_seed(cadence_s, cap, seed_share, seed_group_bound):
    result = plan(PlanInput(cadence_s=cadence_s, lag_cap=cap))
    assert result.lag_over_cap_share == pytest.approx(seed_share, abs=0.005)
    # a group of 8 is dropped when any of its trajectories is, if they are independent
    group_share = 1 - (1 - result.lag_over_cap_share) ** 8
    assert group_share == pytest.approx(seed_group_bound, abs=0.01)


def test_lag_over_cap_share_lies_between_the_continuous_bounds():
    mu, sigma = lognormal_from_median_p99(1_044, 13_900)
    share = lag_over_cap_share(mu, sigma, cadence_s=600, cap=4)

    def duration_over(multiple: float) -> float:
        z = (math.log(multiple * 600) - mu) / sigma
        return 0.5 * math.erfc(z / math.sqrt(2))

    assert duration_over(5) < share < duration_over(4)


def test_time_slack_at_600_s_is_80_minutes_of_the_week(base_case):
    assert base_case.time_slack_share * 604_800 == pytest.approx(80 * 60)


def test_gpu_gap_at_60_tokens_per_s_is_about_700():
    result = plan(PlanInput(tokens_per_gpu_s=60, availability=1, acceptance=1))
    assert result.gpus_needed - 3_000 == pytest.approx(700, abs=5)


def test_mean_lifetime_alone_leaves_median_figures_empty():
    result = plan(PlanInput(lifetime_mean_s=1_900))
    assert result.in_flight_mean == pytest.approx(6.7725 * 1_900, rel=1e-3)
    assert result.in_flight_median is None
    assert result.nodes_median is None
    assert result.lag_over_cap_share is None


# --- bad input ---


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("iterations", -1),
        ("trajectories_per_iteration", 0),
        ("gpus", -3_000),
        ("sandboxes_per_node", 0),
        ("days", 0),
        ("tokens_per_gpu_s", -5.0),
        ("cadence_s", 0),
        ("availability", 0),
        ("availability", 1.1),
        ("acceptance", 0),
        ("acceptance", 1.5),
        ("days", math.inf),
    ],
)
def test_out_of_range_values_are_refused(field, value):
    with pytest.raises(ValidationError, match=field):
        PlanInput(**{field: value})


def test_p99_below_median_is_refused():
    with pytest.raises(ValidationError, match="--lifetime-p99-s .* is below --lifetime-p50-s"):
        PlanInput(lifetime_p50_s=2_000, lifetime_p99_s=1_000)


def test_mean_with_quantiles_is_refused():
    with pytest.raises(ValidationError, match="not both"):
        PlanInput(lifetime_p50_s=1_044, lifetime_p99_s=13_900, lifetime_mean_s=1_900)


def test_median_without_p99_is_refused():
    with pytest.raises(ValidationError, match="must be given together"):
        PlanInput(lifetime_p50_s=1_044)


def test_lognormal_fit_refuses_p99_below_median():
    with pytest.raises(ValueError, match="median <= p99"):
        lognormal_from_median_p99(2_000, 1_000)


# --- output ---


def test_result_json_has_the_contract_keys(base_case):
    dumped = json.loads(base_case.model_dump_json())
    assert CONTRACT_KEYS <= dumped.keys()
    assert CONTRACT_KEYS <= dumped["formulas"].keys()


def test_table_prints_every_figure_with_its_formula(base_case):
    table = render_table(base_case)
    assert "6.77" in table
    assert "102.74" in table
    assert "R = n·B / T" in table
    assert len(table.splitlines()) == len(base_case.formulas)


def test_run_plan_prints_the_table(capsys):
    assert run_plan(parse([])) == 0
    out = capsys.readouterr().out
    assert "effective trajectories/s" in out
    assert "13,133" in out


def test_run_plan_prints_json_with_flags_applied(capsys):
    assert run_plan(parse(["--json", "--days", "14", "--sandboxes-per-node", "3200"])) == 0
    dumped = json.loads(capsys.readouterr().out)
    assert CONTRACT_KEYS <= dumped.keys()
    assert dumped["trajectories_per_s"] == pytest.approx(6.7725 / 2, abs=5e-4)
    assert dumped["input"]["sandboxes_per_node"] == 3_200


def test_run_plan_reports_bad_input_on_one_line_and_returns_2(capsys):
    assert run_plan(parse(["--iterations", "-5", "--acceptance", "1.5"])) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    error = captured.err.strip()
    assert "\n" not in error
    assert error.startswith("dsec plan: ")
    assert "--iterations" in error and "--acceptance" in error
    assert "Traceback" not in error


def test_run_plan_reports_p99_below_median(capsys):
    args = parse(["--lifetime-p50-s", "2000", "--lifetime-p99-s", "1000", "--json"])
    assert run_plan(args) == 2
    assert "below --lifetime-p50-s" in capsys.readouterr().err
