"""`dsec bench tune`: the target and search space it reads, the search (against a fake
simulator, whose cheapest feasible point is known), the command on a short trace in the
simulator, the pool configuration it writes applied by `dsec pool set`, its refusals,
and (Docker) the live check."""

from __future__ import annotations

import asyncio
import json
import os

import pytest
from conftest import STARTED_POOLS, make_spec, pool_containers
from inprocess import inprocess_controlplane
from test_sweep import short_trace

from bench.generate import generate, summarize
from bench.sim.profile import Profile
from bench.tune import (
    TARGETS,
    TUNABLE,
    Search,
    busiest_slice,
    live_check,
    meets,
    parse_space,
    parse_target,
    pool_set_command,
    relative_error,
)
from dsec.cli import main
from dsec.models import PoolParams, PoolPatch
from dsec.processes import dsec_argv
from dsec.trace import Episode, Step, load_trace

BASELINES = {"cold", "hpa", "keda", "kpa", "static"}


def test_a_target_names_figures_and_limits():
    assert parse_target("p99_ms=500,queue_wait=0.1") == {"p99_ms": 500.0, "queue_wait": 0.1}
    with pytest.raises(ValueError, match="unknown target 'p98_ms'; known: " + ", ".join(TARGETS)):
        parse_target("p98_ms=500")
    for bad in ("p99_ms", "p99_ms=fast", "p99_ms=0", "p99_ms=-1", "p99_ms=inf", ""):
        with pytest.raises(ValueError, match="--target"):
            parse_target(bad)


def test_a_space_is_a_range_a_log_range_or_a_list_of_pool_values():
    warm = parse_space("min_warm=0:16")
    assert [warm.value(u) for u in warm.grid(3)] == [0, 8, 16]  # min_warm is an integer
    freeze = parse_space("freeze_after_s=1:100:log")
    assert [freeze.value(u) for u in freeze.grid(3)] == [1, 10, 100]
    assert freeze.position(10) == pytest.approx(0.5) and freeze.position(1000) == 1.0
    recycle = parse_space("recycle=false,true")
    assert [recycle.value(u) for u in recycle.grid(5)] == [False, True]
    assert recycle.moves(0.0, 0.01) == [1.0]  # a list moves to its next value whatever the step
    with pytest.raises(ValueError, match="unknown pool parameter 'warmth'; known: priority, min"):
        parse_space("warmth=0:1")
    assert "templates" not in TUNABLE
    for bad in ("templates=1,2", "min_warm=-1:4", "warm_fraction=0:2", "min_warm=4:0",
                "min_warm=0:4:sqrt", "min_warm=0:4:log", "recycle=false:true", "min_warm",
                "min_warm=a,b"):  # fmt: skip
        with pytest.raises(ValueError):
            parse_space(bad)


def fake_simulator(jobs, busiest_p99=lambda warm: 1.0):
    """Latency falls and cost rises with min_warm; recycling costs more and gives nothing:
    with p99 <= 200 ms the cheapest setting is min_warm=4, recycle off, while the busiest
    slice's p99 (`busiest_p99` of min_warm) meets it."""
    rows = []
    for _policy, params, _seed in jobs:
        warm = params["min_warm"]
        figures = {"p50_ms": 1.0, "p95_ms": 1.0, "queue_wait": 0.0, "failed": 0,
                   "sandbox_seconds": 100.0 + 10 * warm + 50 * params["recycle"]}  # fmt: skip
        rows.append({**figures, "p99_ms": 1000 / (1 + warm),
                     "busiest": {**figures, "p99_ms": busiest_p99(warm)}})  # fmt: skip
    return rows


