"""bench.rollout: a tiny rollout step on the Python template, and its targets."""

from __future__ import annotations

import asyncio
import io
import json
import tarfile

from conftest import pool_containers

from bench.rollout import SIDES, Step, main, render, rollout, step_figures, targets
from bench.rollout_repo import (
    ToolCall,
    check_output,
    check_result,
    expected_result,
    make_repo,
    tool_calls,
)
from dsec.client import DsecError, SandboxLost


def side(episodes_per_hour: float, call_p50: float, open_p99: float, failures: int = 0) -> dict:
    summary = {"n": 1, "p50": call_p50, "p95": call_p50, "p99": call_p50, "max": call_p50}
    return {
        "episodes": 64 - failures, "failures": failures, "failure_samples": [],
        "infra_faults_per_1000": 0.0, "wall_s": 60.0,
        "episodes_per_hour": episodes_per_hour, "open_ms": {**summary, "p99": open_p99},
        "open_ms_by_path": {"warm": {**summary, "p99": open_p99}}, "open_schedule_ms": summary,
        "upload_ms": summary, "tool_call_ms": summary, "tool_call_ms_by_kind": {"ls": summary},
        "read_ms": summary, "close_ms": summary, "containers_cpu_s": 10.0,
        "cpu_per_episode_s": 0.2, "share_of_cores": 0.1, "host_busy": 0.9,
        "ceiling_episodes_per_hour": 36_000.0,
    }  # fmt: skip


def churn(episodes_per_s: float, exec_p50: float, failures: int = 0) -> dict:
    e = {"n": 1, "p50": exec_p50, "p95": exec_p50, "p99": exec_p50, "max": exec_p50}
    return {"completed": 60 - failures, "failures": failures, "failure_samples": [],
            "wall_s": 10.0, "episodes_per_s": episodes_per_s, "exec_ms": e}  # fmt: skip


def report(dsec: dict, sdk: dict, llm: dict, c_dsec: dict, c_llm: dict, left: int = 0) -> dict:
    return {
        "image": "img", "groups": 8, "k": 8, "concurrency": 16, "rounds": 1, "calls": [["ls"]],
        "repo_bytes": 5_000_000, "nodes": 3, "cores": 2,
        "sides": {"dsec": dsec, "sdk": sdk, "llm-sandbox": llm},
        "by_round": [{"dsec": dsec, "sdk": sdk, "llm-sandbox": llm}],
        "engine_ops_dsec_rollout": {}, "tool_calls_dsec": 1280,
        "churn": {"dsec": c_dsec, "llm-sandbox": c_llm, "by_round": [], "engine_ops_dsec": {},
                  "execs_dsec": 180},
        "leftovers": {"pool_swept_at_stop": 0, "pool_left": left, "floor_swept_at_close": 0,
                      "floor_left": 0},
    }  # fmt: skip


def verdicts(r: dict) -> dict[str, str]:
    return {t["target"]: t["verdict"] for t in targets(r)}


def test_each_target_is_a_ratio_within_the_run_and_its_limit_is_inclusive():
    r = report(side(600, 50, 50), side(300, 100, 500), side(200, 90, 400),
               churn(30, 50), churn(10, 100))  # fmt: skip
    assert set(verdicts(r).values()) == {"PASS"}, targets(r)
    assert "MISS" not in render(r | {"targets": targets(r)})
    r = report(side(599, 51, 50.1), side(300, 100, 500), side(200, 90, 400),
               churn(29, 51), churn(10, 100), left=1)  # fmt: skip
    assert verdicts(r) == {
        "episodes/hour / sdk's": "MISS",
        "episodes/hour / llm-sandbox's": "MISS",
        "tool-call p50 / bare docker exec's": "MISS",
        "acquire p99 ms": "MISS",
        "churn: exec p50 / llm-sandbox's": "MISS",
        "churn: episodes/s / llm-sandbox's": "MISS",
        "containers left behind": "MISS",
    }


def test_a_failed_dsec_episode_is_a_miss_however_fast_and_a_baselines_is_only_noted():
    fast = side(6000, 1, 1, failures=1)
    r = report(fast, side(300, 100, 500), side(200, 90, 400), churn(300, 1, failures=2),
               churn(10, 100))  # fmt: skip
    found = {t["target"]: t for t in targets(r)}
    for name in ("episodes/hour / sdk's", "tool-call p50 / bare docker exec's", "acquire p99 ms",
                 "churn: episodes/s / llm-sandbox's"):  # fmt: skip
        assert found[name]["verdict"] == "MISS" and "failed" in found[name]["note"]
    r = report(side(600, 50, 50), side(300, 100, 500, failures=3), side(200, 90, 400),
               churn(30, 50), churn(10, 100))  # fmt: skip
    found = {t["target"]: t for t in targets(r)}
    assert found["episodes/hour / sdk's"]["verdict"] == "PASS"
    assert "sdk: 3 failed" in found["episodes/hour / sdk's"]["note"]


