"""The simulator: virtual time, determinism, every policy, the same report as live."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import subprocess
import sys
import time
from collections import Counter
from types import SimpleNamespace

import pytest

from bench.generate import generate
from bench.report import build_report
from bench.sim import simulate
from bench.sim.agents import Engine, RowChanges, SimAgents, SimSandbox
from bench.sim.loop import VirtualClock, VirtualTimeLoop
from bench.sim.profile import OPS, Profile
from dsec.models import CreateSandbox, PoolParams, TemplateSpec
from dsec.policies import POLICIES
from dsec.policy import SAMPLE_ABOVE, SAMPLE_SIZE, Resources
from dsec.states import SandboxState as S


def small_trace(n: int = 60, seed: int = 5):
    return generate(kind="poisson", n=n, rate_per_s=0.5, seed=seed, lifetime_p50_s=20,
                    lifetime_p99_s=120, mean_step_s=5)  # fmt: skip


def test_the_virtual_loop_skips_time_but_keeps_order():
    loop = VirtualTimeLoop()
    clock = VirtualClock(loop)
    seen: list[tuple[str, float]] = []

    async def sleeper(name: str, seconds: float) -> None:
        await asyncio.sleep(seconds)
        seen.append((name, clock.now()))

    async def main() -> None:
        await asyncio.gather(sleeper("hour", 3600), sleeper("minute", 60), sleeper("day", 86400))

    started = time.perf_counter()
    loop.run_until_complete(main())
    loop.close()
    assert time.perf_counter() - started < 1.0  # a simulated day, in no time
    assert [name for name, _ in seen] == ["minute", "hour", "day"]
    assert [round(t) for _, t in seen] == [60, 3600, 86400]


def test_same_seed_same_run_other_seed_other_run():
    trace = small_trace()
    runs = [simulate(trace, seed=s, nodes=2, slots_per_node=40) for s in (1, 1, 2)]
    summary = [[(r.episode, r.schedule_ms, r.path, r.node) for r in run.records] for run in runs]
    assert summary[0] == summary[1]
    assert summary[0] != summary[2]
    for run in runs:
        run.meta.pop("wall_s")  # the one figure that depends on the machine, not the seed
    assert build_report(runs[0]) == build_report(runs[1])


def test_the_same_seed_repeats_a_run_on_more_nodes_than_the_policy_looks_at():
    """Past SAMPLE_ABOVE nodes the policy samples candidates by request id: the ids come
    from the seed too, or two runs differ (where each sandbox went, at least)."""
    trace = generate(kind="burst", burst_size=80, burst_window_s=1.0, seed=5,
                     lifetime_p50_s=20, lifetime_p99_s=60, mean_step_s=5)  # fmt: skip
    nodes = SAMPLE_ABOVE + 8
    runs = [simulate(trace, seed=7, nodes=nodes, slots_per_node=4) for _ in range(2)]
    placed = [[(r.episode, r.schedule_ms, r.path, r.node) for r in run.records] for run in runs]
    assert placed[0] == placed[1]
    assert len({node for *_, node in placed[0]}) > SAMPLE_SIZE  # sampling was at work


PLACEMENTS_SCRIPT = """
import json
from bench.generate import generate
from bench.sim import simulate
from dsec.policy import SAMPLE_ABOVE
trace = generate(kind="burst", burst_size=80, burst_window_s=1.0, seed=5,
                 lifetime_p50_s=20, lifetime_p99_s=60, mean_step_s=5)
