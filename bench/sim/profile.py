"""How long Docker operations take, as the simulator draws them.

A profile holds measured samples per operation (seconds); the simulator draws from
them with its seeded random generator (a bootstrap: the measured distribution,
tails included). `dsec bench calibrate` measures a live engine and saves one; the
default is built from the figures in docs/benchmarks.md for a 2-core machine.

Operations share the machine's cores with whatever else its engine is doing, so a
calibrated profile also holds samples taken under load: `under_load[op][k]` was
measured while k other engine operations (creates, removes, execs) ran on the same
machine. The simulator draws an operation's duration from the samples of the highest
measured load not above what its engine runs when it starts; while it runs, it goes
as much faster or slower as the load changes, by the ratio of the measured medians
(`slowdown`).
"""

from __future__ import annotations

import bisect
import functools
import json
import math
import random
import statistics
from dataclasses import dataclass, field
from pathlib import Path

OPS = ("create", "remove", "pause", "unpause", "commit", "exec", "lease", "restore")

# Medians from docs/benchmarks.md ("The numbers to design for"); lease is the agent's HTTP call with
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
    # how many operations' worth of load one exec start is (an exec spawns a process in
    # the container through dockerd, containerd and runc, and streams through its agent)
    exec_weight: float = 1.0
    # op -> the most of it a second one engine completes doing nothing else, however
    # many it runs at once (creates measured flat from 3 to 32 at once here): an engine
    # is one throughput that creates, removes and exec starts share (bench/sim/agents.py:
    # Engine). An operation not named here is bounded only by its slowdowns.
    engine_rates_per_s: dict[str, float] = field(default_factory=dict)
    # how many operations' worth of load a command in flight in a sandbox is, whatever
    # it runs (the agent and the client that carry it share the machine's cores)
    command_weight: float = 0.0

    def __post_init__(self) -> None:
        # op -> the measured loads, 0 first, and the median duration at each
        self._loads: dict[str, list[int]] = {}
        self._medians: dict[str, list[float]] = {}
        for op, by_k in self.under_load.items():
            by_k = {0: self.samples[op], **by_k}
            self._loads[op] = sorted(by_k)
            self._medians[op] = [statistics.median(by_k[k]) for k in self._loads[op]]

    @property
    def contended(self) -> bool:
        """Whether durations depend on what else the engine runs (the simulator then
        shares the engine out among what it runs)."""
        return bool(self.under_load)

    def measured_load(self, op: str, load: int) -> int:
        """The highest load `op` was measured under that is not above `load`."""
        loads = self._loads.get(op)
        if not loads:
            return 0
        return loads[bisect.bisect_right(loads, load) - 1]

    def draw(self, op: str, rng: random.Random, load: int = 0) -> float:
        """A duration of `op` as measured under `measured_load(op, load)` others."""
        k = self.measured_load(op, load)
        return rng.choice(self.under_load[op][k] if k else self.samples[op])

    def draws(self, op: str, rng: random.Random, n: int) -> list[float]:
        """`n` durations of `op` as measured alone, in one call."""
        return rng.choices(self.samples[op], k=n)

    def slowdown(self, op: str, load: float) -> float:
        """How much longer `op` takes with `load` others under way than alone: the
        medians' ratio, interpolated between measured loads; past the highest, the
        trend between the two highest goes on (cores shared with a steady background:
        each operation more adds its share, linearly). 1 for an op not measured so."""
        loads = self._loads.get(op)
        if not loads or load <= 0:
            return 1.0
        medians = self._medians[op]
        i = min(bisect.bisect_right(loads, load), len(loads) - 1)  # the next measured load
        per_op = (medians[i] - medians[i - 1]) / (loads[i] - loads[i - 1])
        if load >= loads[-1]:
            per_op = max(0.0, per_op)  # a falling trend at the top is noise: no growth
        return max(1e-3 * medians[0], medians[i] + per_op * (load - loads[i])) / medians[0]

    @classmethod
    def default(cls, n: int = 2000, seed: int = 0) -> Profile:
        samples = {op: list(drawn) for op, drawn in _default_samples(n, seed).items()}
        return cls(samples, source="default: docs/benchmarks.md medians, lognormal sigma 0.3")

    def save(self, path: Path) -> None:
        path.write_text(json.dumps({
            "source": self.source,
            "engine_concurrency": self.engine_concurrency,
            "exec_weight": self.exec_weight,
            "engine_rates_per_s": self.engine_rates_per_s,
            "command_weight": self.command_weight,
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
        # profiles saved before removes and execs were measured name the create rate alone
        rates = data.get("engine_rates_per_s") or (
            {"create": data["create_rate_per_s"]} if data.get("create_rate_per_s") else {}
        )
        for op, rate in rates.items():
            if op not in OPS or not isinstance(rate, int | float) or rate <= 0:
                raise ValueError(f"profile {path}: engine_rates_per_s needs known operations "
                                 f"with rates > 0, got {op!r}: {rate!r}")  # fmt: skip
        return cls(
            data["samples"],
            data.get("engine_concurrency", 2),
            data.get("source", str(path)),
            under_load,
            float(data.get("exec_weight", 1.0)),
            {op: float(rate) for op, rate in rates.items()},
            float(data.get("command_weight", 0.0)),
        )


@functools.cache
def _default_samples(n: int, seed: int) -> dict[str, tuple[float, ...]]:
    """The default profile's draws, made once: a sweep or a tuning search simulates with
    it dozens of times (each Profile gets lists of its own)."""
    rng = random.Random(seed)
    return {
        op: tuple(rng.lognormvariate(math.log(median), DEFAULT_SPREAD) for _ in range(n))
        for op, median in DEFAULT_MEDIANS_S.items()
    }
