"""The control plane's view of the cluster, rebuilt from what the agents report.

Agents are the source of truth: a heartbeat replaces what the view believes about a
node, except for sandboxes with an operation in flight (their outcome will say) and
those confirmed too recently for the report to have seen them. A control plane that
restarts with an empty view learns every sandbox and lease back from the heartbeats.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from dsec.models import NodeReport, SandboxReport
from dsec.policy import NodeSnap, Resources, SandboxSnap
from dsec.states import ASSIGNED, OCCUPYING, TERMINAL, SandboxState, transition

TOMBSTONES = 100_000


@dataclass
class NodeEntry:
    id: str
    kind: str
    url: str
    capacity: Resources
    images: frozenset[str]
    incarnation: str
    last_seen: float
    healthy: bool = True
    refused_until: float = 0.0  # after a refusal, no placements here for a moment
    empty_since: float | None = None  # since when it holds no sandbox at all
    draining: bool = False  # being released: no placements


@dataclass
class SandboxEntry:
    id: str
    node: str
    pool: str
    template: str
    state: SandboxState
    since: float
    created_at: float
    cpus: float
    memory_mb: int
    lease_id: str | None = None
    idempotency_key: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    reserved_for: str | None = None
    op_in_flight: bool = False
    confirmed_at: float = 0.0
    busy_s: float = 0.0
    idle_since: float | None = None  # when its client last ran a command (from heartbeats)
    frozen_at: float | None = None  # when it was first frozen

    def move(self, target: SandboxState, now: float) -> None:
        if target != self.state:
            self.state = transition(self.state, target)
            self.since = now

    @property
    def needs(self) -> Resources:
        return Resources(self.cpus, self.memory_mb, 1)


@dataclass
class ReportChanges:
    """What a heartbeat changed, for the metrics and the log."""

    busy_s: dict[str, float] = field(default_factory=dict)  # per pool, newly accounted
    added: list[SandboxEntry] = field(default_factory=list)  # learnt from the report
    vanished: list[SandboxEntry] = field(default_factory=list)


class ClusterView:
    def __init__(self, confirm_grace_s: float) -> None:
        self.nodes: dict[str, NodeEntry] = {}
        self.sandboxes: dict[str, SandboxEntry] = {}
        self.released: OrderedDict[str, None] = OrderedDict()
        # A report can be older than the latest confirmed outcome: leave alone what was
        # confirmed within this long.
        self.confirm_grace_s = confirm_grace_s

    def used_by_node(self) -> dict[str, Resources]:
        """What the occupying sandboxes take on each node, in one pass (plain sums:
        a Resources per sandbox would cost several times the loop at scale)."""
        sums: dict[str, list[float]] = {}
        for s in self.sandboxes.values():
            if s.state in OCCUPYING:
                acc = sums.get(s.node)
                if acc is None:
                    acc = sums[s.node] = [0.0, 0, 0]
                acc[0] += s.cpus
                acc[1] += s.memory_mb
                acc[2] += 1
        return {node: Resources(c, int(m), int(n)) for node, (c, m, n) in sums.items()}

    def used(self, node_id: str) -> Resources:
        return self.used_by_node().get(node_id, Resources())

    def forget(self, sandbox_id: str) -> SandboxEntry | None:
        entry = self.sandboxes.pop(sandbox_id, None)
        self.released[sandbox_id] = None
        while len(self.released) > TOMBSTONES:
            self.released.popitem(last=False)
        return entry

    def apply_report(self, report: NodeReport, now: float) -> ReportChanges:
        changes = ReportChanges()
        previous = self.nodes.get(report.node_id)
        node = self.nodes[report.node_id] = NodeEntry(
            id=report.node_id,
            kind=report.kind,
            url=report.url,
            capacity=Resources(
                report.capacity.cpus, report.capacity.memory_mb, report.capacity.slots
            ),
            images=frozenset(report.images),
            incarnation=report.incarnation,
            last_seen=now,
        )
        if previous is not None:
            node.refused_until = previous.refused_until
            node.empty_since = previous.empty_since
            node.draining = previous.draining
        reported = {s.id: s for s in report.sandboxes}
        for sb in reported.values():
            entry = self.sandboxes.get(sb.id)
            if entry is None:
                if sb.id not in self.released:
                    entry = self._entry_from_report(report.node_id, sb, now)
                    self.sandboxes[sb.id] = entry
                    changes.added.append(entry)
                    changes.busy_s[sb.pool] = changes.busy_s.get(sb.pool, 0.0) + sb.busy_s
                continue
            delta = max(0.0, sb.busy_s - entry.busy_s)
            if delta:
                changes.busy_s[entry.pool] = changes.busy_s.get(entry.pool, 0.0) + delta
            entry.busy_s = sb.busy_s
            entry.idle_since = now - sb.idle_s
            if entry.op_in_flight or now - entry.confirmed_at < self.confirm_grace_s:
                continue
            if entry.state != sb.state and sb.state != SandboxState.CREATING:
                entry.move(sb.state, now)
                entry.lease_id = sb.lease_id
            entry.frozen_at = None if sb.frozen_s is None else now - sb.frozen_s
            entry.confirmed_at = now
        for entry in list(self.sandboxes.values()):
            if (
                entry.node != report.node_id
                or entry.id in reported
                or entry.op_in_flight
                or entry.state == SandboxState.CREATING
                or now - entry.confirmed_at < self.confirm_grace_s
            ):
                continue
            # the node no longer has it: an agent restart that could not adopt it
            if entry.state in ASSIGNED or entry.state == SandboxState.LOST:
                entry.move(SandboxState.LOST, now)
            else:
                self.forget(entry.id)
            changes.vanished.append(entry)
        return changes

    def _entry_from_report(self, node_id: str, sb: SandboxReport, now: float) -> SandboxEntry:
        return SandboxEntry(
            id=sb.id,
            node=node_id,
            pool=sb.pool,
            template=sb.template,
            state=sb.state,
            since=now - sb.idle_s if sb.state == SandboxState.WARM else now,
            created_at=sb.created_at,
            cpus=sb.cpus,
            memory_mb=sb.memory_mb,
            lease_id=sb.lease_id,
            idempotency_key=sb.idempotency_key,
            labels=dict(sb.labels),
            confirmed_at=now,
            busy_s=sb.busy_s,
            idle_since=now - sb.idle_s,
            frozen_at=None if sb.frozen_s is None else now - sb.frozen_s,
        )

    def mark_silent_nodes(self, now: float, timeout_s: float) -> list[NodeEntry]:
        """Nodes past the heartbeat timeout stop taking placements; their sandboxes are lost."""
        newly_down = []
        for node in self.nodes.values():
            alive = now - node.last_seen <= timeout_s
            if node.healthy and not alive:
                newly_down.append(node)
                for entry in self.sandboxes.values():
                    if entry.node == node.id and entry.state not in TERMINAL:
                        entry.move(SandboxState.LOST, now)
            node.healthy = alive
        return newly_down

    def node_snaps(self, now: float) -> tuple[NodeSnap, ...]:
        used = self.used_by_node()
        holding = {s.node for s in self.sandboxes.values()}
        snaps = []
        for n in self.nodes.values():
            if n.id in holding:
                n.empty_since = None
            elif n.empty_since is None:
                n.empty_since = now
            snaps.append(
                NodeSnap(
                    n.id,
                    n.kind,
                    n.healthy and not n.draining,
                    n.capacity,
                    used.get(n.id, Resources()),
                    n.images,
                    accepting=now >= n.refused_until,
                    empty_since=n.empty_since,
                )
            )
        return tuple(snaps)

    def sandbox_snaps(self) -> tuple[SandboxSnap, ...]:
        return tuple(
            SandboxSnap(
                s.id,
                s.node,
                s.pool,
                s.template,
                s.state,
                s.since,
                s.reserved_for,
                idle_since=s.idle_since,
                frozen_at=s.frozen_at,
            )
            for s in self.sandboxes.values()
            if not s.op_in_flight or s.state == SandboxState.CREATING
        )
