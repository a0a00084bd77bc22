"""The capacity planner against the hand calculation of DSec's capacity study, and its check in the
simulator (`dsec plan --simulate`)."""

import argparse
import json
import math
import random
import subprocess
import sys
from decimal import ROUND_HALF_UP, Decimal

import pytest
from pydantic import ValidationError

from bench.plan_check import (
    POPULATION_PREFIX,
    SEED_CASES,
    VersionModel,
    check_plan,
    measure,
    render_check,
    scaled_load,
    search_nodes,
    steady_state_trace,
    tally_lags,
)
from bench.records import EpisodeRecord, RunResult, TimelineSample
from dsec.cli.plan import add_plan_arguments, render_table, run_plan
from dsec.plan import (
    PlanInput,
    SimulateSettings,
    lag_over_cap_share,
    lag_split,
    lognormal_from_median_p99,
    lognormal_mean,
    plan,
    whole,
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


# --- the capacity study, figure by figure ---
# Each row: the seed's section, the quantity, the seed's words, the plan's inputs, the
# figure, the seed's value and the decimal places the seed rounds it to (negative: tens,
# hundreds, ...; 1.61万 is 16,100 to the hundred). The seed fits its lognormal to p50
# 1,044 s and p99 13,900 s, rounds the fit's mean (1,939 s) to 1,900 s and carries that
# on; SEED_MEAN gives the plan that mean beside the fit, as the seed computes. Where the
# seed reasons without losses (a = p = 1), LOSSLESS says so.

SEED_MEAN = {"lifetime_p50_s": 1_044, "lifetime_p99_s": 13_900, "lifetime_mean_s": 1_900}
LOSSLESS = {"availability": 1, "acceptance": 1}
MICROVM_P99 = {"lifetime_p50_s": 1_044, "lifetime_p99_s": 12_800}


def seed_rounded(value: float, places: int) -> float:
    """value rounded half away from zero (as the seed rounds) to `places` decimals."""
    return float(Decimal(repr(value)).quantize(Decimal(1).scaleb(-places), ROUND_HALF_UP))


def row(result, tokens_per_gpu_s: float):
    return next(r for r in result.sensitivity if r.tokens_per_gpu_s == tokens_per_gpu_s)


def density(nodes_at_densities, sandboxes_per_node: int):
    return next(d for d in nodes_at_densities if d.sandboxes_per_node == sandboxes_per_node)


def percent(share: float) -> float:
    return 100 * share


# fmt: off
SEED_FIGURES = [
    # opening and section 1: the demand
    ("1", "trajectories in the run", "整轮约 410 万条", {},
     lambda r: r.trajectories_total, 4_100_000, -4),
    ("1", "effective trajectories/s", "平均每秒需要交付 6.8 条", {},
     lambda r: r.trajectories_per_s, 6.8, 1),
    # section 2: the inference threshold
    ("2", "tokens/s per GPU, lossless", "≈ 73.97", {},
     lambda r: r.tokens_per_gpu_s_threshold_lossless, 73.97, 2),
    ("2", "tokens/s per GPU, lossless", "约为 74 token/s/卡", {},
     lambda r: r.tokens_per_gpu_s_threshold_lossless, 74, 0),
    ("2", "demand / nominal capacity at 200, %", "需求约占标称产能的 37%", {},
     lambda r: percent(r.inference_demand_share_lossless), 37, 0),
    ("2", "demand / nominal capacity at 200, % (sensitivity row)", "约占 37%", {},
     lambda r: percent(row(r, 200).inference_demand_share_lossless), 37, 0),
    ("2", "tokens/s per GPU with a = 0.9, p = 0.8", "73.97 ÷（0.9 × 0.8）≈ 103", {},
     lambda r: r.tokens_per_gpu_s_threshold, 103, 0),
    # section 3: sandboxes in flight and nodes
    ("3", "in flight, median occupancy", "约 7,100 个在途环境", {},
     lambda r: r.in_flight_median, 7_100, -2),
    ("3", "p99 / p50 occupancy", "p99 约为中位数的 13 倍", {},
     lambda r: r.input.lifetime_p99_s / r.input.lifetime_p50_s, 13, 0),
    ("3", "mean occupancy of the p50/p99 fit, s", "平均占用约 1,900 秒", {},
     lambda r: r.lifetime_mean_s, 1_900, -2),
    ("3", "in flight, mean occupancy", "平均在途量约 1.3 万个", SEED_MEAN,
     lambda r: r.in_flight_mean, 13_000, -3),
    ("3", "in flight, mean over median", "接近基线的两倍", SEED_MEAN,
     lambda r: r.in_flight_mean / r.in_flight_median, 2, 0),
    ("3", "tokens/s a stream, median occupancy", "≈ 单流 31 token/s", {},
     lambda r: r.decode_tokens_per_s_median, 31, 0),
    ("3", "tokens/s a stream, mean occupancy", "按均值 1,900 秒则约 17 token/s", SEED_MEAN,
     lambda r: r.decode_tokens_per_s_mean, 17, 0),
    ("3", "cores of an average DSec node", "平均每节点约 188 核", {},
     lambda r: r.dsec_node_cores, 188, 0),
    ("3", "memory of an average DSec node, TB", "1.56TB 内存", {},
     lambda r: r.dsec_node_memory_tb, 1.56, 2),
    ("3", "nodes at 1,048, median occupancy", "约需 7 台", {},
     lambda r: r.nodes_median, 7, 0),
    ("3", "nodes at 1,048, mean occupancy", "约需 13 台", SEED_MEAN,
     lambda r: r.nodes_mean, 13, 0),
    ("3", "nodes at 3,200, median occupancy", "只需 3 到 5 台", {},
     lambda r: density(r.nodes_at_densities, 3_200).nodes_median, 3, 0),
    ("3", "nodes at 3,200, mean occupancy", "只需 3 到 5 台", SEED_MEAN,
     lambda r: density(r.nodes_at_densities, 3_200).nodes_mean, 5, 0),
    ("3", "in flight at the raw rate R/p", "在途量约 1.61 万", SEED_MEAN,
     lambda r: r.in_flight_mean_raw, 16_100, -2),
    ("3", "nodes at the raw rate", "约需 16 台", SEED_MEAN,
     lambda r: r.nodes_mean_raw, 16, 0),
    ("3", "effective trajectories/s at a 500 s cadence", "有效供给提到每秒 8.19 条",
     {"cadence_s": 500}, lambda r: r.trajectories_per_s, 8.19, 2),
    ("3", "raw trajectories/s at a 500 s cadence", "原始生成率约 10.2 条",
     {"cadence_s": 500}, lambda r: r.raw_trajectories_per_s, 10.2, 1),
    ("3", "in flight at 500 s, raw rate", "在途约 1.95 万", {"cadence_s": 500, **SEED_MEAN},
     lambda r: r.in_flight_mean_raw, 19_500, -2),
    ("3", "nodes at 500 s, raw rate", "约需 19 台", {"cadence_s": 500, **SEED_MEAN},
     lambda r: r.nodes_mean_raw, 19, 0),
    # section 4: cadence, slack and consistency
    ("4", "output tokens/s in a week", "一周输出需求约 22.2 万 token/s", {},
     lambda r: r.output_tokens_per_s, 222_000, -3),
    ("4", "GPU gap at 60 tokens/s", "推理侧缺口约 700 张", {"tokens_per_gpu_s": 60, **LOSSLESS},
     lambda r: r.gpu_gap, 700, -2),
    ("4", "GPU gap at 60 tokens/s (sensitivity row)", "缺口约 700 张", LOSSLESS,
     lambda r: row(r, 60).gpus_needed - r.input.gpus, 700, -2),
    ("4", "training GPUs left", "训练侧随之降到约 6,300 张", {"tokens_per_gpu_s": 60, **LOSSLESS},
     lambda r: r.training_gpus_after_gap, 6_300, -2),
    ("4", "update time stretch, %", "会拉长约 11%", {"tokens_per_gpu_s": 60, **LOSSLESS},
     lambda r: percent(r.update_time_stretch), 11, 0),
    ("4", "run time at 600 s, s", "1,000 轮需要 600,000 秒", {"cadence_s": 600},
     lambda r: r.run_time_s, 600_000, 0),
    ("4", "slack at 600 s, minutes", "一周还剩 80 分钟", {"cadence_s": 600},
     lambda r: r.time_slack_s / 60, 80, 0),
    ("4", "slack at 500 s, %", "名义时间余量提高到约 17.3%", {"cadence_s": 500},
     lambda r: percent(r.time_slack_share), 17.3, 1),
    ("4", "effective trajectories/s at 500 s", "每秒要有 8.19 条有效轨迹", {"cadence_s": 500},
     lambda r: r.trajectories_per_s, 8.19, 2),
    ("4", "rate above the deadline's at 500 s, %", "比基线高约 21%", {"cadence_s": 500},
     lambda r: percent(r.rate_over_deadline_share), 21, 0),
    ("4", "tokens/s per GPU at 500 s, lossless", "每卡约 89.5 token/s", {"cadence_s": 500},
     lambda r: r.tokens_per_gpu_s_threshold_lossless, 89.5, 1),
    ("4", "in flight at 500 s, median occupancy", "增加到约 8,550 个", {"cadence_s": 500},
     lambda r: r.in_flight_median, 8_550, -1),
    ("4", "in flight at 500 s, mean occupancy", "按均值粗估约 1.56 万",
     {"cadence_s": 500, **SEED_MEAN}, lambda r: r.in_flight_mean, 15_600, -2),
    ("4", "share over lag cap 4 at 600 s", "约两成轨迹会超限", {"cadence_s": 600, "lag_cap": 4},
     lambda r: r.lag_over_cap_share, 0.2, 1),
    ("4", "share over lag cap 10 at 600 s, %", "取 10 时降到约 5%", {"cadence_s": 600},
     lambda r: percent(r.lag_over_cap_share), 5, 0),
    ("4", "share over lag cap 10 at 500 s, %", "500 秒节拍下约 7%", {"cadence_s": 500},
     lambda r: percent(r.lag_over_cap_share), 7, 0),
    ("4", "groups over cap 10 at 600 s, lower bound, %", "组级比例在 5% 到约 35% 之间",
     {"cadence_s": 600}, lambda r: percent(r.group_over_cap_share_lower), 5, 0),
    ("4", "groups over cap 10 at 600 s, upper bound, %", "组级比例在 5% 到约 35% 之间",
     {"cadence_s": 600}, lambda r: percent(r.group_over_cap_share_upper), 35, 0),
    ("4", "groups over cap 10 at 500 s, lower bound, %", "500 秒节拍为 7% 到约 46%",
     {"cadence_s": 500}, lambda r: percent(r.group_over_cap_share_lower), 7, 0),
    ("4", "groups over cap 10 at 500 s, upper bound, %", "500 秒节拍为 7% 到约 46%",
     {"cadence_s": 500}, lambda r: percent(r.group_over_cap_share_upper), 46, 0),
    ("4", "groups over cap 4 at 600 s, upper bound, %", "组级上界约为 83%（1 − 0.8⁸）",
     {"cadence_s": 600, "lag_cap": 4}, lambda r: percent(r.group_over_cap_share_upper), 83, 0),
    ("4", "version lag at 600 s, median occupancy", "按中位寿命约 1.7", {"cadence_s": 600},
     lambda r: r.version_lag_median, 1.7, 1),
    ("4", "version lag at 600 s, mean occupancy", "按均值粗估约 3.2",
     {"cadence_s": 600, **SEED_MEAN}, lambda r: r.version_lag_mean, 3.2, 1),
    ("4", "container p99 lifetime, hours", "约 3.9 小时", {},
     lambda r: r.input.lifetime_p99_s / 3_600, 3.9, 1),
    ("4", "microVM p99 lifetime, hours", "约 3.6 小时", MICROVM_P99,
     lambda r: r.input.lifetime_p99_s / 3_600, 3.6, 1),
    ("4", "release periods of the container p99 at 600 s", "约 23 个发布周期",
     {"cadence_s": 600}, lambda r: r.release_periods_p99, 23, 0),
    ("4", "release periods of the microVM p99 at 600 s", "约 21 个发布周期",
     {"cadence_s": 600, **MICROVM_P99}, lambda r: r.release_periods_p99, 21, 0),
    # appendix A1: the discrete lag
    ("A1", "P(lag 1) of a 1,044 s trajectory at 600 s, quarters", "版本差为 1 的概率约四分之一",
     {"cadence_s": 600}, lambda r: 4 * r.version_lag_at_median[1], 1, 0),
    ("A1", "P(lag 2) of a 1,044 s trajectory at 600 s, quarters", "为 2 的约四分之三",
     {"cadence_s": 600}, lambda r: 4 * r.version_lag_at_median[2], 3, 0),
    ("A1", "batch interval at 200 tokens/s, s", "224 秒", LOSSLESS,
     lambda r: row(r, 200).capacity_cadence_s, 224, 0),
    ("A1", "batch interval at 60 tokens/s, s", "746 秒", LOSSLESS,
     lambda r: row(r, 60).capacity_cadence_s, 746, 0),
    ("A1", "version lag at 224 s, median occupancy", "224 秒约 4.7", LOSSLESS,
     lambda r: row(r, 200).version_lag_median, 4.7, 1),
    ("A1", "version lag at 746 s, median occupancy", "746 秒约 1.4", LOSSLESS,
     lambda r: row(r, 60).version_lag_median, 1.4, 1),
    ("A1", "version lag at 224 s, mean occupancy", "三档分别约 3.2、8.5、2.5",
     {**LOSSLESS, **SEED_MEAN}, lambda r: row(r, 200).version_lag_mean, 8.5, 1),
    ("A1", "version lag at 746 s, mean occupancy", "三档分别约 3.2、8.5、2.5",
     {**LOSSLESS, **SEED_MEAN}, lambda r: row(r, 60).version_lag_mean, 2.5, 1),
    # appendix A2: sensitivity to tokens/s per GPU, the rate following the GPUs
    ("A2", "in flight at 1,000 tokens/s, median occupancy", "约 9.6 万", LOSSLESS,
     lambda r: row(r, 1_000).in_flight_median, 96_000, -3),
    ("A2", "in flight at 2,000 tokens/s, median occupancy", "19.1 万", LOSSLESS,
     lambda r: row(r, 2_000).in_flight_median, 191_000, -3),
    ("A2", "in flight at 1,000 tokens/s, mean occupancy", "约 17.4 万", {**LOSSLESS, **SEED_MEAN},
     lambda r: row(r, 1_000).in_flight_mean, 174_000, -3),
    ("A2", "in flight at 2,000 tokens/s, mean occupancy", "34.8 万", {**LOSSLESS, **SEED_MEAN},
     lambda r: row(r, 2_000).in_flight_mean, 348_000, -3),
    ("A2", "node equivalents at 1,048, 1,000 tokens/s, median", "约 91", LOSSLESS,
     lambda r: density(row(r, 1_000).nodes_at_densities, 1_048).node_equivalents_median, 91, 0),
    ("A2", "node equivalents at 1,048, 2,000 tokens/s, median", "182", LOSSLESS,
     lambda r: density(row(r, 2_000).nodes_at_densities, 1_048).node_equivalents_median, 182, 0),
    ("A2", "node equivalents at 3,200, 1,000 tokens/s, median", "约 30", LOSSLESS,
     lambda r: density(row(r, 1_000).nodes_at_densities, 3_200).node_equivalents_median, 30, 0),
    ("A2", "node equivalents at 3,200, 2,000 tokens/s, median", "60", LOSSLESS,
     lambda r: density(row(r, 2_000).nodes_at_densities, 3_200).node_equivalents_median, 60, 0),
    ("A2", "node equivalents at 1,048, 1,000 tokens/s, mean", "约 166", {**LOSSLESS, **SEED_MEAN},
     lambda r: density(row(r, 1_000).nodes_at_densities, 1_048).node_equivalents_mean, 166, 0),
    ("A2", "node equivalents at 1,048, 2,000 tokens/s, mean", "332", {**LOSSLESS, **SEED_MEAN},
     lambda r: density(row(r, 2_000).nodes_at_densities, 1_048).node_equivalents_mean, 332, 0),
    ("A2", "node equivalents at 3,200, 1,000 tokens/s, mean", "约 54", {**LOSSLESS, **SEED_MEAN},
     lambda r: density(row(r, 1_000).nodes_at_densities, 3_200).node_equivalents_mean, 54, 0),
    ("A2", "node equivalents at 3,200, 2,000 tokens/s, mean", "109", {**LOSSLESS, **SEED_MEAN},
     lambda r: density(row(r, 2_000).nodes_at_densities, 3_200).node_equivalents_mean, 109, 0),
    ("A2", "fastest cadence at 60 tokens/s in two weeks, s", "迭代周期可落到 746 秒以上",
     {"days": 14, "tokens_per_gpu_s": 60, **LOSSLESS}, lambda r: r.capacity_cadence_s, 746, 0),
    ("A2", "version lag at 746 s in two weeks, median", "约 1.7 到 1.4",
     {"days": 14, "cadence_s": 746}, lambda r: r.version_lag_median, 1.4, 1),
    ("A2", "version lag at 746 s in two weeks, mean", "按均值粗估约 3.2 到 2.5",
     {"days": 14, "cadence_s": 746, **SEED_MEAN}, lambda r: r.version_lag_mean, 2.5, 1),
]
# fmt: on


@pytest.mark.parametrize(
    ("inputs", "figure", "seed_value", "places"),
    [
        pytest.param(inputs, figure, value, places, id=f"{section}: {quantity}")
        for section, quantity, _words, inputs, figure, value, places in SEED_FIGURES
    ],
)
def test_the_plan_gives_each_figure_of_seed_000_to_its_rounding(inputs, figure, seed_value, places):
    assert seed_rounded(figure(plan(PlanInput(**inputs))), places) == seed_value


def test_seed_rounding_is_half_away_from_zero_at_any_place():
    assert seed_rounded(1.5625, 2) == 1.56
    assert seed_rounded(187.5, 0) == 188
    assert seed_rounded(8_552.4, -1) == 8_550
    assert seed_rounded(16_084, -2) == 16_100
    assert seed_rounded(4_096_000, -4) == 4_100_000


# --- the capacity study's claims without a single figure ---


def test_60_tokens_per_s_falls_short_75_barely_meets_and_200_leaves_room(base_case):
    # section 2: "60 达不到要求，75 几乎没有余量，200 则留出了选择空间" (lossless threshold)
    shares = {r.tokens_per_gpu_s: r.inference_demand_share_lossless for r in base_case.sensitivity}
    assert shares[60] > 1
    assert 0.95 < shares[75] < 1
    assert shares[200] < 0.5
    # with a = 0.9 and p = 0.8, 75 falls short too (threshold 103)
    assert row(base_case, 75).inference_demand_share > 1


def test_600_s_is_the_boundary_of_the_week(base_case):
    # section 4: the deadline's own pace is 604.8 s; 600 s leaves 0.8% of the week
    assert base_case.deadline_cadence_s == pytest.approx(604.8)
    at_600 = plan(PlanInput(cadence_s=600))
    assert at_600.meets_deadline and 0 < at_600.time_slack_share < 0.01
    late = plan(PlanInput(cadence_s=610))
    assert not late.meets_deadline and late.time_slack_s == pytest.approx(-5_200)


def test_cap_4_costs_about_the_whole_loss_budget_and_cap_10_groups_exceed_it():
    # section 4: cap 4 at 600 s costs about all of p = 80%'s budget; at cap 10, dropping
    # whole groups at the upper bound costs more than the budget
    cap_4 = plan(PlanInput(cadence_s=600, lag_cap=4))
    assert cap_4.lag_over_cap_share == pytest.approx(cap_4.loss_budget_share, abs=0.01)
    cap_10 = plan(PlanInput(cadence_s=600))
    assert cap_10.lag_over_cap_share < cap_10.loss_budget_share < cap_10.group_over_cap_share_upper


def test_two_weeks_no_longer_exclude_60_tokens_per_s():
    # appendix A2: at 60 tokens/s the week is out of reach, two weeks are not
    assert plan(PlanInput(tokens_per_gpu_s=60)).inference_demand_share > 1
    two_weeks = plan(PlanInput(days=14, tokens_per_gpu_s=60))
    assert two_weeks.inference_demand_share < 1
    assert two_weeks.capacity_cadence_s < two_weeks.deadline_cadence_s


def test_a_longer_cadence_lowers_the_version_lag():
    # appendix A1: "迭代周期越长，版本差越小"
    lags = [plan(PlanInput(cadence_s=c, days=14)).version_lag_mean for c in (224, 600, 746)]
    assert lags == sorted(lags, reverse=True)


# --- the arithmetic behind the figures ---


def test_the_cadence_sets_the_rate_and_the_deadline_keeps_its_own():
    result = plan(PlanInput(cadence_s=500))
    assert result.input.rate_from == "cadence"
    assert result.trajectories_per_s == pytest.approx(4_096 / 500)
    assert result.deadline_trajectories_per_s == pytest.approx(4_096_000 / 604_800)
    assert result.in_flight_median == pytest.approx(4_096 / 500 * 1_044)
    assert result.run_time_s == 500_000 and result.meets_deadline
    # sized for the deadline, the cadence still sets the lag and the slack
    deadline = plan(PlanInput(cadence_s=500, rate_from="deadline"))
    assert deadline.trajectories_per_s == pytest.approx(4_096_000 / 604_800)
    assert deadline.version_lag_median == result.version_lag_median
    assert deadline.time_slack_share == result.time_slack_share


def test_without_a_cadence_the_plan_runs_at_the_deadlines_pace(base_case):
    assert base_case.input.rate_from == "deadline"
    assert base_case.iteration_period_s == pytest.approx(604.8)
    assert base_case.time_slack_s == 0 and base_case.meets_deadline
    assert base_case.cadence_trajectories_per_s == pytest.approx(base_case.trajectories_per_s)


def test_the_capacity_rate_is_what_the_gpus_deliver():
    result = plan(PlanInput(rate_from="capacity", tokens_per_gpu_s=1_000))
    assert result.trajectories_per_s == pytest.approx(3_000 * 1_000 * 0.9 * 0.8 / 32_768)
    assert result.inference_demand_share == pytest.approx(1)
    assert result.iteration_period_s == pytest.approx(4_096 / result.trajectories_per_s)
    assert result.run_time_s < result.deadline_cadence_s * 1_000


def test_a_sensitivity_row_is_the_capacity_plan_at_that_throughput(base_case):
    at_1000 = plan(PlanInput(rate_from="capacity", tokens_per_gpu_s=1_000))
    r = row(base_case, 1_000)
    assert r.capacity_trajectories_per_s == at_1000.trajectories_per_s
    assert r.capacity_cadence_s == at_1000.iteration_period_s
    assert r.in_flight_mean == at_1000.in_flight_mean
    assert r.nodes_at_densities == at_1000.nodes_at_densities
    # the demand columns are the base plan's
    assert r.gpus_needed == plan(PlanInput(tokens_per_gpu_s=1_000)).gpus_needed


def test_node_counts_are_ceilings_and_node_equivalents_quotients():
    result = plan(PlanInput(densities=[1_000, 7_000]))
    for nodes in result.nodes_at_densities:
        assert nodes.node_equivalents_mean == result.in_flight_mean / nodes.sandboxes_per_node
        assert nodes.nodes_mean == math.ceil(nodes.node_equivalents_mean)
    assert density(result.nodes_at_densities, 7_000).nodes_median == 2  # 7,070 in flight


def test_whole_forgives_float_noise_and_nothing_else():
    assert whole(7.000000000000001) == 7
    assert whole(7.000001) == 8
    assert whole(0.3) == 1


def test_a_group_is_over_the_cap_between_one_trajectorys_share_and_independence():
    result = plan(PlanInput(cadence_s=600, lag_cap=4, group_size=8))
    share = result.lag_over_cap_share
    assert result.group_over_cap_share_lower == share
    assert result.group_over_cap_share_upper == pytest.approx(1 - (1 - share) ** 8)
    single = plan(PlanInput(cadence_s=600, lag_cap=4, group_size=1))
    assert single.group_over_cap_share_upper == pytest.approx(share)


def test_a_fixed_lifetime_lags_by_its_periods_or_one_more():
    assert lag_split(1_044, 600) == pytest.approx({1: 0.26, 2: 0.74})
    assert lag_split(1_200, 600) == {2: 1.0}


def test_the_gpu_gap_stretches_the_update_and_can_take_every_training_gpu():
    stretched = plan(PlanInput(tokens_per_gpu_s=60, **LOSSLESS))
    assert stretched.update_time_stretch == pytest.approx(7_000 / (7_000 - 699) - 1)
    starved = plan(PlanInput(tokens_per_gpu_s=10, training_gpus=500))
    assert starved.gpu_gap > 500
    assert starved.training_gpus_after_gap is None and starved.update_time_stretch is None
    assert "is all of the 500 training GPUs" in starved.formulas["training_gpus_after_gap"]


def test_a_given_mean_beside_the_quantiles_sets_littles_law_and_the_fit_the_shares():
    fitted = plan(PlanInput(cadence_s=600))
    rounded = plan(PlanInput(cadence_s=600, **SEED_MEAN))
    assert rounded.lifetime_mean_s == 1_900 and fitted.lifetime_mean_s == pytest.approx(
        1_939, 0.001
    )
    assert rounded.in_flight_mean == pytest.approx(rounded.trajectories_per_s * 1_900)
    assert rounded.version_lag_mean == pytest.approx(1_900 / 600)
    assert rounded.lag_over_cap_share == fitted.lag_over_cap_share
    assert "1,939 s" in rounded.formulas["lifetime_mean_s"]


def test_lognormal_fit_has_the_seeds_shape():
    mu, sigma = lognormal_from_median_p99(1_044, 13_900)
    assert math.exp(mu) == pytest.approx(1_044)
    assert sigma == pytest.approx(1.113, abs=1e-3)
    assert lognormal_mean(mu, sigma) == pytest.approx(1_939, abs=1)


def test_lag_over_cap_share_lies_between_the_continuous_bounds():
    mu, sigma = lognormal_from_median_p99(1_044, 13_900)
    share = lag_over_cap_share(mu, sigma, cadence_s=600, cap=4)

    def duration_over(multiple: float) -> float:
        z = (math.log(multiple * 600) - mu) / sigma
        return 0.5 * math.erfc(z / math.sqrt(2))

    assert duration_over(5) < share < duration_over(4)


def test_mean_lifetime_alone_leaves_median_figures_empty():
    result = plan(PlanInput(lifetime_mean_s=1_900))
    assert result.in_flight_mean == pytest.approx(6.7725 * 1_900, rel=1e-3)
    assert result.in_flight_median is None
    assert result.nodes_median is None
    assert result.lag_over_cap_share is None
    assert result.group_over_cap_share_upper is None
    assert result.version_lag_at_median is None
    assert row(result, 200).in_flight_median is None


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
        ("training_gpus", 0),
        ("group_size", 0),
        ("lag_cap", -1),
        ("rate_from", "fastest"),
        ("densities", [1_048, 0]),
        ("sensitivity", [60, -75]),
        ("sensitivity", [math.nan]),
    ],
)
def test_out_of_range_values_are_refused(field, value):
    with pytest.raises(ValidationError, match=field):
        PlanInput(**{field: value})


