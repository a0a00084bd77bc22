"""The async SDK's exec, streaming exec and files, against the agent double
(tests/agent_double.py) behind a control plane in this process: how the SDK speaks the
agent's contract and turns its answers and refusals into results and DsecErrors, with
no Docker. tests/test_sync_client.py runs the same scenarios against real agents."""

from __future__ import annotations

import asyncio
import io
import tarfile
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from agent_double import DoublePool, double_pool

from dsec.client import Client, DsecError, ExecChunk, Sandbox, _untar_into

pytestmark = pytest.mark.asyncio(loop_scope="module")

BINARY = bytes(range(256)) * 64  # every byte value, NUL and invalid UTF-8 included


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pool(tmp_path_factory) -> AsyncIterator[DoublePool]:
    async with double_pool(tmp_path_factory.mktemp("double"), max_execs=2) as p:
        yield p


@pytest_asyncio.fixture(loop_scope="module")
async def sb(pool: DoublePool) -> AsyncIterator[Sandbox]:
    async with Client(pool.url, token=pool.client_token) as client:
        yield await client.lease(pool.sandbox_id)  # as the CLI finds it


async def test_exec_gives_bytes_and_text(sb):
    result = await sb.exec(["printf", r"\377\000x"])
    assert result.stdout_bytes == b"\xff\x00x"  # base64 on the wire: byte for byte
    assert result.stdout == "\ufffd\x00x"  # text: undecodable bytes replaced
    assert (result.exit_code, result.timed_out, result.truncated) == (0, False, False)
    failed = await sb.shell("echo out; echo err >&2; exit 3")
    assert (failed.exit_code, failed.stdout, failed.stderr) == (3, "out\n", "err\n")
    capped = await sb.shell("printf 0123456789", max_output_bytes=4)
    assert (capped.stdout_bytes, capped.truncated) == (b"0123", True)
    slow = await sb.exec(["sleep", "5"], timeout=0.3)
    assert (slow.exit_code, slow.timed_out) == (124, True)


async def test_exec_stream_yields_chunks_in_order(sb):
    script = "echo one; sleep 0.2; echo two >&2; sleep 0.2; echo three; exit 4"
    stream = sb.exec_stream(["sh", "-c", script])
    assert stream.exit_code is None  # before the end
    chunks = [chunk async for chunk in stream]  # no `async with`: opens on first use
    assert chunks == [
        ExecChunk("stdout", b"one\n"),
        ExecChunk("stderr", b"two\n"),
        ExecChunk("stdout", b"three\n"),
    ]
    assert (stream.exit_code, stream.timed_out, stream.truncated) == (4, False, False)
    assert stream.duration_ms >= 400


async def test_exec_stream_takes_stdin(sb):
    async with sb.exec_stream(["cat"], stdin=True) as st:
        await st.write(BINARY[:1000])
        await st.write(BINARY[1000:])
        await st.close_stdin()
        echoed = b"".join([chunk.data async for chunk in st])
    assert echoed == BINARY
    assert st.exit_code == 0
    with pytest.raises(DsecError) as finished:
        await st.write(b"late")
    assert (finished.value.status, finished.value.code) == (409, "exec_finished")
    async with sb.exec_stream(["true"]) as no_stdin:
        with pytest.raises(DsecError, match="stdin") as refused:
            await no_stdin.write(b"x")
        assert refused.value.code == "stdin_closed"


async def test_exec_stream_asks_for_a_terminal_and_resizes_it(pool, sb):
    async with sb.exec_stream(["sleep", "0.3"], tty=True, rows=33, cols=101) as st:
        await st.resize(40, 120)
        await st.wait()
    asked = pool.agent.stream_requests[-1]
    assert (asked.tty, asked.rows, asked.cols, asked.stdin) == (True, 33, 101, False)
    assert pool.agent.resizes[-1] == (40, 120)


async def test_exec_stream_callback_and_wait(sb):
    seen: list[ExecChunk] = []
    exit_ = await sb.exec_stream(["sh", "-c", "echo a; echo b >&2"], on_chunk=seen.append).wait()
    assert exit_.exit_code == 0
    assert sorted(c.data for c in seen) == [b"a\n", b"b\n"]


