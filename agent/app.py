"""The agent's HTTP routes and its app factory.

The control plane (its call token for this node) creates, leases, pauses, thaws, resets
and removes sandboxes, and sends the images the node lacks (agent/images.py); the client
holding a lease (lease token) runs commands and moves files.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import get_args

from aiohttp import WSMsgType, web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from agent import runtime
from agent.audit import AuditRecords, RefusalRecord
from agent.docker_driver import DockerOpError
from agent.files import checked_mode, checked_path
from agent.images import ImageLoaded, ImageLoader
from agent.node import SHUTDOWN_WAIT_S, Agent
from agent.report import node_report, sandbox_report
from agent.resident import RunningCommand
from agent.sandboxes import Sandbox
from dsec.httpkit import (
    MAX_BODY_BYTES,
    Api,
    ApiError,
    CredentialRefused,
    Handler,
    bearer_token,
    body_chunks,
    body_limit_with_files,
    cancel_and_wait,
    count_authenticated,
    is_form,
    model_response,
    new_app,
    parse_json,
    parse_model,
    read_form,
    read_model,
    require_token,
    route_of,
    sandbox_id_param,
)
from dsec.models import (
    CLAIM_FILES_CEILING,
    GRANT_FILES_PART,
    GRANT_PART,
    SANDBOX_ID_RE,
    CreateSandbox,
    ExecRequest,
    ExecResult,
    ExecStreamRequest,
    FileInfo,
    FileList,
    FileRemoved,
    LeaseEnd,
    LeaseGrant,
    NodeReport,
    Released,
    ResetSandbox,
    SandboxReport,
    SnapshotMade,
)
from dsec.statedir import sweep_orphans
from dsec.states import SandboxState

AUDIT_READ_LIMIT = 10_000  # records one GET /v1/audit answers at most
FILE_CHUNK = 1 << 16
STDIN_FRAME_BYTES = 1 << 20  # the largest stdin message a streaming command takes
WS_HEARTBEAT_S = 30.0  # pings keep an idle command's connection alive through proxies
WS_FIRST_MESSAGE_S = 30.0  # a client that upgrades must send its command this soon
WS_CLOSE_WAIT_S = 10.0  # after the exit message, how long the client has to close


SNAPSHOT_ID_RE = re.compile(r"[0-9a-f]{32}")

AGENT = web.AppKey("agent", Agent)
IMAGE_LOADER = web.AppKey("image_loader", ImageLoader)


def _agent(request: web.Request) -> Agent:
    return request.app[AGENT]


def _control_plane_only(request: web.Request) -> Agent:
    """The control plane's call token for this node, which no other node knows; before
    the node has joined, nothing is accepted."""
    agent = _agent(request)
    require_token(request, [agent.identity.call_token] if agent.identity else [])
    return agent


async def _lease_holder(
    request: web.Request, sandbox_id: str, token: str | None
) -> tuple[Sandbox, str]:
    """The sandbox and lease that the lease `token` holds (Execs.hold), its request's
    connection then counted as authenticated."""
    held = await _agent(request).execs.hold(sandbox_id, token)
    count_authenticated(request)
    return held


async def create_sandbox(request: web.Request) -> web.Response:
    agent = _control_plane_only(request)
    req = await read_model(request, CreateSandbox)
    sandbox, created = await agent.to_completion(agent.create(req))
    return model_response(sandbox_report(sandbox, agent.clock.now()), 201 if created else 200)


async def lease_sandbox(request: web.Request) -> web.Response:
    agent = _control_plane_only(request)
    sandbox_id = sandbox_id_param(request)
    grant = await _read_grant(request)
    sandbox = await agent.to_completion(agent.lease(sandbox_id, grant))
    return model_response(sandbox_report(sandbox, agent.clock.now()))


async def _read_grant(request: web.Request) -> LeaseGrant:
    """A grant, its claim's files (the control plane's limit holds them) in base64 JSON
    or, as the control plane sends them, as a form's second part, bytes as they are."""
    if not is_form(request):
        return await read_model(request, LeaseGrant, body_limit_with_files(CLAIM_FILES_CEILING))
    parts = await read_form(request, MAX_BODY_BYTES + CLAIM_FILES_CEILING, 2)
    names = [part.name for part in parts]
    if names != [GRANT_PART, GRANT_FILES_PART]:
        raise ApiError(
            422, "validation_error", f"a grant's form is parts {GRANT_PART!r} and "
            f"{GRANT_FILES_PART!r}, not {names}"
        )  # fmt: skip
    grant = parse_model(parts[0].data, LeaseGrant)
    # (set, not validated: a Base64Bytes field would take base64)
    return grant.model_copy(update={"files_tar": parts[1].data})