def test_a_rate_from_the_cadence_needs_a_cadence():
    with pytest.raises(ValidationError, match="--rate-from cadence needs --cadence-s"):
        PlanInput(rate_from="cadence")


def test_p99_below_median_is_refused():
    with pytest.raises(ValidationError, match="--lifetime-p99-s .* is below --lifetime-p50-s"):
        PlanInput(lifetime_p50_s=2_000, lifetime_p99_s=1_000)


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


def test_table_prints_every_figure_with_its_formula_then_densities_and_sensitivity(base_case):
    table = render_table(base_case)
    assert "6.77" in table
    assert "102.74" in table
    assert "R = n·B / T" in table
    figures, densities, sensitivity = table.split("\n\n")
    assert len(figures.splitlines()) == len(base_case.formulas)
    assert "1: 27%, 2: 73%" in figures  # the lag of a median trajectory at 604.8 s
    # a title, a header and a row per density: 7,070 / 1,048 and 13,133 / 3,200
    assert len(densities.splitlines()) == 2 + 2
    assert "6.75 -> 7" in densities and "4.10 -> 5" in densities
    # two lines of title, a header and a row per throughput; 60 tokens/s asks 123.3%
    assert len(sensitivity.splitlines()) == 3 + 5
    assert "123.3%" in sensitivity.splitlines()[3]


