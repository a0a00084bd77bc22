"""A tick's work does not grow with the queue: on a full cluster, every policy makes the
same placements and actions for a queue of 100 as for one of 10,000.

Counted, not timed: a placement looks at every node (the expensive step of a decision),
so the count of placement attempts and of actions returned is the decision's work beyond
reading its snapshot once.
"""

from __future__ import annotations

import pytest

from dsec.models import PoolParams
from dsec.policies import POLICIES, make_policy
from dsec.policy import (
    Claim,
    NodeSnap,
    Placement,
    RequestSnap,
    Resources,
    SandboxSnap,
    Snapshot,
    TemplateSnap,
    Unplaceable,
)
from dsec.states import SandboxState as S

NOW = 1000.0
SLOTS = 20
TEMPLATES = {"t": TemplateSnap("t", "img:t", cpus=1.0, memory_mb=100, may_overflow=False)}


def full_cluster(waiting: int) -> Snapshot:
    """Two nodes with every slot taken (two warm sandboxes, the rest leased) and
    `waiting` requests in line."""
    nodes = tuple(
        NodeSnap(f"n{i}", "local", True, Resources(1000.0, 10**6, SLOTS),
                 Resources(float(SLOTS), SLOTS * 100, SLOTS), frozenset({"img:t"}))
        for i in (1, 2)
    )  # fmt: skip
    warm = tuple(SandboxSnap(f"w{i}", "n1", "p", "t", S.WARM, NOW - 5) for i in range(2))
    requests = tuple(
        RequestSnap(f"r{i:05d}", "p", "t", 0, NOW - 60 + i * 1e-3) for i in range(waiting)
    )
    leased = {("p", "t"): 2 * SLOTS - len(warm)}
    return Snapshot(nodes, warm, requests, TEMPLATES, leased=leased, seed=1)


def work(policy_name: str, waiting: int, monkeypatch) -> tuple[int, dict[str, int]]:
    """Placement attempts and actions by kind of three decisions (a minute apart, so
    each baseline's sync or poll falls in them) with `waiting` requests in line."""
    placements = [0]
    place = Placement.place

    def counted(self, *args, **kwargs):
        placements[0] += 1
        return place(self, *args, **kwargs)

    monkeypatch.setattr(Placement, "place", counted)
    policy = make_policy(policy_name)
    params = {"p": PoolParams(min_warm=2, max_warm=100, warm_fraction=0.0, templates=["t"])}
    actions: dict[str, int] = {}
    for minute in range(3):
        for action in policy.decide(full_cluster(waiting), params, NOW + 60 * minute):
            actions[type(action).__name__] = actions.get(type(action).__name__, 0) + 1
    monkeypatch.undo()
    return placements[0], actions


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_ticks_work_on_a_full_cluster_does_not_grow_with_the_queue(policy, monkeypatch):
    short, long = (work(policy, n, monkeypatch) for n in (100, 10_000))
    assert short == long
    placements, actions = long
    assert placements <= 3 * 4  # a few looks per decision, not one per request
    # the idle sandboxes go to the first in line; no request is answered for nothing
    assert actions.get(Claim.__name__, 0) <= 3 * 2
    assert actions.get(Unplaceable.__name__, 0) <= 3
