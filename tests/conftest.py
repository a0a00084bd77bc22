"""Fixtures: a real Docker engine and real local pools (processes on loopback).

Every pool a test starts is named `test-...`, and the session ends by checking that
no container of such a pool is left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import docker
import pytest
import pytest_asyncio
from inprocess import InProcessControlPlane, inprocess_controlplane
from prometheus_client.parser import text_string_to_metric_families

from agent.docker_driver import LABEL_NODE, LABEL_SANDBOX, RUNC_INIT_DIED
from bench.extra_nodes import node_info
from dsec.client import Client, Sandbox
from dsec.image import ensure_base_image
from dsec.launch.local import LocalPool, LocalPoolSpec
from dsec.models import Capacity, PoolParams

TEST_POOL_PREFIX = "test-"
# pools this session started: the end-of-session check looks at these alone, so two
# test runs side by side do not judge (or remove) each other's containers
STARTED_POOLS: set[str] = set()
# fixtures that reach a Docker engine: every live pool depends on `docker_client`, and
# `engine` (test_reliability) runs a dockerd of its own
DOCKER_FIXTURES = {"docker_client", "engine"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark `docker` every test that needs the engine, so `-m "not docker"` runs the rest;
    in a worker of `pytest -n` (pytest-xdist) those are skipped: they share one engine,
    whose figures and health suffer from two suites at once."""
    in_worker = hasattr(config, "workerinput")
    for item in items:
        if DOCKER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.docker)
        if in_worker and item.get_closest_marker("docker"):
            item.add_marker(pytest.mark.skip(reason="docker tests run one at a time: without -n"))


def pool_containers(client: docker.DockerClient, prefix: str = TEST_POOL_PREFIX) -> list:
    # sparse: no inspect per container, which races with removals elsewhere
    found = client.containers.list(all=True, sparse=True, filters={"label": LABEL_NODE})
    return [
        c for c in found if (c.attrs.get("Labels") or {}).get(LABEL_NODE, "").startswith(prefix)
    ]


@pytest.fixture(scope="session")
def docker_client() -> Iterator[docker.DockerClient]:
    try:
        client = docker.from_env()
        client.ping()
    except docker.errors.DockerException as e:
        pytest.fail(f"these tests need a running Docker engine (.ci/run starts one): {e}")
    ensure_base_image(client)
    yield client
    left = [c for name in STARTED_POOLS for c in pool_containers(client, name + "-")]
    for c in left:
        c.remove(force=True)
    assert not left, f"tests left containers behind: {[c.name for c in left]}"


def make_spec(state_dir: Path, **overrides) -> LocalPoolSpec:
    spec = LocalPoolSpec(
        name=f"{TEST_POOL_PREFIX}{uuid.uuid4().hex[:8]}",
        nodes=3,
        port=0,
        capacity=Capacity(cpus=32, memory_mb=65536, slots=40),
        pool=PoolParams(min_warm=2),
        state_dir=state_dir,
        heartbeat_s=0.5,
    )
    for key, value in overrides.items():
        setattr(spec, key, value)
    return spec


@contextlib.asynccontextmanager
async def started_pool(spec: LocalPoolSpec, docker_client) -> AsyncIterator[LocalPool]:
    pool = LocalPool(spec)
    STARTED_POOLS.add(spec.name)
    async with pool:
        yield pool
    assert pool.swept == 0, "the agents should have removed their own sandboxes on exit"
    assert not pool_containers(docker_client, spec.name + "-")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pool(docker_client, tmp_path_factory) -> AsyncIterator[LocalPool]:
    async with started_pool(make_spec(tmp_path_factory.mktemp("pool")), docker_client) as p:
        yield p


@pytest_asyncio.fixture(loop_scope="module")
async def client(pool: LocalPool) -> AsyncIterator[Client]:
    async with Client(pool.url, token=pool.tokens.client) as c:
        yield c


@pytest_asyncio.fixture(loop_scope="module")
async def operator(pool: LocalPool) -> AsyncIterator[Client]:
    """Sees every sandbox, warm ones included: a client sees only its own leases."""
    async with Client(pool.url, token=pool.tokens.admin) as c:
        yield c


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def tls_pool(docker_client, tmp_path_factory) -> AsyncIterator[LocalPool]:
    """A pool whose every service is on HTTPS, with a CA of its own (`pool.ca`)."""
    spec = make_spec(tmp_path_factory.mktemp("tls-pool"), nodes=2, tls=True)
    async with started_pool(spec, docker_client) as p:
        yield p


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def controlplane_app() -> AsyncIterator[InProcessControlPlane]:
    """A control plane in this process with no agents (tests/inprocess.py): no Docker."""
    async with inprocess_controlplane() as cp:
        yield cp