def test_the_search_refines_from_the_grid_to_the_cheapest_point_that_meets_the_target():
    space = [parse_space("min_warm=0:64"), parse_space("recycle=false,true")]
    search = Search(space, {"p99_ms": 200.0}, budget=24, seed=0, run=fake_simulator)
    search.search()
    stages = [row["stage"] for row in search.rows.values()]
    assert stages[0] == "defaults" and "grid" in stages and "refine" in stages
    assert len(search.rows) <= 24
    best = search.rows[search.ranked()[0]]
    assert (best["min_warm"], best["recycle"], best["p99_ms"]) == (4, False, 200.0)
    # the grid alone (0, 16, 32, 48, 64 here) misses it
    assert not any(r["min_warm"] == 4 for r in search.rows.values() if r["stage"] != "refine")


def test_a_point_whose_busiest_slice_misses_the_target_does_not_meet_it():
    """The hour meets p99 <= 200 ms from min_warm 4 on, its busiest slice only from 9 on
    (2000 / (1 + 9) = 200): the cheapest point meeting the target is 9."""
    space = [parse_space("min_warm=0:64"), parse_space("recycle=false,true")]
    slow_slice = lambda warm: 2000 / (1 + warm)  # noqa: E731
    search = Search(space, {"p99_ms": 200.0}, budget=30, seed=0,
                    run=lambda jobs: fake_simulator(jobs, slow_slice))  # fmt: skip
    search.search()
    best = search.rows[search.ranked()[0]]
    assert (best["min_warm"], best["recycle"], best["busiest"]["p99_ms"]) == (9, False, 200.0)
    below = [r for r in search.rows.values() if 4 <= r["min_warm"] < 9]
    assert below, "the search looked between the two thresholds"
    assert not any(meets(r, search.target) for r in below)
    assert all(r["p99_ms"] <= 200 for r in below), "they meet it over the whole trace"


def test_with_no_point_meeting_the_target_the_search_closes_in_on_the_closest():
    space = [parse_space("min_warm=0:8")]
    search = Search(space, {"p99_ms": 1.0}, budget=8, seed=0, run=fake_simulator)
    search.search()
    assert search.rows[search.ranked()[0]]["min_warm"] == 8


def test_the_busiest_slice_is_the_densest_window_moved_to_zero():
    arrivals = [0, 1, 2, 10, 10.5, 11, 11.2, 30]
    episodes = [Episode(episode=f"e{i}", arrival_s=t, steps=[Step(think_s=1, exec_s=1)])
                for i, t in enumerate(arrivals)]  # fmt: skip
    piece = busiest_slice(episodes, window_s=2.0)
    assert [e.episode for e in piece] == ["e3", "e4", "e5", "e6"]
    assert [e.arrival_s for e in piece] == [0, 0.5, 1, 1.2]


@pytest.fixture
def trace(tmp_path):
    return short_trace(tmp_path / "t.jsonl")


def tune(trace, tmp_path, capsys, *extra: str) -> tuple[int, dict, str]:
    out = tmp_path / "tune"
    code = main(["bench", "tune", "--trace", str(trace), "--nodes", "1", "--slots-per-node",
                 "32", "--no-live", "--out", str(out), "--json", *extra])  # fmt: skip
    captured = capsys.readouterr()
    return code, json.loads(captured.out) if captured.out else {}, captured.err


