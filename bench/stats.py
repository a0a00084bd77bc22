"""Small statistics shared by the benchmarks and reports."""

from __future__ import annotations

import math
from collections.abc import Sequence


def quantile(values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile (q in [0, 1]) of unsorted values; nan for none."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def summary_ms(seconds: Sequence[float]) -> dict[str, float]:
    """p50, p95, p99 and max of latencies given in seconds, in milliseconds."""
    return {
        "n": len(seconds),
        "p50": round(quantile(seconds, 0.50) * 1000, 3),
        "p95": round(quantile(seconds, 0.95) * 1000, 3),
        "p99": round(quantile(seconds, 0.99) * 1000, 3),
        "max": round(max(seconds, default=math.nan) * 1000, 3),
    }
