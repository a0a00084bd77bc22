"""Observability end to end: Debian's Prometheus scrapes a live pool it finds through
the control plane's service discovery, and every query of the Grafana dashboard
(deploy/grafana/dashboards/dsec.json) returns data.

The pool has two small local nodes and, started by this module, a cloud node that
joins and later leaves. Prometheus runs with the users' configuration
(deploy/prometheus.yml), pointed at this pool and scraping every second.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import shutil
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import docker
import pytest
import pytest_asyncio
from conftest import eventually, make_spec, started_pool
from prometheus_client.parser import text_string_to_metric_families

from agent.docker_driver import LABEL_NODE, LABEL_SANDBOX
from bench.extra_nodes import ExtraAgent, start_agent
from controlplane.metrics import UNKNOWN_POOL
from dsec.client import Client, DsecError
from dsec.launch.local import LocalPool
from dsec.models import SANDBOX_ID_RE, Capacity, PoolParams
from dsec.states import SandboxState

pytestmark = pytest.mark.asyncio(loop_scope="module")

REPO = Path(__file__).resolve().parent.parent
DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "dsec.json"
PROMETHEUS_CONFIG = REPO / "deploy" / "prometheus.yml"
CONTRACTS = REPO / "docs" / "contracts.md"
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"

# docs/contracts.md, "Prometheus metric names": the dashboard and operators depend on these.
CONTRACT_METRICS: dict[str, tuple[str, frozenset[str]]] = {
    "dsec_schedule_latency_seconds": ("histogram", frozenset({"pool", "path"})),
    "dsec_queue_depth": ("gauge", frozenset({"pool"})),
    "dsec_sandboxes": ("gauge", frozenset({"node", "pool", "state"})),
    "dsec_node_utilisation_ratio": ("gauge", frozenset({"node", "kind"})),
    "dsec_scale_events_total": ("counter", frozenset({"pool", "action"})),
    "dsec_sandbox_busy_seconds_total": ("counter", frozenset({"pool"})),
    "dsec_sandbox_alive_seconds_total": ("counter", frozenset({"pool"})),
    "dsec_episodes_completed_total": ("counter", frozenset({"pool"})),
    "dsec_agent_docker_op_seconds": ("histogram", frozenset({"node", "op"})),
    "dsec_agent_exec_seconds": ("histogram", frozenset({"node"})),
}
# Labels Prometheus adds to every scraped series: the job and instance, and for the
# agents the node's kind that deploy/prometheus.yml copies from service discovery.
SCRAPE_LABELS = frozenset({"__name__", "job", "instance", "node_kind"})
SCHEDULE_PATHS = {"warm", "thaw", "cold", "overflow"}

SCRAPE_INTERVAL = "1s"
# Grafana fills in the dashboard's variables; the test gives them Grafana's value for
# "All" pools, and for $__rate_interval (at least 4 scrapes in Grafana) a window that
# spans this whole module, so panels over a short burst of load still see all of it.
GRAFANA_VARIABLES = {"$__rate_interval": "3m", "$pool": ".*"}

ACQUIRES_PER_ROUND = 10  # more than the local nodes hold: some go to the cloud node
SLOW_EXEC_S = 1.2  # puts a tail on the exec latency histogram
CLOUD_HOST = "127.0.0.9"  # LocalPool gives its agents 127.0.0.2 upwards


# --- Prometheus, the cloud agent, the load -------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prometheus_config(controlplane_url: str) -> str:
    """deploy/prometheus.yml, pointed at this pool's control plane, scraping every second."""
    shipped = PROMETHEUS_CONFIG.read_text()
    config = shipped.replace("127.0.0.1:8700", controlplane_url.removeprefix("http://"))
    config = config.replace("15s", SCRAPE_INTERVAL)
    assert config.count(controlplane_url) == 1 and "15s" not in config, (
        "deploy/prometheus.yml no longer has the control plane address and intervals "
        "this test rewrites"
    )
    return config


