"""Issue 28's attacks on the file API, and its neighbours: a tenant (or its workload)
that plants symlinks, swaps them in while a write runs, or sends hostile archives and
query strings. Raw HTTP against a real agent and real sandboxes; what landed where is
read back by commands inside the sandbox, as the tenant would see it."""

# ruff: noqa: F811 - the fixtures `sb` and `http` are test_data_plane's, named by the tests

from __future__ import annotations

import asyncio
import io
import json
import tarfile
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from conftest import eventually, make_spec, started_pool
from test_data_plane import auth, get, http, put, run, sb, url  # noqa: F401

from dsec.launch.local import LocalPool

pytestmark = pytest.mark.asyncio(loop_scope="module")
MiB = 1 << 20


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pool(docker_client, tmp_path_factory) -> AsyncIterator[LocalPool]:
    async with started_pool(
        make_spec(tmp_path_factory.mktemp("files"), nodes=1), docker_client
    ) as p:
        yield p


async def sh(http, sb, script: str) -> str:
    answer = await run(http, sb, ["sh", "-c", script])
    assert answer["exit_code"] == 0, answer
    return answer["stdout"]


def tar_of(*members: tuple[tarfile.TarInfo, bytes]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for info, data in members:
            info.size = len(data) if info.isreg() else 0
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return out.getvalue()


def member(name: str, kind: bytes = tarfile.REGTYPE, linkname: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, linkname, 0o644
    return info


async def code_of(http, sb, method: str, route: str, path: str) -> tuple[int, str]:
    async with http.request(method, url(sb, route), params={"path": path}, headers=auth(sb)) as r:
        return r.status, json.loads(await r.read())["error"]["code"]


async def test_attack_2_a_write_onto_a_symlink_to_a_directory_elsewhere_replaces_the_link(sb, http):
    """Before: `mv -f tmp /work/shm` followed the link and moved the file into
    /dev/shm, and answered 200."""
    await sh(http, sb, "ln -s /dev/shm /work/shm")
    status, info = await put(http, sb, "/work/shm", b"mine")
    assert (status, info["type"]) == (200, "file"), info
    assert await sh(http, sb, "ls -A /dev/shm") == ""
    assert await get(http, sb, "/work/shm") == (200, b"mine")


async def test_attack_3_a_tar_member_onto_a_symlink_outside_replaces_it_or_is_refused(sb, http):
    """Before: `cp -a` wrote the member through the link into the file outside; a member
    under a link to a directory outside was refused as a misleading 413."""
    await sh(
        http,
        sb,
        "echo orig > /dev/shm/victim && mkdir /work/proj && "
        "ln -s /dev/shm/victim /work/proj/pw && ln -s /dev/shm /work/proj/d",
    )
    status, info = await put(http, sb, "/work/proj", tar_of((member("pw"), b"evil")), "files/tar")
    assert status == 200, info
    assert await sh(http, sb, "cat /dev/shm/victim") == "orig\n"
    assert (
        await sh(http, sb, "test -f /work/proj/pw && ! test -L /work/proj/pw && cat /work/proj/pw")
        == "evil"
    )
    status, answer = await put(
        http, sb, "/work/proj", tar_of((member("d/x"), b"evil")), "files/tar"
    )
    assert (status, answer["error"]["code"]) == (400, "path_outside_workdir"), answer
    assert await sh(http, sb, "ls -A /dev/shm; ls -A /work/proj") == "victim\nd\npw\n"


async def test_attack_5_a_mode_of_a_unicode_digit_is_a_400_naming_the_rule(sb, http):
    """Before: "²" passed str.isdigit, and int() raised: 500."""
    for mode in ("²", "0x1ff", "-1", "4096" + "0", str(0o7777 + 1)):
        status, answer = await put(http, sb, "/work/m", b"x", mode=mode)
        assert (status, answer["error"]["code"]) == (400, "invalid_mode"), (mode, answer)
        assert "ASCII" in answer["error"]["message"]
    status, info = await put(http, sb, "/work/m", b"x", mode=str(0o640))
    assert (status, info["mode"]) == (200, 0o640), info


async def test_a_symlink_as_an_intermediate_component_is_refused_even_to_inside(sb, http):
    await sh(http, sb, "mkdir /work/real && echo in > /work/real/f && ln -s /work/real /work/lnk")
    for method, route in (
        ("GET", "files"),
        ("GET", "files/list"),
        ("GET", "files/tar"),
        ("DELETE", "files"),
    ):
        target = "/work/lnk" if route != "files" else "/work/lnk/f"
        assert await code_of(http, sb, method, route, target) == (400, "path_outside_workdir")
    status, answer = await put(http, sb, "/work/lnk/new", b"x")
    assert (status, answer["error"]["code"]) == (400, "path_outside_workdir"), answer
    status, answer = await put(http, sb, "/work/lnk", tar_of((member("t"), b"x")), "files/tar")
    assert (status, answer["error"]["code"]) == (400, "path_outside_workdir"), answer
    assert await sh(http, sb, "ls -A /work/real") == "f\n"


async def _write_while(http, sb, path: str, in_dir: str, swap: str) -> tuple[int, dict]:
    """PUT `path` in two chunks, running `swap` in the sandbox once the write's
    temporary file is in `in_dir` (its directory is open, the first chunk written)."""
    swapped = asyncio.Event()

    async def body() -> AsyncIterator[bytes]:
        yield b"first "
        await swapped.wait()
        yield b"second"

    async def swap_in() -> None:
        async def begun() -> bool:
            return ".dsec-upload-" in await sh(http, sb, f"ls -A {in_dir}")

        await eventually(begun, "the write's temporary file")
        await sh(http, sb, swap)
        swapped.set()

    answer, _ = await asyncio.gather(put(http, sb, path, body()), swap_in())
    return answer


async def test_a_symlink_swapped_in_while_a_write_runs_is_never_followed(sb, http):
    # for the file's own name: the rename replaces the link (mv moved the file into it)
    status, info = await _write_while(http, sb, "/work/name", "/work", "ln -s /dev/shm /work/name")
    assert (status, info["type"]) == (200, "file"), info
    assert await sh(http, sb, "ls -A /dev/shm; cat /work/name") == "first second"
    # for its directory: the write stays in the directory it opened
    await sh(http, sb, "mkdir /work/d")
    swap = "mv /work/d /work/d.old && ln -s /dev/shm /work/d"
    status, info = await _write_while(http, sb, "/work/d/f", "/work/d", swap)
    assert status == 200, info
    assert await sh(http, sb, "ls -A /dev/shm; ls -A /work/d.old; cat /work/d.old/f") == (
        "f\nfirst second"
    )


@pytest.mark.parametrize(
    "members",
    [
        [(member("../escape"), b"x")],
        [(member("/abs"), b"x")],
        [(member("ok"), b"x"), (member("h", tarfile.LNKTYPE, "/etc/passwd"), b"")],
        [(member("h", tarfile.LNKTYPE, "../../etc/passwd"), b"")],
        [(member("h", tarfile.LNKTYPE, "not-in-the-archive"), b"")],
        [(member("l", tarfile.SYMTYPE, "/dev/shm"), b""), (member("l/through"), b"x")],
    ],
    ids=[
        "dotdot",
        "absolute",
        "hardlink-absolute",
        "hardlink-out",
        "hardlink-missing",
        "symlink-then-file",
    ],
)
async def test_a_tar_member_that_would_land_outside_is_refused_and_leaves_nothing(
    sb, http, members
):
    status, answer = await put(http, sb, "/work/t", tar_of(*members), "files/tar")
    assert (status, answer["error"]["code"]) == (400, "path_outside_workdir"), answer
    assert await sh(http, sb, "find /work /dev/shm -mindepth 1") == "/work/t\n"


async def test_a_tar_with_a_device_is_refused(sb, http):
    status, answer = await put(
        http, sb, "/work/t", tar_of((member("null", tarfile.CHRTYPE), b"")), "files/tar"
    )
    assert (status, answer["error"]["code"]) == (400, "invalid_tar"), answer


async def test_a_tar_past_the_space_is_413_and_leaves_nothing(sb, http):
    big = tar_of((member("small"), b"s"), (member("big"), b"y" * (70 * MiB)))

    async def undeclared() -> AsyncIterator[bytes]:  # the file system says no, not the agent
        for at in range(0, len(big), MiB):
            yield big[at : at + MiB]

    status, answer = await put(http, sb, "/tmp/t", undeclared(), "files/tar")
    assert (status, answer["error"]["code"]) == (413, "file_too_large"), answer
    assert await sh(http, sb, "ls -A /tmp/t") == ""


async def test_files_written_belong_to_the_sandbox_user(sb, http):
    user = (await sh(http, sb, "echo $(id -u):$(id -g)")).strip()
    assert (await put(http, sb, "/work/own/f", b"x"))[0] == 200
    tar = tar_of((member("dir", tarfile.DIRTYPE), b""), (member("dir/g"), b"y"))
    assert (await put(http, sb, "/tmp/own", tar, "files/tar"))[0] == 200
    owners = await sh(
        http, sb, "stat -c %u:%g /work/own /work/own/f /tmp/own /tmp/own/dir /tmp/own/dir/g"
    )
    assert owners.split() == [user] * 5


async def test_a_file_the_user_may_not_read_is_refused(sb, http):
    await sh(http, sb, "echo secret > /work/s && chmod 000 /work/s && mkdir -m 500 /work/ro")
    assert await code_of(http, sb, "GET", "files", "/work/s") == (403, "permission_denied")
    status, answer = await put(http, sb, "/work/ro/f", b"x")
    assert (status, answer["error"]["code"]) == (403, "permission_denied"), answer