def _sandbox_verb(verb: Callable[[Agent, str], Awaitable[Sandbox]]) -> Handler:
    """The route of a control-plane call that names a sandbox and nothing more."""

    async def handler(request: web.Request) -> web.Response:
        agent = _control_plane_only(request)
        sandbox = await agent.to_completion(verb(agent, sandbox_id_param(request)))
        return model_response(sandbox_report(sandbox, agent.clock.now()))

    return handler


pause_sandbox = _sandbox_verb(Agent.pause)
hibernate_sandbox = _sandbox_verb(Agent.hibernate)
unpause_sandbox = _sandbox_verb(Agent.unpause)


async def reset_sandbox(request: web.Request) -> web.Response:
    agent = _control_plane_only(request)
    sandbox_id = sandbox_id_param(request)
    req = await read_model(request, ResetSandbox)
    sandbox = await agent.to_completion(agent.reset(sandbox_id, req))
    return model_response(sandbox_report(sandbox, agent.clock.now()))


async def destroy_sandbox(request: web.Request) -> web.Response:
    agent = _control_plane_only(request)
    sandbox_id = sandbox_id_param(request)
    ended = request.query.get("ended", "released")
    if ended not in get_args(LeaseEnd):
        raise ApiError(400, "invalid_ended", f"ended is one of {get_args(LeaseEnd)}: {ended!r}")
    busy_s = await agent.to_completion(agent.destroy(sandbox_id, ended))
    return model_response(Released(id=sandbox_id, state=SandboxState.GONE, busy_s=busy_s))


async def get_sandbox(request: web.Request) -> web.Response:
    agent = _control_plane_only(request)
    return model_response(sandbox_report(agent.get(sandbox_id_param(request)), agent.clock.now()))


async def get_node(request: web.Request) -> web.Response:
    agent = _control_plane_only(request)
    return model_response(node_report(agent))


async def exec_in_sandbox(request: web.Request) -> web.StreamResponse:
    agent = _agent(request)
    sandbox_id, token = sandbox_id_param(request), bearer_token(request)
    await _lease_holder(request, sandbox_id, token)  # before the body: a stranger's is unread
    req = await read_model(request, ExecRequest)
    async with agent.execs.run(sandbox_id, token, req, request.remote) as answer:
        # written as it is encoded: the output is in memory once, not three times
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        for piece in answer:
            await resp.write(piece)
            await asyncio.sleep(0)  # a write the socket takes at once yields nothing
        await resp.write_eof()
    return resp


