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


def warm_entry() -> SandboxEntry:
    return SandboxEntry(
        id="n.0000000000000001", node="n", pool="p", template="t",
        state=SandboxState.WARM, since=0, created_at=0, cpus=1, memory_mb=1,
    )  # fmt: skip


def test_an_illegal_transition_is_refused_and_changes_nothing():
    view = ClusterView(confirm_grace_s=1)
    e = warm_entry()
    view.add(e)
    with pytest.raises(IllegalTransition):
        view.move(e, SandboxState.CREATING, 1)
    assert e.state == SandboxState.WARM and view.used("n") == Resources(1, 1, 1)


def test_a_view_with_no_node_yet_has_none_silent():
    """A control plane ticks before its first agent registers."""
    view = ClusterView(confirm_grace_s=1)
    assert view.mark_silent_nodes(10.0, 5.0) == []
    assert view.mark_silent_nodes(20.0, 5.0) == []


def test_a_sandboxs_snap_is_kept_until_a_field_the_policy_sees_changes():
    """The view keeps each sandbox's SandboxSnap from tick to tick. The leases and the
    actuator write an entry's fields directly: every such write shows in the next snap."""
    view = ClusterView(confirm_grace_s=1)
    e = warm_entry()
    view.add(e)
    kept = e.snap()
    e.busy_s, e.confirmed_at, e.op_in_flight = 3.0, 4.0, True  # not in a snap
    assert e.snap() is kept
    changes = {
        "pool": "q", "reserved_for": "r1", "idle_since": 5.0, "frozen_at": 6.0,
        "leased_at": 7.0, "renewed_at": 8.0, "since": 9.0, "node": "m", "template": "u",
    }  # fmt: skip
    for name, value in changes.items():
        setattr(e, name, value)
        assert getattr(e.snap(), name) == value, name
    view.move(e, SandboxState.PAUSED, 10.0)
    assert (e.snap().state, e.snap().since) == (SandboxState.PAUSED, 10.0)
    e.op_in_flight = False
    assert view.sandbox_snaps(11.0, None) == (e.snap(),)


def test_a_node_is_found_silent_once_past_the_timeout_and_not_before():
    view = ClusterView(confirm_grace_s=1)
    for i, seen in enumerate((0.0, 5.0)):
        view.nodes[f"n{i}"] = NodeEntry(
            f"n{i}", "local", "", Resources(8, 8, 8), frozenset(), "x", seen
        )
    assert view.mark_silent_nodes(10.0, timeout_s=10) == []
    assert [n.id for n in view.mark_silent_nodes(10.5, timeout_s=10)] == ["n0"]
    assert view.mark_silent_nodes(14.0, timeout_s=10) == []  # already out: once
    assert [n.id for n in view.mark_silent_nodes(15.5, timeout_s=10)] == ["n1"]
    assert not view.nodes["n0"].healthy and not view.nodes["n1"].healthy