run = simulate(trace, seed=7, nodes=SAMPLE_ABOVE + 8, slots_per_node=4)
print(json.dumps([(r.episode, r.schedule_ms, r.path, r.node) for r in run.records]))
"""


def test_the_same_seed_repeats_a_run_in_another_process():
    """Every process hashes strings with a seed of its own: no order the policy sees may
    come from a set of names."""
    runs = [
        subprocess.run([sys.executable, "-c", PLACEMENTS_SCRIPT], capture_output=True,
                       text=True, check=True, env={**os.environ, "PYTHONHASHSEED": hash_seed})
        for hash_seed in ("1", "2")
    ]  # fmt: skip
    assert json.loads(runs[0].stdout) == json.loads(runs[1].stdout)


def test_a_simulated_run_reports_every_field():
    result = simulate(small_trace(), nodes=2, slots_per_node=40, seed=3)
    report = build_report(result)
    assert report["episodes"]["completed"] == 60
    for key in ("schedule_latency_ms", "utilisation", "queue_wait_share", "episodes_per_hour",
                "sandbox_seconds", "scale_events"):  # fmt: skip
        assert report[key] is not None, key
    assert set(report["schedule_latency_ms"]["by_path"]) <= {"warm", "thaw", "cold", "overflow"}
    assert 0 < report["utilisation"] < 1
    assert report["sandbox_seconds"]["local"] > 0 and report["sandbox_seconds"]["cloud"] == 0
    assert report["scale_events"]["create"] >= 1 and report["scale_events"]["release"] == 60
    assert result.meta["mode"] == "sim" and result.timeline
    # what its engines were asked, as Docker's events name it: a container made and
    # started for each create (its command loop booted with it: no exec); an end for
    # each release (recycle is off: its sandbox is killed), the removal later
    events = result.meta["engine_events"]
    assert events["create"] == events["start"] == report["scale_events"]["create"]
    assert "exec_start" not in events
    assert events["die"] == 60 and events["destroy"] <= events["die"]


def test_a_recycled_sandbox_is_reset_from_the_host_not_by_an_engine_exec():
    """As live (agent/host.py reset_from_host): a release to a recycling pool costs the
    engine nothing, and the reset keeps the command loop its container booted."""
    result = simulate(small_trace(), nodes=2, slots_per_node=40, seed=3,
                      params=PoolParams(recycle=True))  # fmt: skip
    events, actions = result.meta["engine_events"], build_report(result)["scale_events"]
    assert actions["recycle"] == 60
    assert events["create"] == actions["create"]
    assert "die" not in events and "exec_start" not in events


def test_episodes_per_hour_is_the_traces_rate_at_any_time_scale():
    """Every episode completes: the rate is the trace's, episodes over the span of its
    arrivals, whether it is replayed at its own pace or twice as fast."""
    trace = small_trace(30)
    rate = 30 * 3600 / (trace[-1].arrival_s - trace[0].arrival_s)
    for scale in (1.0, 0.5):
        result = simulate(trace, nodes=2, slots_per_node=40, seed=1, time_scale=scale)
        assert build_report(result)["episodes_per_hour"] == pytest.approx(rate, rel=1e-4)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_runs_the_same_trace(policy):
    params = PoolParams(min_warm=4)  # static keeps this many; the others start from it
    result = simulate(small_trace(30), policy=policy, nodes=2, slots_per_node=40, seed=1,
                      params=params, horizon_s=3600)  # fmt: skip
    report = build_report(result)
    assert report["episodes"]["completed"] == 30, policy
    assert report["policy"] == policy


def test_the_warm_pool_beats_cold_create_in_simulation():
    trace = small_trace(80)
    p99 = {
        policy: build_report(simulate(trace, policy=policy, nodes=2, slots_per_node=60, seed=2))[
            "schedule_latency_ms"]["p99"]
        for policy in ("dsec", "cold")
    }  # fmt: skip
    assert p99["dsec"] < p99["cold"]


def test_overflow_reaches_cloud_nodes_in_simulation():
    burst = generate(kind="burst", burst_size=30, burst_window_s=1, seed=1,
                     lifetime_p50_s=30, lifetime_p99_s=60, mean_step_s=10)  # fmt: skip
    result = simulate(burst, nodes=1, slots_per_node=10, cloud_nodes=1, seed=1,
                      params=PoolParams(min_warm=0, max_warm=0))  # fmt: skip
    kinds = {r.node_kind for r in result.records}
    assert kinds == {"local", "cloud"}
    assert result.sandbox_seconds["cloud"] > 0
    assert "overflow" in {r.path for r in result.records}


def test_a_horizon_stops_the_simulation():
    trace = generate(kind="poisson", n=40, rate_per_s=0.2, seed=1)  # long DSec lifetimes
    result = simulate(trace, nodes=2, slots_per_node=64, seed=1, horizon_s=100)
    assert result.meta["simulated_s"] == pytest.approx(100, abs=1)
    assert any(r.released_at_s is None for r in result.records)


def loaded_profile(lease_s: float, loaded_lease_s: float) -> Profile:
    """The default profile, with a lease of `lease_s` alone and `loaded_lease_s` while
    anything else runs on the engine."""
    profile = Profile.default(n=50)
    profile.samples["lease"] = [lease_s]
    return Profile(profile.samples, profile.engine_concurrency, "test",
                   {"lease": {1: [loaded_lease_s]}})  # fmt: skip


def test_a_profile_draws_from_the_highest_measured_load_and_slows_down_as_measured():
    profile = Profile({op: [1.0] for op in OPS}, under_load={"create": {1: [2.0], 3: [4.0]}})
    rng = random.Random(0)
    assert profile.contended
    assert [profile.draw("create", rng, load) for load in (0, 1, 2, 3, 7)] == [1, 2, 2, 4, 4]
    # the medians' ratio, interpolated; past the highest load the trend goes on
    slowdowns = [profile.slowdown("create", load) for load in (0, 0.5, 1, 2, 3, 7)]
    assert slowdowns == pytest.approx([1, 1.5, 2, 3, 4, 8])
    assert profile.slowdown("remove", 5) == 1.0  # not measured under load: as alone
    falling = Profile({op: [1.0] for op in OPS}, under_load={"create": {1: [3.0], 2: [2.0]}})
    assert falling.slowdown("create", 9) == 2.0  # a falling trend is noise: no growth
    assert not Profile.default(n=5).contended


def test_a_profile_saves_and_loads_its_samples_under_load(tmp_path):
    profile = Profile({op: [0.1, 0.2] for op in OPS}, 8, "here", {"lease": {1: [0.3], 4: [0.5]}})
    profile.engine_rates_per_s = {"create": 10.3, "exec": 24.0}
    profile.save(tmp_path / "p.json")
    loaded = Profile.load(tmp_path / "p.json")
    assert loaded.under_load == {"lease": {1: [0.3], 4: [0.5]}}
    assert loaded.engine_rates_per_s == {"create": 10.3, "exec": 24.0}
    assert (loaded.samples, loaded.engine_concurrency, loaded.source) == (
        profile.samples, 8, "here")  # fmt: skip
    data = json.loads((tmp_path / "p.json").read_text())
    data["under_load"] = {"lease": {"0": [0.1]}}
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="loads >= 1"):
        Profile.load(tmp_path / "bad.json")
    data["under_load"] = {"teleport": {"1": [0.1]}}
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="unknown operation"):
        Profile.load(tmp_path / "bad.json")
    del data["under_load"]
    data["engine_rates_per_s"] = {"exec": 0}
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="rates > 0"):
        Profile.load(tmp_path / "bad.json")
    # a profile saved before removes and execs had rates names the create rate alone
    del data["engine_rates_per_s"]
    data["create_rate_per_s"] = 12.5
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert Profile.load(tmp_path / "old.json").engine_rates_per_s == {"create": 12.5}


def test_an_engine_counts_its_operations_and_the_execs_under_way():
    engine = Engine(Profile.default(n=5))
    engine.exec_window(1.0, 2.0)
    engine.exec_window(1.5, 3.0)
    engine.running = 1
    assert [engine.load(t) for t in (0.0, 1.0, 1.6, 2.0, 3.5)] == [1, 2, 3, 2, 1]


def test_an_engine_shares_its_cores_as_the_load_changes():
    """Creates take 1 s alone and 2 s with one other under way (twice as slow): one
    started alone at 0 goes at full speed until a second starts at 0.5 s, then at half
    speed; the second finishes its first half second of work with the first."""
    profile = Profile({op: [1.0] for op in OPS}, under_load={"create": {1: [2.0]}})
    loop = VirtualTimeLoop()
    engine = Engine(profile)
    rng = random.Random(0)
    ended: dict[str, float] = {}

    async def create(name: str, at: float) -> None:
        await asyncio.sleep(at)
        await engine.run("create", rng)
        ended[name] = loop.time()

    async def main() -> None:
        await asyncio.gather(create("first", 0.0), create("second", 0.5))

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    # first: 0.5 s of work alone, the other 0.5 s at half speed: ends at 1.5 s; second
    # drew a 2 s duration under load 1 (1 s of work): 0.5 s done by 1.5 s, the rest alone
    assert ended == pytest.approx({"first": 1.5, "second": 2.0})
    assert engine.running == 0 and not engine.jobs


def test_an_engine_completes_no_more_creates_a_second_than_its_measured_rate():
    """Creates take 1 s alone and no longer beside others (cores to spare), but the
    engine completes 4 a second at most: 20 started together end over 5 s, not in 1."""
    profile = Profile({op: [1.0] for op in OPS}, under_load={"create": {1: [1.0]}})
    profile.engine_rates_per_s = {"create": 4.0}
    loop = VirtualTimeLoop()
    engine = Engine(profile)
    rng = random.Random(0)
    ended: list[float] = []

    async def create() -> None:
        await engine.run("create", rng)
        ended.append(loop.time())

    async def main() -> None:
        await asyncio.gather(*(create() for _ in range(20)))

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    assert max(ended) == pytest.approx(5.0)  # 20 at 4 a second
    assert engine.running == 0 and not engine.jobs


@pytest.mark.parametrize("exec_rate, create_ends_at", [(None, 1.0), (10.0, 2.925)])
def test_exec_starts_take_their_share_of_the_engine_though_nobody_waits_for_them(
    exec_rate, create_ends_at
):
    """20 exec starts handed over at 0 (their commands' windows, 10 ms each, given in
    advance) and a create (1 s alone, a quarter of the engine's throughput at 4 a
    second). At 10 execs a second, each exec start is 0.1 s of the whole engine: with
    all 20 and the create under way the engine is asked for 20.25 engine-seconds a
    second, so everything goes 20.25 times slower. The execs end at 2.025 s, a tenth of
    the create done; the rest alone: 2.925 s. Without an exec rate, execs only load it."""
    profile = Profile({op: [1.0] for op in OPS}, under_load={"create": {1: [1.0]}})
    profile.engine_rates_per_s = {"create": 4.0} | ({"exec": exec_rate} if exec_rate else {})
    loop = VirtualTimeLoop()
    engine = Engine(profile)
    ended: list[float] = []

    async def main() -> None:
        for _ in range(20):
            engine.exec_window(0.0, 0.01)
        await engine.run("create", random.Random(0))
        ended.append(loop.time())
        await asyncio.sleep(5)

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    assert ended == [pytest.approx(create_ends_at)]
    assert not engine.jobs and not engine.execs and engine.in_windows == [0, 0, 0]


def test_a_warm_acquire_is_served_at_its_claim_however_slow_its_lease_call():
    """Every acquire takes a warm sandbox and its claim starts a refill, so the lease
    call meets a create under way and takes the loaded time (50 times the quiet one).
    As in the control plane, the acquire does not wait for it: its token proves the
    lease to the agent, so a warm acquire takes no time at all in virtual time."""
    trace = generate(kind="poisson", n=40, rate_per_s=0.05, seed=3, lifetime_p50_s=5,
                     lifetime_p99_s=10, mean_step_s=5)  # fmt: skip
    params = PoolParams(min_warm=2)
    fast, slow = 0.001, 0.050
    quiet = simulate(trace, nodes=1, slots_per_node=20, seed=1, params=params,
                     profile=loaded_profile(fast, fast), shared_engine=True)  # fmt: skip
    loaded = simulate(trace, nodes=1, slots_per_node=20, seed=1, params=params,
                      profile=loaded_profile(fast, slow), shared_engine=True)  # fmt: skip
    warm = {
        name: [r.schedule_ms for r in run.records if r.path == "warm"]
        for name, run in (("quiet", quiet), ("loaded", loaded))
    }
    assert len(warm["quiet"]) >= 30 and len(warm["loaded"]) >= 30
    assert max(warm["quiet"]) == max(warm["loaded"]) == 0.0


def test_a_contended_simulation_is_the_same_for_the_same_seed():
    profile = Profile.default(n=200, seed=1)
    profile = Profile(profile.samples, 8, "test", {
        "lease": {1: [0.004, 0.006], 4: [0.02]},
        "create": {1: [0.25, 0.3], 3: [0.5]},
    })  # fmt: skip
    runs = [simulate(small_trace(), seed=4, nodes=2, slots_per_node=40, profile=profile,
                     shared_engine=True) for _ in range(2)]  # fmt: skip
    summary = [[(r.episode, r.schedule_ms, r.path, r.node) for r in run.records] for run in runs]
    assert summary[0] == summary[1]


def test_a_sandboxs_row_says_when_its_command_ended_without_a_change_of_its_own():
    """Rows are kept until the sandbox changes; a command that ends changes the row by
    the passing of time alone (active_at: None while it runs, then when it ended)."""
    spec = CreateSandbox(sandbox_id="n.0000000000000001", pool="p",
                         template=TemplateSpec(name="t", image="img"), request_id="r")  # fmt: skip
    sb = SimSandbox(S.WARM, Resources(1, 1, 1), spec, 0.0, RowChanges(), 0)
    assert sb.row(1.0).active_at == 0.0 and sb.row(2.0) is sb.row(1.0)
    sb.busy_s, sb.busy_until = 2.0, 5.0  # a command from now to 5
    assert sb.row(3.0).active_at is None and sb.row(4.9).active_at is None
    assert sb.row(5.0).active_at == 5.0 and sb.row(5.0).busy_s == 2.0
    sb.state = S.LEASED
    assert sb.row(6.0).state == S.LEASED


def one_node_with_a_sandbox_to_make(recyclable: bool):
    """A simulated node whose engine takes 10 ms for anything (an exec start a tenth of
    its throughput), its agents, and the spec of a sandbox to create on it."""
    profile = Profile({op: [0.01] for op in OPS}, under_load={"create": {1: [0.01]}})
    profile.engine_rates_per_s = {"exec": 10.0}
    agents = SimAgents(profile, random.Random(0), shared_engine=False)
    node = agents.add_node("n", "local", Resources(4, 4096, 4), {"img"})
    address = SimpleNamespace(id="n", url="sim://n")
    template = TemplateSpec(name="t", image="img", recyclable=recyclable)
    spec = CreateSandbox(sandbox_id="n.0000000000000001", pool="p", template=template,
                         request_id="r")  # fmt: skip
    return VirtualTimeLoop(), agents, node, address, spec


@pytest.mark.parametrize("recyclable", [True, False])
def test_a_new_sandboxs_commands_are_its_loops_from_the_first(recyclable):
    """As live: every container starts its command loop itself (agent/resident.py,
    boot_script), whether or not its template may be recycled (the agent finds the loop
    from the host for a reset to keep): a command at once after the create is handed to
    the loop (load only), and the engine does no exec for it. On the old code a
    recyclable template's loop was started by a detached engine exec, and a command
    before it was an engine exec too."""
    loop, agents, node, address, spec = one_node_with_a_sandbox_to_make(recyclable)
    seen: list[tuple[int, int]] = []  # (engine execs, loop commands) under way, per command

    async def main() -> None:
        assert (await agents.create(address, spec)).ok
        for _ in range(2):
            agents.run_command("n", spec.sandbox_id, loop.time(), 0.01, 1.0)
            await asyncio.sleep(0.005)  # inside the command's engine part
            node.engine.load(loop.time())  # brought up to now
            windows = node.engine.in_windows
            seen.append((windows[2], windows[0]))
            await asyncio.sleep(2.0)

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    assert seen == [(0, 1), (0, 1)]
    assert not node.engine.execs and not agents.background
    assert agents.engine_events == Counter(create=1, start=1)


def test_heartbeats_thinned_for_a_large_cluster_still_come_within_the_timeout(monkeypatch, caplog):
    """At DSec's scale the simulated agents report less often than every second (one
    report a sandbox per REPORTED_PER_S), but never so seldom that the control plane
    takes their nodes out of placement for silence (at 366,000 sandboxes it once did)."""
    monkeypatch.setattr("bench.sim.agents.REPORTED_PER_S", 0.2)  # 10 sandboxes: 50 s
    trace = generate(kind="poisson", n=40, rate_per_s=0.2, seed=3, lifetime_p50_s=200,
                     lifetime_p99_s=400, mean_step_s=20)  # fmt: skip
    with caplog.at_level(logging.WARNING):
        result = simulate(trace, nodes=2, slots_per_node=40, seed=1)
    assert "missed heartbeats" not in caplog.text
    assert all(r.error is None and r.released_at_s is not None for r in result.records)
