"""Whatever starts a local pool takes it down however it ends: a bench command ended by
SIGTERM stops its pool as on Ctrl-C, and a launcher killed outright (SIGKILL, no clean-up
of its own) leaves no control plane, agent or sandbox behind: its children get SIGTERM
when it dies (dsec.processes.signalled_at_parent_death) and remove their sandboxes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import uuid
from pathlib import Path

from conftest import STARTED_POOLS, TEST_POOL_PREFIX, eventually, pool_containers

from bench.replay_live import REPLAY_POOL_PREFIX
from dsec.trace import Episode, Step, dump_trace

# a pool of one node with two warm sandboxes that runs until it is killed, and says
# which processes it started
LAUNCHER = """
import asyncio, json, sys
from pathlib import Path
from dsec.cli.up import LocalPool, LocalPoolSpec
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


async def test_a_bench_command_ended_by_sigterm_stops_its_pool_as_on_ctrl_c(
    docker_client, tmp_path
):
    trace = tmp_path / "trace.jsonl"
    long = [Step(think_s=0.1, exec_s=120.0)]  # still running when the SIGTERM comes
    dump_trace([Episode(episode=f"e{i}", arrival_s=0.0, steps=long) for i in range(2)], trace)
    before = {c.id for c in pool_containers(docker_client, REPLAY_POOL_PREFIX)}
    env = {**os.environ, "HOME": str(tmp_path)}  # its pool's state dir: ~/.dsec
    replay = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dsec.cli", "bench", "replay", "--trace", str(trace),
        "--mode", "live", "--nodes", "1", "--out", str(tmp_path / "out"),
        env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip

    def its_containers() -> list:
        return [c for c in pool_containers(docker_client, REPLAY_POOL_PREFIX) if c.id not in before]

    try:
        await eventually(lambda: len(its_containers()) >= 2, "its episodes' sandboxes", 120)
        replay.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(replay.communicate(), 120)
    finally:
        if replay.returncode is None:
            replay.kill()
            await replay.wait()
    # its own clean-up ran (Ctrl-C's exit code), rather than the signal ending it
    assert replay.returncode == 130, err.decode()
    assert not its_containers()
