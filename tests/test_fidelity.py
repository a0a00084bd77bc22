"""Fidelity and calibration on real Docker: a profile measured here (alone and under
load), a small trace replayed live and simulated with it; and the commands' refusals."""

from __future__ import annotations

import argparse

import pytest
from conftest import STARTED_POOLS, make_spec, pool_containers

from bench.calibrate import (
    COMMAND_SANDBOXES,
    CONCURRENCY,
    LEASE_SAMPLES_FACTOR,
    LOAD_LEVELS,
    calibrate,
    command_weight,
    exec_weight,
    pool_create_rate,
    simulated_burst,
)
from bench.command_cpu import command_weight as command_cpu_weight
from bench.command_cpu import cores_busy
from bench.fidelity import (
    add_fidelity_arguments,
    fidelity,
    relative_error,
    render,
    run_fidelity,
)
from bench.host_cpu import busy_jiffies
from bench.sim.profile import OPS, Profile
from dsec.models import PoolParams
from dsec.trace import Episode, Step, dump_trace


def fidelity_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_fidelity_arguments(parser)
    return parser.parse_args(argv)


def small_trace(n: int = 10) -> list[Episode]:
    """`n` episodes over about 3 s, two short steps each."""
    step = Step(think_s=0.3, exec_s=0.2)
    return [Episode(episode=f"e{i}", arrival_s=i * 0.3, steps=[step, step]) for i in range(n)]


def test_relative_error_is_the_distance_from_live_over_live():
    assert relative_error(11.0, 10.0) == pytest.approx(0.1)
    assert relative_error(9.0, 10.0) == pytest.approx(0.1)
    assert relative_error(1.0, None) is None and relative_error(None, 1.0) is None
    assert relative_error(1.0, 0.0) is None  # no scale to be relative to


def test_the_create_rate_is_the_one_at_which_the_simulated_burst_takes_the_pool_s_time():
    """The pool's creates, through its agents, come slower than the driver's on the
    engine alone (the agents' and the control plane's own work, on the same cores): the
    simulator is given the rate at which its burst takes as long a create as the pool's
    burst did, and the driver's where it is already that slow."""
    default = Profile.default(n=200)
    # under load as alone (the engine's rates bound only a profile measured under load)
    profile = Profile(default.samples, under_load={"create": {1: default.samples["create"]}})
    at_engine_rate = simulated_burst(profile, 20.0, 3)
    slower = 1.25 * at_engine_rate
    fitted = pool_create_rate(profile, slower, 3, 20.0)
    assert 5.0 < fitted < 19.0
    assert simulated_burst(profile, fitted, 3) == pytest.approx(slower, rel=0.03)
    assert pool_create_rate(profile, 0.5 * at_engine_rate, 3, 20.0) == 20.0


def test_an_exec_start_weighs_its_engine_work_against_a_create():
    assert exec_weight({"create": 10.0, "remove": 20.0, "exec": 25.0}) == pytest.approx(0.4)


def test_a_command_weighs_no_more_than_the_highest_load_measured_shared_out():
    """Leases that barely slow under the engine's load (a flat curve: 6.7 ms alone, 6.8
    at 4 operations) and a little more beside commands: the equivalent load is read no
    further than 4 operations (before, a bound of 256 made it 8 per command)."""
    leases = Profile({op: [1.0] for op in OPS} | {"lease": [0.0067]},
                     under_load={"lease": {1: [0.0063], 2: [0.0076], 4: [0.0068]}})  # fmt: skip
    weight = command_weight(lambda k: leases.slowdown("lease", k), [0.0067], [0.0080])
    assert weight == pytest.approx(max(LOAD_LEVELS) / COMMAND_SANDBOXES)
    # within what was measured, it is the load that slows leases as much
    within = command_weight(lambda k: 1 + 0.1 * k, [0.010], [0.012])
    assert within == pytest.approx(2 / COMMAND_SANDBOXES)
    assert command_weight(lambda k: 1 + 0.1 * k, [0.010], [0.009]) == 0.0


