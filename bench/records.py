"""What every replay produces, live or simulated: one record per episode, a timeline of the
pool, and the pool's own accounting. Reports (``bench.report``) are built from these alone,
so the live replay and the simulator fill the same plain dataclasses.

All times are seconds of replay time since the replay's start: the trace's times have
already been multiplied by the time scale, so a replay at ``time_scale=0.1`` of a one-hour
trace spans about 360 s here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, get_args

from dsec.models import SchedulePath

SCHEDULE_PATHS: tuple[str, ...] = get_args(SchedulePath)  # warm, thaw, cold, overflow


@dataclass
class EpisodeRecord:
    """One episode of the trace as it was played.

    ``requested_at_s`` is when the acquire was sent, ``acquired_at_s`` when the sandbox was in
    hand (None if the acquire failed), ``released_at_s`` when it was given back (None if it
    never was). ``schedule_ms`` and ``path`` are the pool's own account of the acquire (from
    the request's arrival at the pool to a usable sandbox, and whether it came warm, from a
    thaw, from a cold create or from a cloud node); the client-side wait is
    ``acquired_at_s - requested_at_s``. ``exec_s`` holds the wall time of every exec call,
    ``busy_s`` their sum, ``idle_s`` the time spent thinking while holding the sandbox.
    ``error`` says what went wrong, if anything did; the episode still released what it held.
    """

    episode: str
    pool: str
    template: str
    arrival_s: float
    requested_at_s: float
    acquired_at_s: float | None = None
    released_at_s: float | None = None
    schedule_ms: float | None = None
    path: str | None = None
    node: str | None = None
    node_kind: str | None = None
    exec_s: list[float] = field(default_factory=list)
    busy_s: float = 0.0
    idle_s: float = 0.0
    error: str | None = None

    @property
    def completed(self) -> bool:
        """Acquired, played every step and released, without an error."""
        return self.error is None and self.released_at_s is not None

    @property
    def queue_wait_s(self) -> float | None:
        """Time from sending the acquire to holding the sandbox."""
        if self.acquired_at_s is None:
            return None
        return self.acquired_at_s - self.requested_at_s


@dataclass
class TimelineSample:
    """The pool at one instant (about once a second), summed over all pools.

    ``sandboxes`` counts by state (warm, leased, paused, hibernated, ...); ``leased`` is those
    held by clients (leased, and leased but paused while the agent thinks); ``alive`` those
    that occupy a slot on a node, the ones ``sandbox_seconds`` counts (every state but
    hibernated, which keeps files only).
    """

    t_s: float
    queue_depth: int
    sandboxes: dict[str, int]
    leased: int
    alive: int


@dataclass
class RunResult:
    """A whole replay: what each episode saw, how the pool looked, and what it cost.

    ``sandbox_seconds`` is the lifetime of every sandbox during the run (warm, leased and
    frozen alike), split by the kind of node it ran on: ``local`` and ``cloud``.
    ``busy_seconds`` is the time sandboxes spent running commands, as the pool measured it.
    ``scale_events`` counts the pool's actions by kind (create, overflow, freeze, thaw, ...).
    ``meta`` says what the run was: ``trace``, ``policy``, ``params`` (a dict), ``mode``
    ("live" or "sim"), ``seed``, ``time_scale``, ``nodes``, ``slots_per_node`` and ``wall_s``
    (how long the replay took on the clock on the wall).
    """

    records: list[EpisodeRecord]
    timeline: list[TimelineSample]
    sandbox_seconds: dict[str, float]
    busy_seconds: float
    scale_events: dict[str, int]
    meta: dict[str, Any]
