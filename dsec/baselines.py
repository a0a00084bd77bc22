"""The policies dsec is compared with, behind the same interface as dsec's own
(dsec/policies.py, `Policy`).

Each takes the same snapshot and returns the same actions, so the control plane and
the simulator run any of them unchanged (`policy: cold | static | hpa | keda | kpa`).
The autoscaler baselines count replicas (sandboxes of a pool and template, leased or
not), hand out idle ones, and leave requests waiting until their next scaling step,
as the controllers they imitate do; they never create for a single request.

dsec's policy is a pure function. The baselines keep the state their controllers
keep (when they last synced, a window of past observations), fed only from the
snapshots and the `now` they are given: still no I/O and no clock.
"""

from __future__ import annotations

import heapq
import math
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Mapping

from dsec.models import PoolParams
from dsec.policy import (
    Action,
    Claim,
    Create,
    Destroy,
    Placement,
    RequestSnap,
    Snapshot,
    Unplaceable,
)
from dsec.states import SandboxState as S

Key = tuple[str, str]  # (pool, template)


def in_line(r: RequestSnap) -> tuple:
    """Queue order: higher priority first, then arrival."""
    return (-r.priority, r.arrived_at, r.id)


class ColdPolicy:
    """No pool at all: every request waits for a container created for it."""

    name = "cold"

    def decide(self, snapshot: Snapshot, pools: Mapping[str, PoolParams], now: float):
        actions: list[Action] = []
        placement = Placement(snapshot.nodes, snapshot.seed)
        mine = {
            sb.reserved_for: sb
            for sb in snapshot.sandboxes
            if sb.reserved_for and sb.state in (S.WARM, S.CREATING)
        }
        unserved = []
        for req in snapshot.requests:
            sb = mine.get(req.id)
            if sb is None:
                unserved.append((in_line(req), req))
            elif sb.state == S.WARM:
                actions.append(Claim(req.id, sb.id, "cold", "its own container is ready"))
        # in line, until no node has room for any template still waiting: a placement is
        # a look at every node, and a long queue on a full cluster must not cost one each
        heapq.heapify(unserved)
        wanted = {req.template for _, req in unserved if req.template in snapshot.templates}
        full: set[str] = set()  # templates no node has room for, in this decision
        while unserved and not wanted <= full:
            req = heapq.heappop(unserved)[1]
            template, params = snapshot.templates.get(req.template), pools.get(req.pool)
            if template is None or params is None:
                continue
            if req.template in full and req.template_refusal is None:
                continue
            action = placement.for_request(req, template, params, req.id, "cold: per request")
            actions.append(action)
            if isinstance(action, Unplaceable) and not req.refused_by:
                full.add(req.template)  # no node refused it: none has room
        # a request whose template every node refused is told so, wherever it waits
        for _, req in unserved:
            template, params = snapshot.templates.get(req.template), pools.get(req.pool)
            if req.template_refusal is not None and template is not None and params is not None:
                action = placement.for_request(req, template, params, req.id, "cold")
                if isinstance(action, Unplaceable) and action.final:
                    actions.append(action)
        # a container whose request left is not kept: there is no pool to keep it in
        waiting = {r.id for r in snapshot.requests}
        for sb in snapshot.sandboxes:
            if sb.state == S.WARM and sb.reserved_for not in waiting:
                actions.append(Destroy(sb.id, "cold: no pool to return it to"))
        return actions


class ReplicaPolicy(ABC):
    """Shared by the autoscalers: serve from idle replicas, then move to `desired`."""

    name = "replicas"

    @abstractmethod
    def desired(self, key: Key, params: PoolParams, state: dict, now: float) -> int:
        """How many replicas of `key` the controller wants now."""

    def decide(self, snapshot: Snapshot, pools: Mapping[str, PoolParams], now: float):
        actions: list[Action] = []
        idle: dict[Key, list] = {}
        creating: dict[Key, int] = {}
        for sb in sorted(snapshot.sandboxes, key=lambda s: (s.since, s.id)):
            key = (sb.pool, sb.template)
            if sb.state == S.WARM:
                idle.setdefault(key, []).append(sb)
            elif sb.state == S.CREATING:
                creating[key] = creating.get(key, 0) + 1
        waiting: dict[Key, list[RequestSnap]] = {}
        for req in snapshot.requests:
            waiting.setdefault((req.pool, req.template), []).append(req)
        pending: dict[Key, int] = {}
        claimed: dict[Key, int] = {}  # busy from this decision on, not yet in snapshot.leased
        for key, requests in waiting.items():
            free = idle.get(key, [])
            # the first in line take the idle replicas; a long queue is not sorted whole
            first = heapq.nsmallest(len(free), requests, key=in_line) if free else []
            for req, sb in zip(first, free, strict=False):
                actions.append(Claim(req.id, sb.id, "warm", f"{self.name}: an idle replica"))
            idle[key] = free[len(first) :]
            claimed[key] = len(first)
            pending[key] = len(requests) - len(first)
        placement = Placement(snapshot.nodes, snapshot.seed)
        keys = {*pending, *idle, *creating, *snapshot.leased}
        keys |= {(p, t) for p, params in pools.items() for t in params.templates}
        for key in sorted(keys):
            params, template = pools.get(key[0]), snapshot.templates.get(key[1])
            if params is None or template is None:
                continue
            observed = {
                "leased": snapshot.leased.get(key, 0) + claimed.get(key, 0),
                "idle": len(idle.get(key, [])),
                "creating": creating.get(key, 0),
                "pending": pending.get(key, 0),
            }
            current = observed["leased"] + observed["idle"] + observed["creating"]
            observed["current"] = current
            want = self.desired(key, params, observed, now)
            for i in range(want - current):
                node = placement.place(template, params.overflow_threshold, (key, now, i))
                if node is None:
                    break
                actions.append(Create(node.id, key[0], key[1], None, f"{self.name}: scale up"))
            surplus = min(current - want, len(idle.get(key, [])))  # never a busy one
            for sb in idle.get(key, [])[: max(0, surplus)]:
                actions.append(Destroy(sb.id, f"{self.name}: scale down"))
        return actions