@dataclass
class Prometheus:
    url: str
    http: aiohttp.ClientSession

    async def api(self, path: str, **params: str) -> dict | list:
        async with self.http.get(f"{self.url}/api/v1/{path}", params=params) as resp:
            body = await resp.json()
        assert body["status"] == "success", f"{path} {params}: {body}"
        return body["data"]

    async def query(self, expr: str) -> list[dict]:
        data = await self.api("query", query=expr)
        assert data["resultType"] == "vector", data
        return data["result"]

    async def series(self, selector: str) -> list[dict[str, str]]:
        return await self.api("series", **{"match[]": selector})

    async def value(self, expr: str) -> float:
        result = await self.query(expr)
        return float(result[0]["value"][1]) if result else math.nan

    async def active_targets(self) -> list[dict]:
        return (await self.api("targets", state="active"))["activeTargets"]


@dataclass
class Load:
    """What the load did, for the tests to check against."""

    sandbox_ids: set[str] = field(default_factory=set)
    nodes: set[str] = field(default_factory=set)
    released: int = 0
    execs: int = 0


def container_of(docker_client: docker.DockerClient, sandbox_id: str):
    found = docker_client.containers.list(
        all=True, filters={"label": f"{LABEL_SANDBOX}={sandbox_id}"}
    )
    return found[0] if found else None


async def drive_round(
    client: Client, docker_client: docker.DockerClient, load: Load, break_one: bool
) -> None:
    """Acquires at once, a command in each, one slow command, releases.

    With `break_one`, one sandbox's container is removed behind its agent's back
    first, so its next command fails in Docker: the errors panel has something to show.
    """
    sandboxes = await asyncio.gather(
        *(client.acquire(timeout=60) for _ in range(ACQUIRES_PER_ROUND))
    )
    try:
        load.sandbox_ids |= {sb.id for sb in sandboxes}
        load.nodes |= {sb.node for sb in sandboxes}
        results = await asyncio.gather(*(sb.exec(["sh", "-c", "echo hi"]) for sb in sandboxes))
        assert all(r.exit_code == 0 for r in results)
        slow = await sandboxes[0].exec(["sleep", str(SLOW_EXEC_S)])
        assert slow.exit_code == 0
        load.execs += len(sandboxes) + 1
        if break_one:
            victim = sandboxes[-1]
            await asyncio.to_thread(container_of(docker_client, victim.id).remove, force=True)
            with pytest.raises(DsecError):
                await victim.exec(["true"])
            load.execs += 1
    finally:
        await asyncio.gather(*(sb.release() for sb in sandboxes))
    load.released += len(sandboxes)


async def acquire_that_times_out(pool: LocalPool, client: Client) -> None:
    """A pool that keeps nothing warm, and an acquire too impatient for a cold create."""
    async with Client(pool.url, token=pool.tokens.admin) as operator:
        await operator.set_pool("impatient", PoolParams(min_warm=0, templates=[]))
    with pytest.raises(DsecError) as e:
        await client.acquire(pool="impatient", timeout=0.05)
    assert e.value.status == 503


async def scraped(prometheus: Prometheus, load: Load) -> bool:
    """Whether Prometheus has scraped the end of everything `load` did so far."""
    released = await prometheus.value("sum(dsec_episodes_completed_total)")
    execs = await prometheus.value("sum(dsec_agent_exec_seconds_count)")
    return released >= load.released and execs >= load.execs


