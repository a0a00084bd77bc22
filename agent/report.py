"""What the agent tells the control plane: each sandbox in full on GET, and the node's
heartbeat report.

A heartbeat is a delta of compact rows, so that a node of 5,000 sandboxes and more
reports every second (issue 13), for these reasons:

- Compact and bounded: a row (dsec.models.SandboxRow) holds short fields only, sent
  column by column. Labels, the one field a client could make long, stay in the agent's
  records and are served by GET /v1/sandboxes/{id}; idempotency keys are bounded, so a
  report of a node's most sandboxes always fits the heartbeat's body limit.
- Stable: a row holds instants on the agent's clock (when the last command ended, when
  the sandbox froze), not ages, so it changes only when something happens to its
  sandbox, not every second.
- Deltas: a report carries the rows changed since the last report the control plane
  acknowledged, and the ids removed since. The control plane's work is then in
  proportion to what happened, not to what the node holds: a full report of 5,000 every
  second from each of DSec's 160 nodes would take more than its one event loop. Rows
  are absolute, not increments, so a delta applied twice, or based on an older report
  than the last one applied, changes nothing more: a lost heartbeat or a lost answer
  only makes the next delta longer.
- Full reports: the first of an incarnation; whenever the control plane asks (it
  restarted, and cannot apply a delta based on a report it never saw); after a refused
  report; when a delta would be as long; and every FULL_REPORT_EVERY reports, a
  backstop that also rids the control plane of sandboxes the agent never had.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agent.sandboxes import Sandbox
from dsec.models import NodeReport, ReportAck, SandboxReport, SandboxRow, SandboxTable

if TYPE_CHECKING:
    from agent.node import Agent

FULL_REPORT_EVERY = 60  # reports: a minute at the default heartbeat
# a sandbox lost under its lease is named in every report for this long: whatever reports
# the control plane missed or applied late (a restart), one of them tells it why
LOST_REPORTED_S = 300.0


def sandbox_report(sandbox: Sandbox, now: float) -> SandboxReport:
    r = sandbox.record
    return SandboxReport(
        id=r.id,
        pool=r.pool,
        template=sandbox.spec.name,
        state=sandbox.state,
        created_at=r.created_at,
        lease_id=r.lease_id,
        idempotency_key=r.idempotency_key,
        owner=r.owner,
        labels=r.labels,
        cpus=sandbox.spec.cpus,
        memory_mb=sandbox.spec.memory_limit_mb,
        busy_s=sandbox.busy_s,
        idle_s=0.0 if sandbox.running_execs else max(0.0, now - sandbox.last_active),
        frozen_s=None if sandbox.frozen_at is None else max(0.0, now - sandbox.frozen_at),
    )


def sandbox_row(sandbox: Sandbox) -> SandboxRow:
    """Its heartbeat row; times to the millisecond, which is all the policy needs."""
    r = sandbox.record
    return SandboxRow(
        id=r.id,
        pool=r.pool,
        template=sandbox.spec.name,
        state=sandbox.state,
        created_at=round(r.created_at, 3),
        cpus=sandbox.spec.cpus,
        memory_mb=sandbox.spec.memory_limit_mb,
        lease_id=r.lease_id,
        idempotency_key=r.idempotency_key,
        owner=r.owner,
        busy_s=round(sandbox.busy_s, 3),
        active_at=None if sandbox.running_execs else round(sandbox.last_active, 3),
        frozen_at=None if sandbox.frozen_at is None else round(sandbox.frozen_at, 3),
        grant_proof=r.grant_proof,
    )


@dataclass(frozen=True)
class ReportedSandboxes:
    """The sandboxes part of one report: NodeReport's seq, base, sandboxes and removed."""

    seq: int
    base: int | None  # None: a full report
    sandboxes: SandboxTable
    removed: list[str]


