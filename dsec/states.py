"""The sandbox state machine: every legal transition, in one place.

The control plane's view and the agents' records both move sandboxes through these
states; `transition()` refuses any edge not listed here, so a bug shows up as an
error instead of a sandbox in an impossible state.
"""

from __future__ import annotations

from enum import StrEnum


class SandboxState(StrEnum):
    CREATING = "creating"  # placement decided, container being created and started
    WARM = "warm"  # running, unassigned: ready to hand out in milliseconds
    LEASED = "leased"  # handed to a client, which runs commands in it
    PAUSED = "paused"  # cgroup-frozen while unassigned: CPU released, memory kept
    LEASED_PAUSED = "leased_paused"  # frozen while leased and idle; the next exec thaws it
    HIBERNATED = "hibernated"  # files kept as an image and an archive; no container, no memory
    DESTROYING = "destroying"  # container being removed
    GONE = "gone"  # removed; kept only as a tombstone so late calls get a clear answer
    LOST = "lost"  # its node stopped answering; the container may or may not exist


TERMINAL = frozenset({SandboxState.GONE, SandboxState.LOST})
# States that occupy a slot on a node.
OCCUPYING = frozenset(
    {
        SandboxState.CREATING,
        SandboxState.WARM,
        SandboxState.LEASED,
        SandboxState.PAUSED,
        SandboxState.LEASED_PAUSED,
        SandboxState.DESTROYING,
    }
)
ASSIGNED = frozenset({SandboxState.LEASED, SandboxState.LEASED_PAUSED})
# What pausing, thawing and hibernating make of a sandbox, by the state it is in: the
# agents, the control plane and the simulator all read them here. A state missing from
# a map cannot take that operation.
PAUSED_FROM = {
    SandboxState.WARM: SandboxState.PAUSED,
    SandboxState.LEASED: SandboxState.LEASED_PAUSED,
}
THAWED_FROM = {
    SandboxState.PAUSED: SandboxState.WARM,
    SandboxState.LEASED_PAUSED: SandboxState.LEASED,
}
HIBERNATED_FROM = {SandboxState.PAUSED: SandboxState.HIBERNATED}

S = SandboxState
TRANSITIONS: dict[tuple[SandboxState, SandboxState], str] = {
    (S.CREATING, S.WARM): "the agent created and started the container",
    (S.CREATING, S.LEASED): "created for a lease (cold path): handed straight to its client",
    (S.CREATING, S.GONE): "the agent refused the placement or Docker failed: nothing runs",
    (S.WARM, S.LEASED): "claimed from the warm pool",
    (S.WARM, S.PAUSED): "idle past freeze_after: frozen to release its CPU",
    (S.WARM, S.DESTROYING): "the warm pool shrinks, its container died with the engine, or "
    "its node holds a lease on it that the control plane did not grant",
    (S.PAUSED, S.LEASED): "claimed while frozen: thawed and handed out",
    (S.PAUSED, S.WARM): "thawed back into the warm pool",
    (S.PAUSED, S.DESTROYING): "frozen past frozen_ttl, the pool shrinks, or the engine lost it",
    (S.PAUSED, S.HIBERNATED): "paused past hibernate_after: memory released, files kept",
    (S.HIBERNATED, S.LEASED): "claimed while hibernated: restored from its snapshot",
    (S.HIBERNATED, S.DESTROYING): "frozen past frozen_ttl: its snapshot is deleted",
    (S.LEASED, S.LEASED_PAUSED): "its client ran nothing for lease_idle_freeze",
    (S.LEASED, S.DESTROYING): "released by its client, or its container died with the engine",
    (S.LEASED_PAUSED, S.LEASED): "the client's next exec thawed it",
    (S.LEASED_PAUSED, S.DESTROYING): "released while frozen, or lost with the engine",
    # Recycling (pool parameter `recycle`, templates that allow it): a released sandbox
    # is reset (its processes killed, its work dir, /tmp and /dev/shm emptied, checked)
    # and goes back to the warm pool instead of being removed. The agent thaws a frozen
    # lease first (LEASED_PAUSED -> LEASED, an edge above), so it only ever takes
    # LEASED -> WARM; the control plane, which learns the outcome in one answer, may see
    # the sandbox go from LEASED_PAUSED straight to WARM.
    (S.LEASED, S.WARM): "released and recycled: reset, checked clean, back in the warm pool",
    (S.LEASED_PAUSED, S.WARM): "released while frozen and recycled: thawed, reset and checked",
    (S.DESTROYING, S.GONE): "the container is removed",
    # Any live state may be lost with its node; a lost sandbox can come back when the
    # node reports it again (a network blip, or an agent restart that adopted it).
    **{
        (s, S.LOST): "its node missed heartbeats past the timeout"
        for s in (*OCCUPYING, S.HIBERNATED)
    },
    **{
        (S.LOST, s): "its node came back and reported it"
        for s in (S.WARM, S.LEASED, S.PAUSED, S.LEASED_PAUSED, S.HIBERNATED)
    },
    (S.LOST, S.GONE): "its node came back without it, or the lease was released",
}


class IllegalTransition(RuntimeError):
    pass


def transition(current: SandboxState, target: SandboxState) -> SandboxState:
    """Return `target` if the edge current -> target is legal, else raise."""
    if current == target:
        return target
    if (current, target) not in TRANSITIONS:
        raise IllegalTransition(f"sandbox cannot go from {current} to {target}")
    return target
