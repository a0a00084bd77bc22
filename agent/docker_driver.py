"""Docker, driven through the `docker` SDK, always off the event loop.

`DockerDriver` holds the blocking calls. `AsyncDocker` runs them on two bounded
thread pools, one for lifecycle operations and one for exec streams, so a flood of
long-running commands can never starve creates, pauses and removes. Every call is
timed into `dsec_agent_docker_op_seconds`; a Docker failure is raised as
`DockerOpError` carrying the operation and a short kind, for the caller to turn into
an answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import docker
import requests
from docker.errors import APIError, DockerException, ImageNotFound, NotFound
from docker.utils.socket import frames_iter

from agent.engine import CREATES, CreateLimit, EngineQueue, Work
from dsec.clock import Clock
from dsec.models import TemplateSpec

T = TypeVar("T")
STDOUT, STDERR = 1, 2
TIMEOUT_EXIT_CODE = 124  # what coreutils' timeout(1) returns, so scripts read it the same way
RUNC_STOPPED = b"cannot exec in a stopped state"  # runc's answer to an exec in a dead container

LABEL_NODE = "dsec.node"
LABEL_POOL = "dsec.pool"
LABEL_TEMPLATE = "dsec.template"
LABEL_SANDBOX = "dsec.sandbox"
LABEL_LEASE = "dsec.lease"


class DockerOpError(Exception):
    def __init__(self, op: str, kind: str, message: str) -> None:
        super().__init__(f"docker {op} failed ({kind}): {message}")
        self.op, self.kind, self.message = op, kind, message


class StartFailed(DockerException):
    """Docker made the container but could not start it: in practice the template asks
    for what the image or the host cannot give (a user or a command the image lacks, a
    limit past the engine's own, a CPU quota below Docker's minimum)."""


def _error_kind(e: Exception) -> str:
    if isinstance(e, StartFailed):
        return "start_failed"
    if isinstance(e, ImageNotFound):
        return "image_not_found"
    if isinstance(e, NotFound):
        return "not_found"
    if isinstance(e, APIError) and e.response is not None and e.response.status_code == 409:
        return "conflict"
    if isinstance(e, APIError) and e.response is not None and e.response.status_code == 400:
        return "invalid"  # Docker refused what it was asked, e.g. a bad image reference
    text = str(e).lower()
    if "no space left" in text:
        return "disk_full"
    if isinstance(e, requests.exceptions.ConnectionError | ConnectionError):
        return "engine_unreachable"
    return "api_error"


@dataclass
class ContainerSummary:
    container_id: str
    status: str  # docker's: created, running, paused, exited, ...
    labels: dict[str, str]

    @property
    def alive(self) -> bool:
        """Its processes still exist (running, or frozen by a pause)."""
        return self.status in ("running", "paused")


@dataclass
class ExecOutput:
    exit_code: int
    stdout: bytes
    stderr: bytes
    truncated: bool
    timed_out: bool


class DockerDriver:
    """Blocking Docker calls. Call them through AsyncDocker, never on the loop."""

    def __init__(self, client: docker.DockerClient) -> None:
        self.client = client
        self.api = client.api

    def create(self, name: str, spec: TemplateSpec, labels: dict[str, str]) -> str:
        """Create and start a sandbox container, hardened as its template says."""
        tmpfs = {
            spec.workdir: f"rw,size={spec.workdir_mb}m,mode=0755,uid=1000,gid=1000",
            "/tmp": f"rw,size={spec.tmp_mb}m,mode=1777",
        }
        # The limit makes room for both file systems on top of memory_mb, so filling the
        # work dir fails with ENOSPC at workdir_mb instead of OOM-killing every process in
        # the sandbox, and memory_mb stays what the processes get.
        ram_limit = spec.memory_limit_mb << 20
        container = self.client.containers.create(
            spec.image,
            command=spec.command,
            name=name,
            labels=labels,
            detach=True,
            network_mode="none",
            user=spec.user,
            working_dir=spec.workdir,
            read_only=spec.read_only_root,
            tmpfs=tmpfs,
            nano_cpus=int(spec.cpus * 1e9),
            mem_limit=ram_limit,
            memswap_limit=ram_limit,  # no swap
            pids_limit=spec.pids_limit,
            ulimits=[
                docker.types.Ulimit(name="nofile", soft=spec.nofile_limit, hard=spec.nofile_limit)
            ],
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            init=True,
        )
        try:
            container.start()
        except DockerException as e:
            with contextlib.suppress(DockerException):
                container.remove(force=True)
            raise StartFailed(str(e)) from e
        return container.id

    def pause(self, container_id: str) -> None:
        self.api.pause(container_id)

    def unpause(self, container_id: str) -> None:
        self.api.unpause(container_id)

    def running(self, container_id: str) -> bool:
        try:
            return bool(self.api.inspect_container(container_id)["State"]["Running"])
        except NotFound:
            return False

    def remove(self, container_id: str) -> None:
        try:
            self.api.remove_container(container_id, force=True, v=True)
        except NotFound:
            pass  # already gone: removing is idempotent

    def kill(self, container_id: str) -> None:
        """Stop a container at once: its processes end and release CPU and memory; the
        container itself stays until it is removed."""
        try:
            self.api.kill(container_id)
        except NotFound:
            pass  # already gone
        except APIError as e:
            if e.response is None or e.response.status_code != 409:
                raise  # 409: not running (exited, or paused): nothing runs to stop

    def commit(self, container_id: str, repository: str, tag: str) -> str:
        self.api.commit(container_id, repository=repository, tag=tag, pause=False)
        return f"{repository}:{tag}"

    def remove_image(self, ref: str) -> None:
        try:
            self.api.remove_image(ref, force=True)
        except NotFound:
            pass

    def archive_dir(self, container_id: str, path: str, cap: int) -> bytes:
        """A tar of `path` inside the container, read through an exec.

        `docker cp` cannot see a tmpfs mount, which is where a sandbox's work dir lives.
        """
        exec_id = self.exec_create(container_id, ["tar", "-C", path, "-cf", "-", "."], {}, None)
        out, err, truncated = self.exec_stream(exec_id, cap, lambda _: None)
        code = self.exec_exit_code(exec_id)
        if code != 0 or truncated:
            raise DockerException(
                f"archiving {path} failed ({code}, truncated={truncated}): {err!r}"
            )
        return out

    def restore_dir(self, container_id: str, path: str, archive: bytes) -> None:
        """Unpack a tar made by archive_dir into `path`, through an exec's stdin."""
        exec_id = self.api.exec_create(
            container_id, ["tar", "-C", path, "-xf", "-"], stdin=True, stdout=True, stderr=True
        )["Id"]
        sock = self.api.exec_start(exec_id, socket=True)
        raw = getattr(sock, "_sock", sock)
        raw.settimeout(120)
        try:
            raw.sendall(archive)
            raw.shutdown(socket.SHUT_WR)
            err = b"".join(chunk for _, chunk in frames_iter(sock, tty=False))
        finally:
            with contextlib.suppress(OSError):
                sock.close()
        code = self.exec_exit_code(exec_id)
        if code != 0:
            raise DockerException(f"restoring {path} failed ({code}): {err!r}")

    def list_labelled(self, node_id: str) -> list[ContainerSummary]:
        rows = self.api.containers(all=True, filters={"label": f"{LABEL_NODE}={node_id}"})
        return [ContainerSummary(r["Id"], r["State"], r.get("Labels") or {}) for r in rows]

    def ping(self) -> None:
        self.api.ping()

    def image_tags(self) -> list[str]:
        return sorted({t for img in self.api.images() for t in (img.get("RepoTags") or [])})

    def exec_create(
        self, container_id: str, cmd: list[str], env: dict[str, str], workdir: str | None
    ) -> str:
        res = self.api.exec_create(
            container_id, cmd, stdout=True, stderr=True, environment=env or None, workdir=workdir
        )
        return res["Id"]

    def exec_stream(
        self, exec_id: str, cap: int, on_socket: Callable[[socket.socket], None]
    ) -> tuple[bytes, bytes, bool]:
        """Run a created exec and read its output, keeping at most `cap` bytes a stream.

        `on_socket` gets the connection so the caller can shut it down on a timeout;
        output past the cap is read and dropped, so the command is not blocked on a
        full pipe.
        """
        sock = self.api.exec_start(exec_id, socket=True)
        raw = getattr(sock, "_sock", sock)
        raw.settimeout(None)  # the SDK's 60 s read timeout would cut long quiet commands
        on_socket(raw)
        out, err = bytearray(), bytearray()
        truncated = False
        try:
            for stream, chunk in frames_iter(sock, tty=False):
                buf = out if stream == STDOUT else err
                room = cap - len(buf)
                if room > 0:
                    buf += chunk[:room]
                if len(chunk) > room:
                    truncated = True
        except OSError:
            pass  # shut down by the caller after a timeout
        finally:
            with contextlib.suppress(OSError):
                sock.close()
        return bytes(out), bytes(err), truncated

    def exec_exit_code(self, exec_id: str) -> int | None:
        return self.api.exec_inspect(exec_id).get("ExitCode")

    def run_as(
        self, container_id: str, script: str, user: str, timeout_s: float
    ) -> tuple[int | None, bytes, bytes]:
        """Run `sh -c script` in the container as `user` until it ends or `timeout_s`
        passes without output: the agent's own commands (a reset, agent/reset.py), not
        a client's. The exit code is None when it did not end."""
        exec_id = self.api.exec_create(
            container_id, ["sh", "-c", script], stdout=True, stderr=True, user=user
        )["Id"]
        out, err, _ = self.exec_stream(exec_id, 1 << 20, lambda s: s.settimeout(timeout_s))
        return self.exec_exit_code(exec_id), out, err

    def exec_kill(self, exec_id: str) -> None:
        """Kill a timed-out command and everything it started.

        The agent runs beside the engine, so the exec's host pid is ours to signal.
        """
        pid = self.api.exec_inspect(exec_id).get("Pid") or 0
        if pid > 0:
            for p in [pid, *_descendants(pid)]:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(p, signal.SIGKILL)


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class AsyncDocker:
    """The driver's calls as coroutines, timed per operation. Each waits its turn in the
    node's `EngineQueue` by the `Work` it is (agent/engine.py): a client's work on threads
    of its own, the rest on `lifecycle_threads`, creates as many at once as `CreateLimit`
    measures the engine takes."""

    def __init__(
        self,
        driver: DockerDriver,
        clock: Clock,
        observe: Callable[[str, float], None],
        lifecycle_threads: int = 8,
        exec_threads: int = 32,
    ) -> None:
        self.driver = driver
        self.clock = clock
        self.observe = observe
        self.lifecycle_pool = ThreadPoolExecutor(lifecycle_threads, "docker-op")
        self.exec_pool = ThreadPoolExecutor(exec_threads, "docker-exec")
        self.engine = EngineQueue(lifecycle_threads, CreateLimit(), clock.now)
        # its own thread: a check never waits behind creates, and a hung one holds no other
        self.ping_pool = ThreadPoolExecutor(1, "docker-ping")

    async def call(
        self, op: str, fn: Callable[..., T], *args: Any, work: Work = Work.CLIENT, pool=None
    ) -> T:
        loop = asyncio.get_running_loop()
        if pool is None:
            pool = self.exec_pool if work == Work.CLIENT else self.lifecycle_pool
        async with self.engine.turn(work):
            started = self.clock.now()
            try:
                return await loop.run_in_executor(pool, fn, *args)
            except DockerException as e:
                raise DockerOpError(op, _error_kind(e), str(e)) from e
            except (requests.exceptions.RequestException, OSError) as e:
                raise DockerOpError(op, "engine_unreachable", str(e)) from e
            finally:
                took = self.clock.now() - started
                self.observe(op, took)
                if work in CREATES:
                    self.engine.creates.observe(took, self.engine.creating())

    async def create(
        self, name: str, spec: TemplateSpec, labels: dict[str, str], work: Work
    ) -> str:
        return await self.call("create", self.driver.create, name, spec, labels, work=work)

    async def pause(self, container_id: str) -> None:
        await self.call("pause", self.driver.pause, container_id, work=Work.FREEZE)

    async def unpause(self, container_id: str, work: Work) -> None:
        await self.call("unpause", self.driver.unpause, container_id, work=work)

    async def running(self, container_id: str) -> bool:
        return await self.call("inspect", self.driver.running, container_id)

    async def kill(self, container_id: str) -> None:
        await self.call("kill", self.driver.kill, container_id)

    async def remove(self, container_id: str, work: Work = Work.REMOVE) -> None:
        await self.call("remove", self.driver.remove, container_id, work=work)

    async def commit(self, container_id: str, repository: str, tag: str) -> str:
        return await self.call(
            "commit", self.driver.commit, container_id, repository, tag, work=Work.FREEZE
        )

    async def remove_image(self, ref: str) -> None:
        await self.call("remove_image", self.driver.remove_image, ref, work=Work.REMOVE)

    async def archive_dir(self, container_id: str, path: str, cap: int) -> bytes:
        return await self.call(
            "archive", self.driver.archive_dir, container_id, path, cap, work=Work.FREEZE
        )

    async def restore_dir(self, container_id: str, path: str, archive: bytes) -> None:
        await self.call("restore", self.driver.restore_dir, container_id, path, archive)

    async def list_labelled(self, node_id: str) -> list[ContainerSummary]:
        return await self.call("list", self.driver.list_labelled, node_id)

    async def ping(self) -> None:
        await self.call("ping", self.driver.ping, pool=self.ping_pool)

    async def image_tags(self) -> list[str]:
        return await self.call("images", self.driver.image_tags)

    async def run_as(
        self, op: str, container_id: str, script: str, user: str, timeout_s: float = 60.0
    ) -> tuple[int | None, bytes, bytes]:
        """The agent's own script in a sandbox (DockerDriver.run_as), timed as `op`."""
        return await self.call(op, self.driver.run_as, container_id, script, user, timeout_s)

    async def exec(
        self,
        container_id: str,
        cmd: list[str],
        env: dict[str, str],
        workdir: str | None,
        timeout_s: float,
        cap: int,
    ) -> ExecOutput:
        exec_id = await self.call(
            "exec_create", self.driver.exec_create, container_id, cmd, env, workdir
        )
        sockets: list[socket.socket] = []
        got_socket = threading.Event()

        def on_socket(s: socket.socket) -> None:
            sockets.append(s)
            got_socket.set()

        reading = asyncio.ensure_future(
            self.call(
                "exec_start",
                self.driver.exec_stream,
                exec_id,
                cap,
                on_socket,
                pool=self.exec_pool,
            )
        )
        timed_out = False
        try:
            out, err, truncated = await asyncio.wait_for(asyncio.shield(reading), timeout_s)
        except TimeoutError:
            timed_out = True
            with contextlib.suppress(DockerOpError):
                await self.call("exec_kill", self.driver.exec_kill, exec_id)
            # a child that escaped the kill may still hold the stream open: cut it
            await asyncio.get_running_loop().run_in_executor(None, got_socket.wait, 5)
            for s in sockets:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
            out, err, truncated = await reading
        except BaseException:
            for s in sockets:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
            raise
        if timed_out:
            code = TIMEOUT_EXIT_CODE
        else:
            code = await self.call("exec_inspect", self.driver.exec_exit_code, exec_id)
        return ExecOutput(
            exit_code=TIMEOUT_EXIT_CODE if code is None else code,
            stdout=out,
            stderr=err,
            truncated=truncated,
            timed_out=timed_out,
        )

    def close(self) -> None:
        self.lifecycle_pool.shutdown(wait=True, cancel_futures=True)
        self.exec_pool.shutdown(wait=True, cancel_futures=True)
        self.ping_pool.shutdown(wait=False, cancel_futures=True)  # a hung ping holds no one