def test_empty_densities_and_sensitivity_leave_their_tables_out(capsys):
    assert run_plan(parse(["--densities", "--sensitivity"])) == 0
    out = capsys.readouterr().out
    assert "\n\n" not in out.strip() and "effective trajectories/s" in out


def test_json_carries_the_cadence_densities_and_sensitivity(capsys):
    flags = ["--json", "--cadence-s", "500", "--densities", "3200", "--sensitivity", "1000",
             "--group-size", "4"]  # fmt: skip
    assert run_plan(parse(flags)) == 0
    dumped = json.loads(capsys.readouterr().out)
    assert dumped["input"]["rate_from"] == "cadence"
    assert dumped["trajectories_per_s"] == pytest.approx(8.192)
    assert dumped["time_slack_share"] == pytest.approx(1 - 500_000 / 604_800)
    assert [d["sandboxes_per_node"] for d in dumped["nodes_at_densities"]] == [3_200]
    assert [r["tokens_per_gpu_s"] for r in dumped["sensitivity"]] == [1_000]
    share = dumped["lag_over_cap_share"]
    assert dumped["group_over_cap_share_upper"] == pytest.approx(1 - (1 - share) ** 4)
    assert dumped["version_lag_at_median"].keys() == {"2", "3"}  # 1,044 s / 500 s = 2.09


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