def test_the_repo_is_deterministic_per_group_and_its_result_and_calls_are_checked():
    repo = make_repo(2)
    assert make_repo(2).tar == repo.tar and make_repo(3).tar != repo.tar
    assert 4.5e6 < repo.size_bytes < 6e6
    with tarfile.open(fileobj=io.BytesIO(repo.tar)) as tar:
        names = tar.getnames()
        assert all(n == "repo" or n.startswith("repo/") for n in names)
        assert {m.uid for m in tar.getmembers()} == {1000}
    assert "repo/tests/test_pkg.py" in names and "repo/scripts/report.py" in names
    kinds = [c.kind for c in tool_calls()]
    assert len(kinds) == 20 and set(kinds) == {"python", "pytest", "grep", "cat", "write", "ls"}
    good = json.dumps(expected_result(repo)).encode()
    assert check_result(repo, good) is None
    assert check_result(make_repo(3), good) is not None  # another group's digest
    assert check_result(repo, b"not json") is not None
    pytest_call = ToolCall("pytest", ["python3", "-m", "pytest"])
    assert check_output(pytest_call, 0, b"4 passed in 0.05s\n") is None
    assert check_output(pytest_call, 0, b"no tests ran\n") is not None
    assert check_output(pytest_call, 1, b"1 failed, 3 passed\n") is not None


def test_a_tiny_rollout_runs_every_episode_on_each_side_and_leaves_nothing(docker_client, capsys):
    code = main(["--groups", "1", "--k", "2", "--concurrency", "2", "--rounds", "1",
                 "--churn-episodes", "2", "--churn-concurrency", "2", "--json"])  # fmt: skip
    r = json.loads(capsys.readouterr().out)
    assert code == (1 if "MISS" in {t["verdict"] for t in r["targets"]} else 0)
    for name in SIDES:
        s = r["sides"][name]
        # each episode's pytest runs said "passed" and its result.json was as expected
        assert (s["episodes"], s["failures"]) == (2, 0), s["failure_samples"]
        assert s["tool_call_ms_by_kind"]["pytest"]["n"] == 6
        assert s["read_ms"]["n"] == 2 and s["upload_ms"]["n"] == 2
    for name in ("dsec", "llm-sandbox"):
        assert (r["churn"][name]["completed"], r["churn"][name]["failures"]) == (2, 0)
    # the dsec side's commands went through the sandboxes' command loops
    assert r["engine_ops_dsec_rollout"].get("exec_start", 0) == 0
    assert r["leftovers"]["pool_left"] == r["leftovers"]["floor_left"] == 0
    assert not pool_containers(docker_client, "bench-floor-")


class FailingSession:
    """An episode whose first tool call fails with `error`: what rollout() counts."""

    opened_by = "warm"
    schedule_s = 1.0

    def __init__(self, error: Exception) -> None:
        self.error = error

    async def open(self) -> None:
        pass

    async def upload(self, repo) -> None:
        pass

    async def run(self, call):
        raise self.error

    async def read_result(self) -> bytes:
        raise AssertionError("not reached")

    async def close(self) -> None:
        pass


def test_infra_faults_per_1000_counts_only_the_lost_samples_a_trainer_masks():
    said = DsecError(502, "node_unreachable", "gone")
    errors = [
        SandboxLost(said, "node_lost"),  # infrastructure: masked
        SandboxLost(said, "oom_killed"),  # the workload's own: a real zero reward
        DsecError(500, "internal", "not a lost lease"),
        SandboxLost(said, "engine_lost"),
    ]
    step = Step()
    repo = make_repo(0)
    for i, error in enumerate(errors):
        asyncio.run(rollout(step, lambda e=error: FailingSession(e), repo, tool_calls(), i))
    figures = step_figures(step)
    assert (figures["episodes"], figures["failures"]) == (0, 4)
    assert figures["infra_faults_per_1000"] == 500.0  # 2 of 4 started
    assert "500.0" in render_row_of(figures)


def render_row_of(figures: dict) -> str:
    good = side(1.0, 1.0, 1.0)
    r = report(good | figures, good, good, churn(1.0, 1.0), churn(1.0, 1.0))
    return render(r | {"targets": targets(r)})
