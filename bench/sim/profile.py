"""How long Docker operations take, as the simulator draws them.

A profile holds measured samples per operation (seconds); the simulator draws from
them with its seeded random generator (a bootstrap: the measured distribution,
tails included). `dsec bench calibrate` measures a live engine and saves one; the
default is built from DESIGN.md's figures for a 2-core machine.
"""

from __future__ import annotations

import json
import math
import random
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
    # creates, removes and commits are serialised by the engine: how many run at once
    engine_concurrency: int = 2
    source: str = "default"

    def draw(self, op: str, rng: random.Random) -> float:
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
        }))  # fmt: skip

    @classmethod
    def load(cls, path: Path) -> Profile:
        data = json.loads(Path(path).read_text())
        missing = [op for op in OPS if not data.get("samples", {}).get(op)]
        if missing:
            raise ValueError(f"profile {path} has no samples for {missing}")
        return cls(
            data["samples"], data.get("engine_concurrency", 2), data.get("source", str(path))
        )
