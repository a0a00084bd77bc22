"""The capacity planner against the hand calculation of seed 000, and its check in the
simulator (`dsec plan --simulate`)."""

import argparse
import json
import math
import subprocess
import sys

import pytest
from pydantic import ValidationError

from bench.plan_check import (
    POPULATION_PREFIX,
    check_plan,
    measure,
    scaled_load,
    search_nodes,
    steady_state_trace,
)
from bench.records import EpisodeRecord, RunResult, TimelineSample
from dsec.cli.plan import add_plan_arguments, render_table, run_plan
from dsec.plan import (
    PlanInput,
    SimulateSettings,
    lag_over_cap_share,
    lognormal_from_median_p99,
    lognormal_mean,
    plan,
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


# --- dsec plan --simulate: the plan in the simulator ---
# A small load: 0.35 trajectories/s of lifetimes p50 60 s / p99 600 s on 20-slot nodes,
# about 34 in flight, so the arithmetic asks for 2 nodes (40 slots): too tight to keep
# requests from waiting, while 3 nodes leave room.

SMALL_INPUT = {
    "iterations": 10,
    "trajectories_per_iteration": 300,
    "days": 0.1,
    "lifetime_p50_s": 60,
    "lifetime_p99_s": 600,
    "sandboxes_per_node": 20,
}
SMALL_PLAN = [part for k, v in SMALL_INPUT.items() for part in ("--" + k.replace("_", "-"), str(v))]
SMALL_SIM = {"warmup_s": 300, "window_s": 600}


def small_plan():
    return plan(PlanInput(**SMALL_INPUT))


@pytest.fixture(scope="module")
def small_check():
    return check_plan(small_plan(), SimulateSettings(**SMALL_SIM))


def without_wall_time(check) -> dict:
    dumped = check.model_dump()
    for run in dumped["runs"]:
        del run["wall_s"]
    return dumped


def test_simulation_finds_the_planned_count_too_small_and_the_next_one_enough(small_check):
    runs = {run.nodes: run for run in small_check.runs}
    assert small_check.planned_nodes == small_check.start_nodes == 2
    assert not small_check.start_meets_targets
    missed, met = runs[2], runs[3]
    assert missed.schedule_p99_ms >= 500 or missed.queue_wait_share >= 0.10
    assert not missed.meets_targets
    assert met.schedule_p99_ms < 500 and met.queue_wait_share < 0.10
    assert met.meets_targets
    assert small_check.nodes_needed == 3 and small_check.nodes_needed_is_smallest
    assert "smallest count that meets them: 3" in small_check.conclusion


def test_simulation_reports_what_the_measured_requests_saw(small_check):
    assert small_check.slots_per_node == 20 and small_check.sim_scale == 1
    assert small_check.in_flight_little == pytest.approx(34, abs=1)
    for run in small_check.runs:
        # about 0.35/s over the 600 s window: Poisson, far inside 5 standard deviations
        assert abs(run.measured_requests - 208) < 5 * math.sqrt(208)
        assert sum(run.paths.values()) + run.unserved_at_end == run.measured_requests
        # leases never outnumber the slots, and Little's law holds where nothing waits
        assert run.in_flight_peak <= run.nodes * small_check.slots_per_node
        assert run.population_waiting_at_start == 0  # the warm-up was long enough
    assert small_check.runs[-1].in_flight_mean == pytest.approx(34, rel=0.35)


def test_the_search_from_above_finds_the_smallest_count_and_the_miss_below_it():
    check = check_plan(small_plan(), SimulateSettings(**SMALL_SIM, nodes=5))
    runs = {run.nodes: run for run in check.runs}
    assert check.start_nodes == 5 and check.start_meets_targets
    assert check.nodes_needed == 3 and check.nodes_needed_is_smallest
    assert runs[3].meets_targets and not runs[2].meets_targets
    assert set(runs) == {5, 4, 2, 3}  # down 1, then 2 more, then bisected


def test_a_simulation_is_the_same_for_the_same_seed(small_check):
    again = check_plan(small_plan(), SimulateSettings(**SMALL_SIM))
    assert without_wall_time(again) == without_wall_time(small_check)


def test_the_trace_starts_in_steady_state_and_stays_there():
    mu, sigma = lognormal_from_median_p99(60, 600)
    trace, lifetimes = steady_state_trace(20.0, mu, sigma, warmup_s=200, end_s=1000, seed=4)
    little = 20.0 * lognormal_mean(mu, sigma)  # ~1,960 in flight
    population = [e for e in trace if e.episode.startswith(POPULATION_PREFIX)]
    arrivals = [e for e in trace if not e.episode.startswith(POPULATION_PREFIX)]
    # Poisson(rate x mean lifetime) acquire before 100 s and are all held then, when the
    # planned arrivals begin
    assert abs(len(population) - little) < 5 * math.sqrt(little)
    assert all(e.arrival_s < 100 <= e.arrival_s + lifetimes[e.episode] for e in population)
    assert min(e.arrival_s for e in arrivals) >= 100
    assert abs(len(arrivals) - 20 * 900) < 5 * math.sqrt(20 * 900)
    # in flight stays at Little's count: the residual lifetimes are the equilibrium ones
    for t in range(100, 1000, 100):
        held = sum(1 for e in trace if e.arrival_s <= t < e.arrival_s + lifetimes[e.episode])
        assert abs(held - little) < 5 * math.sqrt(little), t
    # holds end with the run; the occupancy measured against is the whole lifetime
    assert all(e.arrival_s + e.lifetime_s <= 1000 + 1e-6 for e in trace)
    assert sorted(lifetimes[e.episode] for e in arrivals)[len(arrivals) // 2] == pytest.approx(
        60, rel=0.1
    )


def test_a_request_still_waiting_at_the_end_counts_its_wait_so_far():
    def record(n: int, requested_at_s: float, acquired_at_s: float | None) -> EpisodeRecord:
        return EpisodeRecord(
            episode=f"e{n}", pool="default", template="base", arrival_s=requested_at_s,
            requested_at_s=requested_at_s, acquired_at_s=acquired_at_s,
            schedule_ms=None if acquired_at_s is None else (acquired_at_s - requested_at_s) * 1e3,
            path=None if acquired_at_s is None else "warm",
        )  # fmt: skip

    served = [record(n, 100.0 + n, 100.005 + n) for n in range(98)]
    # one waits until after the end (the run's drain), one is never served
    late = [record(98, 150.0, 400.0), record(99, 160.0, None)]
    # the warm-up's population, not measured: one got its sandbox only after 100 s
    population = [record(n, 10.0, 20.0) for n in range(100, 103)] + [record(103, 10.0, 101.0)]
    for n, sandboxed in enumerate(population, start=100):
        sandboxed.episode = f"{POPULATION_PREFIX}{n}"
    timeline = [TimelineSample(t, 0, {}, 5, 5) for t in range(100, 300)]
    result = RunResult(population + served + late, timeline, {}, 0.0, {}, {"wall_s": 0.1})
    lifetimes = {f"e{n}": 100.0 for n in range(100)}
    run = measure(result, 1, lifetimes, start_s=100, stop_s=200, end_s=260)
    assert run.population_waiting_at_start == 1
    assert run.measured_requests == 100 and run.unserved_at_end == 2
    assert run.paths == {"warm": 98}
    # nearest-rank p99 of 100: the 99th value, the shorter of the two censored waits
    assert run.schedule_p99_ms == pytest.approx(100_000)
    waited = 98 * 0.005 + 110 + 100
    assert run.queue_wait_share == pytest.approx(waited / (waited + 100 * 100.0), abs=1e-6)
    assert not run.meets_targets
    assert run.in_flight_peak == 5 and run.in_flight_mean == 5


@pytest.mark.parametrize(
    ("threshold", "start", "lowest", "max_runs", "found", "calls"),
    [
        (13, 13, 13, 8, (13, True), [13]),  # fewer than `lowest` is refused without a call
        (13, 13, 1, 8, (13, True), [13, 12]),
        (13, 1, 1, 8, (13, True), [1, 2, 4, 8, 16, 12, 14, 13]),
        (13, 20, 1, 8, (13, True), [20, 19, 17, 13, 5, 9, 11, 12]),
        (13, 40, 1, 3, (37, False), [40, 39, 37]),  # out of runs before the miss below
        (100, 1, 1, 4, (None, False), [1, 2, 4, 8]),  # out of runs before any meet
    ],
)
def test_search_gallops_then_bisects_within_the_cap(
    threshold, start, lowest, max_runs, found, calls
):
    asked = []

    def meets(nodes: int) -> bool:  # stands for a simulation: enough nodes meet the targets
        asked.append(nodes)
        return nodes >= threshold

    assert search_nodes(meets, start, lowest, max_runs) == found
    assert asked == calls


def test_automatic_scale_simulates_at_most_20000_in_flight():
    assert scaled_load(13_133, 1_048, None) == (1.0, 1_048)
    scale, slots = scaled_load(380_000, 3_200, None)
    assert slots == round(3_200 * 20_000 / 380_000)
    assert scale * 380_000 == pytest.approx(20_000, rel=0.01)
    assert scaled_load(13_133, 1_048, 0.1) == (105 / 1_048, 105)


def test_table_and_json_carry_the_simulation(capsys):
    assert run_plan(parse([*SMALL_PLAN, "--simulate", "--warmup-s", "300", "--window-s", "600",
                           "--nodes", "3"])) == 0  # fmt: skip
    captured = capsys.readouterr()
    assert "nodes by arithmetic: 2; by simulation: 3" in captured.out
    assert "effective trajectories/s" in captured.out
    assert "3 nodes: p99" in captured.err  # progress, off stdout

    args = [*SMALL_PLAN, "--simulate", "--json", "--warmup-s", "300", "--window-s", "600",
            "--nodes", "3", "--seed", "5"]  # fmt: skip
    assert run_plan(parse(args)) == 0
    dumped = json.loads(capsys.readouterr().out)
    assert CONTRACT_KEYS <= dumped.keys()
    simulation = dumped["simulation"]
    assert simulation["seed"] == 5 and simulation["policy"] == "dsec"
    assert simulation["nodes_needed"] == 3
    assert [run["nodes"] for run in simulation["runs"]] == [2, 3]
    assert simulation["targets"] == {"schedule_p99_ms_below": 500, "queue_wait_share_below": 0.1}


@pytest.mark.parametrize(
    ("flags", "complaint"),
    [
        (["--sim-scale", "0"], "--sim-scale: Input should be greater than 0"),
        (["--sim-scale", "1.5"], "--sim-scale: Input should be less than or equal to 1"),
        (["--sim-scale", "nan"], "--sim-scale: Input should be a finite number"),
        (["--sim-scale", "0.0001"], "--sim-scale 0.0001 leaves no slot"),
        (["--nodes", "0"], "--nodes: Input should be greater than 0"),
        (["--nodes", "-3"], "--nodes: Input should be greater than 0"),
        (["--policy", "fastest"], "--policy: unknown policy; known: cold, dsec"),
        (["--load", "peak"], "--load: Input should be 'effective' or 'raw'"),
        (["--max-runs", "0"], "--max-runs: Input should be greater than or equal to 1"),
        (["--warmup-s", "-1"], "--warmup-s: Input should be greater than 0"),
        (["--window-s", "10"], "too few for a p99"),
    ],
)
def test_bad_simulation_flags_are_refused_on_one_line(capsys, flags, complaint):
    assert run_plan(parse(["--simulate", *flags])) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert complaint in captured.err
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err


def test_simulation_flags_without_simulate_are_refused(capsys):
    assert run_plan(parse(["--policy", "kpa", "--seed", "3"])) == 2
    assert "--policy, --seed only apply with --simulate" in capsys.readouterr().err


def test_the_command_line_exits_2_on_a_bad_node_count():
    done = subprocess.run(
        [sys.executable, "-m", "dsec.cli", "plan", "--simulate", "--nodes", "0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.strip() == "dsec plan: --nodes: Input should be greater than 0 (got 0)"
