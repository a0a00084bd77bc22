"""The recent peak of a count, per key: what the warm pool is sized from.

A sliding-window maximum kept in coarse buckets, so it costs a few entries per key
however often it is fed. Time comes in as an argument: the control plane feeds it
from its clock and the simulator from virtual time.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable


class PeakTracker:
    def __init__(self, window_s: float = 600.0, bucket_s: float = 10.0) -> None:
        self.window_s = window_s
        self.bucket_s = bucket_s
        self.buckets: dict[Hashable, deque[list[float]]] = {}  # key -> [[start, max], ...]

    def observe(self, key: Hashable, value: float, now: float) -> None:
        buckets = self.buckets.setdefault(key, deque())
        start = now - now % self.bucket_s
        if buckets and buckets[-1][0] == start:
            buckets[-1][1] = max(buckets[-1][1], value)
        else:
            buckets.append([start, value])
        while buckets and buckets[0][0] <= now - self.window_s - self.bucket_s:
            buckets.popleft()

    def peak(self, key: Hashable, now: float) -> float:
        return max(
            (
                m
                for start, m in self.buckets.get(key, ())
                if start > now - self.window_s - self.bucket_s
            ),
            default=0.0,
        )

    def peaks(self, now: float) -> dict[Hashable, int]:
        return {key: int(self.peak(key, now)) for key in self.buckets}
