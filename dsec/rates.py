"""How fast sandboxes are taken and how long one takes to replace: what the warm pool
needs to hold for a steady stream of short leases (Little's law, docs/policy.md).

Time comes in as an argument, as for the peaks (dsec/peaks.py): the control plane feeds
these from its clock, the simulator from virtual time.
"""

from __future__ import annotations

from collections.abc import Hashable

# whole buckets seen before a rate is told: a stream goes on for this long at least
STREAM_BUCKETS = 3


class RateTracker:
    """The steady rate of events per key: the median count a second over the whole
    `bucket_s` buckets of the last `window_s` (or since the key was first seen, if
    later; the bucket under way is not whole and not counted), empty ones included,
    once there are STREAM_BUCKETS of them. A
    stream that goes on counts at its rate; a burst, all in a bucket or two, counts as
    nothing: the recent peak and the scale-up rule size the pool for bursts, and a
    burst is not a stream to be replaced as it goes."""

    def __init__(self, window_s: float = 30.0, bucket_s: float = 1.0) -> None:
        self.window_s = window_s
        self.bucket_s = bucket_s
        self.counts: dict[Hashable, dict[float, int]] = {}  # bucket start -> count
        self.first_seen: dict[Hashable, float] = {}

    def _start(self, t: float) -> float:
        return t - t % self.bucket_s

    def observe(self, key: Hashable, now: float, count: int = 1) -> None:
        counts = self.counts.get(key)
        if counts is None:
            counts = self.counts[key] = {}
            self.first_seen[key] = now
        start = self._start(now)
        counts[start] = counts.get(start, 0) + count

    def rates(self, now: float) -> dict[Hashable, float]:
        current = self._start(now)
        oldest = current - self.window_s
        rates: dict[Hashable, float] = {}
        for key, counts in list(self.counts.items()):
            for start in [s for s in counts if s < oldest]:
                del counts[start]
            if not counts:
                del self.counts[key], self.first_seen[key]
                continue
            first = max(oldest, self._start(self.first_seen[key]))
            whole = int(round((current - first) / self.bucket_s))
            if whole < STREAM_BUCKETS:
                continue  # too soon to tell a stream from a burst
            seen = sorted(counts.get(first + i * self.bucket_s, 0) for i in range(whole))
            rates[key] = seen[(len(seen) - 1) // 2] / self.bucket_s  # the lower median
        return rates


class Durations:
    """The recent typical duration per key: an exponentially weighted mean, each new
    observation weighing `weight` (the last ~1/weight count)."""

    def __init__(self, weight: float = 0.2) -> None:
        self.weight = weight
        self.means: dict[Hashable, float] = {}

    def observe(self, key: Hashable, seconds: float) -> None:
        mean = self.means.get(key)
        self.means[key] = seconds if mean is None else mean + self.weight * (seconds - mean)
