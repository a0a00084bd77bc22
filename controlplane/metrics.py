"""The control plane's Prometheus metrics (names and labels as in docs/contracts.md).

Counters and histograms are updated as things happen; gauges that describe the
view (queue depth, sandboxes by state, node utilisation, heartbeat age) are read
from it at scrape time, so they can never drift from it. Label values are bounded:
nodes, pools, states, paths and actions, never sandbox ids.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from controlplane.queue import RequestQueues
from controlplane.view import ClusterView
from dsec.buckets import LATENCY_BUCKETS
from dsec.policy import Resources
from dsec.states import SandboxState

# The pool label of a refused acquire that named no existing pool: not a valid pool
# name (those start with a letter or digit), so it cannot collide with one.
UNKNOWN_POOL = "_unknown"


class ViewCollector(Collector):
    def __init__(
        self,
        view: ClusterView,
        queues: RequestQueues,
        pools: Callable[[], list[str]],
        now,
        prewarm_targets: Callable[[], Mapping[str, int]] = dict,
    ) -> None:
        self.view, self.queues, self.pools, self.now = view, queues, pools, now
        self.prewarm_targets = prewarm_targets

    def collect(self) -> Iterator[GaugeMetricFamily]:
        depth = GaugeMetricFamily("dsec_queue_depth", "Acquire requests waiting", labels=["pool"])
        prewarm = GaugeMetricFamily(
            "dsec_prewarm_target",
            "Warm sandboxes an active prewarm holds (its count less the acquires it served); "
            "0 without one",
            labels=["pool"],
        )
        targets = self.prewarm_targets()
        for pool in self.pools():
            depth.add_metric([pool], self.queues.depth(pool))
            prewarm.add_metric([pool], targets.get(pool, 0))
        yield depth
        yield prewarm

        by_state = Tally(
            (s.node, s.pool, s.state)
            for s in self.view.sandboxes.values()
            if s.state != SandboxState.GONE
        )
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
        placeable = GaugeMetricFamily(
            "dsec_node_placeable",
            "1 while a node takes new work: heartbeats in time, engine up, calls not failing",
            labels=["node", "kind"],
        )
        engine_ok = GaugeMetricFamily(
            "dsec_node_engine_ok",
            "1 while a node's Docker engine answers its agent, as its last heartbeat said",
            labels=["node", "kind"],
        )
        draining = GaugeMetricFamily(
            "dsec_node_draining",
            "1 while an operator's drain of a node is under way or done (no new sandboxes)",
            labels=["node", "kind"],
        )
        drained = GaugeMetricFamily(
            "dsec_node_drained",
            "1 once a drained node holds no sandbox: it may go",
            labels=["node", "kind"],
        )
        now = self.now()
        used = self.view.used_by_node()
        for node in self.view.nodes.values():
            drain = self.view.drain_state(node)
            draining.add_metric([node.id, node.kind], 0.0 if drain == "none" else 1.0)
            drained.add_metric([node.id, node.kind], 1.0 if drain == "drained" else 0.0)
            ratio = used.get(node.id, Resources()).ratio_of(node.capacity)
            utilisation.add_metric([node.id, node.kind], ratio)
            age.add_metric([node.id], max(0.0, now - node.last_seen))
            healthy.add_metric([node.id, node.kind], 1.0 if node.healthy else 0.0)
            placeable.add_metric([node.id, node.kind], 1.0 if node.placeable(now) else 0.0)
            engine_ok.add_metric([node.id, node.kind], 1.0 if node.engine_ok else 0.0)
        yield utilisation
        yield age
        yield healthy
        yield placeable
        yield engine_ok
        yield draining
        yield drained


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
        self.unproven_leases = Counter(
            "dsec_unproven_leases_total",
            "Leases a node reported without a valid proof of their grant: not taken",
            ["node"],
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

        self.unplaced = Counter(
            "dsec_acquires_unplaced_total",
            "Waiting acquires that no node could take, by why (once per request and reason)",
            ["pool", "code"],
            registry=r,
        )
        self.leases_expired = Counter(
            "dsec_leases_expired_total",
            "Leases ended by their pool's max_lease_s or lease_idle_timeout_s",
            ["pool"],
            registry=r,
        )
        self.prewarms = Counter(
            "dsec_prewarms_total",
            "Prewarms accepted, by whether the count can be warm within its time at the "
            "engines' measured create rate",
            ["pool", "meets_deadline"],
            registry=r,
        )
        self.forks = Counter(
            "dsec_forks_total",
            "Fork calls by outcome (forked, refused: past what fits, failed: a copy failed "
            "and none was kept)",
            ["pool", "outcome"],
            registry=r,
        )
        self.lease_outcomes = Counter(
            "dsec_lease_outcomes_total",
            "Leases ended, by how (released, expired, idle_timeout, node_lost, engine_lost, "
            "container_died, oom_killed, evicted, setup_failed; docs/contracts.md)",
            ["pool", "outcome"],
            registry=r,
        )
        self.image_transfers = Counter(
            "dsec_image_transfers_total",
            "Images sent from the control plane's host to nodes that lacked them, by outcome "
            "(ok, refused: the agent answered 4xx, failed: 5xx, unreachable or timed out, "
            "no_image: the host's engine could not save it)",
            ["node", "outcome"],
            registry=r,
        )
        self.nodes_taken_out = Counter(
            "dsec_nodes_taken_out_total",
            "Times a node was taken out of placement for failing calls in a row",
            ["node"],
            registry=r,
        )

    def watch(self, collector: ViewCollector) -> None:
        self.registry.register(collector)


class SandboxSeconds:
    """Sandbox-seconds up to now, by pool and kind of node. `account` runs before every
    change of what occupies a node (ticks, outcomes, reports), so a sandbox gone between
    ticks is counted to its end."""

    def __init__(self, view: ClusterView, metrics: ControlPlaneMetrics, now: float) -> None:
        self.view, self.metrics, self.accounted_at = view, metrics, now
        # (pool, kind) -> its two labelled counters: `labels()` looks a child up under a
        # lock, and this runs at every tick, outcome and report
        self._counters: dict[tuple[str, str], tuple[Counter, Counter]] = {}

    def account(self, now: float) -> None:
        elapsed = now - self.accounted_at
        self.accounted_at = now
        for key, n in self.view.occupying.items():
            if not n:
                continue
            counters = self._counters.get(key)
            if counters is None:
                pool, kind = key
                # cloud sandbox-seconds cost more: counted apart
                counters = self._counters[key] = (
                    self.metrics.alive_seconds.labels(pool),
                    self.metrics.sandbox_node_seconds.labels(pool, kind),
                )
            alive, by_kind = counters
            alive.inc(n * elapsed)
            by_kind.inc(n * elapsed)
