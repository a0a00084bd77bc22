"""The recent peak of a count, per key: what the warm pool is sized from.

A sliding-window maximum kept in coarse buckets, so it costs a few entries per key
however often it is fed. Time comes in as an argument: the control plane feeds it
from its clock and the simulator from virtual time.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable


class _Buckets:
    """One key's buckets, oldest first, and the peak of all but the newest: the control
    plane asks for the peak at every tick, and only the newest bucket changes between
    two of them (the others come and go once a bucket's length)."""

    __slots__ = ("entries", "_older_peak")

    def __init__(self) -> None:
        self.entries: deque[list[float]] = deque()  # [[start, max], ...]
        self._older_peak: float | None = -math.inf  # None: to be worked out again

    def append(self, start: float, value: float) -> None:
        if self.entries and self._older_peak is not None:
            self._older_peak = max(self._older_peak, self.entries[-1][1])
        self.entries.append([start, value])

    def drop_before(self, cutoff: float) -> None:
        """Drop the buckets that start at or before `cutoff`."""
        entries = self.entries
        while entries and entries[0][0] <= cutoff:
            entries.popleft()
            self._older_peak = None

    def peak(self, cutoff: float) -> float:
        """The highest value in the buckets that start after `cutoff`; 0 without one."""
        entries = self.entries
        if not entries:
            return 0.0
        if entries[0][0] <= cutoff:  # not fed since some went out of the window
            return max((m for start, m in entries if start > cutoff), default=0.0)
        if self._older_peak is None:
            self._older_peak = max((m for _, m in list(entries)[:-1]), default=-math.inf)
        return max(self._older_peak, entries[-1][1])


class PeakTracker:
    def __init__(self, window_s: float = 600.0, bucket_s: float = 10.0) -> None:
        self.window_s = window_s
        self.bucket_s = bucket_s
        self.buckets: dict[Hashable, _Buckets] = {}

    def observe(self, key: Hashable, value: float, now: float) -> None:
        buckets = self.buckets.get(key)
        if buckets is None:
            buckets = self.buckets[key] = _Buckets()
        start = now - now % self.bucket_s
        newest = buckets.entries[-1] if buckets.entries else None
        if newest is not None and newest[0] == start:
            newest[1] = max(newest[1], value)
        else:
            buckets.append(start, value)
        buckets.drop_before(now - self.window_s - self.bucket_s)

    def peak(self, key: Hashable, now: float) -> float:
        buckets = self.buckets.get(key)
        return 0.0 if buckets is None else buckets.peak(now - self.window_s - self.bucket_s)

    def peaks(self, now: float) -> dict[Hashable, int]:
        cutoff = now - self.window_s - self.bucket_s
        return {key: int(buckets.peak(cutoff)) for key, buckets in self.buckets.items()}
