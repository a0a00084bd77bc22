"""How fast sandboxes are taken and how long one takes to replace: what the warm pool
needs to hold for a steady stream of short leases (Little's law, docs/policy.md).

Time comes in as an argument, as for the peaks (dsec/peaks.py): the control plane feeds
these from its clock, the simulator from virtual time.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable


class RateTracker:
    """Events a second per key over the last `window_s`, kept in `bucket_s` buckets. A
    key seen for less than the window is measured over the time it has been seen (at
    least one bucket), so a stream that has just begun counts at its own rate, not
    diluted by the quiet before it."""

    def __init__(self, window_s: float = 30.0, bucket_s: float = 1.0) -> None:
        self.window_s = window_s
        self.bucket_s = bucket_s
        self.buckets: dict[Hashable, deque[list[float]]] = {}  # [[start, count], ...]
        self.first_seen: dict[Hashable, float] = {}

    def observe(self, key: Hashable, now: float, count: int = 1) -> None:
        buckets = self.buckets.get(key)
        if buckets is None:
            buckets = self.buckets[key] = deque()
            self.first_seen[key] = now
        start = now - now % self.bucket_s
        if buckets and buckets[-1][0] == start:
            buckets[-1][1] += count
        else:
            buckets.append([start, float(count)])

    def rates(self, now: float) -> dict[Hashable, float]:
        cutoff = now - self.window_s
        rates: dict[Hashable, float] = {}
        for key, buckets in list(self.buckets.items()):
            while buckets and buckets[0][0] + self.bucket_s <= cutoff:
                buckets.popleft()
            if not buckets:
                del self.buckets[key], self.first_seen[key]
                continue
            seen_for = min(self.window_s, max(self.bucket_s, now - self.first_seen[key]))
            rates[key] = sum(count for _, count in buckets) / seen_for
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
