"""The recent peak of a count: a sliding-window maximum in buckets."""

from __future__ import annotations

import random

from dsec.peaks import PeakTracker


def test_the_peak_is_the_highest_value_within_the_window():
    peaks = PeakTracker(window_s=60, bucket_s=10)
    peaks.observe("a", 5, now=0)
    peaks.observe("a", 9, now=12)
    peaks.observe("a", 3, now=25)
    assert peaks.peak("a", now=25) == 9
    # 9 was seen in the bucket starting at 10: gone once that bucket is out of the window
    peaks.observe("a", 1, now=75)
    assert peaks.peak("a", now=75) == 9
    peaks.observe("a", 1, now=80)
    assert peaks.peak("a", now=80) == 3
    assert peaks.peaks(now=80) == {"a": 3}


def test_a_key_no_longer_fed_loses_its_peak_as_the_window_passes():
    peaks = PeakTracker(window_s=60, bucket_s=10)
    peaks.observe("a", 7, now=0)
    peaks.observe("a", 2, now=30)
    peaks.observe("b", 1, now=30)
    peaks.observe("b", 1, now=100)
    assert peaks.peak("a", now=65) == 7
    assert peaks.peak("a", now=75) == 2
    assert peaks.peaks(now=105) == {"a": 0, "b": 1}
    assert peaks.peak("never fed", now=105) == 0


def test_the_peak_is_the_window_maximum_of_every_value_fed():
    """Against the definition, on random feeds: at any instant, the highest value fed to
    the key in the buckets that start after now - window - bucket."""
    rng = random.Random(3)
    peaks = PeakTracker(window_s=50, bucket_s=5)
    fed: dict[str, list[tuple[float, int]]] = {"a": [], "b": []}
    now = 0.0
    for _ in range(3000):
        now += rng.expovariate(2.0)
        key = "a" if rng.random() < 0.9 else "b"
        value = rng.randrange(100)
        peaks.observe(key, value, now)
        fed[key].append((now, value))
        cutoff = now - 55
        for k, seen in fed.items():
            expected = max(
                (v for t, v in seen if t - t % 5 > cutoff),
                default=0,
            )
            assert peaks.peak(k, now) == expected