async def exec_stream(request: web.Request) -> web.StreamResponse:
    """A command over a WebSocket (the protocol is in docs/contracts.md): output as it comes,
    stdin, a terminal. What can be refused is refused before the upgrade, as HTTP."""
    agent = _agent(request)
    sandbox_id, token = sandbox_id_param(request), bearer_token(request)
    sandbox, _ = await _lease_holder(request, sandbox_id, token)
    agent.execs.admit(sandbox)
    ws = web.WebSocketResponse(max_msg_size=STDIN_FRAME_BYTES, heartbeat=WS_HEARTBEAT_S)
    await ws.prepare(request)
    ended = asyncio.Event()
    inputs: list[asyncio.Task] = []

    async def send_output(stream: int, data: bytes) -> None:
        await ws.send_bytes(bytes([stream]) + data)

    async def take_input(proc: RunningCommand, stdin: bool) -> None:
        async for msg in ws:
            if ended.is_set():
                if msg.type == WSMsgType.BINARY:
                    await _ws_error(ws, ApiError(409, "exec_finished", "the command has ended"))
                continue
            if msg.type == WSMsgType.BINARY and stdin:
                with contextlib.suppress(DockerOpError):  # it stopped reading: its exit says
                    await proc.write(msg.data)
            elif msg.type == WSMsgType.TEXT:
                await _control(ws, proc, msg.data)
        ended.set()

    try:
        first = await asyncio.wait_for(ws.receive(), WS_FIRST_MESSAGE_S)
        if first.type != WSMsgType.TEXT:
            raise ApiError(400, "invalid_request", "the first message is the command, as JSON text")
        req = parse_model(first.data, ExecStreamRequest, "the command")

        def started(proc: RunningCommand) -> None:
            inputs.append(asyncio.create_task(take_input(proc, req.stdin)))

        result = await agent.execs.stream(
            sandbox_id, token, req, request.remote, send_output, started
        )
        ended.set()
        await ws.send_str(result.model_dump_json())
        if inputs:  # the client closes; until then late input is answered
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(inputs[0]), WS_CLOSE_WAIT_S)
    except ApiError as e:
        await _ws_error(ws, e)
    except (TimeoutError, ConnectionError):
        pass  # no command came, or the client went away
    finally:
        ended.set()
        for task in inputs:
            task.cancel()
        await asyncio.gather(*inputs, return_exceptions=True)
        await ws.close()
    return ws


async def _control(ws: web.WebSocketResponse, proc: RunningCommand, text: str) -> None:
    """A text message during a command: end of stdin, or a terminal's new size."""
    try:
        message = parse_json(text)
        kind = message["type"]
        if kind == "stdin_eof":
            proc.close_stdin()
        elif kind == "resize" and proc.tty:
            await proc.resize(int(message["rows"]), int(message["cols"]))
        elif kind != "resize":
            raise KeyError(kind)
    except ApiError as e:
        await _ws_error(ws, e)
    except (ValueError, KeyError, TypeError) as e:
        await _ws_error(ws, ApiError(400, "invalid_message", f"unknown control message: {e}"))
    except DockerOpError:
        pass  # resizing a command that just ended


async def _ws_error(ws: web.WebSocketResponse, e: ApiError) -> None:
    with contextlib.suppress(ConnectionError, RuntimeError):
        await ws.send_json(
            {"type": "error", "status": e.status, "code": e.code, "message": e.message}
        )


async def _file_target(request: web.Request) -> tuple[Agent, Sandbox, str, str]:
    """The agent, the sandbox the lease token holds, its lease and the checked path."""
    agent = _agent(request)
    sandbox, lease_id = await _lease_holder(
        request, sandbox_id_param(request), bearer_token(request)
    )
    path = checked_path(request.query.get("path"), agent.files.roots(sandbox))
    return agent, sandbox, lease_id, path


def _fits(request: web.Request, sandbox: Sandbox, path: str) -> None:
    """A body declared larger than the file system it goes to is refused unread."""
    size = request.content_length
    room_mb = sandbox.spec.tmp_mb if path.startswith("/tmp") else sandbox.spec.workdir_mb
    if size is not None and size > room_mb << 20:
        raise ApiError(413, "file_too_large", f"{size} bytes do not fit in {room_mb} MiB")


async def put_file(request: web.Request) -> web.Response:
    agent, sandbox, lease_id, path = await _file_target(request)
    mode = checked_mode(request.query.get("mode"))
    _fits(request, sandbox, path)
    async with agent.execs.running_in(sandbox, lease_id):
        chunks = body_chunks(request, FILE_CHUNK)
        info = await agent.files.write(sandbox, "write", path, chunks, mode)
    return model_response(info)


