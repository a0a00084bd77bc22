"""The control plane's Prometheus metrics (names and labels as in DESIGN.md).

Counters and histograms are updated as things happen; gauges that describe the
view (queue depth, sandboxes by state, node utilisation, heartbeat age) are read
from it at scrape time, so they can never drift from it. Label values are bounded:
nodes, pools, states, paths and actions, never sandbox ids.
"""

from __future__ import annotations

import json
from collections import Counter as Tally
from collections.abc import Awaitable, Callable, Collection, Iterator

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from agent.metrics import LATENCY_BUCKETS
from controlplane.queue import RequestQueues
from controlplane.view import ClusterView
from dsec.models import AcquireRequest
from dsec.policy import Resources
from dsec.states import OCCUPYING, SandboxState

ACQUIRE_ROUTE = ("POST", "/v1/sandboxes")
# The pool label of a refused acquire that named no existing pool: not a valid pool
# name (those start with a letter or digit), so it cannot collide with one.
UNKNOWN_POOL = "_unknown"
ResponseHook = Callable[[web.Request, web.StreamResponse], Awaitable[None]]


class ViewCollector(Collector):
    def __init__(
        self, view: ClusterView, queues: RequestQueues, pools: Callable[[], list[str]], now
    ) -> None:
        self.view, self.queues, self.pools, self.now = view, queues, pools, now

    def collect(self) -> Iterator[GaugeMetricFamily]:
        depth = GaugeMetricFamily("dsec_queue_depth", "Acquire requests waiting", labels=["pool"])
        for pool in self.pools():
            depth.add_metric([pool], self.queues.depth(pool))
        yield depth

        # One pass over the sandboxes for both the counts and every node's usage (the sum
        # ClusterView.used makes, as plain numbers): asking the view node by node costs
        # nodes x sandboxes, and a Resources object per sandbox costs 4x the loop.
        by_state: Tally[tuple[str, str, SandboxState]] = Tally()
        used: dict[str, list[float]] = {}  # node -> [cpus, memory_mb, slots]
        for s in self.view.sandboxes.values():
            state = s.state
            if state != SandboxState.GONE:
                by_state[s.node, s.pool, state] += 1
            if state in OCCUPYING:
                node_used = used.get(s.node)
                if node_used is None:
                    node_used = used[s.node] = [0.0, 0.0, 0.0]
                node_used[0] += s.cpus
                node_used[1] += s.memory_mb
                node_used[2] += 1
        sandboxes = GaugeMetricFamily(
            "dsec_sandboxes", "Sandboxes by node, pool and state", labels=["node", "pool", "state"]
        )
        for (node, pool, state), n in sorted(by_state.items()):
            sandboxes.add_metric([node, pool, str(state)], n)
        yield sandboxes

        utilisation = GaugeMetricFamily(
            "dsec_node_utilisation_ratio",
            "Share of a node's capacity in use (its fullest resource)",
            labels=["node", "kind"],
        )
        age = GaugeMetricFamily(
            "dsec_agent_heartbeat_age_seconds",
            "Time since a node's last heartbeat",
            labels=["node"],
        )
        healthy = GaugeMetricFamily(
            "dsec_node_healthy", "1 while a node heartbeats in time", labels=["node", "kind"]
        )
        now = self.now()
        for node in self.view.nodes.values():
            ratio = Resources(*used.get(node.id, (0.0, 0.0, 0.0))).ratio_of(node.capacity)
            utilisation.add_metric([node.id, node.kind], ratio)
            age.add_metric([node.id], max(0.0, now - node.last_seen))
            healthy.add_metric([node.id, node.kind], 1.0 if node.healthy else 0.0)
        yield utilisation
        yield age
        yield healthy


class ControlPlaneMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        r = self.registry
        self.schedule_latency = Histogram(
            "dsec_schedule_latency_seconds",
            "From an acquire's arrival to a usable sandbox, by how it was scheduled",
            ["pool", "path"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.scale_events = Counter(
            "dsec_scale_events_total", "Actions the policy took", ["pool", "action"], registry=r
        )
        self.busy_seconds = Counter(
            "dsec_sandbox_busy_seconds_total",
            "Time sandboxes spent running commands",
            ["pool"],
            registry=r,
        )
        self.alive_seconds = Counter(
            "dsec_sandbox_alive_seconds_total", "Time sandboxes existed", ["pool"], registry=r
        )
        self.sandbox_node_seconds = Counter(
            "dsec_sandbox_node_seconds_total",
            "Time sandboxes existed, by the kind of node they ran on (cloud costs more)",
            ["pool", "kind"],
            registry=r,
        )
        self.episodes = Counter(
            "dsec_episodes_completed_total",
            "Leases released by their clients",
            ["pool"],
            registry=r,
        )
        self.acquires = Counter(
            "dsec_acquire_requests_total",
            "Acquire requests by outcome",
            ["pool", "outcome"],
            registry=r,
        )
        self.agent_call_errors = Counter(
            "dsec_agent_call_errors_total",
            "Calls to agents that failed",
            ["node", "op", "code"],
            registry=r,
        )

    def watch(self, collector: ViewCollector) -> None:
        self.registry.register(collector)

    def count_rejected_acquires(self, pools: Callable[[], Collection[str]]) -> ResponseHook:
        """A hook for aiohttp's `on_response_prepare` that counts refused acquires.

        An acquire answered with a 4xx (a bad token or body, an unknown pool or
        template, a spent idempotency key) is outcome "rejected". Most of these are
        refused before the scheduler sees them, so they are counted from the answer.
        The pool label is the pool the body named if that pool exists, else
        UNKNOWN_POOL: a client must not be able to grow the label set.
        """

        async def count(request: web.Request, response: web.StreamResponse) -> None:
            if (request.method, request.path) != ACQUIRE_ROUTE or not 400 <= response.status < 500:
                return
            pool = await _named_pool(request)
            known = pool is not None and pool in pools()
            self.acquires.labels(pool if known else UNKNOWN_POOL, "rejected").inc()

        return count


async def _named_pool(request: web.Request) -> str | None:
    """The pool an acquire's body named, if the handler read a JSON body that names one."""
    if request.can_read_body:
        return None  # refused before its body was read (a bad token, a body too large)
    raw = await request.read()  # already read by the handler: no I/O here
    try:
        data = json.loads(raw) if raw else {}
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    pool = data.get("pool", AcquireRequest.model_fields["pool"].default)
    return pool if isinstance(pool, str) else None
