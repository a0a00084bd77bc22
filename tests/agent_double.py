"""A stand-in for one agent's data plane, for SDK and CLI tests that need no Docker.

It serves the contract the SDK speaks to an agent (docs/contracts.md, "The node's data
plane"): one-shot exec with base64 output, the streaming exec WebSocket, and the file
routes, for one sandbox whose /work and /tmp are directories under a temporary root and
whose commands are processes on this machine (run in that /work; tests give them no
absolute paths).
`double_pool` puts it behind a control plane in this process (tests/inprocess.py) that
holds a lease on its sandbox, so `client.lease(id)` and the CLI find it.

The real agent is held to the same contract by the docker-marked tests, which run the
same scenarios against it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import posixpath
import secrets
import shutil
import stat
import tarfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from aiohttp import WSMsgType, web
from aiohttp.test_utils import TestServer
from inprocess import InProcessControlPlane, inprocess_controlplane

from controlplane.app import SCHEDULER
from controlplane.view import NodeEntry, SandboxEntry
from dsec.httpkit import ApiError, bearer_token, json_errors
from dsec.models import (
    ExecExit,
    ExecRequest,
    ExecResult,
    ExecStreamRequest,
    FileInfo,
    FileList,
    FileRemoved,
)
from dsec.policy import Resources
from dsec.states import SandboxState
from dsec.tokens import NO_EXPIRY, client_id, lease_token, new_lease_id, new_token

T = TypeVar("T")
CONFINED_TO = ("/work", "/tmp")
STDOUT, STDERR = 1, 2


class AgentDouble:
    def __init__(self, root: Path, sandbox_id: str, token: str, max_execs: int = 4) -> None:
        self.root = root
        self.sandbox_id = sandbox_id
        self.token = token
        self.max_execs = max_execs
        self.running = 0  # execs under way, one-shot and streaming
        self.stream_requests: list[ExecStreamRequest] = []  # as they came, in order
        self.resizes: list[tuple[int, int]] = []  # (rows, cols) of resize messages
        for area in CONFINED_TO:
            (root / area.lstrip("/")).mkdir(parents=True, exist_ok=True)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[json_errors], client_max_size=1 << 30)
        base = "/v1/sandboxes/{sandbox_id}"
        app.router.add_post(f"{base}/exec", self.exec)
        app.router.add_get(f"{base}/exec/stream", self.exec_stream)
        app.router.add_put(f"{base}/files", self.write_file)
        app.router.add_get(f"{base}/files", self.read_file)
        app.router.add_delete(f"{base}/files", self.remove)
        app.router.add_get(f"{base}/files/list", self.list_dir)
        app.router.add_get(f"{base}/files/tar", self.read_tar)
        app.router.add_put(f"{base}/files/tar", self.write_tar)
        return app

    # --- what every route checks --------------------------------------------------------

    def _admit(self, request: web.Request) -> None:
        if request.match_info["sandbox_id"] != self.sandbox_id:
            raise ApiError(404, "unknown_sandbox", "no such sandbox here")
        if bearer_token(request) != self.token:
            raise ApiError(403, "forbidden", "not this sandbox's lease token")

    def _local(self, path: str | None) -> Path:
        normal = posixpath.normpath(path or "")
        if not any(normal == area or normal.startswith(area + "/") for area in CONFINED_TO):
            raise ApiError(400, "path_outside_workdir", f"{path!r} is not under /work or /tmp")
        return self.root / normal.lstrip("/")

    def _info(self, local: Path) -> FileInfo:
        st = local.lstat()
        kind = "dir" if stat.S_ISDIR(st.st_mode) else "link" if stat.S_ISLNK(st.st_mode) else "file"
        inside = "/" + local.relative_to(self.root).as_posix()
        return FileInfo(
            path=inside,
            name=local.name,
            type=kind,
            size=st.st_size,
            mode=stat.S_IMODE(st.st_mode),
            mtime=st.st_mtime,
        )

    @contextlib.asynccontextmanager
    async def _exec_slot(self) -> AsyncIterator[None]:
        if self.running >= self.max_execs:
            raise ApiError(429, "too_many_execs", f"{self.max_execs} execs already run here")
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1

    async def _start(self, req: ExecRequest, stdin: bool) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            *req.cmd,
            cwd=self.root / "work",
            env={"PATH": "/usr/bin:/bin", **req.env},
            stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )

    # --- exec ------------------------------------------------------------------------

    async def exec(self, request: web.Request) -> web.Response:
        self._admit(request)
        req = ExecRequest.model_validate(await request.json())
        async with self._exec_slot():
            started = time.monotonic()
            proc = await self._start(req, stdin=False)
            timed_out = False
            try:
                out, err = await asyncio.wait_for(proc.communicate(), req.timeout_s)
            except TimeoutError:
                proc.kill()
                out, err = await proc.communicate()
                timed_out = True
        cap = req.max_output_bytes
        if req.encoding == "base64":
            stdout, stderr = (base64.b64encode(b[:cap]).decode() for b in (out, err))
        else:
            stdout, stderr = (b[:cap].decode("utf-8", "replace") for b in (out, err))
        result = ExecResult(
            exit_code=124 if timed_out else proc.returncode,
            stdout=stdout,
            stderr=stderr,
            encoding=req.encoding,
            timed_out=timed_out,
            truncated=len(out) > cap or len(err) > cap,
            duration_ms=(time.monotonic() - started) * 1000,
        )
        return web.json_response(text=result.model_dump_json())

    async def exec_stream(self, request: web.Request) -> web.StreamResponse:
        self._admit(request)  # refusals before the upgrade are plain HTTP answers
        async with self._exec_slot():
            ws = web.WebSocketResponse()
            await ws.prepare(request)
            first = await ws.receive()
            req = ExecStreamRequest.model_validate_json(first.data)
            self.stream_requests.append(req)
            started = time.monotonic()
            proc = await self._start(req, stdin=req.stdin)
            sent = {STDOUT: 0, STDERR: 0}

            async def forward(tag: int, pipe: asyncio.StreamReader) -> None:
                while chunk := await pipe.read(1 << 16):
                    keep = chunk[: max(0, req.max_output_bytes - sent[tag])]
                    sent[tag] += len(chunk)
                    if keep:
                        await ws.send_bytes(bytes([tag]) + keep)

            inputs = asyncio.create_task(self._stdin_of(ws, proc))
            outputs = asyncio.gather(forward(STDOUT, proc.stdout), forward(STDERR, proc.stderr))
            timed_out = False
            try:
                await asyncio.wait_for(asyncio.shield(outputs), req.timeout_s)
            except TimeoutError:
                proc.kill()
                timed_out = True
                await outputs
            except BaseException:  # the server stops: no process stays behind
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
                raise
            await proc.wait()
            exit_ = ExecExit(
                exit_code=124 if timed_out else proc.returncode,
                timed_out=timed_out,
                truncated=any(n > req.max_output_bytes for n in sent.values()),
                duration_ms=(time.monotonic() - started) * 1000,
            )
            await ws.send_str(exit_.model_dump_json())
            inputs.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await inputs
            await ws.close()
        return ws

    async def _stdin_of(self, ws: web.WebSocketResponse, proc: asyncio.subprocess.Process):
        async for msg in ws:
            if msg.type == WSMsgType.BINARY and proc.stdin is not None:
                if proc.returncode is not None or proc.stdin.is_closing():
                    await ws.send_str(
                        json.dumps({"type": "error", "status": 409, "code": "exec_finished"})
                    )
                    continue
                proc.stdin.write(msg.data)
                await proc.stdin.drain()
            elif msg.type == WSMsgType.TEXT:
                control = json.loads(msg.data)
                if control["type"] == "stdin_eof" and proc.stdin is not None:
                    proc.stdin.close()
                elif control["type"] == "resize":  # no terminal here: only noted
                    self.resizes.append((control["rows"], control["cols"]))

    # --- files -----------------------------------------------------------------------

    async def write_file(self, request: web.Request) -> web.Response:
        self._admit(request)
        local = self._local(request.query.get("path"))
        with local.open("wb") as f:
            async for chunk in request.content.iter_chunked(1 << 16):
                f.write(chunk)
        if "mode" in request.query:
            local.chmod(int(request.query["mode"]))
        return web.json_response(text=self._info(local).model_dump_json())

    async def read_file(self, request: web.Request) -> web.StreamResponse:
        self._admit(request)
        local = self._local(request.query.get("path"))
        if not local.is_file():
            raise ApiError(404, "no_such_file", f"no file {request.query.get('path')}")
        return web.Response(body=local.read_bytes(), content_type="application/octet-stream")

    async def remove(self, request: web.Request) -> web.Response:
        self._admit(request)
        path = request.query.get("path")
        local = self._local(path)
        if local.is_dir() and not local.is_symlink():
            shutil.rmtree(local)
        elif local.exists() or local.is_symlink():
            local.unlink()
        else:
            raise ApiError(404, "no_such_file", f"no file {path}")
        return web.json_response(text=FileRemoved(path=path).model_dump_json())

    async def list_dir(self, request: web.Request) -> web.Response:
        self._admit(request)
        path = request.query.get("path")
        local = self._local(path)
        if not local.is_dir():
            raise ApiError(404, "no_such_file", f"no directory {path}")
        entries = [self._info(child) for child in sorted(local.iterdir())]
        return web.json_response(text=FileList(path=path, entries=entries).model_dump_json())

    async def read_tar(self, request: web.Request) -> web.Response:
        self._admit(request)
        local = self._local(request.query.get("path"))
        if not local.is_dir():
            raise ApiError(404, "no_such_file", "no such directory")
        archive = io.BytesIO()
        with tarfile.open(fileobj=archive, mode="w") as tar:
            for child in sorted(local.iterdir()):
                tar.add(child, arcname=child.name)
        return web.Response(body=archive.getvalue(), content_type="application/x-tar")

    async def write_tar(self, request: web.Request) -> web.Response:
        self._admit(request)
        local = self._local(request.query.get("path"))
        local.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(await request.read()), mode="r:*") as tar:
            tar.extractall(local, filter="data")
        return web.json_response(text=self._info(local).model_dump_json())


@dataclass(frozen=True)
class DoublePool:
    """A control plane in this process holding `client_token`'s lease on the double's
    sandbox `sandbox_id`, served by `agent`; `other_client_token` is another client's."""

    controlplane: InProcessControlPlane
    agent: AgentDouble
    agent_url: str
    sandbox_id: str
    client_token: str
    other_client_token: str

    @property
    def url(self) -> str:
        return self.controlplane.url