@pytest.mark.parametrize(
    ("flags", "complaint"),
    [
        (["--densities", "1048", "0"], "--densities: Input should be greater than 0 (got 0)"),
        (["--sensitivity", "nan"], "--sensitivity: Input should be a finite number"),
        (["--rate-from", "fastest"],
         "--rate-from: Input should be 'deadline', 'cadence' or 'capacity'"),
        (["--rate-from", "cadence"], "dsec plan: --rate-from cadence needs --cadence-s"),
        (["--group-size", "0"], "--group-size: Input should be greater than 0"),
        (["--training-gpus", "-1"], "--training-gpus: Input should be greater than 0"),
    ],
)  # fmt: skip
def test_bad_new_flags_are_refused_on_one_line(capsys, flags, complaint):
    assert run_plan(parse(flags)) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert complaint in captured.err
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err


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
    mu, sigma = lognormal_from_median_p99(100, 1_000)
    versions = VersionModel(period_s=60, lag_cap=1, group_size=8, mu=mu, sigma=sigma)
    run = measure(result, 1, lifetimes, start_s=100, stop_s=200, end_s=260, versions=versions)
    # the one acquired after the end started all the same; of the 12 whole groups of 8
    # consecutive arrivals, the one with e99 (arrived at 160 s, never started) is left out
    assert run.lag.trajectories == 99 and run.lag.groups == 11
    assert run.population_waiting_at_start == 1
    assert run.measured_requests == 100 and run.unserved_at_end == 2
    assert run.paths == {"warm": 98}
    # nearest-rank p99 of 100: the 99th value, the shorter of the two censored waits
    assert run.schedule_p99_ms == pytest.approx(100_000)
    waited = 98 * 0.005 + 110 + 100
    assert run.queue_wait_share == pytest.approx(waited / (waited + 100 * 100.0), abs=1e-6)
    assert not run.meets_targets
    assert run.in_flight_peak == 5 and run.in_flight_mean == 5