class ReportSequence:
    """The reporting side of delta heartbeats, for one incarnation: numbers its reports
    and knows which report last changed each sandbox's row. The simulator's agents use
    it too (bench/sim/agents.py), telling it only what changed (`next_changes`)."""

    def __init__(self, full_every: int = FULL_REPORT_EVERY) -> None:
        self.full_every = full_every
        self.seq = 0
        self.acked = 0  # the last report the control plane said it applied (0: none)
        self.full_wanted = False
        self._last_full = 0
        self._rows: dict[str, tuple[SandboxRow, int]] = {}  # id -> (row, report it changed in)
        self._removed: dict[str, int] = {}  # id -> the first report without it
        # the rows changed since the last acknowledged report (id -> report it changed
        # in), and each row's place in _rows, which a delta lists them in: a delta costs
        # what changed, not what the node holds
        self._changed: dict[str, int] = {}
        self._places: dict[str, int] = {}
        self._next_place = 0

    def next(self, rows: Iterable[SandboxRow]) -> ReportedSandboxes:
        """The next report of `rows`, every sandbox the node holds now."""
        self.seq += 1
        present = set()
        for row in rows:
            present.add(row.id)
            self._note(row)
        for gone in self._rows.keys() - present:
            self._drop(gone)
        return self._report()

    def next_changes(self, rows: Iterable[SandboxRow], removed: Iterable[str]) -> ReportedSandboxes:
        """The next report, told only the rows that may have changed since the last one
        and the ids of the sandboxes gone since (none of them among `rows`)."""
        self.seq += 1
        for row in rows:
            self._note(row)
        for gone in removed:
            if gone in self._rows:
                self._drop(gone)
        return self._report()

    def _note(self, row: SandboxRow) -> None:
        sandbox_id = row.id
        known = self._rows.get(sandbox_id)
        # the same row object is unchanged, and cheaper to tell than an equal one
        if known is not None and (known[0] is row or known[0] == row):
            return
        if known is None:
            self._places[sandbox_id] = self._next_place
            self._next_place += 1
            self._removed.pop(sandbox_id, None)  # a failed create's id, made again
        self._rows[sandbox_id] = (row, self.seq)
        self._changed[sandbox_id] = self.seq

    def _drop(self, sandbox_id: str) -> None:
        del self._rows[sandbox_id]
        del self._places[sandbox_id]
        self._changed.pop(sandbox_id, None)
        self._removed[sandbox_id] = self.seq

    def _report(self) -> ReportedSandboxes:
        changed_ids = sorted(
            (i for i, at in self._changed.items() if at > self.acked), key=self._places.__getitem__
        )
        removed = [sandbox_id for sandbox_id, at in self._removed.items() if at > self.acked]
        if (
            self.full_wanted
            or not self.acked
            or self.seq - self._last_full >= self.full_every
            or len(changed_ids) + len(removed) >= len(self._rows)
        ):
            self.full_wanted = False
            self._last_full = self.seq
            every = [row for row, _ in self._rows.values()]
            return ReportedSandboxes(self.seq, None, SandboxTable.of(every), [])
        changed = [self._rows[i][0] for i in changed_ids]
        return ReportedSandboxes(self.seq, self.acked, SandboxTable.of(changed), removed)

    def acknowledged(self, ack: ReportAck) -> None:
        """The control plane's answer to a report."""
        self.full_wanted |= ack.full_report
        if self.acked < ack.seq <= self.seq:
            self.acked = ack.seq
            self._removed = {i: at for i, at in self._removed.items() if at > ack.seq}
            self._changed = {i: at for i, at in self._changed.items() if at > ack.seq}

    def refused(self) -> None:
        """A report was refused: the control plane may have lost track; start afresh."""
        self.full_wanted = True


def node_report(agent: Agent, sequence: ReportSequence | None = None) -> NodeReport:
    """The node's next heartbeat in `sequence`; without one, a full report."""
    part = (sequence or ReportSequence()).next(map(sandbox_row, agent.sandboxes.values()))
    now = agent.clock.now()
    return NodeReport(
        node_id=agent.config.node_id,
        kind=agent.config.kind,
        url=agent.url,
        capacity=agent.config.capacity,
        usage=agent.usage(),
        images=agent.images,
        incarnation=agent.incarnation,
        engine_ok=agent.engine_ok,
        create_limit=agent.docker.engine.creates.limit,
        engine_id=agent.engine_id,
        clock=now,
        seq=part.seq,
        base=part.base,
        sandboxes=part.sandboxes,
        removed=part.removed,
        lost={
            sandbox_id: lost.cause
            for sandbox_id, lost in agent.lost.items()
            if now - lost.at <= LOST_REPORTED_S
        },
    )
