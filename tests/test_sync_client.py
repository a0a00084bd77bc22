"""SyncClient: the async SDK run on a loop of its own thread, blocking its caller.

Without Docker, against the agent double (tests/agent_double.py) served from a thread of
its own, since a SyncClient's caller blocks. With Docker (the `pool` fixture: real agents
and containers), end to end as a user's code runs it, in a thread of its own: output byte
for byte, streamed chunks in order, stdin through `cat`, binary files, directories, the
lease route, release. Those need the agent's side of issue 13 (/tmp/dsec-agent-ready).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_double import DoublePool, double_pool, in_background_loop

from dsec import (
    Client,
    DsecError,
    ExecChunk,
    ExecStream,
    Sandbox,
    SandboxFiles,
    SyncClient,
    SyncExecStream,
    SyncSandbox,
    SyncSandboxFiles,
)

BINARY = bytes(range(256)) * 64  # every byte value, NUL and invalid UTF-8 included


def make_tree(root: Path) -> Path:
    tree = root / "tree"
    (tree / "sub" / "deeper").mkdir(parents=True)
    (tree / "top.txt").write_text("top\n")
    (tree / "sub" / "deeper" / "blob.bin").write_bytes(BINARY)
    (tree / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (tree / "run.sh").chmod(0o755)
    return tree


def assert_same_tree(a: Path, b: Path) -> None:
    files = sorted(p.relative_to(a) for p in a.rglob("*"))
    assert files == sorted(p.relative_to(b) for p in b.rglob("*"))
    for rel in files:
        if (a / rel).is_file():
            assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel


def public_methods(cls: type) -> set[str]:
    return {
        name for name, value in vars(cls).items() if not name.startswith("_") and callable(value)
    }


# --- the twins ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("async_cls", "sync_cls"),
    [
        (Client, SyncClient),
        (Sandbox, SyncSandbox),
        (SandboxFiles, SyncSandboxFiles),
        (ExecStream, SyncExecStream),
    ],
)
def test_every_async_method_has_its_sync_twin(async_cls, sync_cls):
    missing = public_methods(async_cls) - set(dir(sync_cls))
    assert not missing, f"{sync_cls.__name__} lacks {sorted(missing)}"


# --- on the agent double ------------------------------------------------------------


@pytest.fixture(scope="module")
def double(tmp_path_factory) -> Iterator[DoublePool]:
    with in_background_loop(double_pool(tmp_path_factory.mktemp("double"))) as served:
        yield served


@pytest.fixture
def client(double: DoublePool) -> Iterator[SyncClient]:
    with SyncClient(double.url, double.client_token) as c:
        yield c


def test_exec_and_shell(client, double):
    sb = client.lease(double.sandbox_id)
    assert isinstance(sb, SyncSandbox) and sb.id == double.sandbox_id
    result = sb.exec(["printf", r"\377\000x"])
    assert (result.stdout_bytes, result.stdout, result.exit_code) == (
        b"\xff\x00x",
        "\ufffd\x00x",
        0,
    )
    assert sb.shell("echo hi | wc -c").stdout.strip() == "3"
    assert sb.shell("exit 5").exit_code == 5
    with pytest.raises(DsecError) as unknown:
        client.lease("double.0123456789abcdef")
    assert (unknown.value.status, unknown.value.code) == (404, "unknown_sandbox")


def test_exec_stream_is_a_plain_iterator(client, double):
    sb = client.lease(double.sandbox_id)
    stream = sb.exec_stream(["sh", "-c", "echo one; sleep 0.2; echo two >&2; exit 2"])
    assert list(stream) == [ExecChunk("stdout", b"one\n"), ExecChunk("stderr", b"two\n")]
    assert (stream.exit_code, stream.timed_out) == (2, False)
    with sb.exec_stream(["cat"], stdin=True) as st:
        st.write(BINARY)
        st.close_stdin()
        assert b"".join(chunk.data for chunk in st) == BINARY
    assert st.exit_code == 0
    with pytest.raises(DsecError) as finished:
        st.write(b"late")
    assert (finished.value.status, finished.value.code) == (409, "exec_finished")


def test_files_and_directories(client, double, tmp_path):
    sb = client.lease(double.sandbox_id)
    assert sb.files.write("/work/blob.bin", BINARY).size == len(BINARY)
    assert sb.files.read("/work/blob.bin") == BINARY
    assert "blob.bin" in [e.name for e in sb.files.list("/work")]
    sb.files.remove("/work/blob.bin")
    tree = make_tree(tmp_path)
    sb.files.upload(tree, "/work/tree")
    sb.files.download("/work/tree", tmp_path / "back")
    assert_same_tree(tree, tmp_path / "back")
    with pytest.raises(DsecError) as outside:
        sb.files.read("/etc/passwd")
    assert (outside.value.status, outside.value.code) == (400, "path_outside_workdir")


@pytest.mark.asyncio
async def test_usable_where_a_loop_already_runs(client, double):
    """As in a Jupyter cell: this coroutine's loop runs in the calling thread."""
    asyncio.get_running_loop()
    assert client.lease(double.sandbox_id).shell("echo from a cell").stdout == "from a cell\n"


def test_a_callback_cannot_call_back_in(client, double):
    sb = client.lease(double.sandbox_id)
    # the callback runs on the client's own loop: a blocking call there would wait forever
    stream = sb.exec_stream(["echo", "x"], on_chunk=lambda chunk: client.nodes())
    with pytest.raises(RuntimeError, match="its own loop"):
        stream.wait()


