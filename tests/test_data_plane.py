"""The node's data plane over real sockets against real sandboxes: one-shot and
streaming commands, stdin, limits, kills inside the sandbox, files, and the container
log's cap. Raw HTTP and WebSocket against the agent, so the wire contract itself is
what is checked (the SDK's own tests use these routes through the SDK)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import tarfile
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
import pytest_asyncio
from conftest import eventually, make_spec, metric_value, started_pool

from agent.docker_driver import KEEPER_USER, LABEL_SANDBOX
from bench.data_plane import loopback_seconds
from dsec.client import Client, Sandbox
from dsec.httpkit import BODY_IDLE_TIMEOUT_S
from dsec.launch.local import LocalPool
from dsec.models import SandboxInfo
from dsec.states import SandboxState
from dsec.tokens import NO_EXPIRY, lease_token, new_lease_id

pytestmark = pytest.mark.asyncio(loop_scope="module")

EXECS_PER_SANDBOX = 8  # low, so the limit is reached with few commands
MiB = 1 << 20


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pool(docker_client, tmp_path_factory) -> AsyncIterator[LocalPool]:
    spec = make_spec(tmp_path_factory.mktemp("dataplane"), nodes=1)
    spec.execs_per_sandbox = EXECS_PER_SANDBOX
    async with started_pool(spec, docker_client) as p:
        yield p


@pytest_asyncio.fixture(loop_scope="module")
async def sb(pool: LocalPool) -> AsyncIterator[Sandbox]:
    async with Client(pool.url, token=pool.tokens.client) as c:
        async with c.sandbox() as sandbox:
            yield sandbox


@pytest_asyncio.fixture(loop_scope="module")
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def url(sb: Sandbox, route: str) -> str:
    return f"{sb.lease.agent_url}/v1/sandboxes/{sb.id}/{route}"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def auth(sb: Sandbox) -> dict[str, str]:
    return bearer(sb.lease.lease_token)


async def run(http: aiohttp.ClientSession, sb: Sandbox, cmd: list[str], **fields) -> dict:
    body = {"cmd": cmd, **fields}
    async with http.post(url(sb, "exec"), json=body, headers=auth(sb)) as resp:
        answer = await resp.json()
        assert resp.status == 200, answer
        return answer


async def stream(
    http: aiohttp.ClientSession, sb: Sandbox, request: dict, stdin: list | None = None
) -> tuple[list[tuple[int, bytes, float]], dict, float]:
    """Run a streaming command; returns its chunks (stream, data, arrival), the last
    message and when the command was sent."""
    chunks: list[tuple[int, bytes, float]] = []
    async with http.ws_connect(url(sb, "exec/stream"), headers=auth(sb)) as ws:
        sent = time.monotonic()
        await ws.send_str(json.dumps(request))
        for item in stdin or []:
            if isinstance(item, bytes):
                await ws.send_bytes(item)
            else:
                await ws.send_str(json.dumps(item))
        async for msg in ws:
            if msg.type == aiohttp.WSMsgType.BINARY:
                chunks.append((msg.data[0], msg.data[1:], time.monotonic()))
            else:
                return chunks, json.loads(msg.data), sent
    raise AssertionError(f"the stream closed without a last message; got {chunks}")


async def test_the_benchmark_s_loopback_ceiling_moves_the_bytes_each_way_and_times_both():
    """bench.data_plane's ceiling for any route over TCP (no sandbox): what went up is
    what came down (it checks, and would raise), each way timed on its own."""
    up_s, down_s = await asyncio.to_thread(loopback_seconds, os.urandom(4 * MiB))
    assert 0 < up_s < 60 and 0 < down_s < 60


# --- one-shot commands ---------------------------------------------------------------


async def test_a_warm_sandbox_runs_the_first_command_of_a_lease_before_its_grant(pool, http):
    """The control plane answers a warm acquire before the agent hears of the lease: its
    token proves the lease by itself, so a first command that comes before the grant
    runs. Here no grant comes: the token is made with the node's lease key, as the
    control plane makes it. Another lease's token is refused once it is taken up. The
    control plane, which granted no such lease, does not take it from the node's
    report (a node's key makes tokens, never grants: test_hostile_tenancy, attack 13),
    and removes the sandbox: it is no longer one to hand out."""
    assert pool.identities is not None
    async with Client(pool.url, token=pool.tokens.admin) as operator:

        async def a_warm_one() -> SandboxInfo | None:
            warm = [s for s in await operator.list() if s.state == SandboxState.WARM]
            return warm[0] if warm else None

        warm = await eventually(a_warm_one, "a warm sandbox")
        lease_key = pool.identities.lease_key(warm.node)
        token = lease_token(lease_key, warm.id, new_lease_id(), None, NO_EXPIRY)
        exec_url = f"{warm.agent_url}/v1/sandboxes/{warm.id}/exec"
        body = {"cmd": ["echo", "first"]}
        async with http.post(exec_url, json=body, headers=bearer(token)) as resp:
            answer = await resp.json()
        assert resp.status == 200 and answer["exit_code"] == 0, answer
        assert answer["stdout"] == "first\n"
        other = lease_token(lease_key, warm.id, new_lease_id(), None, NO_EXPIRY)
        async with http.post(exec_url, json=body, headers=bearer(other)) as resp:
            assert resp.status == 403, await resp.text()

        async def refused_from_the_report() -> bool:
            labels = {"node": warm.node}
            return await metric_value(pool, "dsec_unproven_leases_total", labels) > 0

        await eventually(refused_from_the_report, "the node's report of it is refused")

        async def removed() -> bool:
            return warm.id not in {s.id for s in await operator.list()}

        await eventually(removed, "the sandbox is removed")


async def test_output_comes_back_byte_for_byte_in_base64_and_replaced_in_text(sb, http):
    cmd = ["sh", "-c", r"printf '\377\000x'; printf '\376' >&2"]
    raw = await run(http, sb, cmd, encoding="base64")
    assert raw["encoding"] == "base64"
    assert base64.b64decode(raw["stdout"]) == b"\xff\x00x"
    assert base64.b64decode(raw["stderr"]) == b"\xfe"
    text = await run(http, sb, cmd)
    assert (text["encoding"], text["stdout"], text["stderr"]) == ("utf-8", "\ufffd\x00x", "\ufffd")


async def test_output_past_the_cap_is_cut_and_flagged(sb, http):
    answer = await run(http, sb, ["sh", "-c", "yes | head -c 5000"], max_output_bytes=1000)
    assert (len(answer["stdout"]), answer["truncated"], answer["exit_code"]) == (1000, True, 0)


async def test_a_timeout_kills_the_command_and_its_children_inside_the_sandbox(sb, http):
    # a child in a session of its own escapes the process group, not the marker
    cmd = ["sh", "-c", "setsid sleep 301 & sleep 302 & sleep 303"]
    answer = await run(http, sb, cmd, timeout_s=1)
    assert (answer["exit_code"], answer["timed_out"]) == (124, True)
    left = await run(http, sb, ["sh", "-c", "cat /proc/[0-9]*/cmdline | tr '\\0' ' '"])
    assert "sleep 30" not in left["stdout"], left["stdout"]


async def test_a_sandbox_runs_so_many_commands_at_once_and_the_next_gets_429(sb, http):
    long = [asyncio.ensure_future(run(http, sb, ["sleep", "20"])) for _ in range(EXECS_PER_SANDBOX)]
    try:
        await asyncio.sleep(3)  # all started (a probe sent meanwhile would take a slot)
        async with http.post(url(sb, "exec"), json={"cmd": ["true"]}, headers=auth(sb)) as resp:
            answer = await resp.json()
        assert resp.status == 429 and answer["error"]["code"] == "too_many_execs", answer
        assert not any(t.done() for t in long), [t.result() for t in long if t.done()]
    finally:
        for task in long:
            task.cancel()
        await asyncio.gather(*long, return_exceptions=True)
    # the cancelled commands are killed in the sandbox: room again, promptly
    probe = {"cmd": ["sh", "-c", "cat /proc/[0-9]*/cmdline | tr '\\0' ' '"]}
    for _ in range(100):
        async with http.post(url(sb, "exec"), json=probe, headers=auth(sb)) as resp:
            left = await resp.json()
        if resp.status == 200 and "sleep 20" not in left["stdout"]:
            break
        await asyncio.sleep(0.1)
    assert resp.status == 200 and "sleep 20" not in left["stdout"], left


async def test_a_neighbours_long_commands_do_not_queue_another_tenants_command(pool, http):
    """40 long commands in one sandbox (more than the agent's old 32 exec threads, past
    which the next command waited for one to end): another tenant's still runs now."""
    async with Client(pool.url, token=pool.tokens.client) as c:
        async with c.sandbox() as noisy, c.sandbox() as quiet:
            loads = []
            for i in range(40):  # 8 at a time per sandbox: spread over 5 more sandboxes
                if i % EXECS_PER_SANDBOX == 0:
                    target = noisy if i == 0 else await c.acquire()
                    loads.append(target)
                loads.append(asyncio.ensure_future(run(http, target, ["sleep", "30"])))
            tasks = [t for t in loads if isinstance(t, asyncio.Future)]
            holders = [s for s in loads if isinstance(s, Sandbox) and s is not noisy]
            try:
                await asyncio.sleep(3)  # all 40 under way
                started = time.monotonic()
                answer = await run(http, quiet, ["echo", "hi"])
                took = time.monotonic() - started
                assert answer["stdout"] == "hi\n"
                assert took < 10, f"{took:.1f} s: queued behind the neighbour's commands"
                assert not any(t.done() for t in tasks), "the long commands did not all run"
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                for holder in holders:
                    await holder.release()


async def test_a_deeply_nested_body_is_a_400_and_a_strangers_is_never_parsed(sb, http):
    nested = "[" * 100_000 + "]" * 100_000
    headers = {**auth(sb), "Content-Type": "application/json"}
    async with http.post(url(sb, "exec"), data=nested, headers=headers) as resp:
        answer = await resp.json()
        assert (resp.status, answer["error"]["code"]) == (400, "malformed_json"), answer
    stranger = {"Authorization": "Bearer x", "Content-Type": "application/json"}
    async with http.post(url(sb, "exec"), data=nested, headers=stranger) as resp:
        assert (resp.status, (await resp.json())["error"]["code"]) == (403, "forbidden")


# --- streaming -----------------------------------------------------------------------


async def test_chunks_arrive_as_they_are_written_on_their_own_streams(sb, http):
    request = {"cmd": ["sh", "-c", "echo a; sleep 1; echo b >&2; sleep 1; echo c; exit 7"]}
    chunks, last, _ = await stream(http, sb, request)
    assert [(s, d) for s, d, _ in chunks] == [(1, b"a\n"), (2, b"b\n"), (1, b"c\n")]
    assert last["type"] == "exit" and last["exit_code"] == 7 and not last["timed_out"]
    # "a" came about two seconds before "c": it was not held until the end
    assert chunks[2][2] - chunks[0][2] > 1.5


async def test_stdin_reaches_the_command_byte_for_byte(sb, http):
    data = bytes(range(256)) * 64
    request = {"cmd": ["cat"], "stdin": True}
    chunks, last, _ = await stream(
        http, sb, request, [data[:5000], data[5000:], {"type": "stdin_eof"}]
    )
    assert b"".join(d for s, d, _ in chunks if s == 1) == data
    assert last["exit_code"] == 0


async def test_a_command_that_stops_reading_its_stdin_ends_its_stream(sb, http):
    """The command reads 3 bytes of the 8 MiB sent, writes 200 kB and exits; the client
    never ends its input. Its exit comes all the same (the engine keeps the output open
    until the input ends, and takes none of it once the command is gone), after all its
    output."""
    script = "head -c 3; head -c 200000 /dev/zero | tr '\\0' x"
    request = {"cmd": ["sh", "-c", script], "stdin": True, "timeout_s": 30}
    chunks, last, _ = await stream(http, sb, request, [b"y" * (MiB // 2)] * 16)
    assert b"".join(d for s, d, _ in chunks if s == 1) == b"yyy" + b"x" * 200_000
    assert (last["exit_code"], last["timed_out"]) == (0, False), last


async def test_stdin_after_the_command_ended_is_answered_409(sb, http):
    async with http.ws_connect(url(sb, "exec/stream"), headers=auth(sb)) as ws:
        await ws.send_str(json.dumps({"cmd": ["true"], "stdin": True}))
        last = await ws.receive_json()
        assert last["type"] == "exit"
        await ws.send_bytes(b"too late")
        late = await ws.receive_json()
        assert (late["type"], late["status"], late["code"]) == ("error", 409, "exec_finished")


async def test_a_terminal_merges_output_and_has_its_size(sb, http):
    # the engine sizes a terminal once its command runs: a moment after its start
    script = "sleep 0.5; stty size; echo err >&2"
    request = {"cmd": ["sh", "-c", script], "tty": True, "rows": 33, "cols": 101}
    chunks, last, _ = await stream(http, sb, request)
    out = b"".join(d for _, d, _ in chunks)
    assert {s for s, _, _ in chunks} == {1}
    assert b"33 101" in out and b"err" in out and last["exit_code"] == 0


async def test_a_stream_is_refused_before_the_upgrade_without_the_lease(sb, http):
    with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
        await http.ws_connect(url(sb, "exec/stream"), headers={"Authorization": "Bearer nope"})
    assert refused.value.status == 403


async def test_a_bad_first_message_is_answered_on_the_socket(sb, http):
    async with http.ws_connect(url(sb, "exec/stream"), headers=auth(sb)) as ws:
        await ws.send_str(json.dumps({"cmd": []}))
        answer = await ws.receive_json()
        assert (answer["type"], answer["status"], answer["code"]) == (
            "error",
            422,
            "validation_error",
        )


# --- files ---------------------------------------------------------------------------


async def put(http, sb, path: str, data, route: str = "files", **query) -> tuple[int, dict]:
    params = {"path": path, **query}
    async with http.put(url(sb, route), params=params, data=data, headers=auth(sb)) as resp:
        return resp.status, await resp.json()


async def get(http, sb, path: str, route: str = "files") -> tuple[int, bytes]:
    async with http.get(url(sb, route), params={"path": path}, headers=auth(sb)) as resp:
        return resp.status, await resp.read()


async def test_a_binary_file_goes_in_and_out_identical_and_is_listed_and_removed(sb, http):
    data = os.urandom(3 * MiB) + b"\x00\xff"
    status, info = await put(http, sb, "/work/sub/dir/blob.bin", data, mode="384")
    assert status == 200, info
    assert (info["path"], info["type"], info["size"], info["mode"]) == (
        "/work/sub/dir/blob.bin",
        "file",
        len(data),
        0o600,
    )
    assert await get(http, sb, "/work/sub/dir/blob.bin") == (200, data)
    # over plain HTTP the kernel sends it from the file (sendfile): its length up front
    async with http.get(
        url(sb, "files"), params={"path": "/work/sub/dir/blob.bin"}, headers=auth(sb)
    ) as resp:
        assert resp.headers.get("Content-Length") == str(len(data)), resp.headers
        assert "Transfer-Encoding" not in resp.headers and await resp.read() == data
    status, listing = await get(http, sb, "/work/sub/dir", "files/list")
    entries = json.loads(listing)["entries"]
    assert [(e["name"], e["size"]) for e in entries] == [("blob.bin", len(data))]
    async with http.delete(
        url(sb, "files"), params={"path": "/work/sub"}, headers=auth(sb)
    ) as resp:
        assert resp.status == 200 and (await resp.json())["removed"]
    status, body = await get(http, sb, "/work/sub/dir/blob.bin")
    assert status == 404 and json.loads(body)["error"]["code"] == "no_such_file"


async def test_a_program_written_to_the_work_dir_or_tmp_runs_there(sb, http):
    for path in ("/work/hello.sh", "/tmp/hello.sh"):
        status, info = await put(http, sb, path, b"#!/bin/sh\necho hello\n", mode=str(0o755))
        assert (status, info["mode"]) == (200, 0o755), info
        assert (await run(http, sb, [path]))["stdout"] == "hello\n"


@pytest.mark.parametrize(
    "path", ["/etc/passwd", "/work/../etc/passwd", "/workx/a", "relative", "/tmp/../etc"]
)
async def test_paths_outside_the_work_dir_and_tmp_are_refused(sb, http, path):
    status, body = await get(http, sb, path)
    assert status == 400
    assert json.loads(body)["error"]["code"] in ("path_outside_workdir", "invalid_path")
    status, answer = await put(http, sb, path, b"x")
    assert status == 400, answer


async def test_a_symlink_out_of_the_work_dir_is_not_followed(sb, http):
    await run(http, sb, ["sh", "-c", "ln -s /etc /work/etc && ln -s /etc/passwd /tmp/pw"])
    for path in ("/work/etc/passwd", "/tmp/pw"):
        status, body = await get(http, sb, path)
        assert (status, json.loads(body)["error"]["code"]) == (400, "path_outside_workdir")
    status, answer = await put(http, sb, "/work/etc/evil", b"x")
    assert (status, answer["error"]["code"]) == (400, "path_outside_workdir")
    # writing over the link replaces the link, never the file it points to
    status, answer = await put(http, sb, "/tmp/pw", b"mine")
    assert status == 200 and answer["type"] == "file"
    passwd = await run(http, sb, ["cat", "/etc/passwd"])
    assert passwd["stdout"].startswith("root:")


async def test_a_file_past_the_space_is_413_and_leaves_nothing(sb, http):
    # declared: refused unread
    status, answer = await put(http, sb, "/tmp/big", b"x" * (65 * MiB))
    assert (status, answer["error"]["code"]) == (413, "file_too_large")

    answered = asyncio.Event()

    async def chunked() -> AsyncIterator[bytes]:  # undeclared: the file system says no
        for _ in range(70):
            yield b"y" * MiB
        await answered.wait()  # and the body stays open until then

    # The answer comes while the client still sends: once its write failed, the script's
    # end is seen though the engine takes no more of its input (before, the agent waited
    # on that input for as long as the engine held the connection: 15 to 94 s here).
    async with asyncio.timeout(BODY_IDLE_TIMEOUT_S):  # the agent waits on no body meanwhile
        status, answer = await put(http, sb, "/tmp/big", chunked())
    answered.set()
    assert (status, answer["error"]["code"]) == (413, "file_too_large"), answer
    left = await run(http, sb, ["sh", "-c", "ls -A /tmp; df -k /tmp | tail -1"])
    assert "big" not in left["stdout"] and "dsec" not in left["stdout"], left["stdout"]


async def test_a_directory_goes_in_and_out_as_a_tar(sb, http):
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, data in (("a.txt", b"alpha"), ("deep/b.bin", b"\x00\x01\xff")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    status, info = await put(http, sb, "/work/proj", out.getvalue(), "files/tar")
    assert status == 200 and info["type"] == "dir", info
    assert await get(http, sb, "/work/proj/deep/b.bin") == (200, b"\x00\x01\xff")
    status, archive = await get(http, sb, "/work/proj", "files/tar")
    assert status == 200
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        files = {m.name.removeprefix("./"): tar.extractfile(m).read() for m in tar if m.isfile()}
    assert files == {"a.txt": b"alpha", "deep/b.bin": b"\x00\x01\xff"}
    status, answer = await put(http, sb, "/work/proj2", b"not a tar at all", "files/tar")
    assert (status, answer["error"]["code"]) == (400, "invalid_tar")


async def test_files_need_the_lease_token(sb, http):
    params = {"path": "/work/x"}
    async with http.get(
        url(sb, "files"), params=params, headers={"Authorization": "Bearer x"}
    ) as r:
        assert r.status == 403


# --- the container log -----------------------------------------------------------


async def test_output_to_the_main_process_is_capped_in_the_container_log(sb, http, docker_client):
    # no command may write there: PID 1 runs as a user of its own (KEEPER_USER)
    refused = await run(http, sb, ["sh", "-c", "echo x > /proc/1/fd/1"])
    assert refused["exit_code"] != 0 and "denied" in refused["stderr"], refused
    # what the template's command writes, as its user, is capped
    [container] = docker_client.containers.list(filters={"label": f"{LABEL_SANDBOX}={sb.id}"})
    flood = container.exec_run(["timeout", "4", "sh", "-c", "yes > /proc/1/fd/1"], user=KEEPER_USER)
    assert flood.exit_code != 0  # cut by its timeout, never done
    log_path = docker_client.api.inspect_container(container.id)["LogPath"]

    def size_plus_one() -> int:  # 0 while the engine rotates the file (it is gone a moment)
        try:
            return os.path.getsize(log_path) + 1
        except FileNotFoundError:
            return 0

    size = await eventually(size_plus_one, "the container log to be there")
    assert size - 1 <= 2 * MiB  # the cap is one file of 1 MiB
