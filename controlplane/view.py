"""The control plane's view of the cluster, rebuilt from what the agents report.

Agents are the source of truth: a heartbeat replaces what the view believes about a
node, except for sandboxes with an operation in flight (their outcome will say) and
those confirmed too recently for the report to have seen them. A control plane that
restarts with an empty view learns every sandbox and lease back from the heartbeats
(all but labels, which heartbeats do not carry).

A report may describe only leases this control plane granted: one it does not hold
already (after a restart, none) is taken only with the grant's proof, which no node can
make (controlplane/identities.py). A sandbox new to the view whose lease has no valid
proof is taken as one to remove, its lease dropped (no client sees it or counts it);
one the view knows keeps what the view holds. Either way the report's other rows count.

Heartbeats are mostly deltas (agent/report.py says why). The view keeps each node's
rows as last reported, so that a delta amounts to the full report it stands for: the
sandboxes it names are settled against their rows, and so are those a report could
not settle yet (a call in flight, or confirmed within the grace), at every report
until it can. A full report, or the first report of a node back from silence, settles
every sandbox of the node.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dsec.models import DrainState, LeaseEnd, LeaseGrant, NodeReport, ReportAck, SandboxRow
from dsec.policy import NodeSnap, Resources, SandboxSnap
from dsec.recent import RecentMap
from dsec.states import (
    ASSIGNED,
    OCCUPYING,
    TERMINAL,
    IllegalTransition,
    SandboxState,
    transition,
)

if TYPE_CHECKING:
    from controlplane.identities import Identities

log = logging.getLogger(__name__)


@dataclass
class NodeEntry:
    id: str
    kind: str
    url: str
    capacity: Resources
    images: frozenset[str]
    incarnation: str
    last_seen: float
    healthy: bool = True  # heartbeats in time
    engine_ok: bool = True  # its Docker engine answers (the agent checks)
    refused_until: float = 0.0  # after a refusal, no placements here for a moment
    failures: int = 0  # calls to it that failed (5xx, unreachable) in a row
    failing_until: float = 0.0  # out of placement after failures, until then
    empty_since: float | None = None  # since when it holds no sandbox at all
    draining: bool = False  # a cloud node being released: no placements
    # an operator's drain (POST /v1/nodes/{id}/drain): no placements, its idle sandboxes
    # removed, its leases run to their end; then it may go
    drain_requested: bool = False
    create_limit: int = 4  # creates it runs at once, as its agent measured
    engine_id: str = ""  # its Docker engine's id: nodes sharing an engine report the same
    # its agent's reports: the last applied (in this incarnation), every sandbox's row as
    # last reported, and the sandboxes whose row could not be settled yet
    seq: int = 0
    rows: dict[str, SandboxRow] = field(default_factory=dict)
    unsettled: set[str] = field(default_factory=set)
    clock_offset: float = 0.0  # our clock minus its agent's, at its last report

    def serving(self, now: float) -> bool:
        """Its agent carries out calls: heartbeats in time, engine up, calls not failing."""
        return self.healthy and self.engine_ok and now >= self.failing_until

    def placeable(self, now: float) -> bool:
        """Takes work: new sandboxes, and claims of the ones it holds."""
        return self.serving(now) and not self.draining and not self.drain_requested

    def our_time(self, agent_time: float | None, now: float) -> float | None:
        """An instant its agent reported, on our clock (never later than now)."""
        return None if agent_time is None else min(now, agent_time + self.clock_offset)


# what of a SandboxEntry its SandboxSnap holds: a change to one of them makes a new snap
_SNAPPED = frozenset(
    (
        "id", "node", "pool", "template", "state", "since", "reserved_for", "idle_since",
        "frozen_at", "leased_at", "renewed_at", "retired",
    )
)  # fmt: skip


@dataclass
class SandboxEntry:
    """The control plane's record of one sandbox. Changed in this module alone: by the
    methods below, each named for what happened to it, and by ClusterView, which counts
    its state and pool (`move`, `set_pool`) and applies its agent's reports."""

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
    owner: str | None = None  # the client holding the lease
    # None: a lease learnt from a heartbeat (after a restart), whose labels only its agent has
    labels: dict[str, str] | None = field(default_factory=dict)
    reserved_for: str | None = None
    op_in_flight: bool = False
    confirmed_at: float = 0.0
    busy_s: float = 0.0
    idle_since: float | None = None  # when its client last ran a command (from heartbeats)
    failures: int = 0  # calls about it that failed in a row
    retry_at: float = 0.0  # no new call about it before then
    frozen_at: float | None = None  # when it was first frozen
    leased_at: float | None = None  # when its lease began (when learnt, after a restart)
    renewed_at: float | None = None  # when its client last renewed the lease
    lease_expires_at: int | None = None  # Unix second its lease token ends (Leases.token_of)
    ended: LeaseEnd = "released"  # why it goes, once it does: what its agent tells clients
    # made from a template since removed or changed: removed once idle, never recycled
    retired: bool = False
    # what the policy is shown of it, kept from tick to tick while none of that changes
    _snap: SandboxSnap | None = field(default=None, init=False, repr=False, compare=False)
    # its lease cannot be due for a freeze or an expiry before this instant, as a look
    # at the leases found (Scheduler._lease_due): later looks pass it by until then, or
    # until what that was found from changes (a field of the snap, all of it read there)
    lease_not_due_before: float = field(default=-math.inf, init=False, repr=False, compare=False)

    def __setattr__(self, name: str, value: object) -> None:
        if name in _SNAPPED:
            object.__setattr__(self, "_snap", None)
            object.__setattr__(self, "lease_not_due_before", -math.inf)
        object.__setattr__(self, name, value)

    # --- calls to its agent (controlplane/actuator.py): one at a time -----------------

    def call_started(self) -> None:
        """A call about it is under way: nothing else is decided about it until it ends."""
        self.op_in_flight = True

    def call_confirmed(self, now: float) -> None:
        """Its agent carried out the call: what the view holds of it is true as of now."""
        self.op_in_flight = False
        self.confirmed_at = now
        self.failures = 0

    def call_failed(self, now: float) -> None:
        """The call failed: no other about it for a backoff, doubling with every failure
        in a row, to 30 s (so that an agent that is down is not asked at every tick)."""
        self.op_in_flight = False
        self.failures += 1
        self.retry_at = now + min(30.0, 0.5 * 2**self.failures)

    def busy_reported(self, busy_s: float) -> float:
        """Its agent's count of the seconds it ran commands (all time); returns those not
        counted before."""
        new = max(0.0, busy_s - self.busy_s)
        self.busy_s = busy_s
        return new

    def frozen(self, now: float) -> None:
        self.frozen_at = now

    def thawed(self) -> None:
        self.frozen_at = None

    def recycled(self, now: float) -> None:
        """Reset by its agent and back in the warm pool: running, idle from now."""
        self.frozen_at = None
        self.idle_since = now

    # --- its lease (controlplane/leases.py) -------------------------------------------

    def granted(self, grant: LeaseGrant, token_expiry: int, now: float) -> None:
        """Leased as `grant` says, its token good until `token_expiry` (a Unix second):
        running, idle from now, no longer held for the request it was made for."""
        self.lease_id = grant.lease_id
        self.owner = grant.owner
        self.idempotency_key = grant.idempotency_key
        self.labels = dict(grant.labels)
        self.lease_expires_at = token_expiry
        self.leased_at, self.renewed_at = now, None
        self.frozen_at, self.idle_since = None, now
        self.reserved_for = None

    def renewed(self, now: float) -> None:
        """Its client is alive: its lease's idle timeout starts again."""
        self.renewed_at = now

    def token_expiry(self, new_expiry: int) -> int:
        """The Unix second its lease token ends. A lease learnt from a heartbeat (after a
        restart) has none until its token is first made: `new_expiry`, kept from then on,
        so that its token does not change."""
        if self.lease_expires_at is None:
            self.lease_expires_at = new_expiry
        return self.lease_expires_at

    def lease_expired(self) -> None:
        """Its lease lapsed, or its node refused it: its removal tells its agent so, and
        the agent its client (410 lease_expired)."""
        self.ended = "lease_expired"

    def released_to_recycle(self) -> None:
        """Released, to be reset into the warm pool: its lease ends now, before anything
        is awaited, so that its token is void at once."""
        self.lease_id = self.owner = self.idempotency_key = None
        self.labels = {}

    def unreserved(self) -> None:
        """The request it was made for was served or gone: it joins the warm pool."""
        self.reserved_for = None

    @property
    def needs(self) -> Resources:
        return Resources(self.cpus, self.memory_mb, 1)

    def snap(self) -> SandboxSnap:
        """What the policy sees of it (the same object while nothing of that changes)."""
        if self._snap is None:
            self._snap = SandboxSnap(
                self.id,
                self.node,
                self.pool,
                self.template,
                self.state,
                self.since,
                self.reserved_for,
                idle_since=self.idle_since,
                frozen_at=self.frozen_at,
                leased_at=self.leased_at,
                renewed_at=self.renewed_at,
                retired=self.retired,
            )
        return self._snap


