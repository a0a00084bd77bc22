"""Nodes a benchmark or a test adds beside a local pool's own: an agent process that
joins the pool (and may be stopped, or killed, on its own), and a Docker engine of its
own for such an agent, restarted or filled up without disturbing the shared one."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import docker

from agent.docker_driver import LABEL_NODE
from dsec.client import Client
from dsec.image import ensure_base_image
from dsec.launch.local import LocalPool
from dsec.models import Capacity, NodeInfo
from dsec.processes import agent_args, child_env, dsec_argv, stop_process

DISK_MB = 200  # a private engine's data root, when it is a tmpfs of its own


@dataclass
class PrivateEngine:
    """A dockerd of our own: restarted and filled up without disturbing anyone else's."""

    root: Path
    process: subprocess.Popen | None = None

    @property
    def socket(self) -> str:
        return f"unix://{self.root}/docker.sock"

    @property
    def data_root(self) -> Path:
        return self.root / "data"

    def client(self) -> docker.DockerClient:
        return docker.DockerClient(base_url=self.socket, timeout=30)

    def start(self) -> None:
        log = open(self.root / "dockerd.log", "a")  # noqa: SIM115 (dockerd keeps it)
        self.process = subprocess.Popen(
            [
                "dockerd", "--bridge=none", "--iptables=false",
                "--data-root", str(self.data_root),
                "--exec-root", str(self.root / "exec"),
                "--pidfile", str(self.root / "docker.pid"),
                "-H", self.socket,
            ],
            stdout=log, stderr=log, start_new_session=True,
        )  # fmt: skip
        for _ in range(300):
            with contextlib.suppress(docker.errors.DockerException):
                self.client().ping()
                return
            time.sleep(0.1)
        raise AssertionError(f"private dockerd did not start: {self.root}/dockerd.log")

    def stop(self) -> None:
        """As `systemctl stop docker` does: SIGTERM, and dockerd stops its containers."""
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=30)  # reaped: no zombie left behind
        except subprocess.TimeoutExpired:
            raise AssertionError("private dockerd did not stop") from None
        self.process = None

    def fill_disk(self) -> None:
        with open(self.data_root / "filler", "wb") as f, contextlib.suppress(OSError):
            f.write(b"\0" * (DISK_MB << 20))  # stops at ENOSPC

    def free_disk(self) -> None:
        (self.data_root / "filler").unlink(missing_ok=True)

    def containers(self, node_id: str) -> list:
        # sparse: no inspect per container, which races with removals under way
        return self.client().containers.list(
            all=True, sparse=True, filters={"label": f"{LABEL_NODE}={node_id}"}
        )


@contextlib.contextmanager
def private_engine(
    prefix: str, disk_mb: int | None = None, base_image: bool = True
) -> Iterator[PrivateEngine]:
    """A started PrivateEngine (with the base image, unless not `base_image`), its data
    root a tmpfs of `disk_mb` if given; its containers, process and dirs gone at the
    end. Its dirs are short: a unix socket's path must fit in 108 bytes."""
    engine = PrivateEngine(Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp")))
    engine.data_root.mkdir()
    if disk_mb is not None:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={disk_mb}m", "tmpfs", str(engine.data_root)],
            check=True,
        )
    try:
        engine.start()
        if base_image:
            ensure_base_image(engine.client())
        yield engine
    finally:
        with contextlib.suppress(docker.errors.DockerException):
            for c in engine.client().containers.list(all=True, filters={"label": LABEL_NODE}):
                c.remove(force=True)
        engine.stop()
        if disk_mb is not None:
            subprocess.run(["umount", "-l", str(engine.data_root)], check=False)
        shutil.rmtree(engine.root, ignore_errors=True)


@dataclass
class ExtraAgent:
    """An agent process started beside a pool's own: it joins the pool, and may leave."""

    node_id: str
    proc: asyncio.subprocess.Process
    drain: asyncio.Task | None = None

    async def stop(self) -> None:
        await stop_process(self.proc)
        if self.drain is not None:
            with contextlib.suppress(Exception):
                await self.drain


async def start_agent(
    pool: LocalPool,
    node_id: str,
    *,
    host: str,
    slots: int,
    kind: str = "local",
    env: dict[str, str] | None = None,
) -> ExtraAgent:
    """`dsec agent` registering with the pool; `env` may point it at another engine."""
    args = agent_args(
        node_id,
        kind=kind,
        host=host,
        controlplane=pool.url,
        capacity=Capacity(cpus=slots, memory_mb=slots * 1024, slots=slots),
        state_dir=pool.dir,
        heartbeat_s=pool.spec.heartbeat_s,
    )
    proc = await asyncio.create_subprocess_exec(
        *dsec_argv(*args),
        stdout=asyncio.subprocess.PIPE,
        env={**child_env(pool.tokens.agent_env()), **(env or {})},
        start_new_session=True,
    )
    agent = ExtraAgent(node_id, proc)
    assert proc.stdout is not None
    try:
        await asyncio.wait_for(proc.stdout.readline(), 60)  # its "listening" line
    except TimeoutError:
        await agent.stop()
        raise
    agent.drain = asyncio.create_task(proc.stdout.read())
    return agent


async def node_info(operator: Client, node_id: str) -> NodeInfo | None:
    return next((n for n in (await operator.nodes()).nodes if n.node_id == node_id), None)
