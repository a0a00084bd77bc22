"""Live replay on real Docker: a small trace played against a pool the replay starts, and
through `dsec bench replay --mode live --json` against a running one; plus the pieces the
replay reads from the control plane, and the command's refusals."""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest
from conftest import STARTED_POOLS, make_spec

from agent.docker_driver import LABEL_NODE
from bench.records import SCHEDULE_PATHS
from bench.replay import add_replay_arguments, run_replay
from bench.replay_live import parse_metric_totals, replay_live, timeline_sample
from bench.report import build_report, write_report
from dsec.models import PoolInfo, PoolList, PoolParams
from dsec.trace import Episode, Step, dump_trace

pytestmark = pytest.mark.asyncio(loop_scope="module")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TIME_SCALE = 0.5
THINK_S, EXEC_S = 0.4, 0.3


def containers_of(docker_client, node_prefix: str) -> list[str]:
    """Names of the containers of nodes named ``node_prefix...``. Sparse: other test sessions
    on this engine remove containers between a listing and its per-container inspect."""
    listed = docker_client.containers.list(all=True, sparse=True, filters={"label": LABEL_NODE})
    return [c.name for c in listed if c.attrs["Labels"][LABEL_NODE].startswith(node_prefix)]


def small_trace(pool: str = "default", n: int = 12) -> list[Episode]:
    """``n`` episodes arriving over about a second, of 2 or 3 steps; the first exec of the
    first episode takes no time (the replay runs `true` for it)."""
    episodes = []
    for i in range(n):
        first = Step(think_s=THINK_S, exec_s=0.0 if i == 0 else EXEC_S)
        rest = [Step(think_s=THINK_S, exec_s=EXEC_S)] * (1 + i % 2)
        episodes.append(
            Episode(episode=f"e{i}", arrival_s=i * 0.15, pool=pool, steps=[first, *rest])
        )
    return episodes


async def test_a_small_live_replay_on_its_own_pool_reports_every_field(docker_client, tmp_path):
    spec = make_spec(tmp_path, nodes=2, pool=PoolParams(min_warm=2))
    STARTED_POOLS.add(spec.name)  # the session's leftover check covers this pool too
    episodes = small_trace()
    result = await replay_live(
        episodes, pool_spec=spec, time_scale=TIME_SCALE, progress=False, trace="small", seed=3
    )
    assert not containers_of(docker_client, spec.name + "-"), "the replay's pool is gone"

    assert [r.episode for r in result.records] == [e.episode for e in episodes]
    for record, episode in zip(result.records, episodes, strict=True):
        assert record.error is None and record.completed
        assert record.path in SCHEDULE_PATHS and record.schedule_ms > 0
        assert record.node.startswith(spec.name + "-") and record.node_kind == "local"
        assert record.arrival_s == episode.arrival_s * TIME_SCALE
        assert record.requested_at_s >= record.arrival_s
        assert record.requested_at_s <= record.acquired_at_s < record.released_at_s
        assert len(record.exec_s) == len(episode.steps)
        for took_s, step in zip(record.exec_s, episode.steps, strict=True):
            assert took_s >= step.exec_s * TIME_SCALE  # an exec lasts at least its sleep
        assert record.busy_s == pytest.approx(sum(record.exec_s))
        assert record.idle_s >= 0.95 * THINK_S * TIME_SCALE * len(episode.steps)
    assert result.timeline and result.timeline[-1].leased == 0
    times = [sample.t_s for sample in result.timeline]
    assert times == sorted(times)
    assert max(sample.leased for sample in result.timeline) > 0
    assert result.sandbox_seconds["local"] > 0 and result.sandbox_seconds["cloud"] == 0
    assert 0 < result.busy_seconds <= sum(r.busy_s for r in result.records)
    assert result.scale_events["release"] == len(episodes)

    report = build_report(result)
    assert (report["policy"], report["mode"], report["trace"], report["seed"]) == (
        "dsec",
        "live",
        "small",
        3,
    )
    assert (report["time_scale"], report["nodes"], report["slots_per_node"]) == (
        TIME_SCALE,
        2,
        spec.capacity.slots,
    )
    assert report["params"]["default"]["min_warm"] == 2
    assert report["episodes"] == {"total": 12, "completed": 12, "failed": 0}
    latency = report["schedule_latency_ms"]
    assert latency["n"] == 12 and 0 < latency["p50"] <= latency["p99"] <= latency["max"]
    assert set(latency["by_path"]) <= set(SCHEDULE_PATHS)
    assert sum(by_path["n"] for by_path in latency["by_path"].values()) == 12
    assert 0 < report["utilisation"] <= 1
    assert 0 <= report["queue_wait_share"] < 1
    assert report["episodes_per_hour"] > 0
    assert report["scale_events"]["release"] == 12
    json.dumps(report, allow_nan=False)

    out = write_report(result, tmp_path / "report")
    for png in ("latency_cdf.png", "timeline.png"):
        assert (out / png).read_bytes().startswith(PNG_MAGIC)