# --- fixtures --------------------------------------------------------------------------


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pool(docker_client, tmp_path_factory) -> AsyncIterator[LocalPool]:
    """Two local nodes of 4 slots: ten acquires at once pass the 80% overflow threshold."""
    spec = make_spec(
        tmp_path_factory.mktemp("obs-pool"),
        nodes=2,
        capacity=Capacity(cpus=8, memory_mb=8192, slots=4),
        pool=PoolParams(min_warm=2),
    )
    async with started_pool(spec, docker_client) as p:
        yield p


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cloud_agent(pool: LocalPool) -> AsyncIterator[ExtraAgent]:
    # the pool's prefix: the leftover checks cover it
    agent = await start_agent(
        pool, f"{pool.spec.name}-cloud", kind="cloud", host=CLOUD_HOST, slots=8
    )
    try:
        async with Client(pool.url, token=pool.tokens.admin) as operator:

            async def registered() -> bool:
                nodes = (await operator.nodes()).nodes
                return any(n.node_id == agent.node_id and n.healthy for n in nodes)

            await eventually(registered, f"{agent.node_id} to register")
        yield agent
    finally:
        await agent.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def prometheus(pool: LocalPool, cloud_agent, tmp_path_factory) -> AsyncIterator[Prometheus]:
    if not Path(PROMETHEUS).exists():
        pytest.fail("these tests need Debian's prometheus (./run installs it with apt)")
    work = tmp_path_factory.mktemp("prometheus")
    config = work / "prometheus.yml"
    config.write_text(prometheus_config(pool.url))
    url = f"http://127.0.0.1:{free_port()}"
    log = (work / "prometheus.log").open("wb")
    proc = await asyncio.create_subprocess_exec(
        PROMETHEUS,
        f"--config.file={config}",
        f"--storage.tsdb.path={work / 'data'}",
        f"--web.listen-address={url.removeprefix('http://')}",
        stdout=log,
        stderr=log,
    )
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:

            async def ready() -> bool:
                assert proc.returncode is None, (
                    f"prometheus exited: {(work / 'prometheus.log').read_text()[-2000:]}"
                )
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(f"{url}/-/ready") as resp:
                        return resp.status == 200
                return False

            await eventually(ready, "prometheus to be ready")
            yield Prometheus(url, http)
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        log.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def load(pool: LocalPool, cloud_agent, prometheus: Prometheus, docker_client) -> Load:
    """Two rounds of load, each scraped before the next: a series that first appears
    with all its counts has no rate, so every histogram and counter must move again
    after Prometheus has seen it once."""
    expected = {*pool.node_ids, cloud_agent.node_id}

    async def every_agent_up() -> bool:
        up = await prometheus.query('up{job="dsec-agent"} == 1')
        return {s["metric"].get("node") for s in up} >= expected

    await eventually(every_agent_up, "Prometheus to scrape every agent it discovers")
    done = Load()
    async with Client(pool.url, token=pool.tokens.client) as client:
        for round_ in range(2):
            await drive_round(client, docker_client, done, break_one=round_ == 0)
            await eventually(lambda: scraped(prometheus, done), "the load to be scraped")
        await acquire_that_times_out(pool, client)

    async def the_rest_scraped() -> bool:
        timed_out = await prometheus.query('dsec_acquire_requests_total{outcome="timed_out"}')
        busy = await prometheus.value("sum(dsec_sandbox_busy_seconds_total)")
        return bool(timed_out) and busy > 0  # busy seconds come with the heartbeats

    await eventually(the_rest_scraped, "the timed-out acquire and busy seconds to be scraped")
    return done


# --- the dashboard ---------------------------------------------------------------------


