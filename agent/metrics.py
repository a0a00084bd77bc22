"""The agent's Prometheus metrics, in a registry of its own (one per app).

Label values are bounded: the node, Docker operations and error kinds, never sandbox ids.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from agent.engine import EngineQueue, Work
from dsec.buckets import LATENCY_BUCKETS


class AgentMetrics:
    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # CPU, memory, open files of this agent
        self.docker_op = Histogram(
            "dsec_agent_docker_op_seconds",
            "Docker operations run by the agent",
            ["node", "op"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.docker_errors = Counter(
            "dsec_agent_docker_errors_total",
            "Docker operations that failed, by kind",
            ["node", "op", "kind"],
            registry=self.registry,
        )
        self.exec_seconds = Histogram(
            "dsec_agent_exec_seconds",
            "Commands run in sandboxes, from request to result",
            ["node"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.reset_seconds = Histogram(
            "dsec_agent_reset_seconds",
            "Resets of released sandboxes, from the host's side or through the engine",
            ["node", "path"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.sandboxes = Gauge(
            "dsec_agent_sandboxes", "Sandboxes on this node", ["node"], registry=self.registry
        )
        self.audit_failures = Counter(
            "dsec_agent_audit_failures_total",
            "Commands whose audit record could not be written",
            ["node"],
            registry=self.registry,
        )
        self.create_limit = Gauge(
            "dsec_agent_create_limit",
            "Creates the engine runs at once before it only gets slower, as measured",
            ["node"],
            registry=self.registry,
        )
        self.engine_queue = Gauge(
            "dsec_agent_engine_queue",
            "Engine operations waiting their turn, by kind of work",
            ["node", "work"],
            registry=self.registry,
        )
        self.output_buffered = Gauge(
            "dsec_agent_output_buffered_bytes",
            "Commands' output held in memory, counted in the node's output budget",
            ["node"],
            registry=self.registry,
        )
        self.output_relayed = Counter(
            "dsec_agent_output_relayed_bytes_total",
            "Commands' output read from sandboxes (sent, or dropped past a cap)",
            ["node"],
            registry=self.registry,
        )
        self.output_throttled = Counter(
            "dsec_agent_output_throttled_seconds_total",
            "Time commands' output waited for its sandbox's relay rate",
            ["node"],
            registry=self.registry,
        )
        self.heartbeat_failures = Counter(
            "dsec_agent_heartbeat_failures_total",
            "Heartbeats the control plane did not accept",
            ["node"],
            registry=self.registry,
        )

    def observe_engine(self, engine: EngineQueue) -> None:
        """The engine's queue as the heartbeat sees it: what waits, by kind of work, and
        how many creates at once it takes."""
        self.create_limit.labels(self.node_id).set(engine.creates.limit)
        for work in Work:
            self.engine_queue.labels(self.node_id, work.name.lower()).set(engine.queued(work))

    def observe_docker(self, op: str, seconds: float) -> None:
        self.docker_op.labels(self.node_id, op).observe(seconds)

    def observe_reset(self, path: str, seconds: float) -> None:
        self.reset_seconds.labels(self.node_id, path).observe(seconds)

    def docker_error(self, op: str, kind: str) -> None:
        self.docker_errors.labels(self.node_id, op, kind).inc()