async def get_file(request: web.Request) -> web.StreamResponse:
    transport = request.transport
    if transport is None or transport.get_extra_info("sslcontext") is not None:
        # (over TLS the bytes must pass through this process to be encrypted: asyncio's
        # own fallback would read them in its shared thread pool, so the file's thread does)
        return await _send_stream(request, "read", "application/octet-stream")
    agent, sandbox, lease_id, path = await _file_target(request)
    async with agent.execs.running_in(sandbox, lease_id):
        file, size = await agent.files.open_to_send(sandbox, path)
        with file:
            headers = {"Content-Type": "application/octet-stream", "Content-Length": str(size)}
            resp = web.StreamResponse(headers=headers)
            await resp.prepare(request)
            # the kernel copies the file to the socket (sendfile(2)): no byte through this
            # process, a third to a half less of its CPU (docs/benchmarks.md, "Files")
            sent = await asyncio.get_running_loop().sendfile(transport, file, 0, size)
        if sent < size:  # the sandbox cut the file meanwhile: the client sees a short body
            transport.close()
            return resp
        await resp.write_eof()
    return resp


async def get_tar(request: web.Request) -> web.StreamResponse:
    return await _send_stream(request, "tar-get", "application/x-tar")


async def _send_stream(request: web.Request, op: str, content_type: str) -> web.StreamResponse:
    agent, sandbox, lease_id, path = await _file_target(request)
    async with agent.execs.running_in(sandbox, lease_id):
        chunks = await agent.files.stream_out(sandbox, op, path)
        resp = web.StreamResponse(headers={"Content-Type": content_type})
        await resp.prepare(request)
        async for chunk in chunks:
            await resp.write(chunk)
        await resp.write_eof()
    return resp


async def put_tar(request: web.Request) -> web.Response:
    agent, sandbox, lease_id, path = await _file_target(request)
    _fits(request, sandbox, path)
    async with agent.execs.running_in(sandbox, lease_id):
        chunks = body_chunks(request, FILE_CHUNK)
        info = await agent.files.write(sandbox, "tar-put", path, chunks)
    return model_response(info)


async def list_files(request: web.Request) -> web.Response:
    agent, sandbox, lease_id, path = await _file_target(request)
    async with agent.execs.running_in(sandbox, lease_id):
        return model_response(await agent.files.listing(sandbox, path))


async def remove_file(request: web.Request) -> web.Response:
    agent, sandbox, lease_id, path = await _file_target(request)
    async with agent.execs.running_in(sandbox, lease_id):
        await agent.files.remove(sandbox, path)
    return model_response(FileRemoved(path=path))


async def snapshot_sandbox(request: web.Request) -> web.Response:
    """A fork's copy of the sandbox's work dir and /tmp as they are now (agent/snapshots.py)."""
    agent = _control_plane_only(request)
    sandbox = agent.get(sandbox_id_param(request))
    made = await agent.to_completion(agent.snapshots.make(sandbox))
    return model_response(made, 201)


def _snapshot_param(request: web.Request) -> str:
    snapshot_id = request.match_info["snapshot"]
    if not SNAPSHOT_ID_RE.fullmatch(snapshot_id):
        raise ApiError(400, "invalid_snapshot_id", f"not a snapshot id: {snapshot_id[:40]!r}")
    return snapshot_id


async def read_snapshot(request: web.Request) -> web.StreamResponse:
    """One tar of a copy, for a node a fork of it was granted on: its token, which the
    control plane gave that node in the grant, is the credential."""
    agent = _agent(request)
    index = request.match_info["index"]
    if not index.isdigit() or len(index) > 2:
        raise ApiError(400, "invalid_index", f"not a part of a snapshot: {index[:40]!r}")
    path = agent.snapshots.path_of(_snapshot_param(request), bearer_token(request), int(index))
    count_authenticated(request)
    return web.FileResponse(path, headers={"Content-Type": "application/x-tar"})


async def drop_snapshot(request: web.Request) -> web.Response:
    agent = _control_plane_only(request)
    snapshot_id = _snapshot_param(request)
    dropped = await agent.snapshots.drop(snapshot_id)
    return web.json_response({"snapshot": snapshot_id, "dropped": dropped})


async def load_image(request: web.Request) -> web.Response:
    _control_plane_only(request)
    chunks = body_chunks(request, FILE_CHUNK)
    return model_response(await request.app[IMAGE_LOADER].receive(request.query.get("ref"), chunks))


