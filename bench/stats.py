"""Small statistics shared by the benchmarks and reports."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence


def quantile(values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile (q in [0, 1]) of unsorted values; nan for none."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def latency_summary(values_ms: Sequence[float]) -> dict[str, float | int | None]:
    """Count, p50, p95, p99 and max of latencies in milliseconds (None for no values)."""

    def rounded(q: float) -> float | None:
        return round(quantile(values_ms, q), 3) if values_ms else None

    return {
        "n": len(values_ms),
        "p50": rounded(0.50),
        "p95": rounded(0.95),
        "p99": rounded(0.99),
        "max": rounded(1.0),
    }


def summary_ms(seconds: Sequence[float]) -> dict[str, float | int | None]:
    """The same summary, of latencies given in seconds."""
    return latency_summary([s * 1000 for s in seconds])


SUMMARY_COLUMNS = ["n", "p50", "p95", "p99", "max"]


def summary_rows(named: Iterable[tuple[str, dict]]) -> list[list]:
    """Table rows of named latency summaries, under a name column and SUMMARY_COLUMNS."""
    return [[name, *(s[c] for c in SUMMARY_COLUMNS)] for name, s in named]
