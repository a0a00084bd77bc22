"""Docker, driven through the Engine API on the event loop (aiodocker).

No call holds a thread: a command that runs for an hour holds one socket to the
engine and nothing else, so no tenant's commands can starve another's or the node's
own lifecycle calls (the connection pool has no cap). Every call is timed into
`dsec_agent_docker_op_seconds` and waits its turn in the node's `EngineQueue` by the
`Work` it is (agent/engine.py); a Docker failure is raised as `DockerOpError` carrying
the operation and a short kind, for the caller to turn into an answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import aiodocker
import aiohttp
from aiodocker.exceptions import DockerError
from aiodocker.execs import Exec
from aiodocker.stream import Stream

from agent.engine import CREATES, CreateLimit, CreateSlots, EngineQueue, Work
from agent.host import kill_pid_namespace
from agent.users import WORKDIR_MODE, numeric_user
from dsec.clock import Clock
from dsec.models import NodeLostCause, TemplateSpec

T = TypeVar("T")
STDOUT, STDERR = 1, 2
TIMEOUT_EXIT_CODE = 124  # what coreutils' timeout(1) returns, so scripts read it the same way
RUNC_STOPPED = b"cannot exec in a stopped state"  # runc's answer to an exec in a dead container
# runc's answer when its init process died before the command could start: its own
# threads and forks count against the sandbox's pids limit, so at the limit it sometimes
# cannot make them (how many it needs depends on its Go runtime's timing)
RUNC_INIT_DIED = b"read init-p"
# A sandbox's container log (what its main process writes) is capped: one file of 1 MiB,
# the oldest output dropped, so no sandbox can fill the host's disk through it.
LOG_MAX_SIZE = "1m"
LIFECYCLE_SLOTS = 8  # lifecycle calls given to the engine at once; the rest wait their turn
# how long a write to a command's input waits before the agent looks whether the command
# has ended (Process.write): a command reads its input at its own pace meanwhile
STDIN_STALL_CHECK_S = 0.5
ENGINE_UNREACHABLE = 900  # aiodocker's status for a connection that failed
RESIDENT_MOUNT = "/.dsec"  # where a sandbox sees its command loop's directory
# Who runs the init and the template's command of a sandbox that may be recycled: not
# its tenants' user, who could otherwise read and write their memory (/proc/PID/mem, as
# any process of one's own; ptrace likewise) and leave in them what the next lease
# would meet. Commands always run as the template's user, named on every exec.
KEEPER_USER = "65534:65534"
# Who runs a sandbox's command loop (agent/resident.py): root in the container, holding
# only the capabilities to become the sandbox's user for each command (no CAP_KILL, no
# CAP_DAC_OVERRIDE: it can neither signal the tenant's processes nor open the tenant's
# files). The tenant's user then cannot signal, trace or read the loop, nor open its
# pipes (0600, root's), so no command's answer comes from anyone but the loop.
LOOP_USER = "0:0"
LOOP_CAPS = ["SETUID", "SETGID"]

LABEL_NODE = "dsec.node"
LABEL_POOL = "dsec.pool"
LABEL_TEMPLATE = "dsec.template"
LABEL_SANDBOX = "dsec.sandbox"
LABEL_LEASE = "dsec.lease"


class DockerOpError(Exception):
    def __init__(self, op: str, kind: str, message: str) -> None:
        super().__init__(f"docker {op} failed ({kind}): {message}")
        self.op, self.kind, self.message = op, kind, message


class StartFailed(Exception):
    """Docker made the container but could not start it: in practice the template asks
    for what the image or the host cannot give (a user or a command the image lacks, a
    limit past the engine's own, a CPU quota below Docker's minimum)."""


def _error_kind(op: str, e: DockerError) -> str:
    text = str(e.message).lower()
    if e.status == ENGINE_UNREACHABLE:
        return "engine_unreachable"
    if e.status == 404:
        image_op = op in ("create", "image_inspect")
        return "image_not_found" if image_op and "image" in text else "not_found"
    if e.status == 409:
        return "conflict"
    if e.status == 400:
        return "invalid"  # Docker refused what it was asked, e.g. a bad image reference
    if "no space left" in text:
        return "disk_full"
    return "api_error"


def container_config(
    spec: TemplateSpec,
    labels: dict[str, str],
    user: str,
    resident_dir: Path | None = None,
    entrypoint: list[str] | None = None,
) -> dict[str, Any]:
    """The Engine API's create body for a sandbox whose commands run as `user`, hardened
    as its template says; `resident_dir` is mounted read-only for its command loop
    (agent/resident.py), which `entrypoint`, when given, starts with the container as
    LOOP_USER (the template's command is then dropped to its user by the boot)."""
    # The limit makes room for both file systems on top of memory_mb, so filling the
    # work dir fails with ENOSPC at workdir_mb instead of OOM-killing every process in
    # the sandbox, and memory_mb stays what the processes get.
    ram_limit = spec.memory_limit_mb << 20
    uid, gid = numeric_user(user) or (1000, 1000)  # a named user: the image's sandbox ids
    if entrypoint is not None:
        init_user = LOOP_USER
    else:
        init_user = KEEPER_USER if spec.recyclable else user
    config: dict[str, Any] = {
        "Image": spec.image,
        "Cmd": spec.command,
        "Labels": labels,
        "User": init_user,
        # a sandbox's own uid has no home in the image's /etc/passwd: the work dir is,
        # unless the template's environment says otherwise
        "Env": [f"{k}={v}" for k, v in {"HOME": spec.workdir, **spec.env}.items()],
        "WorkingDir": spec.workdir,
        "NetworkDisabled": True,
        "HostConfig": {
            "NetworkMode": "none",
            "ReadonlyRootfs": spec.read_only_root,
            # exec: an agent's tools build and run programs in its work dir and /tmp
            # (Docker's default is noexec); nosuid and no-new-privileges keep them unprivileged
            "Tmpfs": {
                spec.workdir: f"rw,exec,nosuid,nodev,size={spec.workdir_mb}m,mode={WORKDIR_MODE:o},"
                f"uid={uid},gid={gid}",
                "/tmp": f"rw,exec,nosuid,nodev,size={spec.tmp_mb}m,mode=1777",
            },
            "NanoCpus": int(spec.cpus * 1e9),
            "Memory": ram_limit,
            "MemorySwap": ram_limit,  # no swap
            "PidsLimit": spec.pids_limit,
            "Ulimits": [{"Name": "nofile", "Soft": spec.nofile_limit, "Hard": spec.nofile_limit}],
            "Binds": [f"{resident_dir}:{RESIDENT_MOUNT}:ro"] if resident_dir else [],
            "CapDrop": ["ALL"],
            # the loop's (LOOP_CAPS) where one runs: the tenant's user holds none of them
            "CapAdd": LOOP_CAPS if entrypoint is not None else [],
            "SecurityOpt": ["no-new-privileges"],
            "Init": True,
            "LogConfig": {
                "Type": "json-file",
                "Config": {"max-size": LOG_MAX_SIZE, "max-file": "1"},
            },
        },
    }
    if entrypoint is not None:
        config["Entrypoint"] = entrypoint
    return config


@dataclass
class ContainerSummary:
    container_id: str
    status: str  # docker's: created, running, paused, exited, ...
    labels: dict[str, str]

    @property
    def alive(self) -> bool:
        """Its processes still exist (running, or frozen by a pause)."""
        return self.status in ("running", "paused")


class Process:
    """A command running in a container, attached: its output as it comes, its stdin,
    its terminal's size, and its exit code once it has ended."""

    def __init__(self, docker: AsyncDocker, exec_: Exec, stream: Stream, tty: bool) -> None:
        self.docker, self.exec, self.stream, self.tty = docker, exec_, stream, tty
        self._ahead: asyncio.Future[tuple[int, bytes] | None] | None = None

    async def read(self) -> tuple[int, bytes] | None:
        """The next chunk (STDOUT or STDERR, data), None at the end of the output."""
        if self._ahead is not None:
            ahead, self._ahead = self._ahead, None
            return await ahead
        return await self._read()

    async def _read(self) -> tuple[int, bytes] | None:
        try:
            msg = await self.stream.read_out()
        except (aiohttp.ClientError, OSError, RuntimeError):
            return None  # the connection was cut (a timeout's close): the output ends here
        return None if msg is None else (msg.stream, msg.data)

    async def write(self, data: bytes) -> None:
        """Give `data` to the command's input, once the engine has taken it.

        A command that ends without reading all its input (a write that found the disk
        full, `head -c 3`) leaves the engine reading none of the rest, while it keeps
        the connection and the output open until that input ends, which a write the
        engine does not take can never say. So a write that waits is checked against
        the command's end; once it has ended (the engine records the end before it has
        passed on the last output) and a check's time has passed, the connection is cut,
        its output ends there, and its exit code says the rest."""
        connection = self._connection()
        if connection is None or connection.transport is None:  # the engine closed it
            raise DockerOpError("exec_stdin", "closed", "the command's input is closed")
        transport, protocol = connection.transport, connection.protocol
        # what aiodocker's Stream.write_in does, with its wait for the engine to take
        # the bytes (the drain) watched here instead of awaited blindly
        transport.write(data)
        taken = asyncio.ensure_future(protocol._drain_helper())  # type: ignore[union-attr]
        ended = False
        try:
            while not (await asyncio.wait({taken}, timeout=STDIN_STALL_CHECK_S))[0]:
                if ended:  # what it wrote before its end has had a check's time to come
                    transport.abort()
                    raise DockerOpError(
                        "exec_stdin", "closed", "the command ended without reading all its input"
                    )
                ended = await self.exit_code() is not None
            taken.result()
        except (aiohttp.ClientError, OSError, RuntimeError) as e:
            raise DockerOpError(
                "exec_stdin", "closed", f"the command's input is closed: {e}"
            ) from e
        finally:
            taken.cancel()  # when the connection was cut under it, or we were cancelled

    def close_stdin(self) -> None:
        """End of input: the command reads EOF, its output still comes."""
        transport = self._transport()
        if transport is not None and transport.can_write_eof():
            transport.write_eof()

    async def resize(self, rows: int, cols: int) -> None:
        await self.docker.call("exec_resize", lambda: self.exec.resize(h=rows, w=cols))

    async def first_within(self, seconds: float) -> tuple[int, bytes] | None | bool:
        """The first chunk, if it comes (or the output ends: None) within `seconds`;
        False if not yet. Either way the next read returns it: it is only looked at."""
        self._ahead = asyncio.ensure_future(self._read())
        done, _ = await asyncio.wait({self._ahead}, timeout=seconds)
        return self._ahead.result() if done else False

    async def exit_code(self) -> int | None:
        """None while it runs (or when it never ended: a timeout cut it)."""
        info = await self.docker.call("exec_inspect", self.exec.inspect)
        return None if info.get("Running") else info.get("ExitCode")

    async def never_started(self) -> bool:
        """Whether it ended without the engine ever running its process (no pid): runc
        could not start it, and nothing of the command ran."""
        info = await self.docker.call("exec_inspect", self.exec.inspect)
        return not info.get("Running") and not info.get("Pid")

    async def close(self) -> None:
        if self._ahead is not None:  # a first chunk looked for and never read
            self._ahead.cancel()
        with contextlib.suppress(aiohttp.ClientError, OSError, RuntimeError):
            await self.stream.close()

    def _connection(self) -> aiohttp.connector.Connection | None:
        resp = self.stream._resp  # aiodocker keeps the hijacked connection here
        return None if resp is None else resp.connection

    def _transport(self) -> asyncio.Transport | None:
        connection = self._connection()
        return None if connection is None else connection.transport  # type: ignore[return-value]


class AsyncDocker:
    """The node's Docker engine. Lifecycle calls wait their turn in `engine` (creates as
    many at once as `CreateLimit` measures the engine takes); a client's work starts at
    once."""

    def __init__(self, clock: Clock, observe: Callable[[str, float], None], url: str | None = None):
        self.clock = clock
        self.observe = observe
        self.url = url or os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
        self.engine = EngineQueue(LIFECYCLE_SLOTS, CreateLimit(), clock.now)
        # the bound on creates the agents that share this engine share, once its id is
        # known (agent/runtime.py); None: this agent's own limit alone
        self.engine_wide: CreateSlots | None = None
        self._api: aiodocker.Docker | None = None
        self.entrypoints: dict[str, list[str]] = {}  # by image name, read once

    @property
    def api(self) -> aiodocker.Docker:
        # made on first use, inside the running loop that owns its connections
        if self._api is None:
            url = self.url
            if url.startswith("unix://"):
                connector: aiohttp.BaseConnector = aiohttp.UnixConnector(
                    url.removeprefix("unix://"), limit=0
                )
                url = "unix://localhost"  # the host part of a request's URL, as aiodocker has it
            else:
                connector = aiohttp.TCPConnector(limit=0)
            self._api = aiodocker.Docker(url, connector=connector)
        return self._api

    async def call(
        self,
        op: str,
        make: Callable[[], Awaitable[T]],
        work: Work = Work.CLIENT,
        key: Hashable | None = None,
    ) -> T:
        """Run one Engine API call (`make()`) as `op`, once `work` may start (or what
        `promote(key, ...)` made it meanwhile)."""
        async with self.engine.turn(work, key), self._engine_wide_slot(work):
            started = self.clock.now()
            try:
                return await make()
            except DockerError as e:
                raise DockerOpError(op, _error_kind(op, e), str(e.message)) from e
            except StartFailed as e:
                raise DockerOpError(op, "start_failed", str(e)) from e
            except (aiohttp.ClientError, OSError) as e:
                raise DockerOpError(op, "engine_unreachable", str(e)) from e
            finally:
                took = self.clock.now() - started
                self.observe(op, took)
                if work in CREATES:
                    self.engine.creates.observe(took, self.engine.creating())
        raise AssertionError("unreachable")  # the context manager never swallows

    def _engine_wide_slot(self, work: Work) -> contextlib.AbstractAsyncContextManager:
        """A create's slot among every create on this engine, from whichever agent."""
        if work in CREATES and self.engine_wide is not None:
            return self.engine_wide.slot(self.engine.creates.limit)
        return contextlib.nullcontext()

    def _container(self, container_id: str) -> aiodocker.containers.DockerContainer:
        return self.api.containers.container(container_id)

    async def create(
        self,
        name: str,
        spec: TemplateSpec,
        labels: dict[str, str],
        work: Work,
        resident_dir: Path | None = None,
        entrypoint: list[str] | None = None,
        user: str | None = None,
    ) -> str:
        """Create and start a sandbox container whose commands run as `user` (None: its
        template's)."""
        config = container_config(spec, labels, user or spec.user, resident_dir, entrypoint)

        async def create_and_start() -> str:
            container = await self.api.containers.create(config, name=name)
            try:
                await container.start()
            except DockerError as e:
                with contextlib.suppress(DockerError, aiohttp.ClientError, OSError):
                    await container.delete(force=True, v=True)
                if e.status == ENGINE_UNREACHABLE:
                    raise
                raise StartFailed(str(e.message)) from e
            return container.id

        return await self.call("create", create_and_start, work)

    async def image_entrypoint(self, image: str) -> list[str]:
        """The entrypoint `image` names (none: []), read from the engine once per image
        name: a sandbox that starts its own command loop puts it after the loop's boot.
        An image rebuilt under the same name with another entrypoint needs the agent
        restarted. One quick read per image, so it waits for no turn (Work.CLIENT), nor
        counts as a create's time."""
        if image not in self.entrypoints:
            info = await self.call("image_inspect", lambda: self.api.images.inspect(image))
            self.entrypoints[image] = list(info.get("Config", {}).get("Entrypoint") or [])
        return self.entrypoints[image]

    async def pause(self, container_id: str) -> None:
        await self.call("pause", self._container(container_id).pause, Work.FREEZE)

    async def unpause(self, container_id: str, work: Work) -> None:
        await self.call("unpause", self._container(container_id).unpause, work)

    async def death_of(self, container_id: str) -> NodeLostCause | None:
        """None while the container runs (or is paused); else how it died: killed for its
        memory use past its limit, or any other way (a kill, a removal, from outside)."""
        try:
            state = (await self.call("inspect", self._container(container_id).show))["State"]
        except DockerOpError as e:
            if e.kind == "not_found":
                return "container_died"
            raise
        if state["Running"]:
            return None
        return "oom_killed" if state.get("OOMKilled") else "container_died"

    async def remove(self, container_id: str, work: Work = Work.REMOVE) -> None:
        try:
            delete = self._container(container_id).delete
            await self.call("remove", lambda: delete(force=True, v=True), work)
        except DockerOpError as e:
            if e.kind != "not_found":  # already gone: removing is idempotent
                raise

    async def init_pid(self, container_id: str) -> int | None:
        """The host's PID of the container's init; None when it is not running, or
        frozen."""
        state = (await self.call("inspect", self._container(container_id).show))["State"]
        return state["Pid"] if state["Running"] and not state["Paused"] else None

    async def kill(self, container_id: str) -> None:
        """Stop a container at once: its processes end and release CPU and memory; the
        container itself stays until it is removed.

        The engine's kill (with SIGKILL) runs a runc process and then waits until the
        container is seen to stop: under a burst's creates, half a second a release
        waits. So the container's init is killed from here instead, as the engine would
        have: with it goes every process of its PID namespace. The engine's own kill is
        what remains where that cannot be done (an agent without the host's PIDs)."""
        try:
            pid = await self.init_pid(container_id)
            if pid is None:
                return  # not running, nothing to stop; a frozen one is removed instead
            if await kill_pid_namespace(pid, container_id):
                return
            await self.call("kill", self._container(container_id).kill)
        except DockerOpError as e:
            # gone already, or not running (exited, or paused): nothing runs to stop
            if e.kind not in ("not_found", "conflict"):
                raise

    async def commit(self, container_id: str, repository: str, tag: str) -> str:
        container = self._container(container_id)
        await self.call(
            "commit",
            lambda: container.commit(repository=repository, tag=tag, pause=False),
            Work.FREEZE,
        )
        return f"{repository}:{tag}"

    async def remove_image(self, ref: str) -> None:
        try:
            await self.call(
                "remove_image", lambda: self.api.images.delete(ref, force=True), Work.REMOVE
            )
        except DockerOpError as e:
            if e.kind != "not_found":
                raise

    async def list_labelled(self, node_id: str, stopped: bool = False) -> list[ContainerSummary]:
        """This node's containers (`stopped`: only those that have stopped), in one call."""
        filters = {"label": [f"{LABEL_NODE}={node_id}"]}
        if stopped:
            filters["status"] = ["exited", "dead"]
        rows = await self.call("list", lambda: self.api.containers.list(all=True, filters=filters))
        return [
            ContainerSummary(c["Id"], c["State"], c._container.get("Labels") or {}) for c in rows
        ]

    async def ping(self) -> None:
        await self.call("ping", self.api.version)

    async def engine_id(self) -> str:
        """The engine's own id: agents that share an engine see the same."""
        info = await self.call("info", lambda: self.api.system.info())
        return str(info.get("ID") or "")

    async def image_tags(self) -> list[str]:
        images = await self.call("images", self.api.images.list)
        return sorted({t for img in images for t in (img.get("RepoTags") or [])})

    async def load_image(self, archive: Path) -> None:
        """`docker load` of the archive at `archive` (what `docker save` writes), read
        from the file as it is sent (aiohttp reads files in a thread). An archive the
        engine refuses (not a tar, cut short, a layer whose digest does not match)
        raises; the engine keeps nothing of it. A load holds a lifecycle slot while it
        runs, after what clients and creates wait for."""

        async def load() -> None:
            with await asyncio.to_thread(archive.open, "rb") as body:
                await self.api.images.import_image(data=body)

        await self.call("image_load", load, Work.FREEZE)

    # --- commands -----------------------------------------------------------------

    async def start(
        self,
        container_id: str,
        cmd: list[str],
        *,
        user: str,
        env: dict[str, str] | None = None,
        workdir: str | None = None,
        stdin: bool = False,
        tty: bool = False,
        work: Work = Work.CLIENT,
    ) -> Process:
        """Start `cmd` in the container as `user`, attached (named always: the
        container's own user may be KEEPER_USER)."""

        async def create_and_attach() -> Process:
            exec_ = await self._container(container_id).exec(
                cmd, stdin=stdin, tty=tty, environment=env or None, workdir=workdir, user=user
            )
            stream = exec_.start(detach=False)
            await stream.__aenter__()  # the command runs from here
            return Process(self, exec_, stream, tty)

        return await self.call("exec_start", create_and_attach, work)

    async def start_detached(
        self,
        container_id: str,
        cmd: list[str],
        *,
        user: str,
        work: Work,
        hold: Callable[[], contextlib.AbstractAsyncContextManager[bool]],
        key: Hashable | None = None,
    ) -> int | None:
        """Start `cmd` in the container and leave it running there; the host's PID of
        its process (0 where the engine does not tell it), or None when it was not
        started. `hold()` is entered once the engine admits the work and held until the
        exec has started; the exec starts only if it yields True. While it waits for
        the engine, `promote(key, ...)` may make it more urgent work. An exec that starts
        while the container is being paused hangs in the engine for good (runc joins a
        frozen cgroup), and so does everything after it on that container: the caller's
        hold keeps pauses out meanwhile."""

        async def create_and_start() -> int | None:
            async with hold() as may_start:
                if not may_start:
                    return None
                exec_ = await self._container(container_id).exec(cmd, user=user)
                await exec_.start(detach=True)
                return int((await exec_.inspect()).get("Pid") or 0)

        return await self.call("exec_detached", create_and_start, work, key)

    def promote(self, key: Hashable, to: Work) -> bool:
        """Make the call waiting under `key` `to` from now: EngineQueue.promote."""
        return self.engine.promote(key, to)

    async def run(
        self,
        op: str,
        container_id: str,
        cmd: list[str],
        *,
        user: str,
        stdin: bytes | None = None,
        cap: int = 1 << 20,
        work: Work = Work.CLIENT,
    ) -> tuple[int | None, bytes, bytes]:
        """Run the agent's own command to its end (a reset, an archive, a file's check),
        feeding it `stdin`; keep at most `cap` bytes of each stream. Timed as `op`."""
        started = self.clock.now()
        proc = await self.start(container_id, cmd, user=user, stdin=stdin is not None, work=work)
        try:
            if stdin is not None:
                await proc.write(stdin)
                proc.close_stdin()
            out, err = bytearray(), bytearray()
            while (chunk := await proc.read()) is not None:
                buf = out if chunk[0] == STDOUT else err
                buf += chunk[1][: max(0, cap - len(buf))]
            code = await proc.exit_code()
        finally:
            await proc.close()
            self.observe(op, self.clock.now() - started)
        return code, bytes(out), bytes(err)

    async def archive_dir(self, container_id: str, path: str, cap: int, user: str) -> bytes:
        """A tar of `path` inside the container, read through a command run as `user`:
        the Engine API's archive cannot see a tmpfs mount, which is where a sandbox's
        work dir lives."""
        tar = ["tar", "-C", path, "-cf", "-", "."]
        code, out, err = await self.run(
            "archive", container_id, tar, user=user, cap=cap + 1, work=Work.FREEZE
        )
        if code != 0 or len(out) > cap:
            raise DockerOpError("archive", "api_error", f"tar of {path} failed ({code}): {err!r}")
        return out

    async def restore_dir(self, container_id: str, path: str, archive: bytes, user: str) -> None:
        """Unpack a tar made by archive_dir into `path`, as `user`."""
        tar = ["tar", "-C", path, "-xf", "-"]
        code, _, err = await self.run("restore", container_id, tar, user=user, stdin=archive)
        if code != 0:
            raise DockerOpError(
                "restore", "api_error", f"untar into {path} failed ({code}): {err!r}"
            )

    async def close(self) -> None:
        if self._api is not None:
            await self._api.close()
            await self._api.connector.close()
            self._api = None