def test_close_ends_the_thread(double):
    before = {t for t in threading.enumerate() if t.name == "dsec-sync-client"}
    c = SyncClient(double.url, double.client_token)
    c.lease(double.sandbox_id)
    c.close()
    c.close()  # twice is fine
    assert {t for t in threading.enumerate() if t.name == "dsec-sync-client"} == before
    with pytest.raises(RuntimeError, match="closed"):
        c.lease(double.sandbox_id)


# --- end to end, on real agents (docker) ---------------------------------------------
# Each scenario runs in a thread of its own, as a user's code would, while this module's
# loop keeps serving the pool's processes.

live = pytest.mark.asyncio(loop_scope="module")


@live
async def test_live_exec_is_bytes_safe(pool):
    def scenario() -> None:
        with SyncClient(pool.url, pool.tokens.client) as c, c.sandbox() as sb:
            result = sb.exec(["printf", r"\377\000x"])
            assert result.stdout_bytes == b"\xff\x00x"
            assert result.stdout == "\ufffd\x00x"
            assert sb.shell("echo hi | wc -c").stdout.strip() == "3"
            failed = sb.shell("echo out; echo err >&2; exit 7")
            assert (failed.exit_code, failed.stdout, failed.stderr) == (7, "out\n", "err\n")
            slow = sb.exec(["sleep", "30"], timeout=1)
            assert (slow.exit_code, slow.timed_out) == (124, True)

    await asyncio.to_thread(scenario)


@live
async def test_live_exec_stream_order_and_stdin(pool):
    def scenario() -> None:
        with SyncClient(pool.url, pool.tokens.client) as c, c.sandbox() as sb:
            script = "echo one; sleep 0.3; echo two >&2; sleep 0.3; echo three; exit 3"
            stream = sb.exec_stream(["sh", "-c", script], timeout=30)
            assert list(stream) == [
                ExecChunk("stdout", b"one\n"),
                ExecChunk("stderr", b"two\n"),
                ExecChunk("stdout", b"three\n"),
            ]
            assert (stream.exit_code, stream.timed_out, stream.truncated) == (3, False, False)
            with sb.exec_stream(["cat"], stdin=True, timeout=30) as st:
                st.write(BINARY[:5000])
                st.write(BINARY[5000:])
                st.close_stdin()
                assert b"".join(chunk.data for chunk in st) == BINARY
            assert st.exit_code == 0
            with pytest.raises(DsecError) as finished:
                st.write(b"late")
            assert (finished.value.status, finished.value.code) == (409, "exec_finished")
            big = sb.exec_stream(["sh", "-c", "yes abcdefgh | head -c 3000000"], timeout=60)
            assert sum(len(chunk.data) for chunk in big) == 3_000_000  # past the one-shot cap
            assert big.exit_code == 0 and not big.truncated

    await asyncio.to_thread(scenario)


@live
async def test_live_files_round_trip(pool, tmp_path):
    def scenario() -> None:
        with SyncClient(pool.url, pool.tokens.client) as c, c.sandbox() as sb:
            info = sb.files.write("/work/blob.bin", BINARY, mode=0o600)
            assert (info.size, info.mode, info.type) == (len(BINARY), 0o600, "file")
            assert sb.files.read("/work/blob.bin") == BINARY
            assert sb.exec(["cat", "/work/blob.bin"]).stdout_bytes == BINARY
            assert "blob.bin" in [e.name for e in sb.files.list("/work")]
            assert sb.files.remove("/work/blob.bin").removed
            with pytest.raises(DsecError) as gone:
                sb.files.read("/work/blob.bin")
            assert (gone.value.status, gone.value.code) == (404, "no_such_file")
            with pytest.raises(DsecError) as outside:
                sb.files.write("/etc/evil", b"x")
            assert (outside.value.status, outside.value.code) == (400, "path_outside_workdir")
            tree = make_tree(tmp_path)
            sb.files.upload(tree, "/work/tree")
            # its mode came along (run by sh: Docker mounts the work dir noexec)
            assert sb.exec(["stat", "-c", "%a", "/work/tree/run.sh"]).stdout == "755\n"
            assert sb.exec(["sh", "/work/tree/run.sh"]).stdout == "ran\n"
            sb.files.download("/work/tree", tmp_path / "back")
            assert_same_tree(tree, tmp_path / "back")

    await asyncio.to_thread(scenario)


@live
async def test_live_lease_from_another_process_and_release(pool):
    def scenario() -> None:
        with SyncClient(pool.url, pool.tokens.client) as c:
            with c.sandbox() as sb:
                sb.files.write("/work/note", b"kept")
                # another client (the CLI, say) with the same token finds it by id alone
                with SyncClient(pool.url, pool.tokens.client) as elsewhere:
                    again = elsewhere.lease(sb.id)
                    assert again.exec(["cat", "/work/note"]).stdout == "kept"
            with pytest.raises(DsecError) as released:
                c.lease(sb.id)
            assert released.value.status in (404, 410), released.value

    await asyncio.to_thread(scenario)


@live
async def test_live_fork_gives_sync_sandboxes_with_the_source_s_files(pool):
    def scenario() -> None:
        with SyncClient(pool.url, pool.tokens.client) as c, c.sandbox() as sb:
            sb.files.write("/work/state.bin", BINARY)
            forks = sb.fork(2)
            try:
                assert all(isinstance(f, SyncSandbox) for f in forks)
                assert len({f.id for f in forks} | {sb.id}) == 3
                for f in forks:
                    assert f.files.read("/work/state.bin") == BINARY
            finally:
                for f in forks:
                    f.release()

    await asyncio.to_thread(scenario)
