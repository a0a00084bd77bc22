"""The async client SDK.

    async with Client(url, token=...) as client:
        async with client.sandbox(pool="default", template="base") as sb:
            result = await sb.exec(["sh", "-c", "echo hi"], timeout=10)
            async for chunk in sb.exec_stream(["sh", "-c", "echo out; echo err >&2"]):
                print(chunk.stream, chunk.data)
            await sb.files.write("/work/data.bin", b"\\x00\\xff")

Acquire and release go to the control plane; exec and files go straight to the agent
that owns the sandbox, over the same pooled connections, with the lease's token. An
acquire carries an idempotency key and is retried on connection errors with the same
key, so a retry gets the same sandbox rather than a second one. `sandbox()` releases on
exit, on error and on cancellation. Every error answer becomes a DsecError. The
synchronous twin, SyncClient (dsec/sync_client.py), runs this client on a loop of its own.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import posixpath
import stat
import tarfile
import tempfile
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Callable
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal, TypeVar, get_args
from urllib.parse import quote

import aiohttp
from pydantic import BaseModel

from dsec.archives import tar_of_files
from dsec.clock import Clock, SystemClock
from dsec.httpkit import form_body
from dsec.models import (
    ACQUIRE_FILE_PART,
    ACQUIRE_PART,
    ACQUIRE_TAR_PART,
    INFRA_FAULTS,
    MAX_STREAM_OUTPUT_BYTES,
    AcquireRequest,
    ExecExit,
    ExecRequest,
    ExecResult,
    ExecStreamRequest,
    FileInfo,
    FileList,
    FileRemoved,
    Forked,
    ForkRequest,
    Lease,
    LeaseRenewed,
    LeaseStatus,
    NodeInfo,
    NodeList,
    NodeLostCause,
    PoolInfo,
    PoolList,
    PoolParams,
    PoolPatch,
    PrewarmInfo,
    PrewarmRequest,
    Released,
    SandboxInfo,
    SandboxList,
    TemplateBody,
    TemplateInfo,
    TemplateList,
    TemplateRemoved,
    TemplateSpec,
)
from dsec.tls import client_ssl
from dsec.tokens import LEASE_TOKEN_HEADER

DEFAULT_URL = "http://127.0.0.1:8700"
M = TypeVar("M", bound=BaseModel)

# A transfer may take as long as it needs, but not sit this long without a byte moving.
TRANSFER_IDLE_TIMEOUT_S = 120.0
# waits before asking an agent again that answered 503 not_joined (about 10 s in all)
NOT_JOINED_RETRIES_S = (0.1, 0.2, 0.4, 0.8, 1.5, 3.0, 4.0)
TRANSFER_CHUNK_BYTES = 1 << 16
# The first byte of a streaming exec's binary message says whose output the rest is.
STREAM_OF_TAG: dict[int, Literal["stdout", "stderr"]] = {1: "stdout", 2: "stderr"}
# aiohttp drops the body of a refused WebSocket upgrade before its caller sees the
# error; a trace hook (same task, so the same context) keeps it here, for the DsecError.
_REFUSED_UPGRADE_BODY: ContextVar[bytes | None] = ContextVar("refused_upgrade", default=None)


async def _keep_refused_upgrade_body(
    session: aiohttp.ClientSession, ctx: Any, params: aiohttp.TraceRequestEndParams
) -> None:
    if params.response.status >= 400 and params.headers.get("Upgrade", "").lower() == "websocket":
        _REFUSED_UPGRADE_BODY.set(await params.response.read())


Body = bytes | AsyncIterable[bytes] | IO[bytes]


class DsecError(Exception):
    """An error answer from dsec: the HTTP status, a machine-readable code, a message."""

    def __init__(self, status: int, code: str, message: str, details: Any = None) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message, self.details = status, code, message, details


class SandboxLost(DsecError):
    """A call on a lease that has ended under its client (not by its own release).

    `cause` is how it ended (docs/contracts.md, "Lease outcomes": node_lost,
    engine_lost, container_died, oom_killed, evicted, expired, idle_timeout);
    `infra_fault` is whether that was the infrastructure's doing, not the workload's or
    the pool's limits: a sample cut short by one says nothing of the policy that ran it,
    so a trainer masks it (`except SandboxLost as e: if e.infra_fault: ...`). The
    status and code are those of the answer that showed it (410 sandbox_lost, 409
    sandbox_exited, ...)."""

    def __init__(self, said: DsecError, cause: str, message: str | None = None) -> None:
        super().__init__(said.status, said.code, message or said.message, said.details)
        self.cause = cause
        self.infra_fault = cause in INFRA_FAULTS


# an answer from a sandbox's node that may mean its lease has ended: gone (410), its
# container dead (409 sandbox_exited), or its node or engine failing (502, 503)
_MAY_BE_LOST = frozenset({410, 502, 503})
# past its lost_within_s, how long a client that cannot reach a lease's node still asks
# whether it ended (an engine restarting takes some seconds to come back and be seen)
LOST_MARGIN_S = 30.0
LOST_POLL_S = 0.5
_NODE_CAUSES = frozenset(get_args(NodeLostCause))  # what a node tells of a sandbox it lost


@dataclass(frozen=True)
class ExecOutput:
    """What a command did: its exit code and its output, as bytes and as text."""

    exit_code: int  # 124 when it timed out
    stdout_bytes: bytes
    stderr_bytes: bytes
    timed_out: bool
    truncated: bool  # output went past max_output_bytes; the rest was dropped
    duration_ms: float

    @property
    def stdout(self) -> str:
        return self.stdout_bytes.decode("utf-8", "replace")

    @property
    def stderr(self) -> str:
        return self.stderr_bytes.decode("utf-8", "replace")

    @classmethod
    def from_result(cls, result: ExecResult) -> ExecOutput:
        if result.encoding == "base64":
            out, err = base64.b64decode(result.stdout), base64.b64decode(result.stderr)
        else:  # an agent that answers text (undecodable bytes already replaced)
            out, err = result.stdout.encode(), result.stderr.encode()
        return cls(
            exit_code=result.exit_code,
            stdout_bytes=out,
            stderr_bytes=err,
            timed_out=result.timed_out,
            truncated=result.truncated,
            duration_ms=result.duration_ms,
        )


@dataclass(frozen=True)
class ExecChunk:
    """Output of a streaming exec, as it was written: on a terminal (tty) all is stdout."""

    stream: Literal["stdout", "stderr"]
    data: bytes

    @property
    def text(self) -> str:
        return self.data.decode("utf-8", "replace")


class ExecStream:
    """A command whose output arrives as it is written, and which may take input.

    Both an async iterator of ExecChunk and an async context manager:

        async for chunk in sb.exec_stream(["make"]):
            ...
        async with sb.exec_stream(["cat"], stdin=True) as st:
            await st.write(b"hi")
            await st.close_stdin()
            async for chunk in st:
                ...
        st.exit_code

    The connection opens on first use and closes when the command's exit arrives, when
    the `async with` block ends, or on `close()` (the agent then ends a command still
    running). An iteration left early without `async with` keeps it open until close().
    """

    def __init__(
        self,
        sandbox: Sandbox,
        request: ExecStreamRequest,
        on_chunk: Callable[[ExecChunk], None] | None = None,
    ) -> None:
        self.sandbox = sandbox
        self.request = request
        self.on_chunk = on_chunk
        self.exit: ExecExit | None = None  # the command's end, once it has arrived
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._opened = False
        self._ended = False  # the exit or an error arrived, or the connection is gone
        self._stdin_open = request.stdin
        self._refused_stdin = False  # the agent answered exec_finished to our input

    @property
    def exit_code(self) -> int | None:
        return self.exit.exit_code if self.exit else None

    @property
    def timed_out(self) -> bool | None:
        return self.exit.timed_out if self.exit else None

    @property
    def truncated(self) -> bool | None:
        return self.exit.truncated if self.exit else None

    @property
    def duration_ms(self) -> float | None:
        return self.exit.duration_ms if self.exit else None

    async def __aenter__(self) -> ExecStream:
        async with self.sandbox._lost_as_such():
            await self._ensure_open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __aiter__(self) -> ExecStream:
        return self

    async def __anext__(self) -> ExecChunk:
        async with self.sandbox._lost_as_such():
            return await self._next()

    async def _next(self) -> ExecChunk:
        await self._ensure_open()
        try:
            while not self._ended:
                chunk = await self._receive()
                if chunk is not None:
                    if self.on_chunk is not None:
                        self.on_chunk(chunk)
                    return chunk
        except Exception:
            await self.close()  # an error ends the stream: its connection goes too
            raise
        await self.close()  # the exit came: free the connection, `async with` or not
        raise StopAsyncIteration

    async def wait(self) -> ExecExit:
        """Read to the end (chunks go to `on_chunk`, if any) and return the exit."""
        async for _ in self:
            pass
        if self.exit is None:
            raise DsecError(499, "stream_closed", "the stream was closed before the exit")
        return self.exit

    async def write(self, data: bytes) -> None:
        """Send bytes to the command's stdin (the stream must have `stdin=True`)."""
        await self._ensure_open()
        self._check_stdin()
        await self._send(lambda ws: ws.send_bytes(bytes(data)))

    async def close_stdin(self) -> None:
        """End the command's input (EOF); a no-op once stdin is closed or the command ended."""
        await self._ensure_open()
        if not self._stdin_open or self._ended:
            return
        self._stdin_open = False
        await self._send(lambda ws: ws.send_str(json.dumps({"type": "stdin_eof"})))

    async def resize(self, rows: int, cols: int) -> None:
        """Tell the command's terminal (`tty=True`) its new size."""
        await self._ensure_open()
        if self._ended or not self.request.tty:
            return
        await self._send(
            lambda ws: ws.send_str(json.dumps({"type": "resize", "rows": rows, "cols": cols}))
        )

    async def close(self) -> None:
        self._ended = True
        if self._ws is not None and not self._ws.closed:
            await self._ws.close()

    # --- the protocol ---------------------------------------------------------------

    async def _ensure_open(self) -> None:
        if self._opened:
            return
        self._opened = True
        sb = self.sandbox
        url = f"{sb.lease.agent_url}/v1/sandboxes/{sb.id}/exec/stream"
        _REFUSED_UPGRADE_BODY.set(None)
        self._ended = True  # until connected: a failed open leaves nothing to read
        try:
            self._ws = await sb.client._session().ws_connect(
                url,
                headers={"Authorization": f"Bearer {sb.lease.lease_token}"},
                max_msg_size=0,  # chunks are the agent's to size
            )
        except aiohttp.WSServerHandshakeError as e:
            body = _REFUSED_UPGRADE_BODY.get()
            if body is None:
                raise DsecError(e.status, "http_error", f"no streaming exec: {e.message}") from None
            raise _error_from(e.status, body.decode("utf-8", "replace")) from None
        self._ended = False
        await self._ws.send_str(self.request.model_dump_json(exclude_none=True))

    async def _receive(self) -> ExecChunk | None:
        """The next chunk, or None after a control message (the exit ends the stream)."""
        assert self._ws is not None
        # the command ends by its timeout at the latest, and the agent then says so
        msg = await self._ws.receive(timeout=self.request.timeout_s + 30)
        if msg.type == aiohttp.WSMsgType.BINARY:
            stream = STREAM_OF_TAG.get(msg.data[0]) if msg.data else None
            return ExecChunk(stream, msg.data[1:]) if stream else None
        if msg.type == aiohttp.WSMsgType.TEXT:
            self._on_control(json.loads(msg.data))
            return None
        self._ended = True  # closed, or the connection failed
        if self.exit is None:
            raise DsecError(
                502,
                "stream_closed",
                f"the agent closed the stream before the command's exit "
                f"(close code {self._ws.close_code})",
            )
        return None

    def _on_control(self, message: dict) -> None:
        kind = message.get("type")
        if kind == "exit":
            self.exit = ExecExit.model_validate(message)
            self._ended = True
            return
        if kind != "error":
            return  # a message type this client does not know: nothing to do
        if message.get("code") == "exec_finished":
            self._refused_stdin = True  # input that crossed the exit: the exit follows
            return
        self._ended = True
        raise DsecError(
            int(message.get("status", 502)),
            str(message.get("code", "stream_error")),
            str(message.get("message", "the agent ended the stream with an error")),
        )

    def _check_stdin(self) -> None:
        if self._ended or self._refused_stdin:
            raise DsecError(409, "exec_finished", "the command has ended; it takes no input")
        if not self._stdin_open:
            state = "closed" if self.request.stdin else "not open (stdin=False)"
            raise DsecError(409, "stdin_closed", f"the command's stdin is {state}")

    async def _send(self, send: Callable[[aiohttp.ClientWebSocketResponse], Any]) -> None:
        assert self._ws is not None
        try:
            await send(self._ws)
        except (ConnectionResetError, aiohttp.ClientConnectionError) as e:
            raise DsecError(409, "exec_finished", f"the command's stream is closed: {e}") from e


