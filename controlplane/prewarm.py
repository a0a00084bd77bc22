"""Announced bursts: `POST /v1/pools/{name}/prewarm` (`count`, `within_s`, `hold_s`).

An RL trainer knows when its next step starts and how many rollouts it launches. A
prewarm raises its pool's warm target for one template (the pool's first unless it
names one) by `count`, from now until `within_s + hold_s` from now, so that `count`
sandboxes are warm by `within_s`. Each acquire of that pool and template by the client
that announced it, served meanwhile, uses one up: its burst of `count` acquires finds
them warm, and the pool does not make `count` more behind it. It then expires by
itself and the normal target rules again: the sandboxes beyond it are paused after
freeze_after like any others.

Each client's prewarm of a pool is its own: a new one replaces that client's last
(`count` 0 ends it) and never another client's, and the pool warms for the sum of its
clients' prewarms. A client's prewarms count under its quota: together at most its
`max_leases`, only in pools it may use and prewarm (`prewarm_pools`; the others take an
admin token), and none held past the control plane's `max_prewarm_hold_s`.

The policy sees the active prewarms as plain data in its snapshot (`PrewarmSnap`, one
per pool and template); this module keeps them on the scheduler's clock, drops them as
they expire, and checks a request against the client's quota, the pool's max_warm and
the room on the nodes.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from controlplane.config import ClientQuota, ControlPlaneConfig, unknown_name
from controlplane.view import ClusterView, NodeEntry
from dsec.httpkit import ApiError
from dsec.models import PrewarmInfo, PrewarmRequest, TemplateSpec, normalise_image_ref
from dsec.policy import PrewarmSnap, Resources
from dsec.states import SandboxState

log = logging.getLogger(__name__)

# the unassigned sandboxes a prewarm counts as its own already: warm, thawable, on the way
HELD = (SandboxState.WARM, SandboxState.PAUSED, SandboxState.CREATING)


@dataclass
class Prewarm:
    pool: str
    owner: str | None  # the client that announced it (None: a caller in this process)
    template: str
    count: int
    within_s: float
    hold_s: float
    started: float  # the scheduler clock's now() when it was accepted
    served: int = 0  # acquires of its pool and template by its client served since

    @property
    def until(self) -> float:
        return self.started + self.within_s + self.hold_s

    @property
    def target(self) -> int:
        return max(0, self.count - self.served)


class Prewarms:
    """The active prewarm of each client in each pool."""

    def __init__(self) -> None:
        self.by_client: dict[tuple[str, str | None], Prewarm] = {}  # (pool, owner) -> it

    def active(self, now: float) -> dict[tuple[str, str | None], Prewarm]:
        for key, pw in list(self.by_client.items()):
            if now >= pw.until:
                del self.by_client[key]
                log.info(
                    "prewarm of pool %s by %s expired (%d of %d served)",
                    pw.pool,
                    pw.owner,
                    pw.served,
                    pw.count,
                )
        return self.by_client

    def snaps(self, now: float) -> dict[tuple[str, str], PrewarmSnap]:
        """What the policy sees: by pool and template, the sum of the active prewarms'
        targets, held until the last of them ends."""
        snaps: dict[tuple[str, str], PrewarmSnap] = {}
        for pw in self.active(now).values():
            key = (pw.pool, pw.template)
            was = snaps.get(key, PrewarmSnap(0, pw.until))
            snaps[key] = PrewarmSnap(was.count + pw.target, max(was.until, pw.until))
        return snaps

    def targets(self, now: float) -> dict[str, int]:
        """The warm target the active prewarms hold now, by pool (for the gauge)."""
        targets: dict[str, int] = {}
        for pw in self.active(now).values():
            targets[pw.pool] = targets.get(pw.pool, 0) + pw.target
        return targets

    def served(self, pool: str, template: str, owner: str | None, now: float) -> None:
        """An acquire of `pool` and `template` by `owner` was served: it uses up one of
        that client's prewarm."""
        pw = self.active(now).get((pool, owner))
        if pw is not None and pw.template == template:
            pw.served += 1

    def accept(
        self,
        pool: str,
        body: PrewarmRequest,
        owner: str | None,
        quota: ClientQuota | None,
        config: ControlPlaneConfig,
        view: ClusterView,
        now: float,
        wall: float,
        create_times: Mapping[str, float],
    ) -> PrewarmInfo:
        """Check `body` against `owner`'s `quota` (None: an operator's, or a caller's in
        this process), the pool and the nodes, and make it `owner`'s prewarm of `pool`;
        an ApiError says what is wrong (404 for a pool that does not exist, 403 for a
        pool the client may not prewarm, 422 for a hold past the maximum or a count
        beyond its quota or what fits, saying what does). `create_times` are a create's
        time by template as the control plane measured them; the answer says by when
        the count can be warm at that rate, and whether that is
        within `within_s`: a prewarm that cannot make its deadline is accepted all the
        same, and says so."""
        params = config.pools.get(pool)
        if params is None:
            raise ApiError(404, "unknown_pool", f"no pool named {pool!r}")
        if quota is not None:
            _check_may_prewarm(pool, quota)
        template = body.template or (params.templates[0] if params.templates else None)
        if template is None:
            raise ApiError(
                422,
                "validation_error",
                f"pool {pool!r} keeps no template warm: name one",
                [{"loc": "template", "msg": "required for this pool"}],
            )
        spec = config.templates.get(template)
        if spec is None:
            raise unknown_name("template", template, config.templates)
        held = view.count_unreserved(pool, template, HELD)
        active = self.active(now)
        if body.count > 0:
            _check_hold(body, config.max_prewarm_hold_s)
            if quota is not None:
                _check_quota(body, quota, owner, pool, active)
            others = sum(
                pw.target
                for (p, o), pw in active.items()
                if p == pool and o != owner and pw.template == template
            )
            room = room_for(spec, view, now)
            fits = min(params.max_warm, held + room) - others
            if body.count > fits:
                beside = f", and other clients' prewarms hold {others}" if others else ""
                raise ApiError(
                    422,
                    "prewarm_too_large",
                    f"count {body.count} does not fit; at most {max(0, fits)}: pool {pool}'s "
                    f"max_warm is {params.max_warm}, and the nodes have room for {room} more "
                    f"of template {template} beside the {held} the pool holds{beside}",
                    [{"loc": "count", "msg": f"at most {max(0, fits)}"}],
                )
        missing = max(0, body.count - held)
        ready_in = time_to_make(missing, spec, view, now, create_times.get(template))
        replaced = active.pop((pool, owner), None) is not None
        if body.count > 0:
            active[(pool, owner)] = Prewarm(
                pool, owner, template, body.count, body.within_s, body.hold_s, started=now
            )
        log.info(
            "prewarm of pool %s by %s: %d of template %s within %.1f s, held %.1f s more%s",
            pool,
            owner,
            body.count,
            template,
            body.within_s,
            body.hold_s,
            " (replaces its last)" if replaced else "",
        )
        return PrewarmInfo(
            pool=pool,
            template=template,
            count=body.count,
            within_s=body.within_s,
            hold_s=body.hold_s,
            ready_by=wall + ready_in,
            meets_deadline=ready_in <= body.within_s,
            until=wall + body.within_s + body.hold_s,
            warm=held,
            replaced=replaced,
        )