def replay_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_replay_arguments(parser)
    return parser.parse_args(argv)


async def test_the_replay_command_replays_live_against_a_running_pool(
    pool, tmp_path, capsys, monkeypatch
):
    # a pool the control plane does not have yet: the replay creates it (admin token)
    trace = tmp_path / "trace.jsonl"
    dump_trace(small_trace(pool="replay-cli", n=6), trace)
    monkeypatch.setenv("DSEC_TOKEN", pool.tokens.client)
    monkeypatch.setenv("DSEC_ADMIN_TOKEN", pool.tokens.admin)
    args = replay_args(
        "--trace", str(trace), "--mode", "live", "--url", pool.url,
        "--time-scale", str(TIME_SCALE), "--out", str(tmp_path / "out"), "--json",
    )  # fmt: skip
    # run_replay runs its own event loop, as the command line does: a thread of its own
    assert await asyncio.to_thread(run_replay, args) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads((tmp_path / "out" / "report.json").read_text())
    assert printed["episodes"] == {"total": 6, "completed": 6, "failed": 0}
    assert (printed["mode"], printed["policy"], printed["trace"]) == ("live", "dsec", str(trace))
    assert "replay-cli" in printed["params"]
    for name in ("latencies.json", "report.md", "latency_cdf.png", "timeline.png"):
        assert (tmp_path / "out" / name).stat().st_size > 0


async def test_the_replay_command_refuses_a_bad_trace_in_one_line(tmp_path, capsys):
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"episode": "e1", "arrival_s": -1, "steps": []}\n')
    assert run_replay(replay_args("--trace", str(trace), "--mode", "live")) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"dsec bench replay: {trace} line 1: ") and error.count("\n") == 1


async def test_metric_totals_sum_over_pools_and_subtract():
    def exposition(node_seconds: float, busy: float, creates: float) -> str:
        return (
            "# TYPE dsec_sandbox_node_seconds_total counter\n"
            f'dsec_sandbox_node_seconds_total{{pool="a",kind="local"}} {node_seconds}\n'
            'dsec_sandbox_node_seconds_total{pool="b",kind="local"} 10\n'
            'dsec_sandbox_node_seconds_total{pool="b",kind="cloud"} 5\n'
            "# TYPE dsec_sandbox_busy_seconds_total counter\n"
            f'dsec_sandbox_busy_seconds_total{{pool="a"}} {busy}\n'
            'dsec_sandbox_busy_seconds_total{pool="b"} 1\n'
            "# TYPE dsec_scale_events_total counter\n"
            f'dsec_scale_events_total{{pool="a",action="create"}} {creates}\n'
            'dsec_scale_events_total{pool="b",action="create"} 1\n'
            'dsec_scale_events_total{pool="b",action="freeze"} 2\n'
        )

    before = parse_metric_totals(exposition(100, 4, 3))
    assert before.sandbox_seconds == {"local": 110, "cloud": 5}
    assert before.busy_seconds == 5
    assert before.scale_events == {"create": 4, "freeze": 2}
    spent = parse_metric_totals(exposition(160, 9, 8)).minus(before)
    assert spent.sandbox_seconds == {"local": 60, "cloud": 0}
    assert spent.busy_seconds == 5
    assert spent.scale_events == {"create": 5, "freeze": 0}


async def test_a_timeline_sample_sums_pools_and_counts_leased_and_alive():
    params = PoolParams()
    pools = PoolList(
        pools=[
            PoolInfo(
                name="a",
                params=params,
                queue_depth=3,
                sandboxes={"warm": 2, "leased": 4, "gone": 7, "hibernated": 1},
            ),
            PoolInfo(
                name="b",
                params=params,
                queue_depth=1,
                sandboxes={"leased_paused": 1, "paused": 2, "creating": 1},
            ),
        ]
    )
    sample = timeline_sample(4.5, pools)
    assert (sample.t_s, sample.queue_depth) == (4.5, 4)
    assert sample.sandboxes == {
        "warm": 2,
        "leased": 4,
        "hibernated": 1,
        "leased_paused": 1,
        "paused": 2,
        "creating": 1,
    }
    assert sample.leased == 5  # leased, and leased but paused while its agent thinks
    assert sample.alive == 10  # all but hibernated, which hold files, not a slot
