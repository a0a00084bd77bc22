"""The elastic policy: pure decisions from a snapshot.

`decide(snapshot, pools, now)` looks at the cluster and the queues and returns what
to do as plain data, each action with its reason. It does no I/O and reads no
clock: the control plane applies the actions through the agents, and the simulator
applies the same actions in virtual time.

One decision, in order (DSec's defaults; docs/policy.md):
1. Serve the queue, highest pool priority, then request priority, then arrival
   first. A request takes, in order of preference: the sandbox created for it, a
   warm sandbox, a paused one (thaw), a hibernated one (restore), an idle or frozen
   sandbox of a lower-priority pool, and otherwise gets a cold create placed for it.
   A request no node can take gets an Unplaceable with the reason: final (the acquire
   fails now) when every node that could run it refused its template.
2. Scale up on queue depth: when pending > k x idle, create step x idle extra warm
   sandboxes (step x pending when idle is 0), within max_warm and capacity. These
   are on top of the cold creates of step 1: they anticipate the rest of a burst.
3. Keep the warm target: warm_fraction of the recent peak of concurrency, within
   [min_warm, max_warm]; thaw paused sandboxes before creating, and pace creates
   (refill_concurrency) so refills do not starve the acquires they are for.
   An announced burst (a prewarm: `count` within `within_s`, held `hold_s` more)
   raises the target of its pool and template to its count less the acquires it
   has served, within max_warm, until it expires: a burst of `count` acquires finds
   `count` warm sandboxes and the pool does not refill behind it. Its creates are
   not paced: all missing ones start at once, bounded by room on the nodes, so that
   they are ready within `within_s` whatever refill_concurrency says.
4. Scale down once the queue is safe (nothing waiting): warm sandboxes beyond the
   target (raised by an active prewarm) that idled past freeze_after are paused,
   scale_down_step of them a tick.
5. Age the frozen: paused past hibernate_after are hibernated (files kept, memory
   released), and frozen past frozen_ttl are destroyed.
6. Pause leased sandboxes whose client ran nothing for lease_idle_freeze; the
   agent thaws them on their next exec.
7. Cloud overflow: while local utilisation is past overflow_threshold, creates of
   templates that may leave go to cloud nodes; boot one more when none has room,
   release a cloud node that has stayed empty.
8. End leases past their pool's max_lease_s, and those whose client neither ran a
   command nor renewed for lease_idle_timeout_s (a rollout worker that died): the
   sandbox goes and its slot comes back.
9. Drain: a draining node (an operator's drain, or a cloud node being released) gets
   no creates and no claims (rules 1 to 3 and 7 look past it), and its idle sandboxes
   (warm, paused, hibernated) are removed; its leases run to their end, under rules 6
   and 8 as anywhere else.
10. Retire: a sandbox made from a template since removed or changed (`PUT` or `DELETE
   /v1/templates/{name}`) is taken by no request; once idle it is removed, and a lease
   on it runs to its end (its release removes it, whatever the pool's recycle says).

Placement never sends a create to a node whose engine lacks the template's image; a
request no node can take for that reason fails at once (final), unless the control
plane is sending the image to them (`TemplateSnap.distributable`).
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from operator import attrgetter
from typing import Literal

from dsec.models import PoolParams
from dsec.states import SandboxState

S = SandboxState
# With more feasible nodes than this, placement samples candidates instead of scoring
# every node (power of d choices, as DSec and E2B do), so a decision stays cheap at
# thousands of nodes.
SAMPLE_ABOVE = 16
SAMPLE_SIZE = 4


# Snapshot types are values: built once per tick, never changed. They are not frozen
# only because frozen dataclasses cost several times more to build, and a tick at
# thousands of nodes builds many.
@dataclass(slots=True)
class Resources:
    cpus: float = 0.0
    memory_mb: int = 0
    slots: int = 0

    def __add__(self, other: Resources) -> Resources:
        return Resources(
            self.cpus + other.cpus, self.memory_mb + other.memory_mb, self.slots + other.slots
        )

    def fits_in(self, capacity: Resources) -> bool:
        return (
            self.slots <= capacity.slots
            and self.cpus <= capacity.cpus + 1e-9
            and self.memory_mb <= capacity.memory_mb
        )

    def ratio_of(self, capacity: Resources) -> float:
        """The fullest dimension: a node is as full as its scarcest resource."""
        return max(
            self.slots / capacity.slots if capacity.slots else 1.0,
            self.cpus / capacity.cpus if capacity.cpus else 1.0,
            self.memory_mb / capacity.memory_mb if capacity.memory_mb else 1.0,
        )


@dataclass(slots=True)
class NodeSnap:
    id: str
    kind: str  # "local" or "cloud"
    healthy: bool
    capacity: Resources
    used: Resources
    images: frozenset[str] = frozenset()
    accepting: bool = True  # False for a while after it refused a placement
    empty_since: float | None = None  # when it last became empty, None while in use
    creating: int = 0  # creates under way on it
    # creates its engine runs at once before it only gets slower (its agent measures it):
    # more are not placed there, so each create finishes as soon as the engine allows
    create_limit: int = 1 << 30
    draining: bool = False  # rule 9: no placements, its idle sandboxes removed
    # personalised claims its agent is applying (their files, setup or fork copy): work on
    # its one event loop that the client waits for, so another such claim goes elsewhere
    applying: int = 0


@dataclass(frozen=True)
class TemplateSnap:
    name: str
    image: str  # as nodes list their images (dsec.models.normalise_image_ref)
    cpus: float
    memory_mb: int
    may_overflow: bool
    # the control plane is sending its image to nodes that lack it: a request for it
    # waits for a node that has it rather than failing
    distributable: bool = False
    recyclable: bool = False  # a pool that recycles may reset its sandboxes for reuse

    @property
    def needs(self) -> Resources:
        return Resources(self.cpus, self.memory_mb, 1)


@dataclass(slots=True)
class SandboxSnap:
    id: str
    node: str
    pool: str
    template: str
    state: SandboxState
    since: float  # when it entered its state
    reserved_for: str | None = None  # the request a cold create was made for
    idle_since: float | None = None  # leased: when its client last ran something
    frozen_at: float | None = None  # paused or hibernated: when it was first frozen
    leased_at: float | None = None  # leased: when its lease began
    renewed_at: float | None = None  # leased: when its client last renewed it
    # made from a template since removed or changed: rule 10 removes it once idle, and
    # no request takes it
    retired: bool = False


@dataclass(slots=True)
class RequestSnap:
    id: str
    pool: str
    template: str
    priority: int
    arrived_at: float
    refused_by: frozenset[str] = frozenset()  # nodes that refused a create for it
    # the last refusal that was about its template (an image a node lacks, a setting
    # Docker rejects), as the agent said it; None while no node refused the template
    template_refusal: str | None = None
    # requests that should land on different nodes where they can (a fork's copies,
    # docs/contracts.md "Fork"): each is claimed a free sandbox on the node holding the
    # fewest of its group in this decision
    spread: str | None = None
    # a personalised claim (docs/contracts.md): its node applies it before the answer, so
    # it takes a free sandbox on the node applying the fewest claims
    personal: bool = False


@dataclass(frozen=True)
class CloudSnap:
    """What the cloud provider can still do."""

    max_nodes: int
    booting: int  # nodes asked for that have not registered yet
    idle_release_s: float  # how long a cloud node stays empty before it is released


@dataclass(frozen=True)
class PrewarmSnap:
    """The announced bursts of a pool and template (`POST /v1/pools/{name}/prewarm`):
    rule 3 keeps `count` warm (what its clients' prewarms still want: each one's count
    less the acquires it has served), while now < `until`."""

    count: int
    until: float


@dataclass(frozen=True)
class Snapshot:
    nodes: tuple[NodeSnap, ...]
    sandboxes: tuple[SandboxSnap, ...]
    requests: tuple[RequestSnap, ...]
    templates: Mapping[str, TemplateSnap]
    # recent peak of leased sandboxes per (pool, template): sizes the warm pool
    peaks: Mapping[tuple[str, str], int] = field(default_factory=dict)
    # leased sandboxes now per (pool, template): what replica-counting baselines scale on
    leased: Mapping[tuple[str, str], int] = field(default_factory=dict)
    cloud: CloudSnap | None = None
    # by pool and template
    prewarms: Mapping[tuple[str, str], PrewarmSnap] = field(default_factory=dict)
    # acquires served a second, recently, per (pool, template), and the time a sandbox
    # of a template takes to be made, or to be reset for reuse (a pool that recycles):
    # a steady stream needs the rate times the time to replace what it takes warm
    acquire_rates: Mapping[tuple[str, str], float] = field(default_factory=dict)
    create_s: Mapping[str, float] = field(default_factory=dict)
    reset_s: Mapping[str, float] = field(default_factory=dict)
    seed: int = 0  # varies sampling between ticks while keeping decide() deterministic


@dataclass(frozen=True)
class Claim:
    request_id: str
    sandbox_id: str
    path: str  # warm, thaw, cold, overflow
    reason: str


@dataclass(frozen=True)
class Create:
    node: str
    pool: str
    template: str
    for_request: str | None
    reason: str


@dataclass(frozen=True)
class Pause:
    sandbox_id: str
    reason: str


@dataclass(frozen=True)
class Thaw:
    sandbox_id: str
    reason: str


@dataclass(frozen=True)
class Hibernate:
    sandbox_id: str
    reason: str


@dataclass(frozen=True)
class Destroy:
    sandbox_id: str
    reason: str


@dataclass(frozen=True)
class ExpireLease:
    """End a lease its client let lapse (or that reached its pool's max_lease_s): the
    sandbox goes, and its client is told `lease_expired`."""

    sandbox_id: str
    reason: str
    outcome: Literal["expired", "idle_timeout"] = "expired"  # the lease's, for its client


@dataclass(frozen=True)
class Unplaceable:
    """A request that no node can take now, and why. `final`: every node that could run
    it has refused its template, so waiting will not help and the acquire fails now;
    otherwise the request waits, and its reason is what its client hears on timeout."""

    request_id: str
    # no_room (nothing fits now), template_refused (final), image_missing (final unless
    # the image is being sent), template_removed (final)
    code: str
    final: bool
    reason: str


@dataclass(frozen=True)
class ProvisionCloud:
    count: int
    reason: str


@dataclass(frozen=True)
class ReleaseCloud:
    node: str
    reason: str


Action = (
    Claim | Create | Unplaceable | Pause | Thaw | Hibernate | Destroy | ExpireLease
    | ProvisionCloud | ReleaseCloud
)  # fmt: skip

# What a claim costs, best first; the path it reports.
CLAIM_TIERS = ((S.WARM, "warm"), (S.PAUSED, "thaw"), (S.HIBERNATED, "thaw"))
# The reason of the creates an announced burst (a prewarm) makes: the control plane
# counts them in dsec_scale_events_total{action="prewarm"} as well as create.
PREWARM_REASON = "prewarm: warm pool below an announced burst"


def warm_target(params: PoolParams, peak: int) -> int:
    """warm_fraction of the recent peak, within [min_warm, max_warm]."""
    return max(params.min_warm, min(params.max_warm, math.ceil(params.warm_fraction * peak)))


def flow_target(in_flight: float) -> int:
    """The warm sandboxes a steady stream takes while one is replaced: on average
    `in_flight`, its acquires a second times the time a replacement takes (Little's law),
    plus two standard deviations of a random (Poisson) stream's count over that time, so
    that the pool runs dry in about one replacement time in forty rather than one in two."""
    if in_flight <= 0:
        return 0
    return math.ceil(in_flight + 2 * math.sqrt(in_flight))


def scale_up_step(params: PoolParams, pending: int, idle: int) -> int:
    """Extra warm sandboxes when the queue outgrows the idle ones (0 if it does not)."""
    if pending <= params.scale_up_k * idle:
        return 0
    base = idle if idle > 0 else pending  # 50% of nothing would never start a burst
    return max(1, math.ceil(params.scale_up_step * base))


def _seed(*parts: object) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "big")


class Placement:
    """Capacity as this decision uses it up, so one tick never overbooks a node."""

    def __init__(self, nodes: Iterable[NodeSnap], seed: int) -> None:
        self.nodes = tuple(nodes)
        self.extra: dict[str, Resources] = {}
        self.creates: dict[str, int] = {}  # creates placed by this decision, per node
        self.seed = seed
        self.unplaced_overflow = 0  # creates that wanted a cloud node and found none
        # the capacity and use of the nodes that take work (a draining node's room is not
        # there to fill), before this decision's placements: summed on the first look for
        # local room, in the same pass (most ticks at DSec's scale place something)
        self.local_capacity: Resources | None = None
        self.local_used: Resources | None = None
        # (kind, needs, excluded) -> the nodes with room for it, by id in the nodes' order:
        # looked for once a decision, then kept up to date as placements use room (a
        # placement changes the room of one node), since a burst places many creates
        self._room: dict[tuple[str, float, int, int, frozenset[str]], dict[str, NodeSnap]] = {}

    def used(self, node: NodeSnap) -> Resources:
        extra = self.extra.get(node.id)
        return node.used + extra if extra else node.used

    def local_utilisation(self) -> float:
        """After a look for local room (`feasible("local", ...)`), which sums the nodes."""
        assert self.local_capacity is not None and self.local_used is not None
        if not self.local_capacity.slots:
            return 1.0
        return self.local_used.ratio_of(self.local_capacity)

    def feasible(self, kind: str, needs: Resources, excluded: frozenset[str]) -> list[NodeSnap]:
        """The nodes of `kind` that take work and have room for `needs`, less `excluded`."""
        key = (kind, needs.cpus, needs.memory_mb, needs.slots, excluded)
        room = self._room.get(key)
        if room is None:
            room = self._room[key] = {n.id: n for n in self._look_for_room(kind, needs, excluded)}
        return list(room.values())

    def _look_for_room(
        self, kind: str, needs: Resources, excluded: frozenset[str]
    ) -> list[NodeSnap]:
        # inline, with what it reads in locals: this runs per node per create
        found = []
        extra = self.extra
        slots, cpus, memory_mb = needs.slots, needs.cpus, needs.memory_mb
        totals = kind == "local" and self.local_capacity is None
        total_cpus = total_memory_mb = total_slots = used_cpus = used_memory_mb = used_slots = 0
        for n in self.nodes:
            if n.kind != kind or not n.healthy or n.draining:
                continue
            used, cap = n.used, n.capacity
            if totals:
                total_cpus += cap.cpus
                total_memory_mb += cap.memory_mb
                total_slots += cap.slots
                used_cpus += used.cpus
                used_memory_mb += used.memory_mb
                used_slots += used.slots
            if not n.accepting or n.id in excluded:
                continue
            if extra and (more := extra.get(n.id)) is not None:
                used = used + more
            if (
                used.slots + slots <= cap.slots
                and used.cpus + cpus <= cap.cpus + 1e-9
                and used.memory_mb + memory_mb <= cap.memory_mb
            ):
                found.append(n)
        if totals:
            self.local_capacity = Resources(total_cpus, total_memory_mb, total_slots)
            self.local_used = Resources(used_cpus, used_memory_mb, used_slots)
        return found

    def creates_queued(self, node: NodeSnap) -> float:
        """How many rounds of its engine's creates a new create on `node` waits behind."""
        return (node.creating + self.creates.get(node.id, 0)) / node.create_limit

    def place(
        self,
        template: TemplateSnap,
        overflow_threshold: float,
        key: object,
        exclude: frozenset[str] = frozenset(),
        spare_engine_only: bool = False,
    ) -> NodeSnap | None:
        """Pick a node for one sandbox of `template`, or None if nothing fits.

        Only nodes whose engine holds the template's image. Local nodes first; cloud
        ones while local utilisation is past the overflow threshold (or local is full)
        and the template may leave. Among candidates, the shortest queue of creates on
        their engine, then the most free capacity. With `spare_engine_only` (a refill no
        request waits for) it only goes where the engine has a create to spare: past its
        measured limit it would only queue behind the creates that requests wait for.
        """
        needs, image = template.needs, template.image
        candidates = [n for n in self.feasible("local", needs, exclude) if image in n.images]
        overflowing = not candidates or self.local_utilisation() >= overflow_threshold
        if overflowing and template.may_overflow:
            cloud = [n for n in self.feasible("cloud", needs, exclude) if image in n.images]
            if cloud:
                candidates = cloud
            else:
                self.unplaced_overflow += 1
        if spare_engine_only:
            candidates = [n for n in candidates if self.creates_queued(n) < 1]
        if not candidates:
            return None
        if len(candidates) > SAMPLE_ABOVE:
            candidates = random.Random(_seed(self.seed, key)).sample(candidates, SAMPLE_SIZE)
        best = max(
            candidates,
            key=lambda n: (
                -self.creates_queued(n),
                1.0 - (self.used(n) + needs).ratio_of(n.capacity),
                n.id,  # a stable tie-break keeps decisions reproducible
            ),
        )
        self.extra[best.id] = self.extra.get(best.id, Resources()) + needs
        self.creates[best.id] = self.creates.get(best.id, 0) + 1
        for (_, cpus, memory_mb, slots, _), room in self._room.items():
            if best.id in room and not (
                self.used(best) + Resources(cpus, memory_mb, slots)
            ).fits_in(best.capacity):
                del room[best.id]
        if best.kind == "local" and best.healthy:
            self.local_used = self.local_used + needs
        return best

    def for_request(
        self, req: RequestSnap, template: TemplateSnap, params: PoolParams, key: object, why: str
    ) -> Create | Unplaceable:
        """A cold create for a waiting request, or the reason there can be none."""
        node = self.place(template, params.overflow_threshold, key, req.refused_by)
        if node is not None:
            return Create(node.id, req.pool, req.template, req.id, why)
        # the nodes that could ever run it, whatever their room: have they all refused it?
        eligible = [
            n
            for n in self.nodes
            if n.healthy and not n.draining and (n.kind == "local" or template.may_overflow)
        ]
        if eligible and not any(template.image in n.images for n in eligible):
            sent = template.distributable
            return Unplaceable(
                req.id,
                "image_missing",
                not sent,
                f"no node holds image {template.image} of template {req.template!r}"
                + ("; it is being sent to them" if sent else ""),
            )
        if req.template_refusal is not None and req.refused_by.issuperset(n.id for n in eligible):
            return Unplaceable(
                req.id,
                "template_refused",
                True,
                f"no node can run template {req.template!r} (image {template.image}): "
                f"{req.template_refusal}",
            )
        return Unplaceable(
            req.id,
            "no_room",
            False,
            f"no node has room for template {req.template!r} "
            f"({template.cpus} cpus, {template.memory_mb} MB) that has not refused it",
        )


class _Decision:
    def __init__(self, snapshot: Snapshot, pools: Mapping[str, PoolParams], now: float) -> None:
        self.snap = snapshot
        self.pools = pools
        self.now = now
        self.actions: list[Action] = []
        self._placement: Placement | None = None
        self._lenders: dict[str, list[str]] = {}
        # spread group -> node -> claims made for it in this decision
        self.spread_nodes: dict[str, dict[str, int]] = {}
        # node -> personalised claims it is applying, this decision's included
        self._applying: dict[str, int] | None = None
        # unassigned sandboxes by (pool, template) and state, oldest first
        self.free: dict[tuple[str, str, SandboxState], list[SandboxSnap]] = {}
        # creates under way per (pool, template); each waiting request served in this
        # decision by one of them takes it, and what is left is the warm pool's
        self.creating: dict[tuple[str, str], int] = {}
        self.leased: list[SandboxSnap] = []
        self.frozen_leases: list[SandboxSnap] = []
        draining = {n.id for n in snapshot.nodes if n.draining}
        self.drained: list[SandboxSnap] = []  # idle on a draining node: rule 9 removes them
        self.retired: list[SandboxSnap] = []  # idle, of an old template: rule 10 removes them
        free, creating = self.free, self.creating  # in locals: this runs per sandbox per tick
        for sb in sorted(snapshot.sandboxes, key=attrgetter("since", "id")):
            state = sb.state
            if (
                (sb.retired or (draining and sb.node in draining))
                and state != S.LEASED
                and state != S.LEASED_PAUSED
            ):
                # neither claimed nor waited for: a create under way is removed once it is
                # ready, and its request is served elsewhere (by the template as it is now)
                if state in (S.WARM, S.PAUSED, S.HIBERNATED):
                    (self.retired if sb.retired else self.drained).append(sb)
                continue
            # a sandbox created for a request is not kept for it: whatever is ready first
            # goes to the oldest waiter (reserved_for only tells whose create it was)
            if state == S.CREATING:
                key = (sb.pool, sb.template)
                creating[key] = creating.get(key, 0) + 1
            elif state in (S.WARM, S.PAUSED, S.HIBERNATED):
                key = (sb.pool, sb.template, state)
                if (same := free.get(key)) is None:
                    free[key] = [sb]
                else:
                    same.append(sb)
            elif state == S.LEASED:
                self.leased.append(sb)
            elif sb.state == S.LEASED_PAUSED:
                self.frozen_leases.append(sb)
        # waiting requests beyond the creates under way: the queue-depth signal
        self.pending: dict[tuple[str, str], int] = {}
        self.waiting: dict[tuple[str, str], int] = {}
        for r in snapshot.requests:
            self.waiting[(r.pool, r.template)] = self.waiting.get((r.pool, r.template), 0) + 1
        for key, n in self.waiting.items():
            if n > self.creating.get(key, 0):
                self.pending[key] = n - self.creating.get(key, 0)
        # idle before this tick's claims: what the scale-up rule compares the queue with
        self.idle_before = {
            key: self.count(key, S.WARM) + self.count(key, S.PAUSED)
            for key in {*self.pending, *((p, t) for p, t, _ in self.free)}
        }

    @property
    def placement(self) -> Placement:
        """Built on first use: most ticks place nothing."""
        if self._placement is None:
            self._placement = Placement(self.snap.nodes, self.snap.seed)
        return self._placement

    def count(self, key: tuple[str, str], state: SandboxState) -> int:
        return len(self.free.get((*key, state), []))

    def normal_target(self, key: tuple[str, str], params: PoolParams) -> int:
        """Rule 3's target without a prewarm: 0 for a template the pool does not keep warm;
        the recent peak's share, or what the recent acquire rate takes while a sandbox is
        replaced (within max_warm), whichever is more."""
        if key[1] not in params.templates:
            return 0
        return max(warm_target(params, self.snap.peaks.get(key, 0)), self.flow(key, params))

    def flow(self, key: tuple[str, str], params: PoolParams) -> int:
        """flow_target for `key` from the snapshot, within max_warm."""
        return min(params.max_warm, flow_target(self._in_flight(key, params)))

    def recycles(self, key: tuple[str, str], params: PoolParams) -> bool:
        template = self.snap.templates.get(key[1])
        return params.recycle and template is not None and template.recyclable

    def _in_flight(self, key: tuple[str, str], params: PoolParams) -> float:
        """Acquires a second times the time to replace one: a create, or in a pool that
        recycles, the reset that makes a released sandbox warm again."""
        times = self.snap.reset_s if self.recycles(key, params) else self.snap.create_s
        return self.snap.acquire_rates.get(key, 0.0) * times.get(key[1], 0.0)

    def prewarm_target(self, key: tuple[str, str], params: PoolParams) -> int:
        """What an active prewarm holds warm for (pool, template): its count less the
        acquires it has served, within max_warm; 0 when there is none or it expired."""
        pw = self.snap.prewarms.get(key)
        if pw is None or self.now >= pw.until:
            return 0
        # this tick's claims count as served too: the control plane learns of them only
        # once they are applied, and the warm sandboxes they took must not be remade
        asked = {r.id for r in self.snap.requests if (r.pool, r.template) == key}
        now_served = sum(1 for a in self.actions if isinstance(a, Claim) and a.request_id in asked)
        return max(0, min(params.max_warm, pw.count - now_served))

    def priority(self, pool: str) -> int:
        params = self.pools.get(pool)
        return params.priority if params else 0

    def lenders_to(self, pool: str) -> list[str]:
        """Pools of lower priority, lowest first: whose idle sandboxes `pool` may take."""
        if pool not in self._lenders:
            mine = self.priority(pool)
            self._lenders[pool] = sorted(
                (p for p in self.pools if self.priority(p) < mine),
                key=lambda p: (self.priority(p), p),
            )
        return self._lenders[pool]

    def take(
        self, pool: str, template: str, state: SandboxState, req: RequestSnap | None = None
    ) -> SandboxSnap | None:
        """The oldest free sandbox; for a request of a `spread` group, the oldest on the
        node that holds the fewest of that group's claims so far; for a personalised
        one, then on the node applying the fewest claims."""
        free = self.free.get((pool, template, state))
        if not free:
            return None
        if req is None or not (req.spread or req.personal):
            return free.pop(0)
        held = self.spread_nodes.setdefault(req.spread, {}) if req.spread else {}
        applying = self.applying if req.personal else {}
        at = min(
            range(len(free)),
            key=lambda i: (held.get(free[i].node, 0), applying.get(free[i].node, 0), i),
        )
        sb = free.pop(at)
        if req.spread:
            held[sb.node] = held.get(sb.node, 0) + 1
        if req.personal:
            applying[sb.node] = applying.get(sb.node, 0) + 1
        return sb

    @property
    def applying(self) -> dict[str, int]:
        """Built on first use: most decisions claim nothing personalised."""
        if self._applying is None:
            self._applying = {n.id: n.applying for n in self.snap.nodes if n.applying}
        return self._applying

    # 1 ---------------------------------------------------------------------------
    def serve_queue(self) -> None:
        order = sorted(
            self.snap.requests,
            key=lambda r: (-self.priority(r.pool), -r.priority, r.arrived_at, r.id),
        )
        # (pool, template) no node has room for, in this decision: the requests behind
        # the first one refused for want of room take no placement (a look at every node)
        # each, so that a long queue on a full cluster costs a tick no more than a short one
        full: set[tuple[str, str]] = set()
        for req in order:
            if self._claim_for(req):
                continue
            key = (req.pool, req.template)
            if key in full and req.template_refusal is None:
                continue  # a refused template's request is still told when all refused it
            made = self._create_for(req)
            if isinstance(made, Unplaceable) and not made.final and not req.refused_by:
                full.add(key)  # no node excluded for it, and none had room

    def _claim_for(self, req: RequestSnap) -> bool:
        """Hand `req` a free sandbox, or one of the creates under way; False if neither."""
        key = (req.pool, req.template)
        for state, path in CLAIM_TIERS:
            sb = self.take(req.pool, req.template, state, req)
            if sb is not None:
                if sb.since > req.arrived_at or sb.reserved_for == req.id:  # made for it
                    path = "overflow" if self._on_cloud(sb) else "cold"
                self._claim(req, sb, path, f"a {state} sandbox of its pool was free")
                return True
        for state, path in CLAIM_TIERS[:2]:  # idle or frozen, never busy
            for lender in self.lenders_to(req.pool):
                sb = self.take(lender, req.template, state, req)
                if sb is not None:
                    reason = f"taken from lower-priority pool {lender} ({state})"
                    self._claim(req, sb, path, reason)
                    return True
        if self.creating.get(key, 0) > 0:  # the next create to finish is its
            self.creating[key] -= 1
            return True
        return False

    @cached_property
    def nodes(self) -> dict[str, NodeSnap]:
        """Built on first use: most ticks look up no node."""
        return {n.id: n for n in self.snap.nodes}

    def _on_cloud(self, sb: SandboxSnap) -> bool:
        node = self.nodes.get(sb.node)
        return node is not None and node.kind == "cloud"

    def _claim(self, req: RequestSnap, sb: SandboxSnap, path: str, reason: str) -> None:
        self.actions.append(Claim(req.id, sb.id, path, reason))

    def _create_for(self, req: RequestSnap) -> Create | Unplaceable | None:
        template = self.snap.templates.get(req.template)
        params = self.pools.get(req.pool)
        if params is None:
            return None
        if template is None:  # removed while the request waited
            made: Create | Unplaceable = Unplaceable(
                req.id, "template_removed", True, f"template {req.template!r} was removed"
            )
        else:
            made = self.placement.for_request(
                req, template, params, ("request", req.id), "no free sandbox for a request"
            )
        self.actions.append(made)
        return made

    # 2, 3 ------------------------------------------------------------------------
    def grow(self) -> None:
        for pool_name in sorted(self.pools):
            params = self.pools[pool_name]
            templates = {*params.templates, *(t for p, t in self.pending if p == pool_name)}
            # a prewarm may name a template not kept warm
            templates |= {t for p, t in self.snap.prewarms if p == pool_name}
            for template_name in sorted(templates):
                template = self.snap.templates.get(template_name)
                if template is None:
                    continue
                key = (pool_name, template_name)
                warm_now = self.count(key, S.WARM) + self.creating.get(key, 0)
                room = max(0, params.max_warm - warm_now)
                step = scale_up_step(params, self.pending.get(key, 0), self.idle_before.get(key, 0))
                # one step in flight at a time: a queue that stays long over several ticks
                # must not add a step on every tick
                extra = min(room, max(0, step - self.creating.get(key, 0)))
                self._create_warm(key, template, params, extra, "scale-up: pending > k x idle")
                prewarm = self.prewarm_target(key, params)
                if template_name not in params.templates and not prewarm:
                    continue
                normal = self.normal_target(key, params)
                missing = max(normal, prewarm) - warm_now - extra
                while missing > 0 and (sb := self.take(pool_name, template_name, S.PAUSED)):
                    self.actions.append(Thaw(sb.id, "warm pool below target: thaw before create"))
                    missing -= 1
                if prewarm > normal:
                    # an announced burst: every missing create starts now, bounded by room
                    # on the nodes (placement), so that the count is ready within within_s;
                    # pacing them at refill_concurrency would miss it at any size. The
                    # agents order their engine's work themselves.
                    self._create_warm(key, template, params, missing, PREWARM_REASON)
                    continue
                # paced: the engine serialises creates, so more in flight only steals CPU
                # from the acquires the warm pool is there to serve; but where creates
                # replace what a steady stream takes, it needs as many in flight as it
                # takes while one is made (Little's law), or the refill falls behind it
                # whatever the target (where resets replace them, they do not)
                pace = params.refill_concurrency
                if not self.recycles(key, params):
                    pace = max(pace, math.ceil(self._in_flight(key, params)))
                paced = pace - self.creating.get(key, 0) - extra
                self._create_warm(
                    key,
                    template,
                    params,
                    min(missing, paced),
                    "warm pool below target",
                    spare_engine_only=True,
                )

    def _create_warm(
        self,
        key: tuple[str, str],
        template: TemplateSnap,
        params: PoolParams,
        n: int,
        why: str,
        spare_engine_only: bool = False,
    ) -> None:
        """`n` creates no request waits for. A refill (`spare_engine_only`) goes only where
        an engine has a create to spare; a scale-up or a prewarm anticipates demand and is
        placed anyway: the agents run every create a request waits for before it, and
        whatever is ready first goes to the oldest waiter."""
        for i in range(max(0, n)):
            node = self.placement.place(
                template,
                params.overflow_threshold,
                (*key, why, i),
                spare_engine_only=spare_engine_only,
            )
            if node is None:
                return
            self.actions.append(Create(node.id, key[0], key[1], None, why))

    # 4 ---------------------------------------------------------------------------
    def scale_down(self) -> None:
        for pool_name in sorted(self.pools):
            params = self.pools[pool_name]
            for template_name in sorted({t for p, t, _ in self.free if p == pool_name}):
                key = (pool_name, template_name)
                if self.waiting.get(key, 0) > 0:
                    continue  # only once the queue is at a safe level
                warm = self.free.get((*key, S.WARM), [])
                # an active prewarm holds its sandboxes: they are not paused before it ends
                target = max(self.normal_target(key, params), self.prewarm_target(key, params))
                excess = len(warm) - target
                step = math.ceil(params.scale_down_step * len(warm))
                idle_long = [sb for sb in warm if self.now - sb.since >= params.freeze_after_s]
                for sb in idle_long[: max(0, min(excess, step))]:
                    self.actions.append(Pause(sb.id, "idle past freeze_after, beyond the target"))

    # 5 ---------------------------------------------------------------------------
    def age_frozen(self) -> None:
        for (pool_name, _, state), sandboxes in sorted(self.free.items()):
            params = self.pools.get(pool_name)
            if params is None or state == S.WARM:
                continue
            for sb in sandboxes:
                frozen_for = self.now - (sb.frozen_at if sb.frozen_at is not None else sb.since)
                if frozen_for >= params.frozen_ttl_s:
                    self.actions.append(Destroy(sb.id, "frozen past frozen_ttl"))
                elif state == S.PAUSED and self.now - sb.since >= params.hibernate_after_s:
                    self.actions.append(Hibernate(sb.id, "paused past hibernate_after"))

    # 6 ---------------------------------------------------------------------------
    def freeze_idle_leases(self) -> None:
        for sb in self.leased:
            params = self.pools.get(sb.pool)
            if params is None or sb.idle_since is None:
                continue
            if self.now - sb.idle_since >= params.lease_idle_freeze_s:
                self.actions.append(Pause(sb.id, "leased but idle past lease_idle_freeze"))

    # 7 ---------------------------------------------------------------------------
    def cloud(self) -> None:
        cloud = self.snap.cloud
        if cloud is None:
            return
        cloud_nodes = [n for n in self.snap.nodes if n.kind == "cloud"]
        unplaced = self._placement.unplaced_overflow if self._placement else 0
        if unplaced and cloud.booting == 0:
            if len(cloud_nodes) + cloud.booting < cloud.max_nodes:
                self.actions.append(
                    ProvisionCloud(1, "local utilisation past the overflow threshold")
                )
        placed_on = {a.node for a in self.actions if isinstance(a, Create)}
        for node in cloud_nodes:
            if (
                node.empty_since is not None
                and node.id not in placed_on
                and self.now - node.empty_since >= cloud.idle_release_s
            ):
                self.actions.append(ReleaseCloud(node.id, "cloud node empty for a while"))

    # 8 ---------------------------------------------------------------------------
    def expire_leases(self) -> None:
        for sb in self.leased + self.frozen_leases:
            params = self.pools.get(sb.pool)
            if params is None or sb.leased_at is None:
                continue
            if params.max_lease_s is not None and self.now - sb.leased_at >= params.max_lease_s:
                self.actions.append(ExpireLease(sb.id, "lease past max_lease_s"))
                continue
            if params.lease_idle_timeout_s is None or sb.idle_since is None:
                continue  # no timeout, or a command is running: its client is there
            active_at = max(sb.idle_since, sb.leased_at, sb.renewed_at or sb.leased_at)
            if self.now - active_at >= params.lease_idle_timeout_s:
                self.actions.append(
                    ExpireLease(
                        sb.id, "no command and no renewal for lease_idle_timeout_s", "idle_timeout"
                    )
                )

    # 9 ---------------------------------------------------------------------------
    def drain(self) -> None:
        for sb in self.drained:
            self.actions.append(Destroy(sb.id, "its node is draining"))

    # 10 --------------------------------------------------------------------------
    def retire(self) -> None:
        for sb in self.retired:
            self.actions.append(Destroy(sb.id, "its template was removed or changed"))


def decide(snapshot: Snapshot, pools: Mapping[str, PoolParams], now: float) -> list[Action]:
    d = _Decision(snapshot, pools, now)
    d.serve_queue()
    d.grow()
    d.scale_down()
    d.age_frozen()
    d.freeze_idle_leases()
    d.expire_leases()
    d.cloud()
    d.drain()
    d.retire()
    return d.actions