def dashboard_panels(dashboard: dict) -> list[dict]:
    """Every panel, including those inside collapsed rows."""
    panels = []
    for panel in dashboard["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))
    return panels


def dashboard_queries() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [
        (panel["title"], target["expr"])
        for panel in dashboard_panels(dashboard)
        for target in panel.get("targets", [])
    ]


def as_prometheus_query(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"a Grafana variable this test does not fill in: {expr}"
    return expr


async def test_the_dashboard_covers_what_operators_asked_for():
    dashboard = json.loads(DASHBOARD.read_text())
    queries = dashboard_queries()
    assert len(queries) >= 20
    exprs = " ".join(expr for _, expr in queries)
    for metric in CONTRACT_METRICS:
        assert metric in exprs, f"no panel shows {metric}"
    for quantile in ("0.5", "0.95", "0.99"):
        assert f"histogram_quantile({quantile}, sum by (path, le)" in exprs
    titles = [p["title"] for p in dashboard_panels(dashboard) if p["type"] != "row"]
    assert len(titles) == len(set(titles)), "panel titles must be unique: failures name them"
    ids = [p["id"] for p in dashboard_panels(dashboard)]
    assert len(ids) == len(set(ids))
    for panel in dashboard_panels(dashboard):
        refs = [t["refId"] for t in panel.get("targets", [])]
        assert len(refs) == len(set(refs)), panel["title"]


async def test_service_discovery_lists_every_agent(pool, cloud_agent, prometheus):
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{pool.url}/v1/sd/prometheus") as resp:
            assert resp.status == 200
            assert resp.content_type == "application/json"
            groups = await resp.json()
    # Prometheus' http_sd format: a list of {"targets": ["host:port"], "labels": {...}}
    by_node = {}
    for group in groups:
        assert set(group) == {"targets", "labels"}
        for target in group["targets"]:
            assert re.fullmatch(r"127\.0\.0\.\d+:\d+", target), target
        by_node[group["labels"]["node"]] = group["labels"]
    assert set(by_node) == {*pool.node_ids, cloud_agent.node_id}
    assert by_node[cloud_agent.node_id]["kind"] == "cloud"

    async def all_scraped() -> bool:
        targets = await prometheus.active_targets()
        agents = {
            t["labels"].get("node"): t["labels"].get("node_kind")
            for t in targets
            if t["labels"]["job"] == "dsec-agent" and t["health"] == "up"
        }
        controlplane = [
            t for t in targets if t["labels"]["job"] == "dsec-controlplane" and t["health"] == "up"
        ]
        expected = {n: by_node[n]["kind"] for n in by_node}
        return agents == expected and len(controlplane) == 1

    await eventually(all_scraped, "one control plane and every agent to be scraped")


async def test_every_dashboard_query_returns_data(load, prometheus):
    failures = []
    for title, expr in dashboard_queries():
        result = await prometheus.query(as_prometheus_query(expr))
        values = [float(sample["value"][1]) for sample in result]
        if not values:
            failures.append(f"panel {title!r}: no series for {expr}")
        elif all(math.isnan(v) for v in values):
            failures.append(f"panel {title!r}: only NaN for {expr}")
    assert not failures, "dashboard queries without data:\n" + "\n".join(failures)


async def test_the_queue_wait_share_reads_0_where_nothing_waited_or_was_held(load, prometheus):
    """A window too short for any rate (one scrape): no acquire waited in it, so the share
    is 0 for every pool, not a panel with no data (its two sides matched no series)."""
    [expr] = [expr for title, expr in dashboard_queries() if title == "Queue-wait share"]
    quiet = as_prometheus_query(expr.replace("$__rate_interval", "1s"))
    result = await prometheus.query(quiet)
    assert {s["metric"]["pool"] for s in result} >= {"default"}, quiet
    assert [float(s["value"][1]) for s in result] == [0.0] * len(result), result


async def test_the_pool_variable_lists_the_pools(load, prometheus):
    dashboard = json.loads(DASHBOARD.read_text())
    (variable,) = [v for v in dashboard["templating"]["list"] if v["name"] == "pool"]
    metric, label = re.fullmatch(r"label_values\((\w+), (\w+)\)", variable["definition"]).groups()
    values = await prometheus.api(f"label/{label}/values", **{"match[]": metric})
    assert {"default", "impatient"} <= set(values)


# --- the metrics -------------------------------------------------------------------------


async def test_the_contracts_table_is_the_one_tested_here():
    table = {}
    for line in CONTRACTS.read_text().splitlines():
        if not line.startswith("| `dsec_"):
            continue
        names, kind, labels = (cell.strip() for cell in line.strip().strip("|").split("|"))
        label_names = frozenset(
            name.strip() for name in re.sub(r"\([^)]*\)", "", labels).split(",")
        )
        for name in re.findall(r"`(\w+)`", names):
            table[name] = (kind, label_names)
    assert table == CONTRACT_METRICS


async def test_design_metrics_exist_with_exactly_their_labels(load, prometheus):
    metadata = await prometheus.api("metadata")
    problems = []
    for name, (kind, labels) in CONTRACT_METRICS.items():
        family = name.removesuffix("_total")
        declared = [m["type"] for m in metadata.get(name, metadata.get(family, []))]
        if kind not in declared:
            problems.append(f"{name}: declared as {declared}, not {kind}")
        scraped_name = f"{name}_bucket" if kind == "histogram" else name
        series = await prometheus.series(scraped_name)
        if not series:
            problems.append(f"{name}: no series")
        for s in series:
            own = set(s) - SCRAPE_LABELS - ({"le"} if kind == "histogram" else set())
            if own != labels:
                problems.append(f"{name}: labels {sorted(own)}, not {sorted(labels)}")
                break
        if kind == "histogram":
            bounds = sorted(float(s["le"]) for s in series if s["le"] != "+Inf")
            if not bounds or (bounds[0], bounds[-1]) != (0.001, 60.0):
                problems.append(f"{name}: buckets do not run from 1 ms to 60 s: {bounds[:1]}")
    assert not problems, "\n".join(problems)


async def test_label_values_are_the_bounded_sets_the_design_names(load, pool, prometheus):
    paths = {s["path"] for s in await prometheus.series("dsec_schedule_latency_seconds_count")}
    assert paths and paths <= SCHEDULE_PATHS
    states = {s["state"] for s in await prometheus.series("dsec_sandboxes")}
    assert states and states <= {str(s) for s in SandboxState}
    kinds = {s["node"]: s["kind"] for s in await prometheus.series("dsec_node_utilisation_ratio")}
    assert kinds[pool.node_ids[0]] == "local" and f"{pool.spec.name}-cloud" in kinds
    assert set(kinds.values()) == {"local", "cloud"}


async def test_no_label_holds_a_sandbox_id(load, prometheus):
    assert load.sandbox_ids
    for series in await prometheus.series('{__name__=~"dsec_.+"}'):
        for label, value in series.items():
            assert not SANDBOX_ID_RE.match(value), f"{series['__name__']} has {label}={value}"


async def test_operator_metrics_beyond_the_design_table(load, prometheus):
    errors = await prometheus.series('dsec_agent_docker_errors_total{kind="not_found"}')
    assert errors, "the removed container's failed exec was not counted by kind"
    ages = await prometheus.series("dsec_agent_heartbeat_age_seconds")
    assert {s["node"] for s in ages} >= load.nodes
    outcomes = {s["outcome"] for s in await prometheus.series("dsec_acquire_requests_total")}
    assert {"served", "timed_out"} <= outcomes
    for job in ("dsec-controlplane", "dsec-agent"):
        for metric in ("process_cpu_seconds_total", "process_resident_memory_bytes"):
            assert await prometheus.series(f'{metric}{{job="{job}"}}'), f"{metric} of {job}"


def rejected_acquires(metrics_text: str) -> dict[str, float]:
    return {
        sample.labels["pool"]: sample.value
        for family in text_string_to_metric_families(metrics_text)
        for sample in family.samples
        if sample.name == "dsec_acquire_requests_total"
        and sample.labels.get("outcome") == "rejected"
    }


async def test_refused_acquires_are_counted_as_rejected(controlplane_app):
    # refused before any queue: the control plane in this process (no agents) counts them
    base = controlplane_app.url
    headers = {"Authorization": f"Bearer {controlplane_app.tokens.client}"}
    async with aiohttp.ClientSession(headers=headers) as http:

        async def rejected() -> dict[str, float]:
            async with http.get(f"{base}/metrics") as resp:
                return rejected_acquires(await resp.text())

        before = await rejected()
        for body in ({"pool": "no-such-pool"}, {"pool": "default", "priority": 5000}):
            async with http.post(f"{base}/v1/sandboxes", json=body) as resp:
                assert resp.status == 422
        after = await rejected()
    # an unknown pool must not become a label value; a known one is kept
    assert after.get(UNKNOWN_POOL, 0) - before.get(UNKNOWN_POOL, 0) == 1
    assert after.get("default", 0) - before.get("default", 0) == 1


# --- a node that leaves ------------------------------------------------------------------


async def test_a_cloud_node_that_leaves_drops_out_of_discovery(
    load, pool, cloud_agent, prometheus, docker_client
):
    await cloud_agent.stop()
    # its agent removed its sandboxes on the way out
    leftovers = docker_client.containers.list(
        all=True, filters={"label": f"{LABEL_NODE}={cloud_agent.node_id}"}
    )
    assert not leftovers

    async def gone() -> bool:
        targets = await prometheus.active_targets()
        return cloud_agent.node_id not in {t["labels"].get("node") for t in targets}

    await eventually(gone, "Prometheus to drop the node once discovery stops listing it")
    still = {t["labels"].get("node") for t in await prometheus.active_targets()}
    assert set(pool.node_ids) <= still