async def until_placeable(pool: LocalPool, node_id: str) -> None:
    """Wait until the pool's control plane places sandboxes on `node_id` (a new agent)."""
    async with Client(pool.url, token=pool.tokens.admin) as operator:

        async def placeable() -> bool:
            info = await node_info(operator, node_id)
            return info is not None and info.placeable

        await eventually(placeable, f"{node_id} to register")


async def acquire_on(client: Client, node_id: str, held: list[Sandbox], limit: int = 8) -> Sandbox:
    """Acquire until a sandbox lands on `node_id`; the others stay held (in `held`)."""
    for _ in range(limit):
        sandbox = await client.acquire(pool="default", template="base", timeout=30)
        held.append(sandbox)
        if sandbox.node == node_id:
            return sandbox
    raise AssertionError(f"no sandbox landed on {node_id} in {limit} acquires")


async def eventually(check, what: str = "", timeout: float = 30.0, interval: float = 0.1):
    """Poll a check (plain or async) until it returns something truthy, and return that."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what or check.__name__}")
        await asyncio.sleep(interval)


async def take_pids(container) -> None:
    """Take all of a container's pids but one, for good, from outside (no command of
    the sandbox's, for a timeout to kill): sleepers until a fork fails, which ends the
    shell that forked (ash's rule), leaving its pid."""
    fill = "while sleep 1000 & do :; done"
    await asyncio.to_thread(container.exec_run, ["sh", "-c", fill], detach=True)

    async def filled() -> bool:
        args = await commands_running(container)
        return "sleep 1000" in args and not any(fill in a for a in args)

    await eventually(filled, timeout=60)


async def take_last_pid(container) -> None:
    """After `take_pids`: the last one too, by an engine exec, which joins past the limit.
    At the limit runc's init sometimes dies before the command starts (RUNC_INIT_DIED:
    its own threads count against the limit), so it is started again, as the agent
    does (agent/execs.py); an exec that says so did not start."""

    async def started() -> bool:
        try:
            await asyncio.to_thread(container.exec_run, ["sleep", "1001"], detach=True)
        except docker.errors.APIError as e:
            if RUNC_INIT_DIED.decode() not in str(e.explanation):
                raise
            return False
        return True

    await eventually(started, "an engine exec whose runc init lived", timeout=30)

    async def taken() -> bool:
        return "sleep 1001" in await commands_running(container)

    await eventually(taken, timeout=10)


async def commands_running(container) -> list[str]:
    """What the container's processes run, seen by `docker top` (`ps` on the host: it
    needs no pid of the container's)."""
    return [p[-1] for p in (await asyncio.to_thread(container.top))["Processes"]]


def process_of(pid: int, container_id: str) -> bool:
    """Whether process `pid` lives (not a zombie) in container `container_id`'s cgroup."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        in_container = container_id in Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return False
    return in_container and "\nState:\tZ" not in status


def still_runs(docker_client: docker.DockerClient, container) -> bool:
    """Whether a container (from a sparse list) still runs its init. The agent kills it
    itself (agent/host.py kill_pid_namespace): the engine may not have seen it
    stop yet."""
    if container.attrs["State"] != "running":
        return False
    try:
        pid = docker_client.api.inspect_container(container.id)["State"]["Pid"]
    except docker.errors.NotFound:
        return False
    return bool(pid) and process_of(pid, container.id)


async def assert_stopped_then_removed(docker_client: docker.DockerClient, sandbox_id: str):
    """A released sandbox is stopped by the time its release answers, and its container
    removed once its engine is quiet (within 30 s of waiting: agent/engine.py)."""

    def container():
        # sparse: no inspect per container, which races with the removal under way
        found = docker_client.containers.list(
            all=True, sparse=True, filters={"label": f"{LABEL_SANDBOX}={sandbox_id}"}
        )
        return found[0] if found else None

    stopped = container()
    assert stopped is None or not still_runs(docker_client, stopped), f"{sandbox_id} still runs"
    await eventually(lambda: container() is None, f"the removal of {sandbox_id}", 40)


async def metric_value(pool: LocalPool, name: str, labels: dict[str, str]) -> float:
    """A sample of the pool's control plane's metrics (0 where it has none yet)."""
    async with aiohttp.ClientSession() as http, http.get(f"{pool.url}/metrics") as resp:
        text = await resp.text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0