def test_tune_finds_the_cheapest_setting_meeting_the_target_and_compares_it(
    trace, tmp_path, capsys
):
    code, result, err = tune(trace, tmp_path, capsys, "--target", "p99_ms=100", "--budget", "12",
                             "--space", "min_warm=0:8", "--space", "warm_fraction=0,0.15",
                             "--seeds", "2", "--live-s", "20")  # fmt: skip
    assert code == 0, err
    assert result["met"] and result["p99_ms"] <= 100 and result["busiest"]["p99_ms"] <= 100
    assert result["busiest_s"] == 20
    PoolPatch.model_validate(result["params"])  # what PATCH and `dsec pool set` take
    assert PoolParams.model_validate(result["params"]) == PoolParams(**result["params"])
    # confirmed over two seeds: its p99 is the worst of theirs, its cost their mean
    assert len(result["per_seed"]) == 2 == len(result["seeds"])
    assert result["p99_ms"] == max(r["p99_ms"] for r in result["per_seed"])
    assert result["busiest"]["p99_ms"] == max(r["busiest"]["p99_ms"] for r in result["per_seed"])
    assert result["sandbox_seconds"] == pytest.approx(
        sum(r["sandbox_seconds"] for r in result["per_seed"]) / 2, abs=0.1
    )
    rows = result["search"]["rows"]
    assert 5 < len(rows) <= 12 and rows[0]["stage"] == "defaults"
    met = [r for r in rows if max(r["p99_ms"], r["busiest"]["p99_ms"]) <= 100 and not r["failed"]]
    assert result["per_seed"][0]["sandbox_seconds"] == min(r["sandbox_seconds"] for r in met)
    assert set(result["baselines"]) == BASELINES
    for run in (result["defaults"], *result["baselines"].values()):
        busiest = run["busiest"]
        assert run["meets_target"] == (
            max(run["p99_ms"], busiest["p99_ms"]) <= 100 and not run["failed"] + busiest["failed"]
        )
        assert run["winner_saves"] == pytest.approx(
            1 - result["sandbox_seconds"] / run["sandbox_seconds"], abs=1e-4
        )
    assert result["defaults"]["meets_target"]
    assert result["sandbox_seconds"] <= result["defaults"]["sandbox_seconds"]
    out = tmp_path / "tune"
    assert json.loads((out / "pool.json").read_text()) == result["params"]
    assert (out / "pareto.png").read_bytes().startswith(b"\x89PNG")
    report = (out / "tune.md").read_text()
    assert result["pool_set"] in report and "| static |" in report
    # a progress bar on stderr of the simulations, against the most it may run
    ran = result["simulation"]["runs"]
    expected = 12 + 3 * (2 - 1) + len(BASELINES) + 1  # budget, confirmations, comparisons
    bar = [line for line in err.replace("\r", "\n").splitlines() if "tune: simulations" in line]
    assert f"| 0/{expected} " in bar[0] and f"| {ran}/{expected} " in bar[-1], bar


def test_calibrate_measures_the_profile_first_and_the_search_uses_it(
    trace, tmp_path, capsys, monkeypatch
):
    """The wiring of --calibrate (the measurement itself, on Docker, is
    test_fidelity's): the profile measured with the samples asked for is saved beside
    the report and is the one every simulation of the search ran with."""
    measured = Profile({op: [0.05] for op in Profile.default(10).samples}, source="measured now")
    asked = []

    def calibrate(samples: int, nodes: int) -> Profile:
        asked.append((samples, nodes))
        return measured

    monkeypatch.setattr("bench.calibrate.calibrate", calibrate)
    code, result, err = tune(trace, tmp_path, capsys, "--target", "p99_ms=100", "--budget", "6",
                             "--space", "min_warm=0:4", "--calibrate", "--calibrate-samples",
                             "7")  # fmt: skip
    assert code == 0, err
    assert asked == [(7, 1)]
    assert result["simulation"]["profile"] == "measured now"
    assert Profile.load(tmp_path / "tune" / "profile.json").source == "measured now"


