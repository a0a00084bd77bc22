"""A released sandbox is stopped from the agent (agent/host.py kill_pid_namespace):
its container's init gets SIGKILL through a pidfd, and with it goes every process of its
PID namespace; a process that is not the container's is never signalled."""

from __future__ import annotations

import asyncio
import os
import uuid

import pytest
from conftest import process_of

from agent.docker_driver import LABEL_NODE, AsyncDocker
from agent.host import is_init_of, kill_pid_namespace
from agent.sandboxes import Sandbox
from agent.store import SandboxRecord
from dsec.clock import SystemClock
from dsec.image import BASE_IMAGE
from dsec.models import TemplateSpec
from dsec.states import SandboxState as S

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


async def test_a_container_s_init_is_kept_while_it_is_that_init_and_asked_again_after(
    docker_client,
):
    """Sandbox.container_init (agent/sandboxes.py): a reset asks the engine for the init's PID once,
    not on every reset; a PID that is no longer that container's init is asked again."""
    container = docker_client.containers.run(
        BASE_IMAGE, ["sh", "-c", "sleep 1000 & wait"], detach=True, init=True,
        network_mode="none", labels={LABEL_NODE: f"test-{uuid.uuid4().hex[:8]}"},
    )  # fmt: skip
    docker = AsyncDocker(SystemClock(), lambda op, took: None)
    try:
        container.reload()
        init = container.attrs["State"]["Pid"]
        others = [int(p[0]) for p in container.top(ps_args="-o pid")["Processes"]]
        assert is_init_of(init, container.id)
        assert not [p for p in others if p != init and is_init_of(p, container.id)]
        assert not is_init_of(init, uuid.uuid4().hex * 2) and not is_init_of(os.getpid(), "")
        asked: list[str] = []
        engine_init_pid = docker.init_pid

        async def counted(container_id: str) -> int | None:
            asked.append(container_id)
            return await engine_init_pid(container_id)

        docker.init_pid = counted  # the real engine's answer, counted
        record = SandboxRecord(id="n1.x", container_id=container.id, pool="p",
                               template={}, created_at=0.0)  # fmt: skip
        sandbox = Sandbox(record, TemplateSpec(name="t", image=BASE_IMAGE), S.WARM, 0.0)
        sandbox.init_pid = next(p for p in others if p != init)  # not its init
        assert await sandbox.container_init(docker) == init and asked == [container.id]
        assert await sandbox.container_init(docker) == init and len(asked) == 1
    finally:
        container.remove(force=True)
        await docker.close()
