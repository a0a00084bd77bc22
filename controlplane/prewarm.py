"""Announced bursts: `POST /v1/pools/{name}/prewarm` (`count`, `within_s`, `hold_s`).

An RL trainer knows when its next step starts and how many rollouts it launches. A
prewarm raises its pool's warm target for one template (the pool's first unless it
names one) to `count`, from now until `within_s + hold_s` from now, so that `count`
sandboxes are warm by `within_s`. Each acquire of that pool and template served
meanwhile uses one up: a burst of `count` acquires finds them warm, and the pool
does not make `count` more behind it. It then expires by itself and the normal
target rules again: the sandboxes beyond it are paused after freeze_after like any
others. A new prewarm replaces the pool's last; `count` 0 ends it.

The policy sees the active prewarms as plain data in its snapshot (`PrewarmSnap`);
this module keeps them on the scheduler's clock, drops them as they expire, and
checks a request against the pool's max_warm and the room on the nodes.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from controlplane.config import ControlPlaneConfig, unknown_name
from controlplane.view import ClusterView
from dsec.httpkit import ApiError
from dsec.models import PrewarmInfo, PrewarmRequest, TemplateSpec
from dsec.policy import PrewarmSnap, Resources
from dsec.states import SandboxState

log = logging.getLogger(__name__)

# the unassigned sandboxes a prewarm counts as its own already: warm, thawable, on the way
HELD = (SandboxState.WARM, SandboxState.PAUSED, SandboxState.CREATING)


@dataclass
class Prewarm:
    pool: str
    template: str
    count: int
    within_s: float
    hold_s: float
    started: float  # the scheduler clock's now() when it was accepted
    served: int = 0  # acquires of its pool and template served since

    @property
    def until(self) -> float:
        return self.started + self.within_s + self.hold_s

    @property
    def target(self) -> int:
        return max(0, self.count - self.served)


class Prewarms:
    """The active prewarm of each pool."""

    def __init__(self) -> None:
        self.by_pool: dict[str, Prewarm] = {}

    def active(self, now: float) -> dict[str, Prewarm]:
        for pool, pw in list(self.by_pool.items()):
            if now >= pw.until:
                del self.by_pool[pool]
                log.info("prewarm of pool %s expired (%d of %d served)", pool, pw.served, pw.count)
        return self.by_pool

    def snaps(self, now: float) -> dict[str, PrewarmSnap]:
        """What the policy sees: the prewarms active at `now`."""
        return {
            pool: PrewarmSnap(pw.template, pw.count, pw.until, pw.served)
            for pool, pw in self.active(now).items()
        }

    def targets(self, now: float) -> dict[str, int]:
        """The warm target each active prewarm holds now, by pool (for the gauge)."""
        return {pool: pw.target for pool, pw in self.active(now).items()}

    def served(self, pool: str, template: str, now: float) -> None:
        """An acquire of `pool` and `template` was served: it uses up one of the prewarm."""
        pw = self.active(now).get(pool)
        if pw is not None and pw.template == template:
            pw.served += 1

    def accept(
        self,
        pool: str,
        body: PrewarmRequest,
        config: ControlPlaneConfig,
        view: ClusterView,
        now: float,
        wall: float,
    ) -> PrewarmInfo:
        """Check `body` against the pool and the nodes, and make it the pool's prewarm;
        an ApiError says what is wrong (404 for a pool that does not exist, 422 for a
        count beyond what fits, saying what does)."""
        params = config.pools.get(pool)
        if params is None:
            raise ApiError(404, "unknown_pool", f"no pool named {pool!r}")
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
        held = sum(
            1
            for state in HELD
            for e in view.by_state[state].values()
            if e.pool == pool and e.template == template and e.reserved_for is None
        )
        if body.count > 0:
            room = room_for(spec, view, now)
            fits = min(params.max_warm, held + room)
            if body.count > fits:
                raise ApiError(
                    422,
                    "prewarm_too_large",
                    f"count {body.count} does not fit; at most {fits}: pool {pool}'s max_warm "
                    f"is {params.max_warm}, and the nodes have room for {room} more of "
                    f"template {template} beside the {held} the pool holds",
                    [{"loc": "count", "msg": f"at most {fits}"}],
                )
        replaced = self.active(now).pop(pool, None) is not None
        if body.count > 0:
            self.by_pool[pool] = Prewarm(
                pool, template, body.count, body.within_s, body.hold_s, started=now
            )
        log.info(
            "prewarm of pool %s: %d of template %s within %.1f s, held %.1f s more%s",
            pool,
            body.count,
            template,
            body.within_s,
            body.hold_s,
            " (replaces the last)" if replaced else "",
        )
        return PrewarmInfo(
            pool=pool,
            template=template,
            count=body.count,
            within_s=body.within_s,
            hold_s=body.hold_s,
            ready_by=wall + body.within_s,
            until=wall + body.within_s + body.hold_s,
            warm=held,
            replaced=replaced,
        )


def room_for(spec: TemplateSpec, view: ClusterView, now: float) -> int:
    """How many more sandboxes of `spec` the nodes that take work have room for: local
    ones, and the cloud nodes up now if the template may overflow (not those a cloud
    provider could still boot)."""
    needs = Resources(spec.cpus, spec.memory_limit_mb, 1)
    used_by_node = view.used_by_node()
    room = 0
    for node in view.nodes.values():
        if not node.placeable(now) or (node.kind == "cloud" and not spec.may_overflow):
            continue
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