def test_a_command_s_weight_by_cpu_is_its_cores_over_an_engine_operation_s():
    # user nice system idle iowait irq softirq steal guest guest_nice: iowait is not
    # busy, and guest time is in user time already
    before = busy_jiffies("cpu  100 0 50 1000 30 0 5 0 0 0")
    after = busy_jiffies("cpu  160 0 80 1100 50 0 15 0 40 0")
    assert before == (155, 1185) and after == (255, 1405)
    assert cores_busy(before, after, cores=2) == pytest.approx(2 * 100 / 220)
    cores = {"idle": 0.05, "commands": 0.19, "1 operation": 0.95, "2 operations": 1.5}
    assert command_cpu_weight(cores, 32) == pytest.approx(0.14 / 32 / 0.9)
    # commands that cost nothing weigh nothing; with no operation's cores, no weight
    assert command_cpu_weight(cores | {"commands": 0.04}, 32) == 0.0
    assert command_cpu_weight(cores | {"1 operation": 0.05}, 32) is None


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--calibrate", "--profile", "p.json"], "not both"),
        (["--sim-seeds", "0"], "--sim-seeds"),
        (["--calibrate", "--calibrate-samples", "2"], "--calibrate-samples"),
        (["--nodes", "0"], "--nodes"),
    ],
)
def test_the_fidelity_command_refuses_bad_flags_in_one_line(tmp_path, capsys, extra, says):
    trace = tmp_path / "trace.jsonl"
    dump_trace(small_trace(2), trace)
    args = fidelity_args("--trace", str(trace), "--out", str(tmp_path / "out"), *extra)
    assert run_fidelity(args) == 2
    error = capsys.readouterr().err
    assert error.startswith("dsec bench fidelity: ") and says in error
    assert error.count("\n") == 1
    assert not (tmp_path / "out").exists()  # refused before anything ran


def test_calibration_measures_every_operation_alone_and_under_load(docker_client):
    n = 5
    profile = calibrate(n)
    assert set(profile.samples) == set(OPS)
    for op in OPS:
        assert len(profile.samples[op]) >= 3 and all(s > 0 for s in profile.samples[op]), op
    # creates and removes c at a time are measured under c - 1 others
    for op in ("create", "remove"):
        assert sorted(profile.under_load[op]) == [c - 1 for c in CONCURRENCY]
        assert all(len(s) >= n for s in profile.under_load[op].values())
    assert sorted(profile.under_load["lease"]) == [k for k in LOAD_LEVELS if k]
    leases = n * LEASE_SAMPLES_FACTOR
    assert len(profile.samples["lease"]) == leases
    assert all(len(s) == leases for s in profile.under_load["lease"].values())
    rates = profile.engine_rates_per_s
    assert profile.exec_weight == pytest.approx(rates["create"] / rates["exec"], abs=1e-3)
    assert 0 <= profile.command_weight <= max(LOAD_LEVELS) / COMMAND_SANDBOXES
    # the engine's throughput of each: more than one a second, and the same engine's
    assert set(profile.engine_rates_per_s) == {"create", "remove", "exec"}
    assert all(rate > 1 for rate in profile.engine_rates_per_s.values())
    # a warm acquire is the lease call: milliseconds, not a create's tenths of a second
    assert max(profile.samples["lease"]) < min(profile.samples["create"])
    assert profile.contended and profile.engine_concurrency >= max(CONCURRENCY)
    assert not [c for c in pool_containers(docker_client, "calibrate-")], "calibrate cleans up"


def test_a_small_trace_replayed_live_and_simulated_gives_both_figures(docker_client, tmp_path):
    spec = make_spec(tmp_path, nodes=2, pool=PoolParams(min_warm=2))
    STARTED_POOLS.add(spec.name)
    profile = Profile.default(n=200)
    # the profile measured again after the live run (here one drawn with another seed:
    # what is checked is that both are simulated and reported apart)
    after = Profile.default(n=200, seed=9)
    result = fidelity(small_trace(), spec, time_scale=1.0, seed=1, profile=profile,
                      trace_name="small", out=tmp_path / "out", sim_seeds=3,
                      recalibrate=lambda: after)  # fmt: skip
    assert not pool_containers(docker_client, spec.name + "-"), "the live pool is gone"
    for side in ("live", "sim"):
        figures = result[side]
        # a warm acquire takes no virtual time (the claim answers it), only live time
        assert 0 < figures["p50_ms"] if side == "live" else figures["p50_ms"] >= 0, side
        assert figures["p50_ms"] <= figures["p95_ms"], side
        assert 0 < figures["utilisation"] < 1, side
    for name, error in result["relative_error"].items():
        assert error == relative_error(result["sim"][name], result["live"][name]), name
    # the simulator's figure is the median of its seeds, inside their spread
    for name, (low, high) in result["sim_spread"].items():
        assert low <= result["sim"][name] <= high, name
    assert result["sim_seeds"] == 3 and result["policy"] == spec.policy
    for side in ("live", "sim", "sim_after"):
        assert (tmp_path / "out" / side / "report.json").exists()
    assert result["profile_after"] == after.source
    for name, error in result["relative_error_after"].items():
        assert error == relative_error(result["sim_after"][name], result["live"][name]), name
    assert "| sim_after |" in render(result) and "after the live run" in render(result)
    # what the engine did, by its own event stream live: each release ends its sandbox's
    # container (recycle is off), as the simulator has it; and refills made containers
    events = result["engine_events"]
    assert set(events) == {"live", "sim", "sim_after"}
    for side, counts in events.items():
        assert counts["die"] == len(small_trace()), (side, counts)
        assert counts["create"] >= 1, (side, counts)
    assert "| engine events | live | sim | sim_after |" in render(result)