def started(n: int, arrival_s: float, acquired_at_s: float | None) -> EpisodeRecord:
    return EpisodeRecord(episode=f"e{n}", pool="default", template="base", arrival_s=arrival_s,
                         requested_at_s=arrival_s, acquired_at_s=acquired_at_s)  # fmt: skip


def test_a_trajectorys_lag_counts_the_releases_between_its_start_and_its_end():
    mu, sigma = lognormal_from_median_p99(100, 1_000)
    versions = VersionModel(period_s=100, lag_cap=1, group_size=2, mu=mu, sigma=sigma)
    records = [started(0, 50, 50), started(1, 60, 90), started(2, 70, 10), started(3, 80, None)]
    # ends at 150 (lag 1), at 210 (lag 2, over the cap), at 60 (lag 0); one never started
    lifetimes = {"e0": 100.0, "e1": 120.0, "e2": 50.0}
    tally = tally_lags(records, lifetimes, versions)
    assert tally.trajectories == 3 and tally.version_lag_mean == 1.0
    assert tally.over_cap_share == pytest.approx(1 / 3, abs=1e-6)
    # groups e0 + e1 (over the cap, e1 is) and e2 + e3 (skipped: e3 never started)
    assert tally.groups == 1 and tally.group_over_cap_share == 1.0