class StaticPolicy(ReplicaPolicy):
    """A fixed pool of min_warm sandboxes, replaced as they are released."""

    name = "static"

    def desired(self, key, params, state, now):
        return params.min_warm


class HpaPolicy(ReplicaPolicy):
    """Kubernetes' Horizontal Pod Autoscaler on utilisation (leased / replicas):
    target 0.7 within a 0.1 tolerance, a 15 s sync period, at most max(+100%, +4)
    up per period, and a 300 s stabilisation window for scaling down."""

    name = "hpa"
    TARGET, TOLERANCE, SYNC_S, DOWN_WINDOW_S = 0.7, 0.1, 15.0, 300.0

    def __init__(self) -> None:
        self.synced_at: dict[Key, float] = {}
        self.replicas: dict[Key, int] = {}
        self.recommendations: dict[Key, deque[tuple[float, int]]] = {}

    def desired(self, key, params, state, now):
        floor = max(1, params.min_warm)  # minReplicas
        if key in self.synced_at and now - self.synced_at[key] < self.SYNC_S:
            return self.replicas.get(key, floor)
        self.synced_at[key] = now
        current = max(state["current"], 1)
        # waiting requests count as busy: they would be, given replicas
        busy = state["leased"] + state["pending"]
        ratio = (busy / current) / self.TARGET
        if abs(ratio - 1.0) <= self.TOLERANCE:
            want = state["current"]
        else:
            want = math.ceil(current * ratio)
        want = min(want, max(2 * current, current + 4), params.max_warm + busy)
        history = self.recommendations.setdefault(key, deque())
        history.append((now, max(want, floor)))
        while history and history[0][0] < now - self.DOWN_WINDOW_S:
            history.popleft()
        self.replicas[key] = max(r for _, r in history)  # down only as the window allows
        return self.replicas[key]


class KedaPolicy(ReplicaPolicy):
    """KEDA's ScaledJob: every 30 s, start min(max, pending) - running jobs."""

    name = "keda"
    POLL_S = 30.0

    def __init__(self) -> None:
        self.polled_at: dict[Key, float] = {}
        self.target: dict[Key, int] = {}

    def desired(self, key, params, state, now):
        if key not in self.polled_at or now - self.polled_at[key] >= self.POLL_S:
            self.polled_at[key] = now
            running = state["idle"] + state["creating"]  # jobs not yet taken by a request
            start = max(0, min(params.max_warm, state["pending"]) - running)
            self.target[key] = state["current"] + start
        else:
            # jobs end with their request: between polls, only what was started stays
            self.target[key] = min(self.target.get(key, 0), state["current"])
        return max(self.target[key], state["leased"])


class KpaPolicy(ReplicaPolicy):
    """Knative's Pod Autoscaler on concurrency (leased + waiting), one request per
    sandbox at a 0.7 target: a 60 s stable window, a 6 s panic window, panic when
    the panic window asks for 200% of the current replicas (no scale-down in panic)."""

    name = "kpa"
    STABLE_S, PANIC_S, PANIC_THRESHOLD, TARGET = 60.0, 6.0, 2.0, 0.7

    def __init__(self) -> None:
        self.samples: dict[Key, deque[tuple[float, int]]] = {}
        self.panic_until: dict[Key, float] = {}

    def desired(self, key, params, state, now):
        samples = self.samples.setdefault(key, deque())
        samples.append((now, state["leased"] + state["pending"]))
        while samples and samples[0][0] < now - self.STABLE_S:
            samples.popleft()

        def average(window_s: float) -> float:
            recent = [c for t, c in samples if t >= now - window_s]
            return sum(recent) / len(recent)

        stable = math.ceil(average(self.STABLE_S) / self.TARGET)
        panic = math.ceil(average(self.PANIC_S) / self.TARGET)
        current = state["current"]
        if current and panic / current >= self.PANIC_THRESHOLD or (current == 0 and panic):
            self.panic_until[key] = now + self.STABLE_S
        if now < self.panic_until.get(key, -math.inf):
            want = max(panic, current)
        else:
            want = stable
        return max(params.min_warm, min(want, params.max_warm + state["leased"]))