@contextlib.asynccontextmanager
async def double_pool(root: Path, max_execs: int = 4) -> AsyncIterator[DoublePool]:
    client_token, other_client_token = new_token(), new_token()
    # heartbeats never come: its node must not be declared silent while a test runs
    async with inprocess_controlplane(
        client_token, other_client_token, heartbeat_timeout_s=3600
    ) as cp:
        scheduler = cp.http.server.app[SCHEDULER]
        node, now = "double", scheduler.clock.now()
        sandbox_id, lease_id = f"{node}.{secrets.token_hex(8)}", new_lease_id()
        # the token the control plane hands out for this lease (no max_lease_s: no expiry)
        token = lease_token(
            cp.identities.lease_key(node), sandbox_id, lease_id, client_id(client_token), NO_EXPIRY
        )
        agent = AgentDouble(root, sandbox_id, token, max_execs)
        server = TestServer(agent.app(), host="127.0.0.1")
        await server.start_server()
        try:
            url = f"http://127.0.0.1:{server.port}"
            scheduler.view.nodes[node] = NodeEntry(
                id=node,
                kind="local",
                url=url,
                capacity=Resources(1, 1024, 1),
                images=frozenset(),
                incarnation="double",
                last_seen=now,
                draining=True,  # nothing new is placed on it: it only serves this lease
            )
            scheduler.view.add(
                SandboxEntry(
                    id=sandbox_id,
                    node=node,
                    pool="default",
                    template="base",
                    state=SandboxState.LEASED,
                    since=now,
                    created_at=now,
                    cpus=0.5,
                    memory_mb=256,
                    lease_id=lease_id,
                    owner=client_id(client_token),
                )
            )
            yield DoublePool(cp, agent, url, sandbox_id, client_token, other_client_token)
        finally:
            await server.close()


@contextlib.contextmanager
def in_background_loop(scope: contextlib.AbstractAsyncContextManager[T]) -> Iterator[T]:
    """Enter an async context manager on a loop in a thread of its own: for tests whose
    own thread blocks, as a SyncClient's caller does."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="test-servers", daemon=True)
    thread.start()
    try:
        value = asyncio.run_coroutine_threadsafe(scope.__aenter__(), loop).result()
        try:
            yield value
        finally:
            asyncio.run_coroutine_threadsafe(scope.__aexit__(None, None, None), loop).result()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()
