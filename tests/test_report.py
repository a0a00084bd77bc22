"""Reports built from hand-made runs: every field, the arithmetic behind each, the files
and plots written, and comparisons of several reports."""

from __future__ import annotations

import argparse
import json

import pytest

from bench.generate import generate, summarize
from bench.records import EpisodeRecord, RunResult, TimelineSample
from bench.replay import add_compare_arguments, add_replay_arguments, run_compare, run_replay
from bench.report import (
    build_report,
    compare_reports,
    executing_over_time,
    load_report,
    write_report,
)
from bench.sim.profile import Profile
from dsec.trace import dump_trace

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
REPORT_FIELDS = {
    "trace",
    "policy",
    "params",
    "mode",
    "seed",
    "time_scale",
    "episodes",
    "schedule_latency_ms",
    "utilisation",
    "queue_wait_share",
    "episodes_per_hour",
    "sandbox_seconds",
    "scale_events",
}
QUANTILES = {"p50", "p95", "p99", "max"}


def record(name: str, requested: float, acquired: float | None, released: float | None, **kw):
    return EpisodeRecord(
        episode=name,
        pool="default",
        template="base",
        arrival_s=requested,
        requested_at_s=requested,
        acquired_at_s=acquired,
        released_at_s=released,
        **kw,
    )


def hand_made_run(policy: str = "dsec", latency_offset_ms: float = 0.0) -> RunResult:
    """Four episodes: two complete, one fails an exec but releases, one never gets a sandbox."""
    records = [
        record(
            "e1", 0.0, 1.0, 11.0, schedule_ms=5.0 + latency_offset_ms, path="warm",
            node="n-1", node_kind="local", exec_s=[1.0, 3.0], busy_s=4.0, idle_s=6.0,
        ),
        record(
            "e2", 2.0, 4.0, 12.0, schedule_ms=2000.0 + latency_offset_ms, path="cold",
            node="n-2", node_kind="local", exec_s=[3.0], busy_s=3.0, idle_s=5.0,
        ),
        record(
            "e3", 3.0, 3.5, 9.0, schedule_ms=20.0 + latency_offset_ms, path="warm",
            node="n-cloud-1", node_kind="cloud", exec_s=[0.5], busy_s=0.5, idle_s=1.0,
            error="exec: exit code 1",
        ),
        record("e4", 5.0, None, None, error="acquire: 408 acquire_timeout: no sandbox in time"),
    ]  # fmt: skip
    timeline = [
        TimelineSample(t_s=float(t), queue_depth=1 if t < 4 else 0,
                       sandboxes={"warm": 2, "leased": min(t, 3)}, leased=min(t, 3),
                       alive=2 + min(t, 3))
        for t in range(13)
    ]  # fmt: skip
    return RunResult(
        records=records,
        timeline=timeline,
        sandbox_seconds={"local": 30.0, "cloud": 6.0},
        busy_seconds=9.0,
        scale_events={"release": 3, "create": 4},
        meta={
            "trace": "trace.jsonl",
            "policy": policy,
            "params": {"default": {"min_warm": 2}},
            "mode": "live",
            "seed": 7,
            "time_scale": 0.5,
            "nodes": 2,
            "slots_per_node": 8,
            "wall_s": 12.5,
        },
    )


def test_the_report_has_every_field_and_is_strict_json():
    report = build_report(hand_made_run())
    assert REPORT_FIELDS <= report.keys()
    assert QUANTILES <= report["schedule_latency_ms"].keys()
    for by_path in report["schedule_latency_ms"]["by_path"].values():
        assert QUANTILES <= by_path.keys()
    assert report["sandbox_seconds"].keys() == {"local", "cloud"}
    assert report["episodes"].keys() == {"total", "completed", "failed"}
    json.dumps(report, allow_nan=False)


def test_the_report_says_what_the_run_was():
    report = build_report(hand_made_run())
    assert (report["trace"], report["policy"], report["mode"]) == ("trace.jsonl", "dsec", "live")
    assert (report["seed"], report["time_scale"]) == (7, 0.5)
    assert report["params"] == {"default": {"min_warm": 2}}
    assert (report["nodes"], report["slots_per_node"], report["wall_s"]) == (2, 8, 12.5)


def test_utilisation_is_busy_time_over_every_sandbox_second_local_and_cloud():
    assert build_report(hand_made_run())["utilisation"] == 9.0 / (30.0 + 6.0)


def test_queue_wait_share_is_waiting_over_request_to_release_of_served_episodes():
    # e1 waits 1 of 11 s, e2 2 of 10, e3 0.5 of 6; e4 was never served and is left out
    assert build_report(hand_made_run())["queue_wait_share"] == round(3.5 / 27.0, 4)


