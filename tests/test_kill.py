"""A released sandbox is stopped from the agent (agent/host.py kill_pid_namespace):
its container's init gets SIGKILL through a pidfd, and with it goes every process of its
PID namespace; a process that is not the container's is never signalled."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from conftest import process_of

from agent.docker_driver import LABEL_NODE
from agent.host import kill_pid_namespace
from dsec.image import BASE_IMAGE

pytestmark = pytest.mark.asyncio


async def test_a_pid_outside_the_container_is_never_signalled():
    proc = await asyncio.create_subprocess_exec("sleep", "30")
    try:
        assert await kill_pid_namespace(proc.pid, uuid.uuid4().hex * 2) is False
        await asyncio.sleep(0.1)
        assert proc.returncode is None  # still running: not ours to kill
    finally:
        proc.kill()
        await proc.wait()


async def test_killing_the_init_ends_every_process_of_the_container(docker_client):
    container = docker_client.containers.run(
        BASE_IMAGE,
        ["sh", "-c", "sleep 1000 & sleep 1000 & trap '' TERM; sleep 1000"],
        detach=True,
        init=True,
        network_mode="none",
        labels={LABEL_NODE: f"test-{uuid.uuid4().hex[:8]}"},
    )
    try:
        container.reload()
        pid = container.attrs["State"]["Pid"]
        pids = [int(p[1]) for p in container.top(ps_args="-o pid,pid")["Processes"]]
        assert len(pids) >= 4  # init, sh and its three sleeps
        assert await kill_pid_namespace(pid, container.id) is True
        # by the time it answers, none of them runs any more
        assert not [p for p in pids if process_of(p, container.id)]
        container.wait(timeout=10)  # and the engine sees it stop
        container.reload()
        assert container.status == "exited"
    finally:
        container.remove(force=True)