def test_lag_tallies_agree_with_the_arithmetic_and_can_disagree():
    rng = random.Random(7)
    mu, sigma = lognormal_from_median_p99(1_044, 13_900)
    records, lifetimes = [], {}
    for n in range(16_000):
        t = rng.uniform(0, 60_000)
        records.append(started(n, t, t))
        lifetimes[f"e{n}"] = rng.lognormvariate(mu, sigma)
    versions = VersionModel(period_s=600, lag_cap=4, group_size=8, mu=mu, sigma=sigma)
    tally = tally_lags(records, lifetimes, versions)
    planned = plan(PlanInput(cadence_s=600, lag_cap=4))
    assert tally.agrees
    # uniform starts: the expectation is the plan's share; groups of independent lifetimes
    # land at the plan's upper bound
    assert tally.over_cap_share_expected == pytest.approx(planned.lag_over_cap_share, abs=0.005)
    assert tally.over_cap_share == pytest.approx(planned.lag_over_cap_share, abs=0.015)
    assert tally.group_over_cap_share == pytest.approx(planned.group_over_cap_share_upper, abs=0.04)
    assert tally.version_lag_mean == pytest.approx(planned.version_lag_mean, rel=0.1)
    # lifetimes thinner-tailed than drawn: the tallies refute that arithmetic
    thin = lognormal_from_median_p99(1_044, 6_000)
    wrong = VersionModel(period_s=600, lag_cap=4, group_size=8, mu=thin[0], sigma=thin[1])
    assert not tally_lags(records, lifetimes, wrong).agrees