def test_with_calibrate_the_live_check_measures_the_engine_again_just_before(
    trace, tmp_path, capsys, monkeypatch
):
    """The wiring (the check itself, on Docker, is below): the search runs on the first
    profile measured, the live check's simulation on a second one measured after the
    search, and the search's is simulated beside it."""
    measured = []

    def calibrate(samples: int, nodes: int) -> Profile:
        measured.append(Profile({op: [0.05 * (1 + len(measured))]
                                 for op in Profile.default(10).samples},
                                source=f"measured {len(measured) + 1}"))  # fmt: skip
        return measured[-1]

    checked = {}

    def fake_live_check(piece, spec, target, *, profile, search_profile, **_):
        checked.update(profile=profile.source, search_profile=search_profile.source,
                       searches_done=len(measured), pool=spec.pool)  # fmt: skip
        side = {"p50_ms": 1.0, "p99_ms": 1.0, "queue_wait": 0.0, "sandbox_seconds": 1.0}
        return {"episodes": len(piece), "span_s": 1.0, "live": side, "sim": side,
                "sim_search_profile": side, "sim_seeds": [0], "meets_target": True,
                "errors": {}, "agrees": True, "profile": profile.source}  # fmt: skip

    monkeypatch.setattr("bench.calibrate.calibrate", calibrate)
    monkeypatch.setattr("bench.tune.live_check", fake_live_check)
    out = tmp_path / "tune"
    code = main(["bench", "tune", "--trace", str(trace), "--nodes", "1", "--slots-per-node",
                 "32", "--out", str(out), "--json", "--target", "p99_ms=100", "--budget", "6",
                 "--space", "min_warm=0:4", "--calibrate", "--calibrate-samples", "7"])  # fmt: skip
    result = json.loads(capsys.readouterr().out)
    assert code == 0
    assert result["simulation"]["profile"] == "measured 1"
    assert checked["profile"] == "measured 2" and checked["search_profile"] == "measured 1"
    assert checked["pool"] == PoolParams.model_validate(result["params"])
    assert Profile.load(out / "profile.json").source == "measured 1"
    assert Profile.load(out / "profile-live.json").source == "measured 2"
    assert "sim (the search's profile)" in (out / "tune.md").read_text()


async def test_the_pool_configuration_it_writes_is_what_dsec_pool_set_applies(tmp_path):
    params = {**PoolParams().model_dump(mode="json"), "min_warm": 3, "warm_fraction": 0.05,
              "recycle": True}  # fmt: skip
    params.pop("templates")
    command = pool_set_command("default", params)
    assert command.startswith("dsec pool set default ")
    async with inprocess_controlplane() as cp:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DSEC_")}
        env |= {"DSEC_URL": cp.url, "DSEC_ADMIN_TOKEN": cp.tokens.admin}
        proc = await asyncio.create_subprocess_exec(
            *dsec_argv(*command.split()[1:], "--json"), env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await proc.communicate()
        assert proc.returncode == 0, err
        applied = json.loads(out)["params"]
    assert applied == {**params, "templates": ["base"]}


def test_a_target_no_setting_meets_shows_the_closest_and_fails(trace, tmp_path, capsys):
    # a warm acquire takes no virtual time; with at most 1 warm sandbox some wait for a create
    code, result, err = tune(trace, tmp_path, capsys, "--target", "p99_ms=0.001",
                             "--budget", "6", "--space", "min_warm=0,1",
                             "--space", "warm_fraction=0")  # fmt: skip
    assert code == 1
    assert "no setting met p99_ms=0.001; the closest: p99" in err and "min_warm" in err
    assert not result["met"] and result["params"] is None
    closest = result["closest"]
    assert closest["p99_ms"] == min(r["p99_ms"] for r in result["search"]["rows"])
    assert not (tmp_path / "tune" / "pool.json").exists()


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--target", "p98_ms=5"], "unknown target 'p98_ms'; known: p50_ms, p95_ms, p99_ms"),
        (["--target", "p99_ms=5", "--space", "warmth=0:1"],
         "unknown pool parameter 'warmth'; known: priority, min_warm, max_warm"),
        (["--target", "p99_ms=5", "--budget", "4"], "give --budget 17 or more"),
        (["--target", "p99_ms=5", "--policy", "keda"], "--policy"),
        (["--target", "p99_ms=5", "--space", "min_warm=0:2", "--space", "min_warm=0,1"],
         "twice"),
        (["--target", "p99_ms=5", "--calibrate", "--profile", "p.json"], "not both"),
        (["--target", "p99_ms=5", "--calibrate", "--calibrate-samples", "2"],
         "--calibrate-samples"),
    ],
)  # fmt: skip
def test_bad_flags_are_refused_in_one_line(trace, tmp_path, capsys, extra, says):
    code, _, err = tune(trace, tmp_path, capsys, *extra)
    assert code == 2 and says in err, err
    assert len(err.strip().splitlines()) == 1


