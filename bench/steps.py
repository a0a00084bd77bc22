"""What the trace generators and importers share: cutting an episode's lifetime into think
and exec steps, and the checks that refuse bad input with a ValueError.

bench/generate.py (synthetic traces) and bench/importers.py (recorded ones) both build
their episodes with these; neither imports the other for them.
"""

from __future__ import annotations

import math
import random

from dsec.trace import MAX_STEPS_PER_EPISODE, Steps

DEFAULT_MEAN_STEP_S = 30.0
DEFAULT_EXEC_SHARE = 0.3
# How much single steps scatter around exec_share: Beta(k * share, k * (1 - share)).
_EXEC_SHARE_CONCENTRATION = 5.0


def split_lifetime(
    rng: random.Random, lifetime_s: float, mean_step_s: float, exec_share: float
) -> Steps:
    """Cut a lifetime into steps whose think and exec times add up to it.

    Step lengths are uniform spacings of the lifetime (so some think gaps are long enough for
    the pool to freeze the sandbox); each step's exec fraction is drawn around ``exec_share``.
    """
    count = max(1, min(MAX_STEPS_PER_EPISODE, round(lifetime_s / mean_step_s)))
    weights = [rng.expovariate(1.0) for _ in range(count)]
    scale = lifetime_s / sum(weights)
    thinks, execs = [], []
    for weight in weights:
        length = weight * scale
        if 0 < exec_share < 1:
            concentration = _EXEC_SHARE_CONCENTRATION
            fraction = rng.betavariate(concentration * exec_share, concentration * (1 - exec_share))
        else:
            fraction = exec_share
        thinks.append(length * (1 - fraction))
        execs.append(length * fraction)
    return Steps.rounded(thinks, execs)


def require(condition: bool, problem: str) -> None:
    """Refuse bad input with a ValueError that says what is wrong."""
    if not condition:
        raise ValueError(problem)


def require_positive(name: str, value: float) -> None:
    require(math.isfinite(value) and value > 0, f"{name} must be a finite number > 0, got {value}")


def require_non_negative(name: str, value: float) -> None:
    require(
        math.isfinite(value) and value >= 0, f"{name} must be a finite number >= 0, got {value}"
    )


def require_fraction(name: str, value: float) -> None:
    require(0 <= value <= 1, f"{name} must be within [0, 1], got {value}")
