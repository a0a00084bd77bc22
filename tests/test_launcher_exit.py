"""Whatever starts a local pool takes it down however it ends: each command that starts
one (`dsec up`, `dsec bench replay --mode live`, `fidelity`, `tune`, `bench.burst`,
`bench.churn`, `bench.fusion`) stops it on SIGINT, SIGTERM and SIGHUP as on Ctrl-C,
and a launcher killed outright (SIGKILL, no clean-up of its own) leaves no control
plane, agent or sandbox behind: its children get SIGTERM when it dies
(dsec.processes.signalled_at_parent_death) and remove their sandboxes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import uuid
from pathlib import Path

import pytest
from conftest import STARTED_POOLS, TEST_POOL_PREFIX, eventually, make_spec, pool_containers

from dsec.client import Client
from dsec.launch.local import LocalPool
from dsec.models import PoolParams
from dsec.statedir import loops_dir
from dsec.trace import Episode, Step, dump_trace

# a pool of one node with two warm sandboxes that runs until it is killed, and says
# which processes it started
LAUNCHER = """
import asyncio, json, sys
from pathlib import Path
from dsec.launch.local import LocalPool, LocalPoolSpec
from dsec.models import Capacity, PoolParams

async def main():
    spec = LocalPoolSpec(name=sys.argv[1], nodes=1, port=0, state_dir=Path(sys.argv[2]),
                         capacity=Capacity(cpus=8, memory_mb=8192, slots=8),
                         pool=PoolParams(min_warm=2), heartbeat_s=0.5)
    async with LocalPool(spec) as pool:
        pids = [pool.controlplane.proc.pid, *(a.proc.pid for a in pool.agents)]
        print(json.dumps(pids), flush=True)
        await asyncio.Event().wait()

asyncio.run(main())
"""


def descendants(pid: int) -> set[int]:
    """Every live process under `pid`, from /proc's parent links."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return {p for p in found if running(p)}


def running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie no one has reaped yet is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


async def test_a_killed_launcher_leaves_no_service_and_no_sandbox(docker_client, tmp_path):
    name = f"{TEST_POOL_PREFIX}{uuid.uuid4().hex[:8]}"
    STARTED_POOLS.add(name)
    launcher = await asyncio.create_subprocess_exec(
        sys.executable, "-c", LAUNCHER, name, str(tmp_path), stdout=asyncio.subprocess.PIPE
    )
    assert launcher.stdout is not None
    try:
        pids = json.loads(await asyncio.wait_for(launcher.stdout.readline(), 120))
        await eventually(
            lambda: len(pool_containers(docker_client, name + "-")) >= 2, "two warm sandboxes"
        )
    finally:
        launcher.kill()  # SIGKILL: nothing of the launcher's own runs after this
        await launcher.wait()
    await eventually(lambda: not any(map(running, pids)), "its services to end", timeout=90)
    await eventually(
        lambda: not pool_containers(docker_client, name + "-"), "its sandboxes to go", timeout=30
    )


def pool_commands(tmp_path: Path) -> dict[str, list[str]]:
    """Each command that starts a pool, on one node where it can, sized to start quickly;
    the episodes' commands run for minutes, so the signal finds them under way."""
    trace = tmp_path / "trace.jsonl"
    long = [Step(think_s=0.1, exec_s=120.0)]
    dump_trace([Episode(episode=f"e{i}", arrival_s=0.0, steps=long) for i in range(2)], trace)
    dsec = [sys.executable, "-m", "dsec.cli"]
    out = ["--out", str(tmp_path / "out")]
    one_node = ["--trace", str(trace), "--nodes", "1", *out]
    return {
        "up": [*dsec, "up", "--nodes", "1", "--port", "0", "--min-warm", "2",
               "--name", f"{TEST_POOL_PREFIX}{uuid.uuid4().hex[:8]}"],
        "replay": [*dsec, "bench", "replay", "--mode", "live", *one_node],
        "fidelity": [*dsec, "bench", "fidelity", "--sim-seeds", "1", *one_node],
        "tune": [*dsec, "bench", "tune", *one_node, "--slots-per-node", "8",
                 "--target", "p99_ms=100000", "--budget", "6", "--space", "min_warm=0,1",
                 "--space", "warm_fraction=0", "--seeds", "1", "--live-s", "30"],
        "burst": [sys.executable, "-m", "bench.burst", "--size", "20"],
        "churn": [sys.executable, "-m", "bench.churn", "--episodes", "40",
                  "--concurrency", "4"],
        "fusion": [sys.executable, "-m", "bench.fusion", "--requests", "400",
                   "--baseline-requests", "40", "--concurrency", "4"],
    }  # fmt: skip


@pytest.mark.parametrize(
    "sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name
)
@pytest.mark.parametrize(
    "command", ["up", "replay", "fidelity", "tune", "burst", "churn", "fusion"]
)
async def test_a_command_that_starts_a_pool_stops_it_on_each_signal(
    docker_client, tmp_path, command, sig
):
    before = {c.id for c in pool_containers(docker_client, "")}

    def its_containers() -> list:
        return [c for c in pool_containers(docker_client, "") if c.id not in before]

    env = {**os.environ, "HOME": str(tmp_path)}  # its pool's state dir: ~/.dsec
    proc = await asyncio.create_subprocess_exec(
        *pool_commands(tmp_path)[command], env=env, cwd=tmp_path,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        await eventually(lambda: its_containers(), "its sandboxes", timeout=180)
        children = descendants(proc.pid)
        assert children, "a pool's services run as its children"
        proc.send_signal(sig)
        _, err = await asyncio.wait_for(proc.communicate(), 120)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    # its own clean-up ran, rather than the signal ending it
    assert proc.returncode in (0, 130), err.decode()[-2000:]
    await eventually(lambda: not any(map(running, children)), "its services to end", 30)
    assert its_containers() == []


async def test_a_pool_stopped_after_its_agent_was_killed_leaves_nothing_in_shared_memory(
    docker_client, tmp_path
):
    """An agent killed outright cannot remove its command loops' directory, which sits on
    /dev/shm (the host's memory) and outlives it while the state dir stays; the pool's
    stop removes it, and the sweep the sandbox the agent left."""
    spec = make_spec(tmp_path, nodes=1, pool=PoolParams(min_warm=1))
    base = loops_dir(spec.state_dir / spec.name)
    if base == spec.state_dir / spec.name:
        pytest.skip("/dev/shm is not a tmpfs here: the loops stay in the state dir")
    STARTED_POOLS.add(spec.name)
    async with LocalPool(spec) as pool:
        async with Client(pool.url, token=pool.tokens.client) as client:
            sb = await client.acquire()
            await sb.exec(["true"])  # through its loop, whose directory is now made
            assert any(p.name.endswith("-resident") for p in base.iterdir())
            pool.agents[0].proc.kill()
            await pool.agents[0].proc.wait()
    assert not base.exists()
    # (the leased sandbox, and a warm one if its refill had been made)
    assert pool.swept >= 1 and not pool_containers(docker_client, spec.name + "-")
