"""Histogram bucket bounds the services' Prometheus metrics share."""

from __future__ import annotations

# 1 ms to 60 s: a pause is ~10 ms, a cold create ~200 ms, a command may run a minute.
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
