"""How long Docker operations take, as the simulator draws them.

A profile holds measured samples per operation (seconds); the simulator draws from
them with its seeded random generator (a bootstrap: the measured distribution,
tails included). `dsec bench calibrate` measures a live engine and saves one; the
default is built from DESIGN.md's figures for a 2-core machine.

Operations share the machine's cores with whatever else its engine is doing, so a
calibrated profile also holds samples taken under load: `under_load[op][k]` was
measured while k other engine operations (creates, removes, execs) ran on the same
machine. The simulator counts what its engine runs when an operation starts and
draws from the samples of the highest measured load not above that count; past the
highest, a duration grows with the load as the medians grew between the two highest
measured loads (cores shared with a steady background: linear in the load).
"""

from __future__ import annotations

import bisect
import json
import math
import random
import statistics
from dataclasses import dataclass, field
from pathlib import Path

OPS = ("create", "remove", "pause", "unpause", "commit", "exec", "lease", "restore")

# Medians from DESIGN.md ("Numbers to design for"); lease is the agent's HTTP call with
# its on-disk record, restore a create plus unpacking the work dir.
DEFAULT_MEDIANS_S = {
    "create": 0.170,
    "remove": 0.045,
    "pause": 0.010,
    "unpause": 0.010,
    "commit": 0.070,
    "exec": 0.050,
    "lease": 0.002,
    "restore": 0.220,
}
DEFAULT_SPREAD = 0.3  # lognormal sigma: a p99 about twice the median


@dataclass
class Profile:
    samples: dict[str, list[float]] = field(default_factory=dict)
    # how many creates, removes and commits a node's agent runs at once (more queue)
    engine_concurrency: int = 2
    source: str = "default"
    # op -> {k: samples measured while k other engine operations ran}; k >= 1
    under_load: dict[str, dict[int, list[float]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._levels = {op: sorted(by_k) for op, by_k in self.under_load.items()}
        self._growth = {op: self._growth_past_top(op) for op in self.under_load}

    def _growth_past_top(self, op: str) -> float:
        """The relative growth of a duration per operation more under way, past the
        highest measured load: the trend of the medians between the two highest loads
        (with the load 0 samples below the first). On cores shared with a steady
        background, each operation more adds its share: the growth is linear."""
        by_k = {0: self.samples[op], **self.under_load[op]}
        high, low = sorted(by_k)[-1], sorted(by_k)[-2]
        top, below = statistics.median(by_k[high]), statistics.median(by_k[low])
        return max(0.0, (top - below) / (high - low) / top)

    @property
    def contended(self) -> bool:
        """Whether durations depend on what else the engine runs (the simulator then
        keeps count of it)."""
        return bool(self.under_load)

    def draw(self, op: str, rng: random.Random, load: int = 0) -> float:
        """A duration of `op` started while `load` other engine operations run."""
        levels = self._levels.get(op)
        if load and levels:
            i = bisect.bisect_right(levels, load)  # the highest measured load not above
            if i == len(levels):
                top = levels[-1]
                return rng.choice(self.under_load[op][top]) * (1 + self._growth[op] * (load - top))
            if i:
                return rng.choice(self.under_load[op][levels[i - 1]])
        return rng.choice(self.samples[op])

    @classmethod
    def default(cls, n: int = 2000, seed: int = 0) -> Profile:
        rng = random.Random(seed)
        samples = {
            op: [rng.lognormvariate(math.log(median), DEFAULT_SPREAD) for _ in range(n)]
            for op, median in DEFAULT_MEDIANS_S.items()
        }
        return cls(samples, source="default: DESIGN.md medians, lognormal sigma 0.3")

    def save(self, path: Path) -> None:
        path.write_text(json.dumps({
            "source": self.source,
            "engine_concurrency": self.engine_concurrency,
            "samples": self.samples,
            "under_load": {
                op: {str(k): s for k, s in by_k.items()} for op, by_k in self.under_load.items()
            },
        }))  # fmt: skip

    @classmethod
    def load(cls, path: Path) -> Profile:
        data = json.loads(Path(path).read_text())
        missing = [op for op in OPS if not data.get("samples", {}).get(op)]
        if missing:
            raise ValueError(f"profile {path} has no samples for {missing}")
        under_load = {}
        for op, by_k in data.get("under_load", {}).items():
            if op not in OPS:
                raise ValueError(f"profile {path}: under_load names an unknown operation {op!r}")
            levels = {}
            for k, samples in by_k.items():
                if not k.isdigit() or int(k) < 1 or not samples:
                    raise ValueError(f"profile {path}: under_load[{op!r}] needs loads >= 1 "
                                     f"with samples, got {k!r}")  # fmt: skip
                levels[int(k)] = samples
            under_load[op] = levels
        return cls(
            data["samples"],
            data.get("engine_concurrency", 2),
            data.get("source", str(path)),
            under_load,
        )
