"""bench.trace_floor: a trace played on the engine alone, no pool."""

from __future__ import annotations

import json

import pytest
from conftest import pool_containers

from bench.trace_floor import engine_demand, main
from dsec.trace import Episode, Step


def episode(name: str, arrival_s: float, steps: int) -> Episode:
    return Episode(episode=name, arrival_s=arrival_s, pool="default", template="base",
                   steps=[Step(think_s=0.05, exec_s=0.1)] * steps)  # fmt: skip


def test_the_engine_demand_is_each_episodes_work_at_the_engines_rates_over_the_span():
    episodes = [episode("a", 0.0, 3), episode("b", 1.0, 1), episode("c", 2.0, 1)]
    rates = {"create": 10.0, "remove": 20.0, "exec": 25.0}
    # 3 creates (0.3 s), 3 removes (0.15 s), 5 execs (0.2 s): 0.65 s of work in 2 s
    assert engine_demand(episodes, rates, 1.0) == pytest.approx(0.325)
    assert engine_demand(episodes, rates, 2.0) == pytest.approx(0.1625)  # played slower


def test_a_trace_played_on_the_engine_alone_reports_every_episode_and_leaves_nothing(
    docker_client, tmp_path, capsys
):
    trace = tmp_path / "t.jsonl"
    episodes = [episode("a", 0.0, 2), episode("b", 0.2, 1), episode("c", 0.4, 2)]
    trace.write_text("".join(e.model_dump_json() + "\n" for e in episodes))
    assert main(["--trace", str(trace), "--threads", "4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["episodes"] == 3 and report["failures"] == [] and report["left_behind"] == 0
    assert report["start_ms"]["n"] == 3 and report["start_ms"]["p50"] > 0
    assert report["exec_overhead_ms"]["n"] == 5  # one per step
    assert report["remove_ms"]["n"] == 3
    assert report["wall_s"] >= 0.4 + 2 * 0.15  # the last arrival's own steps
    assert not pool_containers(docker_client, "bench-floor-")


def test_bad_flags_and_a_bad_trace_are_refused_before_the_engine_is_touched(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"episode": "a"}\n')
    assert main(["--trace", str(bad)]) == 2
    assert "bad.jsonl" in capsys.readouterr().err
    assert main(["--trace", str(bad), "--threads", "0"]) == 2
    assert "--threads" in capsys.readouterr().err