def test_episodes_per_hour_counts_completed_episodes_over_the_traces_arrivals():
    # two completed episodes; arrivals from 0 s to 5 s of a replay at time scale 0.5: 10 s
    # of the trace (neither the replay's 5 s nor the 12 s to the last release)
    report = build_report(hand_made_run())
    assert report["episodes_per_hour"] == 2 * 3600 / 10
    assert report["episodes"] == {"total": 4, "completed": 2, "failed": 2}


def test_episodes_per_hour_does_not_count_the_tail_of_long_episodes():
    run = hand_made_run()
    for r in run.records:
        if r.released_at_s is not None:
            r.released_at_s += 3600.0  # an hour longer each: the trace's rate is the same
    assert build_report(run)["episodes_per_hour"] == 2 * 3600 / 10


def test_schedule_latency_quantiles_overall_and_by_path():
    latency = build_report(hand_made_run())["schedule_latency_ms"]
    # nearest rank over 5, 20, 2000 ms
    assert (latency["p50"], latency["p95"], latency["p99"], latency["max"]) == (
        20,
        2000,
        2000,
        2000,
    )
    assert list(latency["by_path"]) == ["warm", "cold"]  # docs/contracts.md's order of paths
    assert latency["by_path"]["warm"] == {"n": 2, "p50": 5.0, "p95": 20.0, "p99": 20.0, "max": 20.0}
    assert latency["by_path"]["cold"]["p50"] == 2000.0


def test_sandbox_seconds_and_scale_events_are_carried_over():
    report = build_report(hand_made_run())
    assert report["sandbox_seconds"] == {"local": 30.0, "cloud": 6.0}
    assert report["scale_events"] == {"create": 4, "release": 3}


def test_a_run_with_nothing_to_measure_reports_nulls_not_nan():
    run = hand_made_run()
    run.records = [record("e1", 0.0, None, None, error="acquire: refused")]
    run.sandbox_seconds, run.busy_seconds = {}, 0.0
    report = build_report(run)
    latency = report["schedule_latency_ms"]
    assert (latency["p50"], latency["max"], latency["by_path"]) == (None, None, {})
    assert report["utilisation"] is None
    assert report["queue_wait_share"] is None
    assert report["episodes_per_hour"] is None
    assert report["sandbox_seconds"] == {"local": 0.0, "cloud": 0.0}
    json.dumps(report, allow_nan=False)


def test_executing_over_time_spreads_each_episodes_busy_time_over_its_hold():
    # e1 executes 4 s of its 10 s hold (1-11 s), e2 3 of 8 (4-12 s), e3 0.5 of 5.5 (3.5-9 s)
    at = executing_over_time(hand_made_run(), [0.0, 2.0, 5.0, 10.0, 11.5, 13.0])
    expected = [0.0, 0.4, 0.4 + 3 / 8 + 0.5 / 5.5, 0.4 + 3 / 8, 3 / 8, 0.0]
    assert at == pytest.approx(expected)


def test_write_report_writes_json_markdown_latencies_and_real_pngs(tmp_path):
    run = hand_made_run()
    out = write_report(run, tmp_path / "dsec-live")
    assert json.loads((out / "report.json").read_text()) == build_report(run)
    assert json.loads((out / "latencies.json").read_text()) == {
        "warm": [5.0, 20.0],
        "cold": [2000.0],
    }
    markdown = (out / "report.md").read_text()
    assert "# Replay report: dsec (live)" in markdown
    assert "| utilisation (busy / sandbox lifetime) | 25.0% | > 30% |" in markdown
    assert "| warm | 2 | 5.0 | 20.0 | 20.0 | 20.0 |" in markdown
    for png in ("latency_cdf.png", "timeline.png"):
        data = (out / png).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000


def test_write_report_draws_a_run_without_timeline_or_latencies(tmp_path):
    run = hand_made_run()
    run.records, run.timeline = [record("e1", 0.0, None, None, error="acquire: refused")], []
    out = write_report(run, tmp_path / "empty")
    for png in ("latency_cdf.png", "timeline.png"):
        assert (out / png).read_bytes().startswith(PNG_MAGIC)