@dataclass
class ReportChanges:
    """What a heartbeat changed, for the metrics and the log, and the answer to its agent."""

    ack: ReportAck
    busy_s: dict[str, float] = field(default_factory=dict)  # per pool, newly accounted
    added: list[SandboxEntry] = field(default_factory=list)  # learnt from the report
    vanished: list[SandboxEntry] = field(default_factory=list)
    unproven: list[str] = field(default_factory=list)  # sandboxes with a lease not granted


class ClusterView:
    """Nodes and sandboxes, with running totals kept as they change.

    Every change of a sandbox goes through add, move, set_pool and forget, which keep
    the totals (use per node, sandboxes per node, counts per pool) and an index of
    sandboxes by state. A tick then costs in proportion to the sandboxes it may act on
    (the unassigned ones) and the nodes, not to every sandbox in the cluster.
    """

    def __init__(self, confirm_grace_s: float, identities: Identities | None = None) -> None:
        self.nodes: dict[str, NodeEntry] = {}
        # checks the proofs of the leases reports name; None takes every lease as granted,
        # for tests and benchmarks of the report mechanics alone (build_scheduler, which
        # every control plane runs, always gives its own)
        self.identities = identities
        self.sandboxes: dict[str, SandboxEntry] = {}  # read freely; change through methods
        self.released: RecentMap[str, None] = RecentMap()  # ids released: late calls learn so
        # A report can be older than the latest confirmed outcome: leave alone what was
        # confirmed within this long.
        self.confirm_grace_s = confirm_grace_s
        self.by_state: dict[SandboxState, dict[str, SandboxEntry]] = {s: {} for s in SandboxState}
        self._used: dict[str, list[float]] = {}  # node -> [cpus, memory_mb, slots] occupied
        self._creating: dict[str, int] = {}  # node -> creates under way
        self._applying: dict[str, int] = {}  # node -> personalised claims being applied
        self._by_node: dict[str, dict[str, SandboxEntry]] = {}  # of any state
        # (pool, node kind) -> occupying sandboxes; (pool, template) -> leased ones
        self.occupying: dict[tuple[str, str], int] = {}
        self.assigned: dict[tuple[str, str], int] = {}
        # NodeSnaps are rebuilt only for nodes that changed since the last snapshot
        self._node_snaps: dict[str, NodeSnap] = {}
        # ordered (a dict, not a set of strings, whose order changes with each process's hash
        # seed): the first snapshot lists nodes in it, and placement samples from that list
        self._dirty_nodes: dict[str, None] = {}
        # node -> when its snapshot changes by itself (a refusal or a failure backoff ends)
        self._changes_at: dict[str, float] = {}
        # nodes not serving at the last snapshot: their sandboxes are left alone
        self._not_serving: set[str] = set()
        # no node had gone without a report since before this, at the last look for silent
        # ones: until it is a timeout ago, none can have missed its heartbeats
        self._earliest_seen = -math.inf

    def _count(self, entry: SandboxEntry, sign: int) -> None:
        self._dirty_nodes.setdefault(entry.node)
        if entry.state == SandboxState.CREATING:
            self._creating[entry.node] = self._creating.get(entry.node, 0) + sign
        if entry.state in OCCUPYING:
            acc = self._used.setdefault(entry.node, [0.0, 0, 0])
            acc[0] += sign * entry.cpus
            acc[1] += sign * entry.memory_mb
            acc[2] += sign
            node = self.nodes.get(entry.node)
            key = (entry.pool, node.kind if node else "local")
            self.occupying[key] = self.occupying.get(key, 0) + sign
        if entry.state in ASSIGNED:
            key = (entry.pool, entry.template)
            self.assigned[key] = self.assigned.get(key, 0) + sign

    def applying(self, node_id: str, change: int) -> None:
        """A personalised claim's grant sent to `node_id` (+1), or answered (-1)."""
        self._applying[node_id] = self._applying.get(node_id, 0) + change
        self._dirty_nodes.setdefault(node_id)

    def add(self, entry: SandboxEntry) -> None:
        self.sandboxes[entry.id] = entry
        self.by_state[entry.state][entry.id] = entry
        self._by_node.setdefault(entry.node, {})[entry.id] = entry
        self._count(entry, +1)

    def move(self, entry: SandboxEntry, target: SandboxState, now: float) -> None:
        """The one way a sandbox changes state: checked against the state machine."""
        if target == entry.state:
            return
        transition(entry.state, target)
        self._count(entry, -1)
        del self.by_state[entry.state][entry.id]
        entry.state, entry.since = target, now
        self.by_state[target][entry.id] = entry
        self._count(entry, +1)

    def set_pool(self, entry: SandboxEntry, pool: str) -> None:
        """A sandbox taken over by another pool (a higher priority one)."""
        self._count(entry, -1)
        entry.pool = pool
        self._count(entry, +1)

    def retire_template(self, template: str) -> list[SandboxEntry]:
        """Mark every sandbox of `template` as made from a template that is no longer
        (removed, or changed): no request takes one again (policy rule 10)."""
        found = [e for e in self.sandboxes.values() if e.template == template]
        for entry in found:
            entry.retired = True
        return found

    def forget(self, sandbox_id: str, tombstone: bool = True) -> SandboxEntry | None:
        """Drop a sandbox; with a tombstone, late calls about it learn it was released."""
        entry = self.sandboxes.pop(sandbox_id, None)
        if entry is not None:
            del self.by_state[entry.state][entry.id]
            del self._by_node[entry.node][entry.id]
            self._count(entry, -1)
            node = self.nodes.get(entry.node)
            if node is not None and sandbox_id in node.rows:
                # its agent still had it at its last report: the next one settles it, as
                # a full report would (a delta need not name it again)
                node.unsettled.add(sandbox_id)
        if tombstone:
            self.released.add(sandbox_id)
        return entry

    def used_by_node(self) -> dict[str, Resources]:
        return {node: Resources(c, int(m), int(n)) for node, (c, m, n) in self._used.items() if n}

    def used(self, node_id: str) -> Resources:
        c, m, n = self._used.get(node_id, (0.0, 0, 0))
        return Resources(c, int(m), int(n))

    def refuse(self, node_id: str, until: float) -> None:
        """No placements on this node until then: it refused one."""
        if node := self.nodes.get(node_id):
            node.refused_until = until
            self._change_at(node_id, until)

    def call_failed(self, node_id: str, now: float, threshold: int, backoff_s: float) -> bool:
        """A call to the node failed on its side. After `threshold` in a row it is out of
        placement for a backoff that doubles with every further failure (to 60 s); when
        it ends, the next call is a probe. True when this failure took it out."""
        node = self.nodes.get(node_id)
        if node is None:
            return False
        node.failures += 1
        if node.failures < threshold:
            return False
        delay = min(60.0, backoff_s * 2 ** (node.failures - threshold))
        node.failing_until = now + delay
        self._change_at(node_id, node.failing_until)
        return True

    def vouched_warm(self, entry: SandboxEntry, now: float) -> bool:
        """Whether `entry`'s agent said it runs warm, in its node's last report or in an
        answer since (its create): only such a sandbox is served before its agent
        answers the grant. One this view still holds warm from before may have died
        since (an engine restart: the report that no longer lists it is held back for
        the confirm grace), and its grant's refusal must put the request back in line."""
        node = self.nodes.get(entry.node)
        if node is None or not node.serving(now):
            return False
        row = node.rows.get(entry.id)
        if row is not None:
            return row.state == SandboxState.WARM
        return entry.confirmed_at >= node.last_seen

    def call_succeeded(self, node_id: str) -> None:
        node = self.nodes.get(node_id)
        if node is not None and node.failures:
            node.failures = 0
            node.failing_until = 0.0
            self._dirty_nodes.setdefault(node_id)

    def _change_at(self, node_id: str, at: float) -> None:
        self._changes_at[node_id] = max(at, self._changes_at.get(node_id, 0.0))
        self._dirty_nodes.setdefault(node_id)

    def set_draining(self, node_id: str, draining: bool) -> None:
        if node := self.nodes.get(node_id):
            node.draining = draining
            self._dirty_nodes.setdefault(node_id)

    def request_drain(self, node_id: str, requested: bool) -> NodeEntry | None:
        """An operator's drain of a node starts (or, `requested` false, is called off);
        None: no such node."""
        node = self.nodes.get(node_id)
        if node is not None:
            node.drain_requested = requested
            self._dirty_nodes.setdefault(node_id)
        return node

    def drain_state(self, node: NodeEntry) -> DrainState:
        """none; draining while it holds sandboxes (leases running, removals under way);
        drained once it holds none: it may go."""
        if not node.drain_requested:
            return "none"
        return "draining" if self._by_node.get(node.id) else "drained"

    def on_node(self, node_id: str) -> list[SandboxEntry]:
        return list(self._by_node.get(node_id, {}).values())

    def count_unreserved(self, pool: str, template: str, states: Iterable[SandboxState]) -> int:
        """Sandboxes of `pool` and `template` in `states` that no waiting request's create
        is making: what an announced burst or a fork may count on."""
        return sum(
            1
            for state in states
            for e in self.by_state[state].values()
            if e.pool == pool and e.template == template and e.reserved_for is None
        )

    def apply_report(self, report: NodeReport, now: float) -> ReportChanges:
        """Apply a heartbeat: a full report, or a delta based on a report this view has
        applied (or an earlier one). The changes carry the answer for its agent."""
        previous = self.nodes.get(report.node_id)
        known = previous is not None and previous.incarnation == report.incarnation
        applied = previous.seq if known else 0
        if known and report.seq <= applied:
            # a retried or late request: the agent has reported since
            return ReportChanges(ReportAck(seq=applied))
        if report.base is not None and (not known or report.base > applied):
            # a delta on a report this view never had (it restarted): send everything
            return ReportChanges(ReportAck(seq=applied, full_report=True))
        node = self._node_from_report(report, previous, now)
        reported = report.sandboxes.rows()
        if report.base is None:
            node.rows = {row.id: row for row in reported}
        else:
            # rows are absolute: applied on any report from `base` on, they give this one
            node.rows.update((row.id, row) for row in reported)
            for sandbox_id in report.removed:
                node.rows.pop(sandbox_id, None)
        if report.base is None or not previous.healthy:
            held = self._by_node.get(node.id, {})
            settle = [*node.rows, *(i for i in held if i not in node.rows)]
        else:
            settle = [*(row.id for row in reported), *report.removed, *node.unsettled]
        node.unsettled = set()
        changes = ReportChanges(ReportAck(seq=report.seq))
        for sandbox_id in dict.fromkeys(settle):  # each once, in order
            self._settle(node, sandbox_id, now, changes)
        node.seq = report.seq
        return changes

    def _node_from_report(
        self, report: NodeReport, previous: NodeEntry | None, now: float
    ) -> NodeEntry:
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
            engine_ok=report.engine_ok,
            create_limit=report.create_limit,
            engine_id=report.engine_id,
            clock_offset=now - report.clock,
        )
        self._dirty_nodes.setdefault(node.id)
        if previous is not None:
            node.refused_until = previous.refused_until
            node.failures = previous.failures
            node.failing_until = previous.failing_until
            node.empty_since = previous.empty_since
            node.draining = previous.draining
            node.drain_requested = previous.drain_requested
            if previous.incarnation == report.incarnation:
                node.seq, node.rows = previous.seq, previous.rows
                node.unsettled = previous.unsettled
        return node

    def _settle(self, node: NodeEntry, sandbox_id: str, now: float, changes: ReportChanges) -> None:
        """Bring one sandbox of `node` in line with its row, or with its having none."""
        row = node.rows.get(sandbox_id)
        entry = self.sandboxes.get(sandbox_id)
        if row is None:
            if entry is not None:
                self._vanish(node, entry, now, changes)
            return
        if entry is None:
            proven = row.lease_id is None or self._granted(node, row)
            if not proven:
                changes.unproven.append(sandbox_id)
            # to go, and the next tick removes it: a lease not granted here (not a lease,
            # and not a sandbox to hand out), or one released while its node was away
            # (lost) or reported by a heartbeat older than its removal
            doomed = not proven or sandbox_id in self.released
            entry = self._entry_from_row(node, row, now, proven, doomed)
            self.add(entry)
            if not doomed:
                changes.added.append(entry)
                changes.busy_s[row.pool] = changes.busy_s.get(row.pool, 0.0) + row.busy_s
            return
        if delta := entry.busy_reported(row.busy_s):
            changes.busy_s[entry.pool] = changes.busy_s.get(entry.pool, 0.0) + delta
        entry.idle_since = node.our_time(row.active_at, now)
        if entry.op_in_flight or now - entry.confirmed_at < self.confirm_grace_s:
            node.unsettled.add(sandbox_id)
            return
        if entry.state == SandboxState.DESTROYING:
            return  # its removal failed and is retried: it is not coming back
        if entry.state != row.state and row.state != SandboxState.CREATING:
            if row.lease_id not in (None, entry.lease_id) and not self._granted(node, row):
                changes.unproven.append(sandbox_id)
                # its node holds a lease not granted here: it is no sandbox to hand out
                # (nor to keep), and the next tick removes it, as one first seen so
                self.move(entry, SandboxState.DESTROYING, now)
                return
            try:
                self.move(entry, row.state, now)
            except IllegalTransition as e:
                # no edge of the state machine leads there: a faulty (or hostile) node's
                # word, not taken; the rest of its report still counts
                log.warning("node %s reported %s: %s; ignored", node.id, sandbox_id, e)
                return
            entry.lease_id = row.lease_id
        entry.frozen_at = node.our_time(row.frozen_at, now)
        entry.confirmed_at = now

    def _granted(self, node: NodeEntry, row: SandboxRow) -> bool:
        return self.identities is None or self.identities.granted(node.id, row)

    def _vanish(
        self, node: NodeEntry, entry: SandboxEntry, now: float, changes: ReportChanges
    ) -> None:
        """A sandbox the node no longer has: an agent restart that could not adopt it."""
        if (
            entry.op_in_flight
            or entry.state == SandboxState.CREATING
            or now - entry.confirmed_at < self.confirm_grace_s
        ):
            node.unsettled.add(entry.id)
            return
        if entry.state in ASSIGNED or entry.state == SandboxState.LOST:
            self.move(entry, SandboxState.LOST, now)
        else:
            self.forget(entry.id)
        changes.vanished.append(entry)

    def _entry_from_row(
        self, node: NodeEntry, row: SandboxRow, now: float, proven: bool, doomed: bool
    ) -> SandboxEntry:
        """A sandbox new to the view, as its row says; without its lease if the lease was
        not `proven` granted here, and being removed if `doomed`."""
        active_at = node.our_time(row.active_at, now)
        leased = not doomed and row.state in ASSIGNED
        return SandboxEntry(
            id=row.id,
            node=node.id,
            pool=row.pool,
            template=row.template,
            state=SandboxState.DESTROYING if doomed else row.state,
            since=active_at if row.state == SandboxState.WARM and active_at is not None else now,
            created_at=row.created_at,
            cpus=row.cpus,
            memory_mb=row.memory_mb,
            lease_id=row.lease_id if proven else None,
            idempotency_key=row.idempotency_key if proven else None,
            owner=row.owner if proven else None,
            labels=None if row.lease_id else {},
            leased_at=now if leased else None,  # its start is not known: from now on
            confirmed_at=now,
            busy_s=row.busy_s,
            idle_since=active_at,
            frozen_at=node.our_time(row.frozen_at, now),
        )

    def mark_silent_nodes(self, now: float, timeout_s: float) -> list[NodeEntry]:
        """Nodes past the heartbeat timeout stop taking placements; their sandboxes are lost.
        A drained node that goes silent has left as its operator meant: it is forgotten."""
        if now - self._earliest_seen <= timeout_s:
            # every node has reported since: none is silent, and none was at the last look
            # (a node out for silence stays out until it reports, and then is new)
            return []
        newly_down = []
        for node in list(self.nodes.values()):
            alive = now - node.last_seen <= timeout_s
            if not alive and self.drain_state(node) == "drained":
                log.info("drained node %s has gone: forgotten", node.id)
                self.drop_node(node.id)
                continue
            if node.healthy != alive:
                self._dirty_nodes.setdefault(node.id)
            if node.healthy and not alive:
                newly_down.append(node)
                for entry in self.on_node(node.id):
                    if entry.state not in TERMINAL:
                        self.move(entry, SandboxState.LOST, now)
            node.healthy = alive
        self._earliest_seen = min([now, *(node.last_seen for node in self.nodes.values())])
        return newly_down

    def node_snaps(self, now: float) -> tuple[NodeSnap, ...]:
        for node_id, at in list(self._changes_at.items()):
            if now >= at:  # a refusal or a failure backoff has run out
                del self._changes_at[node_id]
                self._dirty_nodes.setdefault(node_id)
        for node_id in self._dirty_nodes:
            n = self.nodes.get(node_id)
            if n is None:
                self._node_snaps.pop(node_id, None)
                continue
            if self._by_node.get(n.id):
                n.empty_since = None
            elif n.empty_since is None:
                n.empty_since = now
            serving = n.serving(now)
            if serving:
                self._not_serving.discard(node_id)
            else:
                self._not_serving.add(node_id)
            self._node_snaps[node_id] = NodeSnap(
                n.id,
                n.kind,
                serving,
                n.capacity,
                self.used(n.id),
                n.images,
                accepting=now >= n.refused_until,
                empty_since=n.empty_since,
                creating=self._creating.get(n.id, 0),
                create_limit=n.create_limit,
                draining=n.draining or n.drain_requested,
                applying=self._applying.get(n.id, 0),
            )
        self._dirty_nodes.clear()
        return tuple(self._node_snaps.values())

    def drop_node(self, node_id: str) -> None:
        self.nodes.pop(node_id, None)
        self._not_serving.discard(node_id)
        self._dirty_nodes.setdefault(node_id)

    def sandbox_snaps(
        self, now: float, lease_due: Callable[[SandboxEntry], bool] | None
    ) -> tuple[SandboxSnap, ...]:
        """The sandboxes the policy may act on: unassigned ones (to claim, freeze, age),
        creates under way, and the leases (frozen or not) that `lease_due` picks (for
        lease-idle freezing and expiry; None leaves leases out). One with a call in
        flight, or backing off after a failed one (until its `retry_at`), is left out:
        nothing is decided about it until it can be acted on."""
        # list comprehensions, not generators: a look at the leases goes through 20,000
        # at DSec's scale
        snaps = [s.snap() for s in self.by_state[SandboxState.CREATING].values()]
        for state in (SandboxState.WARM, SandboxState.PAUSED, SandboxState.HIBERNATED):
            snaps += [
                s.snap()
                for s in self.by_state[state].values()
                if not s.op_in_flight and s.retry_at <= now
            ]
        if lease_due is not None:
            for state in (SandboxState.LEASED, SandboxState.LEASED_PAUSED):
                snaps += [
                    s.snap()
                    for s in self.by_state[state].values()
                    if now >= s.lease_not_due_before
                    and not s.op_in_flight
                    and s.retry_at <= now
                    and lease_due(s)
                ]
        if self._not_serving:
            # a node that cannot carry out calls cannot hand out, freeze or remove what it
            # holds either: its sandboxes wait for it to come back (creates under way still
            # count). A draining node serves: the policy removes its idle sandboxes.
            snaps = [
                s
                for s in snaps
                if s.node not in self._not_serving or s.state == SandboxState.CREATING
            ]
        return tuple(snaps)