def _check_may_prewarm(pool: str, quota: ClientQuota) -> None:
    """Whether the client may prewarm `pool` at all: 403 naming the rule."""
    if quota.pools is not None and pool not in quota.pools:
        raise ApiError(
            403, "pool_not_allowed", f"this client may use pools {quota.pools}, not {pool!r}"
        )
    if quota.prewarm_pools is not None and pool not in quota.prewarm_pools:
        raise ApiError(
            403,
            "prewarm_not_allowed",
            f"this client may prewarm pools {quota.prewarm_pools} (its quota's "
            f"prewarm_pools), not {pool!r}: an admin token may",
        )


def _check_hold(body: PrewarmRequest, max_hold_s: float) -> None:
    if body.hold_s > max_hold_s:
        raise ApiError(
            422,
            "hold_too_long",
            f"hold_s {body.hold_s:g} is past the maximum, {max_hold_s:g} s (the control "
            "plane's max_prewarm_hold_s)",
            [{"loc": "hold_s", "msg": f"at most {max_hold_s:g}"}],
        )


def _check_quota(
    body: PrewarmRequest,
    quota: ClientQuota,
    owner: str | None,
    pool: str,
    active: dict[tuple[str, str | None], Prewarm],
) -> None:
    """A client's prewarms together ask for no more than it may lease: 422 saying so."""
    if quota.max_leases is None:
        return
    elsewhere = sum(pw.count for (p, o), pw in active.items() if o == owner and p != pool)
    allowed = max(0, quota.max_leases - elsewhere)
    if body.count > allowed:
        raise ApiError(
            422,
            "prewarm_over_quota",
            f"count {body.count} is more than this client may lease: at most {allowed} "
            f"(its quota's max_leases is {quota.max_leases}, and its prewarms of other "
            f"pools ask for {elsewhere})",
            [{"loc": "count", "msg": f"at most {allowed}"}],
        )


def _taking(spec: TemplateSpec, view: ClusterView, now: float) -> Iterator[NodeEntry]:
    """The nodes that take sandboxes of `spec` now: local ones, and the cloud nodes up
    now if the template may overflow (not those a cloud provider could still boot)."""
    for node in view.nodes.values():
        if node.placeable(now) and (node.kind != "cloud" or spec.may_overflow):
            yield node


# a create's time assumed before the control plane has measured one of the template
UNMEASURED_CREATE_S = 1.0


def time_to_make(
    count: int, spec: TemplateSpec, view: ClusterView, now: float, create_s: float | None
) -> float:
    """Seconds to make `count` sandboxes of `spec` on the engines of the nodes that take
    them: each engine runs its measured creates at once (its nodes' create_limit; nodes
    that share an engine, as `dsec up`'s do, report one engine id and count once), a round
    of them taking `create_s`. Infinite when no node can make one."""
    if count <= 0:
        return 0.0
    image = normalise_image_ref(spec.image)
    at_once: dict[str, int] = {}  # engine -> creates it runs at once
    for node in _taking(spec, view, now):
        if image not in node.images:
            continue
        engine = node.engine_id or node.id
        at_once[engine] = max(at_once.get(engine, 0), node.create_limit)
    parallel = sum(at_once.values())
    if not parallel:
        return math.inf
    return math.ceil(count / parallel) * (create_s or UNMEASURED_CREATE_S)


def room_for(spec: TemplateSpec, view: ClusterView, now: float) -> int:
    """How many more sandboxes of `spec` the nodes that take them (`_taking`) have room
    for."""
    needs = Resources(spec.cpus, spec.memory_limit_mb, 1)
    used_by_node = view.used_by_node()
    room = 0
    for node in _taking(spec, view, now):
        used = used_by_node.get(node.id, Resources())
        cap = node.capacity
        room += max(
            0,
            min(
                cap.slots - used.slots,
                math.floor((cap.cpus - used.cpus) / needs.cpus + 1e-9),
                (cap.memory_mb - used.memory_mb) // needs.memory_mb,
            ),
        )
    return room