def test_compare_overlays_reports_and_tabulates_them(tmp_path):
    ours = write_report(hand_made_run("dsec"), tmp_path / "dsec-live")
    cold = write_report(hand_made_run("cold", latency_offset_ms=500.0), tmp_path / "cold-live")
    again = write_report(hand_made_run("dsec"), tmp_path / "dsec-live-2")
    comparison = compare_reports([ours, cold, again], tmp_path / "compare")
    rows = comparison["reports"]
    assert [row["report"] for row in rows] == [
        "dsec (live)",
        "cold (live)",
        "dsec (live) dsec-live-2",  # same policy and mode twice: told apart by directory
    ]
    assert rows[1]["p50_ms"] == 520.0
    assert rows[0] == {
        "report": "dsec (live)",
        "policy": "dsec",
        "mode": "live",
        "p50_ms": 20.0,
        "p95_ms": 2000.0,
        "p99_ms": 2000.0,
        "utilisation": 0.25,
        "queue_wait_share": round(3.5 / 27, 4),
        "episodes_per_hour": 720.0,  # over the trace's arrivals: 2 in 10 s of the trace
        "sandbox_seconds_local": 30.0,
        "sandbox_seconds_cloud": 6.0,
    }
    assert json.loads((tmp_path / "compare" / "compare.json").read_text()) == comparison
    assert (
        "| cold (live) | cold | live | 520.0 |" in (tmp_path / "compare" / "compare.md").read_text()
    )
    assert (tmp_path / "compare" / "latency_cdf.png").read_bytes().startswith(PNG_MAGIC)
    report, latencies = load_report(cold)
    assert report["policy"] == "cold" and latencies["cold"] == [2500.0]


def compare_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_compare_arguments(parser)
    return parser.parse_args(argv)


def test_the_compare_command_prints_json_or_a_table(tmp_path, capsys):
    ours = write_report(hand_made_run("dsec"), tmp_path / "dsec-live")
    cold = write_report(hand_made_run("cold"), tmp_path / "cold-live")
    out = tmp_path / "compare"
    assert (
        run_compare(compare_args("--reports", str(ours), str(cold), "--out", str(out), "--json"))
        == 0
    )
    printed = json.loads(capsys.readouterr().out)
    assert [row["policy"] for row in printed["reports"]] == ["dsec", "cold"]
    assert run_compare(compare_args("--reports", str(ours), str(cold), "--out", str(out))) == 0
    assert "| dsec (live) | dsec | live |" in capsys.readouterr().out


def test_the_compare_command_refuses_a_directory_without_a_report(tmp_path, capsys):
    assert run_compare(compare_args("--reports", str(tmp_path), "--out", str(tmp_path / "c"))) == 2
    error = capsys.readouterr().err
    assert (
        error.startswith("dsec bench compare: cannot read the reports") and error.count("\n") == 1
    )


def test_the_replay_command_runs_each_baseline_at_its_best_configuration(tmp_path, capsys):
    # a static pool sized at the trace's peak, autoscalers bounded by the cluster's slots
    trace = tmp_path / "trace.jsonl"
    # minutes-long lifetimes, not DSec's hours: the same peak to size for, simulated quickly
    episodes = generate(
        "poisson", duration_s=60, rate_per_s=0.5, seed=3, lifetime_p50_s=60, lifetime_p99_s=300
    )
    dump_trace(episodes, trace)
    peak = int(summarize(episodes)["peak_concurrency"])
    assert peak > 7  # more than a node's slots: the static pool's size is the trace's peak
    parser = argparse.ArgumentParser()
    add_replay_arguments(parser)
    for policy, field, expected in (("static", "min_warm", peak), ("keda", "max_warm", 2 * 7)):
        argv = ["--trace", str(trace), "--mode", "sim", "--policy", policy, "--json"]
        argv += ["--nodes", "2", "--slots-per-node", "7", "--out", str(tmp_path / policy)]
        assert run_replay(parser.parse_args(argv)) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["params"][field] == expected, (policy, report["params"])


def test_sim_replay_takes_a_profile_and_shares_one_engine_unless_told(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    dump_trace(generate("poisson", duration_s=20, rate_per_s=0.5, seed=4, lifetime_p50_s=10,
                        lifetime_p99_s=30), trace)  # fmt: skip
    profile = tmp_path / "engine.json"
    Profile.default(n=200, seed=1).save(profile)
    parser = argparse.ArgumentParser()
    add_replay_arguments(parser)
    base = ["--trace", str(trace), "--mode", "sim", "--json"]
    for extra, shared, source in (
        ([], True, None),  # as dsec up: three agents on one engine
        (["--no-shared-engine", "--profile", str(profile)], False, profile),
    ):
        argv = [*base, *extra, "--out", str(tmp_path / f"out-{shared}")]
        assert run_replay(parser.parse_args(argv)) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["shared_engine"] is shared
        if source is not None:
            assert report["profile"] == Profile.load(source).source
    for bad, says in (
        (["--profile", str(tmp_path / "missing.json")], "missing.json"),
        (["--profile", str(trace)], "profile"),  # not a profile
    ):
        assert run_replay(parser.parse_args([*base, *bad])) == 2
        err = capsys.readouterr().err
        assert err.startswith("dsec bench replay:") and says in err and err.count("\n") == 1
    live = ["--trace", str(trace), "--mode", "live", "--profile", str(profile)]
    assert run_replay(parser.parse_args(live)) == 2
    assert "--profile is for --mode sim" in capsys.readouterr().err
