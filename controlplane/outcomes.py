"""How each lease ended, for an hour past its end: what GET /v1/leases/{lease_id}
answers, what the SDK's SandboxLost is raised from, and what
dsec_lease_outcomes_total counts.

The first outcome told of a lease is its outcome: a release that follows a node's loss
(the client giving back what it can no longer reach) does not make it `released`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from controlplane.metrics import ControlPlaneMetrics
from controlplane.view import SandboxEntry
from dsec.clock import Clock
from dsec.models import INFRA_FAULTS, LeaseOutcome, LeaseStatus

# how long an ended lease's outcome is kept: the contract promises an hour at least
OUTCOME_RETENTION_S = 3600.0
# and at most this many, whatever the churn: far past an hour of this pool's episodes
MAX_OUTCOMES = 2_000_000


@dataclass(frozen=True)
class LeaseEnded:
    lease_id: str
    sandbox_id: str
    pool: str
    owner: str | None
    outcome: LeaseOutcome
    cause: str
    at: float  # on the clock's monotonic scale
    wall: float  # Unix seconds


class LeaseOutcomes:
    def __init__(self, clock: Clock, metrics: ControlPlaneMetrics) -> None:
        self.clock = clock
        self.metrics = metrics
        self._ended: OrderedDict[str, LeaseEnded] = OrderedDict()  # lease id -> its end

    def ended(self, entry: SandboxEntry, outcome: LeaseOutcome, cause: str) -> None:
        """`entry`'s lease ended as `outcome`, unless an earlier outcome was told."""
        lease_id = entry.lease_id
        if lease_id is None or lease_id in self._ended:
            return
        now = self.clock.now()
        self._ended[lease_id] = LeaseEnded(
            lease_id, entry.id, entry.pool, entry.owner, outcome, cause, now, self.clock.wall()
        )
        self.metrics.lease_outcomes.labels(entry.pool, outcome).inc()
        while self._ended:
            _, oldest = next(iter(self._ended.items()))
            if len(self._ended) <= MAX_OUTCOMES and now - oldest.at <= OUTCOME_RETENTION_S:
                break
            self._ended.popitem(last=False)

    def get(self, lease_id: str) -> LeaseEnded | None:
        return self._ended.get(lease_id)


def status_of(end: LeaseEnded, lost_within_s: float) -> LeaseStatus:
    return LeaseStatus(
        lease_id=end.lease_id,
        sandbox_id=end.sandbox_id,
        pool=end.pool,
        ended=True,
        outcome=end.outcome,
        infra_fault=end.outcome in INFRA_FAULTS,
        message=end.cause,
        ended_at=end.wall,
        lost_within_s=lost_within_s,
    )