def test_the_simulation_tallies_the_version_lag_of_its_trajectories():
    lagging = plan(PlanInput(**SMALL_INPUT, cadence_s=60, rate_from="deadline", lag_cap=1))
    check = check_plan(lagging, SimulateSettings(**SMALL_SIM, nodes=3))
    assert check.iteration_period_s == 60 and check.group_size == 8
    assert check.lag_over_cap_share_planned == pytest.approx(lagging.lag_over_cap_share, abs=1e-6)
    assert check.group_over_cap_share_bounds[1] == pytest.approx(
        lagging.group_over_cap_share_upper, abs=1e-6
    )
    assert check.lag_checked_at_nodes == 3 and check.lag_agrees
    run = next(r for r in check.runs if r.nodes == 3)
    assert (
        run.lag.trajectories == run.measured_requests
        and run.lag.groups == run.measured_requests // 8
    )
    assert 0.2 < run.lag.over_cap_share < 0.5  # the arithmetic: 35%
    assert "version lag at 3 nodes, cap 1, every 60 s" in render_check(check)


@pytest.mark.parametrize("case", SEED_CASES, ids=lambda case: case.name)
def test_each_seed_case_is_a_dsec_plan_command_line(case):
    args = parse([*case.flags(), "--simulate"])
    given = {k: getattr(args, k) for k in PlanInput.model_fields if getattr(args, k) is not None}
    assert PlanInput(**given) == PlanInput(**case.inputs)
    assert (args.load or "effective") == case.load


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