class SandboxFiles:
    """Files in a sandbox's /work and /tmp, byte for byte: `sb.files`."""

    def __init__(self, sandbox: Sandbox) -> None:
        self.sandbox = sandbox

    async def write(self, path: str, data: Body, mode: int | None = None) -> FileInfo:
        """Create or replace a file; `data` is bytes, an open binary file or an async
        iterable of bytes (sent as it comes). `mode` is its permission bits, e.g. 0o755."""
        query = {"path": path} if mode is None else {"path": path, "mode": str(mode)}
        async with self._request("PUT", "", query, data) as resp:
            return FileInfo.model_validate_json(await resp.read())

    async def read(self, path: str) -> bytes:
        async with self._request("GET", "", {"path": path}) as resp:
            return await resp.read()

    async def list(self, path: str = "/work") -> list[FileInfo]:
        async with self._request("GET", "/list", {"path": path}) as resp:
            return FileList.model_validate_json(await resp.read()).entries

    async def remove(self, path: str) -> FileRemoved:
        """Remove a file, or a directory with everything in it."""
        async with self._request("DELETE", "", {"path": path}) as resp:
            return FileRemoved.model_validate_json(await resp.read())

    async def write_tar(self, directory: str, tar: Body) -> FileInfo:
        """Unpack a tar archive into `directory` (created if missing)."""
        async with self._request("PUT", "/tar", {"path": directory}, tar) as resp:
            return FileInfo.model_validate_json(await resp.read())

    async def read_tar(self, directory: str) -> bytes:
        """`directory`'s contents as a tar archive."""
        async with self._request("GET", "/tar", {"path": directory}) as resp:
            return await resp.read()

    async def is_dir(self, path: str) -> bool:
        """Whether `path` is a directory in the sandbox (False when it does not exist)."""
        path = posixpath.normpath(path)
        parent, name = posixpath.split(path)
        try:
            entries = await self.list(parent)
        except DsecError as e:
            if e.code == "path_outside_workdir":  # /work and /tmp themselves, or outside
                return await self._lists(path)
            if e.status == 404:  # no parent, so no such directory
                return False
            raise
        return any(e.name == name and e.type == "dir" for e in entries)

    async def _lists(self, path: str) -> bool:
        try:
            await self.list(path)
        except DsecError:
            return False
        return True

    async def upload(self, local_path: str | os.PathLike, remote_path: str) -> FileInfo:
        """Copy a local file or directory to `remote_path`, which names the copy (a
        directory's contents go into it, through tar)."""
        local = Path(local_path)
        if local.is_dir():
            with tempfile.TemporaryFile() as spool:
                await asyncio.to_thread(_tar_contents, local, spool)
                spool.seek(0)
                return await self.write_tar(remote_path, spool)
        with local.open("rb") as f:
            return await self.write(remote_path, f, mode=stat.S_IMODE(local.stat().st_mode))

    async def download(self, remote_path: str, local_path: str | os.PathLike) -> Path:
        """Copy a file or directory of the sandbox to `local_path`, which names the copy
        (a directory's contents go into it). Archive members that would land outside it
        (absolute paths, `..`, links out) are refused."""
        local = Path(local_path)
        if await self.is_dir(remote_path):
            with tempfile.TemporaryFile() as spool:
                await self._fetch("/tar", remote_path, spool)
                spool.seek(0)
                await asyncio.to_thread(_untar_into, spool, local)
            return local
        # beside it, then renamed: a failed copy leaves neither a part nor a file clobbered
        part = local.with_name(f".{local.name}.dsec-part")
        try:
            with part.open("wb") as f:
                await self._fetch("", remote_path, f)
            part.replace(local)
        finally:
            part.unlink(missing_ok=True)
        return local

    async def _fetch(self, route: str, path: str, into: IO[bytes]) -> None:
        async with self._request("GET", route, {"path": path}) as resp:
            async for chunk in resp.content.iter_chunked(TRANSFER_CHUNK_BYTES):
                into.write(chunk)

    @asynccontextmanager
    async def _request(
        self, method: str, route: str, query: dict[str, str], data: Body | None = None
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        sb = self.sandbox
        async with (
            sb._lost_as_such(),
            sb.client._request(
                method,
                f"{sb.lease.agent_url}/v1/sandboxes/{sb.id}/files{route}",
                token=sb.lease.lease_token,
                params=query,
                data=data,
                timeout=aiohttp.ClientTimeout(
                    total=None, sock_connect=30, sock_read=TRANSFER_IDLE_TIMEOUT_S
                ),
            ) as resp,
        ):
            yield resp


def _tar_contents(directory: Path, into: IO[bytes]) -> None:
    with tarfile.open(fileobj=into, mode="w") as tar:
        for child in sorted(directory.iterdir()):
            tar.add(child, arcname=child.name)


def _untar_into(archive: IO[bytes], directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=archive, mode="r:*") as tar:
        # "data": the archive comes from inside a sandbox; nothing may land outside
        tar.extractall(directory, filter="data")


class Sandbox:
    def __init__(self, client: Client, lease: Lease) -> None:
        self.client = client
        self.lease = lease
        self.files = SandboxFiles(self)

    @property
    def id(self) -> str:
        return self.lease.id

    @property
    def node(self) -> str:
        return self.lease.node

    @asynccontextmanager
    async def _lost_as_such(self) -> AsyncIterator[None]:
        """A call on this sandbox whose failure comes from its lease having ended under
        it raises SandboxLost, with how it ended; any other failure is raised as it is."""
        try:
            yield
        except SandboxLost:
            raise
        except DsecError as e:
            if e.status not in _MAY_BE_LOST and e.code != "sandbox_exited":
                raise
            # a node that could not say how (a dead container it has not yet dropped, or
            # its engine failing) leaves it to the control plane, which learns it soon
            lost = await self._lost_by(e, wait=e.status >= 500 or e.code == "sandbox_exited")
            if lost is None:
                raise
            raise lost from e
        except aiohttp.ClientConnectionError as e:
            said = DsecError(502, "node_unreachable", f"{self.lease.agent_url}: {e}")
            lost = await self._lost_by(said, wait=True)
            if lost is None:
                raise
            raise lost from e

    async def _lost_by(self, said: DsecError, wait: bool) -> SandboxLost | None:
        """How the lease ended, if `said` (a failed call on it) comes from its end: the
        node's own word, or the control plane's; `wait`: the node could not say, so ask
        until the control plane has had time to find its node lost."""
        for detail in said.details if isinstance(said.details, list) else []:
            if isinstance(detail, dict) and detail.get("outcome") in _NODE_CAUSES:
                return SandboxLost(said, detail["outcome"])
        deadline = None
        while True:
            try:
                status = await self.client.lease_status(self.lease.lease_id)
            except (DsecError, aiohttp.ClientError, TimeoutError):
                return None  # the control plane cannot say either: the call's own error
            if status.ended:
                if status.outcome in (None, "released"):
                    return None  # its client's own doing
                why = f"{said.message} (its lease ended: {status.outcome}, {status.message})"
                return SandboxLost(said, status.outcome, why)
            now = asyncio.get_running_loop().time()
            deadline = deadline or now + status.lost_within_s + LOST_MARGIN_S
            if not wait or now >= deadline:
                return None
            await asyncio.sleep(LOST_POLL_S)

    async def exec(
        self,
        cmd: list[str],
        timeout: float = 60.0,
        max_output_bytes: int = 1024 * 1024,
        env: dict[str, str] | None = None,
        workdir: str | None = None,
    ) -> ExecOutput:
        """Run a command to its end (no stdin); output past `max_output_bytes` per stream
        is dropped (`truncated`). For more, or for output as it comes, use exec_stream."""
        body = ExecRequest(
            cmd=cmd,
            timeout_s=timeout,
            max_output_bytes=max_output_bytes,
            env=env or {},
            workdir=workdir,
            encoding="base64",  # bytes as they are: the SDK decodes the text itself
        )
        async with self._lost_as_such():
            result = await self.client._call(
                "POST",
                f"{self.lease.agent_url}/v1/sandboxes/{self.id}/exec",
                ExecResult,
                body,
                token=self.lease.lease_token,
                timeout=timeout + 30,
            )
        return ExecOutput.from_result(result)

    async def shell(self, script: str, timeout: float = 60.0, **kw: Any) -> ExecOutput:
        """Run a shell command line: `exec(["sh", "-c", script])`."""
        return await self.exec(["sh", "-c", script], timeout, **kw)

    def exec_stream(
        self,
        cmd: list[str],
        timeout: float = 60.0,
        *,
        stdin: bool = False,
        tty: bool = False,
        env: dict[str, str] | None = None,
        workdir: str | None = None,
        rows: int = 24,
        cols: int = 80,
        max_output_bytes: int = MAX_STREAM_OUTPUT_BYTES,
        on_chunk: Callable[[ExecChunk], None] | None = None,
    ) -> ExecStream:
        """A command whose output arrives as it is written (see ExecStream): iterate it,
        or pass `on_chunk` and `await stream.wait()`. Output past `max_output_bytes` per
        stream is dropped (`truncated`)."""
        request = ExecStreamRequest(
            cmd=cmd,
            timeout_s=timeout,
            env=env or {},
            workdir=workdir,
            stdin=stdin,
            tty=tty,
            rows=rows,
            cols=cols,
            max_output_bytes=max_output_bytes,
        )
        return ExecStream(self, request, on_chunk)

    async def renew(self) -> LeaseRenewed:
        """Tell the pool this lease's client is alive, so its idle timeout starts again
        (a `sandbox()` block does it by itself)."""
        return await self.client.renew(self.id)

    async def release(self) -> Released:
        return await self.client.release(self.id, self.lease.lease_token)

    async def fork(
        self,
        n: int,
        pool: str | None = None,
        timeout: float = 60.0,
        labels: dict[str, str] | None = None,
    ) -> list[Sandbox]:
        """`n` new sandboxes, each on a lease of its own, whose work dir and /tmp are
        copies of this one's as they are now (its processes and memory are not copied;
        commands running now may or may not have written what is copied). All or none:
        a fork that fails leaves no lease. Release each one, as any acquired sandbox."""
        forked = await self.client.fork(
            self.id, self.lease.lease_token, n, pool=pool, timeout=timeout, labels=labels
        )
        return [Sandbox(self.client, lease) for lease in forked.leases]


class Client:
    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        acquire_retries: int = 3,
        connection_limit: int = 512,
        ca: str | Path | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.url = (url or os.environ.get("DSEC_URL") or DEFAULT_URL).rstrip("/")
        self.clock = clock or SystemClock()  # what an acquire's files are dated
        self.token = token if token is not None else os.environ.get("DSEC_TOKEN", "")
        # the CA bundle an https pool is verified with (its agents too); None: the system's
        self.ca = ca or os.environ.get("DSEC_CA") or None
        self.acquire_retries = acquire_retries
        self.connection_limit = connection_limit
        self._http: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Client:
        refusals = aiohttp.TraceConfig()
        refusals.on_request_end.append(_keep_refused_upgrade_body)
        self._http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=self.connection_limit, limit_per_host=0, ssl=client_ssl(self.ca)
            ),
            trace_configs=[refusals],
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None:
            raise RuntimeError("use the Client as `async with Client(...) as client:`")
        return self._http

    @asynccontextmanager
    async def _request(
        self,
        method: str,
        url: str,
        *,
        token: str | None = None,
        params: dict[str, str] | None = None,
        data: Body | str | None = None,
        headers: dict[str, str] | None = None,
        timeout: aiohttp.ClientTimeout,
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """A response with a 2xx status, its body unread; any other raises DsecError."""
        headers = {
            **(headers or {}),
            "Authorization": f"Bearer {token if token is not None else self.token}",
        }
        async with self._session().request(
            method, url, params=params, data=data, headers=headers, timeout=timeout
        ) as resp:
            if resp.status >= 300:
                raise _error_from(resp.status, (await resp.read()).decode("utf-8", "replace"))
            yield resp

    async def _call(
        self,
        method: str,
        url: str,
        answer: type[M],
        body: BaseModel | aiohttp.MultipartWriter | None = None,
        *,
        token: str | None = None,
        timeout: float = 60.0,
        headers: dict[str, str] | None = None,
    ) -> M:
        headers = dict(headers or {})
        data: str | aiohttp.MultipartWriter | None = None
        if isinstance(body, BaseModel):
            data = body.model_dump_json(exclude_none=True)
            headers["Content-Type"] = "application/json"
        elif body is not None:
            data = body  # (a form says its own type)
        for wait_s in (*NOT_JOINED_RETRIES_S, None):
            try:
                async with self._request(
                    method,
                    url,
                    token=token,
                    data=data,
                    headers=headers,
                    timeout=aiohttp.ClientTimeout(total=timeout),
                ) as resp:
                    return answer.model_validate_json(await resp.read())
            except DsecError as e:
                # an agent that has just (re)started and not yet joined its control plane:
                # nothing ran, so asking again a moment later is safe
                if e.code != "not_joined" or wait_s is None:
                    raise
                await asyncio.sleep(wait_s)
        raise AssertionError("unreachable")  # the last try returns or raises

    async def acquire(
        self,
        pool: str = "default",
        template: str = "base",
        *,
        priority: int = 0,
        timeout: float = 30.0,
        idempotency_key: str | None = None,
        labels: dict[str, str] | None = None,
        env: dict[str, str] | None = None,
        files: dict[str, bytes] | bytes | None = None,
        setup: list[str] | None = None,
    ) -> Sandbox:
        """A sandbox from `pool`; `env`, `files` ({path in the work dir: bytes}, or an
        uncompressed tar's bytes) and `setup` (argv) make it the caller's own before it
        is answered, and it is still a warm one (docs/contracts.md, "Personalised
        claims"). A failed setup raises DsecError 422 `setup_failed` with its output."""
        request = AcquireRequest(
            pool=pool,
            template=template,
            priority=priority,
            timeout_s=timeout,
            idempotency_key=idempotency_key or uuid.uuid4().hex,
            labels=labels or {},
            env=env or {},
            setup=setup,
        )
        parts = self._files_parts(files)

        def body(attempt: int) -> AcquireRequest | aiohttp.MultipartWriter:
            # a key made here is new on its first send, never on a retry of it
            sent = request.model_copy(update={"new_key": idempotency_key is None and not attempt})
            if not parts:
                return sent
            # files go as a form's parts, their bytes as they are (no base64 on any hop)
            first = (ACQUIRE_PART, None, sent.model_dump_json(exclude_none=True))
            return form_body([first, *parts])

        for attempt in range(self.acquire_retries + 1):
            try:
                lease = await self._call(
                    "POST", f"{self.url}/v1/sandboxes", Lease, body(attempt), timeout=timeout + 10
                )
                return Sandbox(self, lease)
            except (aiohttp.ClientConnectionError, TimeoutError):
                if attempt == self.acquire_retries:
                    raise
                await asyncio.sleep(0.2 * 2**attempt)  # same key: the same sandbox comes back
        raise AssertionError("unreachable")

    def _files_parts(
        self, files: dict[str, bytes] | bytes | None
    ) -> list[tuple[str, str | None, bytes]]:
        """An acquire's files as its form's parts after the request: one tar, which the
        control plane checks and passes on as it is (a part per file costs it far more
        CPU to read, and a tar to build: 5 ms of a 1 MiB claim of 16 files, measured);
        a part per file only where a path is absolute or not a plain file's (`a/`), for
        the control plane to check against the template's work dir, which only it knows."""
        if not files:
            return []
        if not isinstance(files, dict):
            return [(ACQUIRE_TAR_PART, None, files)]
        if any(not path or path[0] == "/" or path[-1] == "/" for path in files):
            return [(ACQUIRE_FILE_PART, path, data) for path, data in files.items()]
        return [(ACQUIRE_TAR_PART, None, tar_of_files(files, self.clock.wall()))]

    async def lease(self, sandbox_id: str) -> Sandbox:
        """A sandbox this client holds (an operator: any leased one), acquired here or
        in another process, ready for exec and files."""
        lease = await self._call("GET", f"{self.url}/v1/sandboxes/{sandbox_id}/lease", Lease)
        return Sandbox(self, lease)

    async def release(self, sandbox_id: str, lease_token: str | None = None) -> Released:
        headers = {LEASE_TOKEN_HEADER: lease_token} if lease_token else None
        return await self._call(
            "DELETE", f"{self.url}/v1/sandboxes/{sandbox_id}", Released, headers=headers
        )

    async def fork(
        self,
        sandbox_id: str,
        lease_token: str | None,
        count: int,
        pool: str | None = None,
        timeout: float = 60.0,
        labels: dict[str, str] | None = None,
    ) -> Forked:
        """`POST /v1/sandboxes/{id}/fork` (Sandbox.fork is the usual way); `lease_token`
        None for an operator's token, which may fork any leased sandbox."""
        headers = {LEASE_TOKEN_HEADER: lease_token} if lease_token else None
        body = ForkRequest(count=count, pool=pool, timeout_s=timeout, labels=labels or {})
        return await self._call(
            "POST",
            f"{self.url}/v1/sandboxes/{sandbox_id}/fork",
            Forked,
            body,
            timeout=timeout + 30,
            headers=headers,
        )

    @asynccontextmanager
    async def sandbox(
        self, pool: str = "default", template: str = "base", **kw: Any
    ) -> AsyncIterator[Sandbox]:
        sb = await self.acquire(pool, template, **kw)
        renewing = asyncio.ensure_future(self._keep_renewed(sb))
        try:
            yield sb
        finally:
            renewing.cancel()
            # shielded: a cancelled caller still gives its sandbox back
            await asyncio.shield(self._release_quietly(sb.id, sb.lease.lease_token))

    async def _keep_renewed(self, sb: Sandbox) -> None:
        """Renew the lease three times per idle timeout while the block is open, so a
        client that thinks for long keeps it, and one that died loses it."""
        every = sb.lease.lease_idle_timeout_s
        while every is not None:
            await asyncio.sleep(every / 3)
            try:
                every = (await sb.renew()).idle_timeout_s
            except DsecError as e:
                if e.status in (404, 409, 410):
                    return  # released or expired: nothing left to keep
                # the control plane erred: try again well before the timeout
            except (aiohttp.ClientError, TimeoutError):
                pass  # unreachable for now: the same
        # no idle timeout in its pool: nothing to renew

    async def renew(self, sandbox_id: str) -> LeaseRenewed:
        return await self._call("POST", f"{self.url}/v1/sandboxes/{sandbox_id}/renew", LeaseRenewed)

    async def _release_quietly(self, sandbox_id: str, lease_token: str) -> None:
        try:
            await self.release(sandbox_id, lease_token)
        except DsecError as e:
            if e.code not in ("already_released", "unknown_sandbox", "lease_expired"):
                raise

    async def lease_status(self, lease_id: str) -> LeaseStatus:
        """A lease this client holds or held, running or ended, and how it ended (kept an
        hour past its end)."""
        return await self._call("GET", f"{self.url}/v1/leases/{lease_id}", LeaseStatus)

    async def get(self, sandbox_id: str) -> SandboxInfo:
        return await self._call("GET", f"{self.url}/v1/sandboxes/{sandbox_id}", SandboxInfo)

    async def list(self, pool: str | None = None) -> list[SandboxInfo]:
        query = f"?pool={pool}" if pool else ""
        answer = await self._call("GET", f"{self.url}/v1/sandboxes{query}", SandboxList)
        return answer.sandboxes

    async def nodes(self) -> NodeList:
        return await self._call("GET", f"{self.url}/v1/nodes", NodeList)

    async def drain_node(self, node_id: str) -> NodeInfo:
        """Drain a node (admin token): no new sandboxes there, its idle ones removed, its
        leases run to their end; its `drain` reads "drained" once it may go."""
        url = f"{self.url}/v1/nodes/{quote(node_id, safe='')}/drain"
        return await self._call("POST", url, NodeInfo)

    async def undrain_node(self, node_id: str) -> NodeInfo:
        """Call a node's drain off (admin token): it takes new sandboxes again."""
        url = f"{self.url}/v1/nodes/{quote(node_id, safe='')}/drain"
        return await self._call("DELETE", url, NodeInfo)

    async def pools(self) -> PoolList:
        return await self._call("GET", f"{self.url}/v1/pools", PoolList)

    async def pool(self, name: str) -> PoolInfo:
        for info in (await self.pools()).pools:
            if info.name == name:
                return info
        raise DsecError(404, "unknown_pool", f"no pool named {name!r}")

    async def set_pool(self, name: str, params: PoolParams) -> PoolInfo:
        """Replace all of a pool's parameters (admin token)."""
        return await self._call("PUT", f"{self.url}/v1/pools/{name}", PoolInfo, params)

    async def patch_pool(self, name: str, **fields: Any) -> PoolInfo:
        """Change only the named parameters of a pool (admin token), e.g.
        `patch_pool("train", min_warm=8, recycle=True)`. An unknown name raises
        pydantic's ValidationError here; a bad value or pair, DsecError 422."""
        body = PoolPatch.model_validate(fields)
        return await self._call("PATCH", f"{self.url}/v1/pools/{name}", PoolInfo, body)

    async def templates(self) -> list[TemplateInfo]:
        """Every template: its settings, the pools keeping it warm, the nodes holding its
        image, its sandboxes by state."""
        return (await self._call("GET", f"{self.url}/v1/templates", TemplateList)).templates

    async def template(self, name: str) -> TemplateInfo:
        return await self._call("GET", self._template_url(name), TemplateInfo)

    async def put_template(
        self, name: str, spec: TemplateSpec | TemplateBody | dict[str, Any]
    ) -> TemplateInfo:
        """Add or change a template live (admin token): `spec` is a TemplateSpec, or a dict
        of its fields (its name may be left out). A change retires the old one's sandboxes:
        its idle ones go, its leases run to their end. A field pydantic refuses raises its
        ValidationError here; an image no node holds, DsecError 422."""
        fields = spec if isinstance(spec, dict) else spec.model_dump(exclude_unset=True)
        body = TemplateBody.model_validate(fields)
        return await self._call("PUT", self._template_url(name), TemplateInfo, body)

    async def delete_template(self, name: str) -> TemplateRemoved:
        """Remove a template live (admin token): its idle sandboxes go, its leases run to
        their end; DsecError 409 while a pool keeps it warm."""
        return await self._call("DELETE", self._template_url(name), TemplateRemoved)

    def _template_url(self, name: str) -> str:
        return f"{self.url}/v1/templates/{quote(name, safe='')}"

    async def prewarm(
        self,
        pool: str,
        count: int,
        within_s: float,
        hold_s: float = 60.0,
        *,
        template: str | None = None,
    ) -> PrewarmInfo:
        """Announce a burst: `count` sandboxes of `pool` warm within `within_s`, held
        `hold_s` more (the pool's first template unless `template` names one). A new
        prewarm replaces the pool's last; count 0 ends it. A count beyond the pool's
        max_warm or the nodes' room answers 422 saying what fits."""
        body = PrewarmRequest(count=count, within_s=within_s, hold_s=hold_s, template=template)
        return await self._call("POST", f"{self.url}/v1/pools/{pool}/prewarm", PrewarmInfo, body)


def _error_from(status: int, text: str) -> DsecError:
    try:
        err = json.loads(text)["error"]
        return DsecError(status, err["code"], err["message"], err.get("details"))
    except (ValueError, KeyError, TypeError):
        return DsecError(status, "http_error", text[:500])
