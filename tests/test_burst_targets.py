"""bench.burst's announced-burst targets hold the pool to what its prewarm promised:
a p99 and a warm share when the prewarm said it would make its deadline, neither (SKIP,
with its own estimate) when it said it would not."""

from __future__ import annotations

import argparse

from bench.burst import targets


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
