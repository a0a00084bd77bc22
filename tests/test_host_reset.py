"""The host's side of a reset (agent/host.py) on real files and a real IPC namespace:
what a tenant leaves is removed, and nothing it points at outside is touched.
The whole reset on a real sandbox is in tests/test_recycle_live.py."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys

import pytest

from agent.host import _clear_ipc, _empty, in_own_thread

SHM_SCRIPT = """
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
ids = [libc.shmget(0, 4096, 0o1600), libc.semget(0, 1, 0o1600), libc.msgget(0, 0o1600)]
assert min(ids) >= 0, ctypes.get_errno()
print("ready", flush=True)
sys.stdin.read()
libc.shmctl(ids[0], 0, None); libc.semctl(ids[1], 0, 0); libc.msgctl(ids[2], 0, None)
"""


def sysvipc(pid: int | None = None) -> list[str]:
    """The SysV IPC objects of process `pid`'s IPC namespace (the caller's by default),
    read from inside it."""
    files = ["/proc/sysvipc/shm", "/proc/sysvipc/sem", "/proc/sysvipc/msg"]
    enter = [] if pid is None else ["nsenter", "-t", str(pid), "-i"]
    out = subprocess.run([*enter, "cat", *files], capture_output=True, text=True, check=True)
    return [line for line in out.stdout.splitlines() if line.split()[0] != "key"]


def test_emptying_removes_everything_and_follows_no_symlink(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    work = root / "work"
    (work / "d" / "e").mkdir(parents=True)
    outside.mkdir()
    (outside / "keep").write_text("kept")
    (work / ".dot").write_text("x")
    (work / "d" / "e" / "f").write_text("x")
    (work / "out").symlink_to(outside)  # an absolute link out of the sandbox
    (work / "d" / "keep").symlink_to(outside / "keep")
    (work / "up").symlink_to("../..")
    (work / "d").chmod(0)
    fd = os.open(root, os.O_PATH | os.O_DIRECTORY)
    try:
        assert _empty(fd, "/work") == []
        assert _empty(fd, "/missing") == []  # not there: nothing in it
    finally:
        os.close(fd)
    assert list(work.iterdir()) == []
    assert (outside / "keep").read_text() == "kept"


def test_a_directory_that_is_a_symlink_is_refused_and_its_target_kept(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "keep").write_text("kept")
    (root / "tmp").symlink_to(outside)
    fd = os.open(root, os.O_PATH | os.O_DIRECTORY)
    try:
        [problem] = _empty(fd, "/tmp")
        assert _empty(fd, "/../outside") == ["dir /../outside: a path with '..'"]
    finally:
        os.close(fd)
    assert problem.startswith("dir /tmp: ")
    assert (outside / "keep").read_text() == "kept"


def test_a_tree_too_deep_to_walk_is_reported_not_left_silently(tmp_path):
    root = tmp_path / "root"
    deep = root / "work"
    deep.mkdir(parents=True)
    levels = sys.getrecursionlimit() + 100  # deeper than Python's walk can go
    fd = os.open(deep, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(levels):
            os.mkdir("a", dir_fd=fd)
            nxt = os.open("a", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nxt
    finally:
        os.close(fd)
    fd = os.open(root, os.O_PATH | os.O_DIRECTORY)
    try:
        assert _empty(fd, "/work") == ["file /work/a"]
    finally:
        os.close(fd)
        for level in range(levels, 0, -1):  # bottom up: pytest's cleanup walks it as rmtree
            with contextlib.suppress(FileNotFoundError):
                os.rmdir(deep.joinpath(*["a"] * level))


@pytest.mark.skipif(os.geteuid() != 0, reason="joining another IPC namespace takes root")
async def test_sysv_ipc_of_the_sandbox_is_removed_and_the_hosts_kept():
    mine = subprocess.Popen(  # the host's own: must stay
        [sys.executable, "-c", SHM_SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    theirs = subprocess.Popen(  # in an IPC namespace of its own, as a sandbox
        ["unshare", "--ipc", sys.executable, "-c", SHM_SCRIPT], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert mine.stdout.readline() == theirs.stdout.readline() == "ready\n"
        ours_before = sysvipc()
        assert len(sysvipc(theirs.pid)) == 3
        assert await in_own_thread(lambda: _clear_ipc(theirs.pid)) == []
        assert sysvipc(theirs.pid) == []
        assert sysvipc() == ours_before and len(ours_before) >= 3
        # the thread that joined it has ended: this one is still in the host's
        assert await asyncio.to_thread(sysvipc) == ours_before
    finally:
        for proc in (mine, theirs):  # each removes its own (the host's would outlive it)
            proc.communicate("")
