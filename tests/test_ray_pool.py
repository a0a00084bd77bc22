"""The pool on Ray's own local multi-node test cluster (`ray.cluster_utils.Cluster`, on
loopback: bench/ray_clusters.py), started by `dsec ray up`: an agent on every sandbox
node, pinned there and restarted by Ray; nodes that join get one, nodes that leave take
theirs and its sandboxes are reported lost; the example rollout loop on Ray actors."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import re
import signal
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

if importlib.util.find_spec("ray") is None:
    pytest.skip("needs the ray extra: pip install 'dsec[ray]'", allow_module_level=True)

import aiohttp  # noqa: E402
import pytest_asyncio  # noqa: E402
from conftest import STARTED_POOLS, eventually, pool_containers  # noqa: E402

from bench.ray_clusters import add_sandbox_node, sandbox_cluster  # noqa: E402  (env first)
from controlplane.ray_cloud import ray_node_id  # noqa: E402
from dsec.client import Client  # noqa: E402
from dsec.processes import dsec_argv  # noqa: E402
from dsec.tokens import new_token  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.docker, pytest.mark.asyncio(loop_scope="module")]

EXAMPLE = Path(__file__).parent.parent / "examples" / "ray_rollout.py"
SLOTS = 6


@dataclass
class RayUp:
    """A `dsec ray up` process and what it printed."""

    name: str
    proc: asyncio.subprocess.Process
    summary: dict
    env: dict[str, str]
    stderr: Path

    @property
    def url(self) -> str:
        return self.summary["url"]

    def node_id(self, ray_node) -> str:
        return ray_node_id(ray_node.node_id, self.name)


@pytest.fixture(scope="module")
def cluster():
    cluster = sandbox_cluster(2)
    yield cluster
    cluster.shutdown()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def ray_up(cluster, docker_client, tmp_path_factory):
    name = f"test-{uuid.uuid4().hex[:8]}"
    STARTED_POOLS.add(name)
    state = tmp_path_factory.mktemp("ray-up")
    tokens = {"DSEC_TOKEN": new_token(), "DSEC_ADMIN_TOKEN": new_token()}
    env = {**os.environ, **tokens, "DSEC_AGENT_TOKEN": new_token()}
    stderr = state / "stderr"
    with stderr.open("wb") as err:
        proc = await asyncio.create_subprocess_exec(
            *dsec_argv(
                "ray",
                "up",
                "--address",
                cluster.address,
                "--name",
                name,
                "--port",
                "0",
                # where agents register and clients call: the bound port, as none is given
                "--advertise-url",
                "http://localhost",
                "--json",
                "--state-dir",
                str(state),
                "--min-warm",
                "2",
                "--slots-per-node",
                str(SLOTS),
                "--cpus-per-node",
                str(SLOTS),
                "--memory-mb-per-node",
                str(SLOTS * 2048),
            ),  # fmt: skip
            stdout=asyncio.subprocess.PIPE,
            stderr=err,
            env=env,
            start_new_session=True,
        )
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 120)
        up = RayUp(name, proc, json.loads(line), {**os.environ, **tokens}, stderr)
        drain = asyncio.create_task(proc.stdout.read())
        yield up
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(proc.wait(), 120)
        with contextlib.suppress(Exception):
            await drain
        for c in pool_containers(docker_client, name + "-"):  # a removed node's, if a test failed
            c.remove(force=True)


@pytest_asyncio.fixture(loop_scope="module")
async def client(ray_up):
    async with Client(ray_up.url, token=ray_up.env["DSEC_TOKEN"]) as c:
        yield c


@pytest_asyncio.fixture(loop_scope="module")
async def operator(ray_up):
    async with Client(ray_up.url, token=ray_up.env["DSEC_ADMIN_TOKEN"]) as c:
        yield c


async def healthy(operator: Client) -> set[str]:
    return {n.node_id for n in (await operator.nodes()).nodes if n.healthy}


def agent_pids(node_id: str) -> list[int]:
    """The `dsec agent` processes of `node_id` on this machine."""
    found = []
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if b"agent" in argv and node_id.encode() in argv:
                found.append(int(proc.name))
    return found


async def test_every_sandbox_node_gets_an_agent_and_acquires_spread(ray_up, cluster, client):
    expected = {ray_up.node_id(n) for n in cluster.worker_nodes}
    assert {n["node_id"] for n in ray_up.summary["nodes"]} == expected
    assert ray_up.summary["ray"] == cluster.address
    assert re.fullmatch(r"http://localhost:\d+", ray_up.url)  # advertised, with its port
    held = await asyncio.gather(*(client.acquire(timeout=60) for _ in range(8)))
    try:
        assert {sb.node for sb in held} == expected
        outputs = await asyncio.gather(*(sb.exec(["sh", "-c", "echo $HOSTNAME"]) for sb in held))
        assert all(o.exit_code == 0 for o in outputs)
        assert {sb.lease.agent_url for sb in held} == {n["url"] for n in ray_up.summary["nodes"]}
    finally:
        await asyncio.gather(*(sb.release() for sb in held))


async def test_an_agent_that_dies_is_restarted_by_ray_and_keeps_its_sandboxes(
    ray_up, cluster, client, operator
):
    sb = await client.acquire(timeout=60)
    try:
        assert (await sb.exec(["sh", "-c", "echo kept > /work/f"])).exit_code == 0
        (pid,) = agent_pids(sb.node)
        os.kill(pid, signal.SIGKILL)

        def restarted():
            pids = agent_pids(sb.node)
            return pids and pids != [pid]

        await eventually(restarted, "Ray restarts the agent", timeout=60)

        async def answers():
            with contextlib.suppress(aiohttp.ClientConnectionError):
                return await sb.exec(["cat", "/work/f"])

        # the same address (its port kept), the container adopted: the lease goes on
        assert (await eventually(answers, "it listens again", timeout=60)).stdout == "kept\n"
        await eventually(lambda: _healthy_has(operator, sb.node), "it reports", timeout=30)
        # and the control plane keeps it: a look at the cluster (every second) that finds
        # it restarting does not give it up
        (restarted_pid,) = agent_pids(sb.node)
        await asyncio.sleep(3)
        assert agent_pids(sb.node) == [restarted_pid]
        assert (await sb.exec(["cat", "/work/f"])).stdout == "kept\n"
    finally:
        await sb.release()


async def _healthy_has(operator: Client, node_id: str) -> bool:
    return node_id in await healthy(operator)


async def test_a_node_that_leaves_takes_its_agent_and_its_sandboxes_are_lost(
    ray_up, cluster, client, operator, docker_client
):
    # more than one node holds: both nodes hold some
    held = await asyncio.gather(*(client.acquire(timeout=60) for _ in range(SLOTS + 2)))
    leaving = next(iter(cluster.worker_nodes))
    node_id = ray_up.node_id(leaving)
    on_node = [sb for sb in held if sb.node == node_id]
    assert on_node and len(on_node) < len(held), [sb.node for sb in held]
    await asyncio.to_thread(cluster.remove_node, leaving)
    await eventually(lambda: not agent_pids(node_id), "the agent goes with its node", timeout=30)
    # the machine would take its containers with it: here they share our engine
    for c in pool_containers(docker_client, node_id):
        c.remove(force=True)

    async def lost():
        return {(await operator.get(sb.id)).state for sb in on_node} == {"lost"}

    await eventually(lost, "its sandboxes are reported lost", timeout=30)
    assert node_id not in await healthy(operator)
    others = [sb for sb in held if sb not in on_node]
    outputs = await asyncio.gather(*(sb.exec(["true"]) for sb in others))
    assert [o.exit_code for o in outputs] == [0] * len(others)  # the rest go on
    await asyncio.gather(*(sb.release() for sb in others))


async def test_a_node_that_joins_gets_an_agent(ray_up, cluster, client, operator):
    joined = add_sandbox_node(cluster)  # in the main thread: Ray sets a signal handler
    node_id = ray_up.node_id(joined)
    await eventually(lambda: _healthy_has(operator, node_id), "an agent registers", timeout=60)
    pids = agent_pids(node_id)
    assert len(pids) == 1


async def test_the_example_rollout_loop_runs_episodes_in_sandboxes(ray_up, cluster, operator):
    env = {**ray_up.env, "DSEC_URL": ray_up.url}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(EXAMPLE), "--address", cluster.address,
        "--workers", "3", "--episodes", "6", "--steps", "3",
        stdout=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), 180)
    assert proc.returncode == 0
    report = json.loads(out.decode().strip().splitlines()[-1])
    assert report["episodes"] == 6 and report["mean_reward"] == 1.0
    assert report["tool_calls"] == 6 * 4
    assert report["nodes"] and set(report["nodes"]) <= await healthy(operator)
    assert not [s for s in await operator.list() if s.state == "leased"]  # all released


async def test_stopping_stops_every_agent_and_removes_their_sandboxes(
    ray_up, operator, docker_client
):
    nodes = await healthy(operator)
    ray_up.proc.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(ray_up.proc.wait(), 120) == 0
    assert "swept 0 leftover containers" in ray_up.stderr.read_text()
    assert not [n for n in nodes if agent_pids(n)]
    assert not pool_containers(docker_client, ray_up.name + "-")