def test_a_trace_that_fails_validation_names_its_line_and_reason(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    step = '"steps": [{"think_s": 1, "exec_s": 1}]'
    path.write_text(f'{{"episode": "a", "arrival_s": 0, {step}}}\n'
                    f'{{"episode": "b", "arrival_s": -1, {step}}}\n')  # fmt: skip
    code, _, err = tune(path, tmp_path, capsys, "--target", "p99_ms=500")
    assert code == 2
    assert f"{path} line 2: arrival_s: Input should be greater than or equal to 0" in err, err


def test_a_trace_whose_peak_exceeds_the_nodes_is_refused_before_any_search(trace, tmp_path, capsys):
    peak = int(summarize(load_trace(trace))["peak_concurrency"])
    code = main(["bench", "tune", "--trace", str(trace), "--nodes", "1", "--slots-per-node",
                 str(peak - 1), "--no-live", "--out", str(tmp_path / "tune"), "--json",
                 "--target", "p99_ms=500"])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert f"its peak is {peak} sandboxes at once, more than the {peak - 1} slots" in captured.err
    assert "simulations" not in captured.err  # said first: nothing was simulated
    assert len(captured.err.strip().splitlines()) == 1


@pytest.mark.docker
def test_the_live_check_replays_the_winner_and_simulates_the_same_pool(docker_client, tmp_path):
    episodes = generate(kind="poisson", n=24, rate_per_s=2.0, seed=3, lifetime_p50_s=3,
                        lifetime_p99_s=8, mean_step_s=1.5)  # fmt: skip
    spec = make_spec(tmp_path, nodes=1, pool=PoolParams(min_warm=2, warm_fraction=0))
    STARTED_POOLS.add(spec.name)
    piece = busiest_slice(episodes, window_s=6.0)
    target = {"p99_ms": 500.0}
    slower = Profile({op: [2 * s for s in samples]
                      for op, samples in Profile.default(n=200).samples.items()},
                     source="twice as slow")  # fmt: skip
    result = live_check(piece, spec, target, seeds=[0, 1], time_scale=1.0,
                        profile=Profile.default(n=200), trace_name="small",
                        search_profile=slower)  # fmt: skip
    assert not pool_containers(docker_client, spec.name + "-"), "the live pool is gone"
    assert result["episodes"] == len(piece) and result["sim_seeds"] == [0, 1]
    for side in ("live", "sim"):
        assert 0 < result[side]["p99_ms"] < 5000, side
        assert result[side]["sandbox_seconds"] > sum(e.lifetime_s for e in piece), side
    assert result["live"]["failed"] == 0
    errors = result["errors"]
    for name in ("p99_ms", "sandbox_seconds"):
        assert result["relative_error"][name] == relative_error(
            result["sim"][name], result["live"][name]
        )
    assert errors["p99_ms"] == round(
        abs(result["sim"]["p99_ms"] - result["live"]["p99_ms"]) / 500, 4
    )
    assert errors["sandbox_seconds"] == result["relative_error"]["sandbox_seconds"]
    # the cost is the episodes' hold plus the pool's: the simulator's close to live
    assert errors["sandbox_seconds"] <= 0.15
    assert result["agrees"] == (errors["p99_ms"] <= 0.15 and errors["sandbox_seconds"] <= 0.15)
    assert result["meets_target"] == (result["live"]["p99_ms"] <= 500)
    # the search's profile, simulated beside: a slower engine, a slower p99
    assert result["profile"] == Profile.default(n=200).source
    assert result["sim_search_profile"]["p99_ms"] > result["sim"]["p99_ms"]
