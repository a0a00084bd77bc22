"""bench.burst's announced-burst targets hold the pool to what its prewarm promised:
a p99 and a warm share when the prewarm said it would make its deadline, neither (SKIP,
with its own estimate) when it said it would not."""

from __future__ import annotations

import argparse

from bench.burst import render, targets


def report(meets_deadline: bool, warm: int, p99: float) -> dict:
    summary = {"n": 200, "p50": 1.0, "p95": 1.0, "p99": p99, "max": p99}
    floor = {"client_ms": {**summary, "p99": 1000.0}, "failures": 0}
    return {
        "floor": floor,
        "fresh": {"client_ms": {**summary, "p99": 500.0}, "served": 200, "failures": 0},
        "announced": {
            "prewarm": {"ready_by": 1045.0, "meets_deadline": meets_deadline},
            "prewarm_wall": 1000.0,
            "client_ms": summary,
            "failures": 0,
            "paths": {"warm": warm, "cold": 200 - warm},
        },
        "leftovers": {"pool_left": 0, "floor_left": 0},
    }


def verdicts(r: dict) -> dict[str, tuple[str, str]]:
    args = argparse.Namespace(size=200, announce_s=30.0, skip_prewarm=False, skip_refill=True)
    return {t["target"]: (t["verdict"], t["note"]) for t in targets(r, args)}


def test_a_prewarm_that_promised_is_held_to_a_warm_burst():
    got = verdicts(report(True, warm=199, p99=80.0))
    assert got["announced: p99 ms (prewarm 30 s ahead)"][0] == "PASS"
    assert got["announced: share of acquires warm"][0] == "PASS"  # 0.995
    got = verdicts(report(True, warm=190, p99=80.0))
    assert got["announced: share of acquires warm"][0] == "MISS"


def test_a_prewarm_that_said_it_could_not_is_not_held_to_it():
    got = verdicts(report(False, warm=20, p99=4000.0))
    for name in ("announced: p99 ms (prewarm 30 s ahead)", "announced: share of acquires warm"):
        verdict, note = got[name]
        assert verdict == "SKIP" and "ready in 45.0 s" in note, got[name]


def test_the_report_renders_every_phase_with_its_targets():
    r = report(True, warm=199, p99=80.0)
    summary = r["announced"]["client_ms"]
    r |= {"size": 200, "window_s": 1.0, "nodes": 3, "slots": 300}
    r["floor"] |= {"threads": 32, "served": 200}
    r["fresh"] |= {"paths": {"cold": 200}, "scale_events": {"create": 200}}
    r["announced"] |= {"prewarm_by": "client", "sandboxes_at_burst": {"warm": 200},
                       "served": 200}  # fmt: skip
    r["refill"] = {
        "min_warm": 40, "fill_s": 3.0, "samples": 100, "interval_s": 0.05, "measured_s": 5.0,
        "warm_ms": summary, "round_trip_ms": summary, "not_warm": {}, "creates_during": 7,
        "acquires_with_creates_in_flight": 50, "creating_max": 3,
    }  # fmt: skip
    r["leftovers"] |= {"pool_swept_at_stop": 0, "floor_swept_at_close": 0}
    args = argparse.Namespace(size=200, announce_s=30.0, skip_prewarm=False, skip_refill=False)
    r["targets"] = targets(r, args)
    text = render(r)
    assert "ready in 45.0 s by its own estimate (meets its deadline: True)" in text
    assert "containers left behind" in text and "refill: the same moments' floor" in text
