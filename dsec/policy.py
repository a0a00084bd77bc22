"""The elastic policy: pure decisions from a snapshot.

`decide(snapshot, pools, now)` looks at the cluster and the queues and returns what
to do as plain data (claims, creates, destroys, pauses), each with its reason. It
does no I/O and reads no clock: the control plane applies its actions through the
agents, and the simulator applies the same actions in virtual time.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from dsec.models import PoolParams
from dsec.states import SandboxState

# With more feasible nodes than this, placement samples candidates instead of scoring
# every node (power of d choices, as DSec and E2B do), so a decision stays cheap at
# thousands of nodes.
SAMPLE_ABOVE = 16
SAMPLE_SIZE = 4


@dataclass(frozen=True)
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


@dataclass(frozen=True)
class NodeSnap:
    id: str
    kind: str  # "local" or "cloud"
    healthy: bool
    capacity: Resources
    used: Resources
    images: frozenset[str] = frozenset()


@dataclass(frozen=True)
class TemplateSnap:
    name: str
    image: str
    cpus: float
    memory_mb: int
    may_overflow: bool

    @property
    def needs(self) -> Resources:
        return Resources(self.cpus, self.memory_mb, 1)


@dataclass(frozen=True)
class SandboxSnap:
    id: str
    node: str
    pool: str
    template: str
    state: SandboxState
    since: float  # when it entered its state
    reserved_for: str | None = None  # the request a cold create was made for


@dataclass(frozen=True)
class RequestSnap:
    id: str
    pool: str
    template: str
    priority: int
    arrived_at: float
    refused_by: frozenset[str] = frozenset()  # nodes that refused a create for it


@dataclass(frozen=True)
class Snapshot:
    nodes: tuple[NodeSnap, ...]
    sandboxes: tuple[SandboxSnap, ...]
    requests: tuple[RequestSnap, ...]
    templates: Mapping[str, TemplateSnap]
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
class Destroy:
    sandbox_id: str
    reason: str


@dataclass(frozen=True)
class Pause:
    sandbox_id: str
    reason: str


Action = Claim | Create | Destroy | Pause


@dataclass
class _Placement:
    """Capacity as this decision uses it up, so one tick never overbooks a node."""

    nodes: dict[str, NodeSnap]
    extra: dict[str, Resources] = field(default_factory=dict)

    def used(self, node: NodeSnap) -> Resources:
        return node.used + self.extra.get(node.id, Resources())

    def local_utilisation(self) -> float:
        local = [n for n in self.nodes.values() if n.kind == "local" and n.healthy]
        cap = sum((n.capacity for n in local), Resources())
        used = sum((self.used(n) for n in local), Resources())
        return used.ratio_of(cap) if local else 1.0

    def take(self, node_id: str, needs: Resources) -> None:
        self.extra[node_id] = self.extra.get(node_id, Resources()) + needs


def place(
    placement: _Placement,
    template: TemplateSnap,
    overflow_threshold: float,
    exclude: Iterable[str] = (),
    seed: int = 0,
) -> NodeSnap | None:
    """Pick a node for one sandbox of `template`, or None if nothing fits.

    Feasible nodes only; local ones first, cloud ones when local utilisation is past
    the overflow threshold (or local is full) and the template may leave; among
    candidates, those holding the image, then the most free capacity.
    """
    excluded = set(exclude)
    needs = template.needs

    def feasible(kind: str) -> list[NodeSnap]:
        return [
            n
            for n in placement.nodes.values()
            if n.kind == kind
            and n.healthy
            and n.id not in excluded
            and (placement.used(n) + needs).fits_in(n.capacity)
        ]

    local = feasible("local")
    overflowing = placement.local_utilisation() >= overflow_threshold or not local
    candidates = local
    if overflowing and template.may_overflow:
        candidates = feasible("cloud") or local
    if not candidates:
        return None
    if len(candidates) > SAMPLE_ABOVE:
        candidates = random.Random(seed).sample(candidates, SAMPLE_SIZE)
    best = max(
        candidates,
        key=lambda n: (
            template.image in n.images,
            1.0 - (placement.used(n) + needs).ratio_of(n.capacity),
            n.id,  # a stable tie-break keeps decisions reproducible
        ),
    )
    placement.take(best.id, needs)
    return best


def _seed(*parts: object) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "big")


def decide(snapshot: Snapshot, pools: Mapping[str, PoolParams], now: float) -> list[Action]:
    actions: list[Action] = []
    nodes = {n.id: n for n in snapshot.nodes}
    placement = _Placement(nodes)

    # Sandboxes free to hand out, by (pool, template), oldest first.
    warm: dict[tuple[str, str], list[SandboxSnap]] = {}
    reserved: dict[str, SandboxSnap] = {}
    creating_unreserved: dict[tuple[str, str], int] = {}
    for sb in sorted(snapshot.sandboxes, key=lambda s: (s.since, s.id)):
        key = (sb.pool, sb.template)
        if sb.reserved_for is not None and sb.state in (SandboxState.WARM, SandboxState.CREATING):
            reserved[sb.reserved_for] = sb
        elif sb.state == SandboxState.WARM:
            warm.setdefault(key, []).append(sb)
        elif sb.state == SandboxState.CREATING:
            creating_unreserved[key] = creating_unreserved.get(key, 0) + 1

    # Serve the queue: higher priority first, then first come.
    for req in sorted(snapshot.requests, key=lambda r: (-r.priority, r.arrived_at, r.id)):
        key = (req.pool, req.template)
        mine = reserved.pop(req.id, None)
        if mine is not None and mine.state == SandboxState.WARM:
            path = (
                "overflow"
                if nodes.get(mine.node, None) and nodes[mine.node].kind == "cloud"
                else "cold"
            )
            actions.append(Claim(req.id, mine.id, path, "the sandbox created for it is ready"))
            continue
        if warm.get(key):
            sb = warm[key].pop(0)
            actions.append(Claim(req.id, sb.id, "warm", "a warm sandbox was ready"))
            continue
        if mine is not None:
            continue  # its cold create is under way
        template = snapshot.templates.get(req.template)
        params = pools.get(req.pool)
        if template is None or params is None:
            continue
        node = place(
            placement,
            template,
            params.overflow_threshold,
            req.refused_by,
            _seed(snapshot.seed, req.id),
        )
        if node is not None:
            actions.append(
                Create(node.id, req.pool, req.template, req.id, "no warm sandbox for a request")
            )

    # Keep each pool's warm floor topped up.
    for pool_name in sorted(pools):
        params = pools[pool_name]
        for template_name in params.templates:
            template = snapshot.templates.get(template_name)
            if template is None:
                continue
            key = (pool_name, template_name)
            have = len(warm.get(key, [])) + creating_unreserved.get(key, 0)
            # paced: the engine serialises creates, so more in flight only steals CPU
            # from the acquires the warm pool is there to serve
            in_flight = creating_unreserved.get(key, 0)
            missing = min(params.min_warm - have, params.refill_concurrency - in_flight)
            for i in range(max(0, missing)):
                node = place(
                    placement,
                    template,
                    params.overflow_threshold,
                    seed=_seed(snapshot.seed, pool_name, template_name, i),
                )
                if node is None:
                    break
                actions.append(
                    Create(node.id, pool_name, template_name, None, "warm pool below min_warm")
                )
    return actions
