"""The control plane's view keeps running totals; they must equal a recount."""

from __future__ import annotations

import random

import pytest

from controlplane.view import ClusterView, NodeEntry, SandboxEntry
from dsec.policy import Resources
from dsec.states import ASSIGNED, OCCUPYING, TRANSITIONS, IllegalTransition, SandboxState


def recount(view: ClusterView) -> tuple[dict, dict, dict]:
    used: dict[str, Resources] = {}
    occupying: dict[tuple[str, str], int] = {}
    assigned: dict[tuple[str, str], int] = {}
    for e in view.sandboxes.values():
        if e.state in OCCUPYING:
            used[e.node] = used.get(e.node, Resources()) + Resources(e.cpus, e.memory_mb, 1)
            kind = "cloud" if e.node == "n3" else "local"
            occupying[(e.pool, kind)] = occupying.get((e.pool, kind), 0) + 1
        if e.state in ASSIGNED:
            assigned[(e.pool, e.template)] = assigned.get((e.pool, e.template), 0) + 1
    return used, occupying, assigned


def test_running_totals_match_a_recount_through_random_changes():
    rng = random.Random(3)
    view = ClusterView(confirm_grace_s=1)
    for i in range(4):
        view.nodes[f"n{i}"] = NodeEntry(
            f"n{i}", "cloud" if i == 3 else "local", "", Resources(8, 8, 8), frozenset(), "x", 0
        )
    edges: dict[SandboxState, list[SandboxState]] = {}
    for a, b in TRANSITIONS:
        edges.setdefault(a, []).append(b)
    for step in range(3000):
        live = list(view.sandboxes.values())
        roll = rng.random()
        if roll < 0.3 or not live:
            view.add(SandboxEntry(
                id=f"n{rng.randrange(4)}.{step:016x}", node=f"n{rng.randrange(4)}",
                pool=rng.choice("ab"), template="t", state=SandboxState.CREATING, since=step,
                created_at=step, cpus=rng.choice([0.5, 1.0]), memory_mb=rng.choice([64, 256]),
            ))  # fmt: skip
        elif roll < 0.85:
            e = rng.choice(live)
            view.move(e, rng.choice(edges.get(e.state, [e.state])), step)
        elif roll < 0.9:
            view.set_pool(rng.choice(live), rng.choice("ab"))
        else:
            view.forget(rng.choice(live).id)
        used, occupying, assigned = recount(view)
        assert view.used_by_node() == {k: v for k, v in used.items()}
        assert {k: v for k, v in view.occupying.items() if v} == occupying
        assert {k: v for k, v in view.assigned.items() if v} == assigned
        for state, members in view.by_state.items():
            assert all(e.state == state for e in members.values())
    assert sum(len(m) for m in view.by_state.values()) == len(view.sandboxes)


def test_an_illegal_transition_is_refused_and_changes_nothing():
    view = ClusterView(confirm_grace_s=1)
    e = SandboxEntry(
        id="n.0000000000000001", node="n", pool="p", template="t",
        state=SandboxState.WARM, since=0, created_at=0, cpus=1, memory_mb=1,
    )  # fmt: skip
    view.add(e)
    with pytest.raises(IllegalTransition):
        view.move(e, SandboxState.CREATING, 1)
    assert e.state == SandboxState.WARM and view.used("n") == Resources(1, 1, 1)