async def read_audit(request: web.Request) -> web.Response:
    agent = _control_plane_only(request)
    sandbox_id = request.query.get("sandbox")
    if sandbox_id is not None and not SANDBOX_ID_RE.match(sandbox_id):
        raise ApiError(400, "invalid_sandbox_id", f"not a sandbox id: {sandbox_id!r}")
    raw_limit = request.query.get("limit", str(AUDIT_READ_LIMIT))
    if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= AUDIT_READ_LIMIT:
        raise ApiError(400, "invalid_limit", f"limit must be 1 to {AUDIT_READ_LIMIT}")
    records = await agent.audit.read(sandbox_id, int(raw_limit))
    return model_response(AuditRecords(records=records))


async def healthz(request: web.Request) -> web.Response:
    agent = _agent(request)
    return web.json_response(
        {"status": "ok", "node": agent.config.node_id, "sandboxes": len(agent.sandboxes)}
    )


async def metrics(request: web.Request) -> web.Response:
    agent = _agent(request)
    readers = agent.config.metrics_readers()
    if readers is not None:
        require_token(request, readers)
    body = generate_latest(agent.metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def agent_api() -> Api:
    api = Api("dsec agent")
    api.route(
        "POST",
        "/v1/sandboxes",
        create_sandbox,
        body=CreateSandbox,
        answer=SandboxReport,
        summary="create and start a sandbox (control plane only); idempotent on its id",
    )
    api.route(
        "GET",
        "/v1/sandboxes/{sandbox_id}",
        get_sandbox,
        answer=SandboxReport,
        summary="one sandbox (control plane only)",
    )
    api.route(
        "DELETE",
        "/v1/sandboxes/{sandbox_id}",
        destroy_sandbox,
        answer=Released,
        summary="remove a sandbox (control plane only); idempotent",
    )
    api.route(
        "POST",
        "/v1/sandboxes/{sandbox_id}/lease",
        lease_sandbox,
        body=LeaseGrant,
        answer=SandboxReport,
        summary="hand a sandbox to a lease (control plane only)",
    )
    api.route(
        "POST",
        "/v1/sandboxes/{sandbox_id}/pause",
        pause_sandbox,
        answer=SandboxReport,
        summary="freeze a sandbox (control plane only)",
    )
    api.route(
        "POST",
        "/v1/sandboxes/{sandbox_id}/hibernate",
        hibernate_sandbox,
        answer=SandboxReport,
        summary="keep a paused sandbox's files, release its memory (control plane only)",
    )
    api.route(
        "POST",
        "/v1/sandboxes/{sandbox_id}/unpause",
        unpause_sandbox,
        answer=SandboxReport,
        summary="thaw a sandbox (control plane only)",
    )
    api.route(
        "POST",
        "/v1/sandboxes/{sandbox_id}/reset",
        reset_sandbox,
        body=ResetSandbox,
        answer=SandboxReport,
        summary="recycle a released sandbox: end its lease, kill its processes, empty its "
        "work dir, /tmp and /dev/shm, check, make it warm (control plane only); a failed "
        "reset removes it",
    )
    api.route(
        "POST",
        "/v1/sandboxes/{sandbox_id}/exec",
        exec_in_sandbox,
        body=ExecRequest,
        answer=ExecResult,
        summary="run a command (lease token)",
    )
    api.route(
        "GET",
        "/v1/sandboxes/{sandbox_id}/exec/stream",
        exec_stream,
        summary="run a command over a WebSocket: output as it comes, stdin, a terminal "
        "(lease token; protocol in docs/contracts.md)",
    )
    api.route(
        "PUT",
        "/v1/sandboxes/{sandbox_id}/files",
        put_file,
        answer=FileInfo,
        summary="write a file (?path=, ?mode=; the body is its bytes; lease token)",
    )
    api.route(
        "GET",
        "/v1/sandboxes/{sandbox_id}/files",
        get_file,
        summary="read a file (?path=; its bytes; lease token)",
    )
    api.route(
        "DELETE",
        "/v1/sandboxes/{sandbox_id}/files",
        remove_file,
        answer=FileRemoved,
        summary="remove a file or a directory with its contents (?path=; lease token)",
    )
    api.route(
        "GET",
        "/v1/sandboxes/{sandbox_id}/files/list",
        list_files,
        answer=FileList,
        summary="a directory's entries (?path=; lease token)",
    )
    api.route(
        "GET",
        "/v1/sandboxes/{sandbox_id}/files/tar",
        get_tar,
        summary="a directory's contents as a tar (?path=; lease token)",
    )
    api.route(
        "PUT",
        "/v1/sandboxes/{sandbox_id}/files/tar",
        put_tar,
        answer=FileInfo,
        summary="unpack a tar into a directory, made if missing (?path=; lease token)",
    )
    api.route(
        "POST",
        "/v1/sandboxes/{sandbox_id}/snapshot",
        snapshot_sandbox,
        answer=SnapshotMade,
        summary="copy a sandbox's work dir and /tmp as they are now, for its forks (control "
        "plane only; agent/snapshots.py)",
    )
    api.route(
        "GET",
        "/v1/snapshots/{snapshot}/{index}",
        read_snapshot,
        summary="one directory of a copy as a tar (the copy's token, from a fork's grant)",
    )
    api.route(
        "DELETE",
        "/v1/snapshots/{snapshot}",
        drop_snapshot,
        summary="drop a copy its forks have taken (control plane only)",
    )
    api.route(
        "PUT",
        "/v1/images",
        load_image,
        answer=ImageLoaded,
        summary="load image ?ref= (name:tag) from the body, what `docker save` writes of it "
        "(control plane only; agent/images.py)",
    )
    api.route("GET", "/v1/node", get_node, answer=NodeReport, summary="this node's report")
    api.route(
        "GET",
        "/v1/audit",
        read_audit,
        answer=AuditRecords,
        summary="the last commands run on this node (?sandbox=, ?limit=; control plane only)",
    )
    api.route("GET", "/healthz", healthz, summary="liveness")
    api.route("GET", "/metrics", metrics, summary="Prometheus metrics")
    return api


async def _audit_refusal(request: web.Request, refusal: CredentialRefused) -> None:
    """A refused credential leaves an audit record: who tried, from where, what."""
    agent = _agent(request)
    named = request.match_info.get("sandbox_id")
    await agent.audit_record(
        RefusalRecord(
            time=agent.clock.wall(),
            node=agent.config.node_id,
            peer=request.remote,
            method=request.method,
            route=route_of(request),
            sandbox=named if named and SANDBOX_ID_RE.match(named) else None,
            status=refusal.status,
            code=refusal.code,
        )
    )


def create_agent_app(agent: Agent) -> web.Application:
    app = new_app(agent_api(), on_refused=_audit_refusal)
    app[AGENT] = agent
    app[IMAGE_LOADER] = ImageLoader(agent)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        await asyncio.to_thread(agent.protect_state_dir)
        await asyncio.to_thread(agent.snapshots.clear)
        await asyncio.to_thread(sweep_orphans)
        await runtime.adopt(agent)
        await runtime.refresh_images(agent)  # the first heartbeat already says what it holds
        loops = [
            asyncio.create_task(runtime.refresh_images_forever(agent), name="images"),
            asyncio.create_task(runtime.watch_engine_forever(agent), name="engine"),
            asyncio.create_task(runtime.watch_containers_forever(agent), name="containers"),
        ]
        if agent.config.controlplane_url:
            loops.append(asyncio.create_task(runtime.heartbeat_forever(agent), name="heartbeat"))
        yield
        await cancel_and_wait(*loops)
        # the control plane's requests cut short by the shutdown finish first
        await agent.settle(within_s=SHUTDOWN_WAIT_S)
        if agent.config.cleanup_on_exit:
            await agent.remove_all()
            await asyncio.to_thread(agent.resident.close, set(agent.sandboxes))
        await agent.snapshots.close()
        await agent.store.close()
        await agent.audit.close()
        await agent.docker.close()

    app.cleanup_ctx.append(lifecycle)
    return app
