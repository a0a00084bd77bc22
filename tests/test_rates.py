"""The acquire rate and create time the warm pool's flow target is made from (dsec/rates.py)."""

from __future__ import annotations

import pytest

from dsec.rates import Durations, RateTracker


def test_a_steady_stream_counts_at_its_rate_and_a_burst_counts_as_none():
    rates = RateTracker(window_s=30.0, bucket_s=1.0)
    for i in range(50):  # 10 a second for 5 s
        rates.observe("k", 100.0 + i / 10)
    assert rates.rates(105.0)["k"] == 10.0  # over its 5 whole seconds, not the window
    for i in range(300):  # then 2 a second for 150 s: the first stream leaves the window
        rates.observe("k", 105.0 + i / 2)
    assert rates.rates(255.0)["k"] == 2.0
    assert rates.rates(300.0) == {}  # quiet for the whole window: gone
    for _ in range(30):  # 30 at once, then nothing
        rates.observe("burst", 400.2)
    assert rates.rates(402.5) == {}  # too soon to tell
    assert [rates.rates(t)["burst"] for t in (403.5, 410.0)] == [0.0, 0.0]


def test_durations_follow_the_recent_ones():
    times = Durations(weight=0.5)
    times.observe("t", 1.0)
    assert times.means["t"] == 1.0
    times.observe("t", 3.0)
    assert times.means["t"] == 2.0
    for _ in range(20):
        times.observe("t", 0.2)
    assert times.means["t"] == pytest.approx(0.2, abs=1e-3)