async def test_a_refused_stream_says_why(pool, sb):
    # the double runs 2 execs at once: a third is refused before the upgrade (429)
    async with sb.exec_stream(["sleep", "5"]) as one, sb.exec_stream(["sleep", "5"]) as two:
        assert one and two
        with pytest.raises(DsecError) as refused:
            async with sb.exec_stream(["true"]):
                pass
    assert (refused.value.status, refused.value.code) == (429, "too_many_execs")
    assert "2 execs" in refused.value.message  # the agent's own words, from its body
    with pytest.raises(DsecError) as one_shot:
        await asyncio.gather(*(sb.exec(["sleep", "0.5"]) for _ in range(3)))
    assert (one_shot.value.status, one_shot.value.code) == (429, "too_many_execs")
    await asyncio.sleep(0.6)  # the other two end
    stranger = Sandbox(sb.client, sb.lease.model_copy(update={"lease_token": "0" * 64}))
    with pytest.raises(DsecError) as forbidden:
        await stranger.exec_stream(["true"]).wait()
    assert (forbidden.value.status, forbidden.value.code) == (403, "forbidden")


async def test_files_round_trip_binary(sb):
    info = await sb.files.write("/work/data.bin", BINARY, mode=0o640)
    assert (info.path, info.type, info.size, info.mode) == ("/work/data.bin", "file", 16384, 0o640)
    assert await sb.files.read("/work/data.bin") == BINARY

    async def pieces():
        for i in range(0, len(BINARY), 1000):
            yield BINARY[i : i + 1000]

    await sb.files.write("/tmp/streamed.bin", pieces())  # sent as it comes
    assert await sb.files.read("/tmp/streamed.bin") == BINARY
    assert "data.bin" in [e.name for e in await sb.files.list("/work")]
    assert (await sb.files.remove("/work/data.bin")).removed
    with pytest.raises(DsecError) as gone:
        await sb.files.read("/work/data.bin")
    assert (gone.value.status, gone.value.code) == (404, "no_such_file")
    for outside in ("/etc/passwd", "/work/../etc/passwd"):
        with pytest.raises(DsecError) as refused:
            await sb.files.write(outside, b"x")
        assert (refused.value.status, refused.value.code) == (400, "path_outside_workdir")


async def test_tar_and_directories(sb, tmp_path):
    tree = tmp_path / "tree"
    (tree / "sub" / "deeper").mkdir(parents=True)
    (tree / "top.txt").write_text("top\n")
    (tree / "sub" / "deeper" / "blob.bin").write_bytes(BINARY)
    (tree / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (tree / "run.sh").chmod(0o755)
    await sb.files.upload(tree, "/work/tree")
    assert await sb.files.is_dir("/work/tree")
    assert not await sb.files.is_dir("/work/tree/top.txt")
    assert not await sb.files.is_dir("/work/nothing-here")
    assert await sb.files.is_dir("/work")
    assert (await sb.shell("./tree/run.sh")).stdout == "ran\n"  # its mode came along
    back = tmp_path / "back"
    await sb.files.download("/work/tree", back)
    assert (back / "top.txt").read_text() == "top\n"
    assert (back / "sub" / "deeper" / "blob.bin").read_bytes() == BINARY
    # a single file both ways
    await sb.files.upload(tree / "top.txt", "/tmp/top.txt")
    assert (await sb.files.download("/tmp/top.txt", tmp_path / "t.txt")).read_text() == "top\n"
    # a failed download leaves what was there as it was
    with pytest.raises(DsecError) as missing:
        await sb.files.download("/tmp/missing.txt", tmp_path / "t.txt")
    assert missing.value.code == "no_such_file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["back", "t.txt", "tree"]
    assert (tmp_path / "t.txt").read_text() == "top\n"
    # read_tar is the directory's contents
    with tarfile.open(fileobj=io.BytesIO(await sb.files.read_tar("/work/tree"))) as tar:
        assert {"top.txt", "run.sh", "sub/deeper/blob.bin"} <= set(tar.getnames())


async def test_an_archive_from_a_sandbox_cannot_land_outside(tmp_path):
    """download() unpacks what a sandbox sent: whatever its tenant put there."""
    for member in (
        tarfile.TarInfo("../escaped.txt"),
        _symlink("link", "/etc/passwd"),
        _symlink("up", "../../outside"),
    ):
        hostile = io.BytesIO()
        with tarfile.open(fileobj=hostile, mode="w") as tar:
            tar.addfile(member, io.BytesIO(b"") if member.isfile() else None)
        hostile.seek(0)
        with pytest.raises(tarfile.FilterError):
            _untar_into(hostile, tmp_path / "dest")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dest"]
    assert not any((tmp_path / "dest").iterdir())


def _symlink(name: str, target: str) -> tarfile.TarInfo:
    member = tarfile.TarInfo(name)
    member.type, member.linkname = tarfile.SYMTYPE, target
    return member
