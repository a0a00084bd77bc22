"""Files in a sandbox, for the client holding the lease: write, read, list, remove, and
a directory as a tar either way.

Every operation is done from the host, in the container's own view of its files: from
/proc/<its init>/root (checked, once open, to be that container's init), the work dir
or /tmp is opened, and everything under it is resolved with openat2(2)'s
RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV: a
symlink at any component, a `..` or another file system on the way is refused (400
`path_outside_workdir`), whatever the sandbox changes meanwhile, since each step is
taken from a directory already open. Nothing is copied or moved through a path: a file
is written into a temporary file made (O_EXCL) in its directory and renamed onto its
name relative to that directory, which replaces a symlink there and never follows it;
a tar is unpacked member by member the same way, into a staging directory first, so
an archive that does not fit or is refused leaves nothing behind.

Each operation runs in a thread of its own whose file system uid and gid (setfsuid,
setfsgid: per thread) are the sandbox user's, with no supplementary group: the files
it makes are that user's, and the kernel refuses it what it would refuse the user (a
mode-000 file: 403 `permission_denied`). A tenant's slow or huge operation holds no
thread that another needs. The agent needs the host's PIDs for this (`--pid host` in a
container): without them files answer 503 `files_unavailable`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import errno
import os
import platform
import posixpath
import re
import secrets
import select
import shutil
import stat
import tarfile
import threading
import zlib
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import BinaryIO, TypeVar

from agent.docker_driver import AsyncDocker, DockerOpError
from agent.host import in_own_thread, open_in_container
from agent.sandboxes import Sandbox
from agent.users import numeric_user
from dsec.httpkit import ApiError
from dsec.models import FileInfo, FileList, FileType

T = TypeVar("T")
MAX_PATH = 4096
MAX_DEPTH = 256  # directories deep a tar of a directory goes (each level holds an fd)
CHUNK = 1 << 20  # bytes a read step hands the event loop
DEFAULT_FILE_MODE = 0o644  # as the sandbox's own `cat >` made them (umask 022)
DIR_MODE = 0o755
# ASCII digits only: str.isdigit takes "²", which int() refuses
MODE_PATTERN = re.compile(r"[0-9]{1,5}")
UPLOAD_PREFIX = ".dsec-upload-"
UNTAR_PREFIX = ".dsec-untar-"

SYS_OPENAT2 = 437  # the same on x86_64 and aarch64
SYS_SETGROUPS = {"x86_64": 116, "aarch64": 159}.get(platform.machine(), 116)
RESOLVE_NO_XDEV, RESOLVE_NO_MAGICLINKS, RESOLVE_NO_SYMLINKS = 0x01, 0x02, 0x04
RESOLVE_BENEATH, RESOLVE_IN_ROOT = 0x08, 0x10
BENEATH = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV
IN_ROOT = RESOLVE_IN_ROOT | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS
_libc = ctypes.CDLL(None, use_errno=True)


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def openat2(dir_fd: int, path: str, flags: int, mode: int = 0, resolve: int = BENEATH) -> int:
    how = _OpenHow(flags | os.O_CLOEXEC, mode, resolve)
    encoded = os.fsencode(path)
    fd = _libc.syscall(SYS_OPENAT2, dir_fd, encoded, ctypes.byref(how), ctypes.sizeof(how))
    if fd < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), path)
    return fd


def _become(uid: int, gid: int) -> None:
    """Take `uid` and `gid` as this thread's file system ids, with no supplementary
    group. The raw setgroups call changes this thread alone (glibc's changes them all);
    a non-root fsuid drops the file capabilities (CAP_DAC_OVERRIDE and the rest)."""
    if _libc.syscall(SYS_SETGROUPS, 0, None) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"setgroups: {os.strerror(code)}")
    _libc.setfsgid(gid)
    _libc.setfsuid(uid)
    if _libc.setfsgid(-1) != gid or _libc.setfsuid(-1) != uid:  # -1: asks, changes nothing
        raise OSError(errno.EPERM, f"could not take uid {uid} and gid {gid} for files")


NO_ROOM = (413, "file_too_large", "does not fit in the sandbox's space (nothing was written)")
DENIED = (403, "permission_denied", "is not the sandbox user's to do this to")
# what an error of the kernel's means as an answer
REFUSALS = {
    errno.ENOENT: (404, "no_such_file", "does not exist"),
    errno.ELOOP: (400, "path_outside_workdir", "has a symlink on its way, which is not followed"),
    errno.EXDEV: (400, "path_outside_workdir", "leaves the work dir and /tmp"),
    errno.EISDIR: (400, "is_a_directory", "is a directory"),
    errno.ENOTDIR: (400, "not_a_directory", "is not a directory"),
    errno.ENOSPC: NO_ROOM,
    errno.EDQUOT: NO_ROOM,
    errno.EFBIG: NO_ROOM,
    errno.EACCES: DENIED,
    errno.EPERM: DENIED,
    errno.ENAMETOOLONG: (400, "invalid_path", "is too long a name"),
}


def _refusal(e: OSError, path: str) -> ApiError:
    failed = (502, "file_operation_failed", f"failed: {e.strerror}")
    status, code, what = REFUSALS.get(e.errno or 0, failed)
    return ApiError(status, code, f"{path[:200]!r} {what}")


@contextlib.contextmanager
def _answering(path: str) -> Iterator[None]:
    try:
        yield
    except OSError as e:
        raise _refusal(e, path) from e


def checked_path(raw: str | None, roots: tuple[str, ...]) -> str:
    """The path as asked, refused before anything runs when it plainly leaves the roots."""
    if not raw:
        raise ApiError(400, "invalid_path", "give the file's path: ?path=/work/...")
    if "\x00" in raw or not raw.startswith("/") or len(raw) > MAX_PATH:
        raise ApiError(400, "invalid_path", f"not an absolute path: {raw[:200]!r}")
    normal = posixpath.normpath(raw)
    if ".." in raw.split("/") or not any(normal == r or normal.startswith(r + "/") for r in roots):
        raise ApiError(
            400, "path_outside_workdir", f"{raw[:200]!r} is outside {' and '.join(roots)}"
        )
    return normal


def checked_mode(raw: str | None) -> int | None:
    """`?mode=`: the permission bits as a decimal number of ASCII digits, up to 0o7777."""
    if not raw:
        return None
    if not MODE_PATTERN.fullmatch(raw) or int(raw) > 0o7777:
        raise ApiError(
            400,
            "invalid_mode",
            f"mode is the permission bits as a decimal number of ASCII digits, 0 to "
            f"{0o7777} (420 for 0644): {raw[:20]!r}",
        )
    return int(raw)


def _file_type(mode: int) -> FileType:
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "link"
    return "file" if stat.S_ISREG(mode) else "other"


def _info(path: str, st: os.stat_result) -> FileInfo:
    return FileInfo(
        path=path,
        name=posixpath.basename(path),
        type=_file_type(st.st_mode),
        size=st.st_size,
        mode=stat.S_IMODE(st.st_mode),
        mtime=float(int(st.st_mtime)),
    )


def _lstat(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _mkdir(dir_fd: int, name: str, mode: int) -> None:
    """A new directory `name` with exactly `mode` (the agent's umask left out); one that
    is there already is kept."""
    try:
        os.mkdir(name, 0o700, dir_fd=dir_fd)
    except FileExistsError:
        return
    fd = openat2(dir_fd, name, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def _open_dir(dir_fd: int, parts: list[str], create: bool, flags: int = os.O_PATH) -> int:
    """Directory `parts` under `dir_fd`, made (DIR_MODE) where missing if `create`."""
    relative = "/".join(parts) or "."
    try:
        return openat2(dir_fd, relative, flags | os.O_DIRECTORY)
    except FileNotFoundError:
        if not create:
            raise
    fd = os.dup(dir_fd)
    for i, part in enumerate(parts):
        try:
            _mkdir(fd, part, DIR_MODE)
            nxt = openat2(fd, part, (flags if i == len(parts) - 1 else os.O_PATH) | os.O_DIRECTORY)
        finally:
            os.close(fd)
        fd = nxt
    return fd


def _write_into(
    dir_fd: int, name: str, chunks: Iterator[bytes], mode: int, mtime: float | None = None
) -> None:
    """`chunks` as file `name` in directory `dir_fd`: a temporary file made there, renamed
    onto the name (a symlink there is replaced, not followed); nothing stays on failure."""
    temp = UPLOAD_PREFIX + secrets.token_hex(8)
    fd = openat2(dir_fd, temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            for chunk in chunks:
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view) :]
            os.fchmod(fd, mode)
            if mtime is not None:
                os.utime(fd, (mtime, mtime))
        finally:
            os.close(fd)
        os.rename(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp, dir_fd=dir_fd)
        raise


@dataclass
class Tree:
    """A sandbox's files as the host reaches them: its root (an O_PATH fd of
    /proc/<init>/root) and the directories the API may touch."""

    root: int
    roots: tuple[str, ...]
    closing: threading.Lock = field(default_factory=threading.Lock)

    def split(self, path: str) -> tuple[str, list[str]]:
        """The root `path` is under and its components below it."""
        root = next(r for r in self.roots if path == r or path.startswith(r + "/"))
        return root, [p for p in path[len(root) :].split("/") if p]

    def _root_dir(self, root: str) -> int:
        return openat2(self.root, root, os.O_PATH | os.O_DIRECTORY, resolve=IN_ROOT)

    def dir(self, path: str, create: bool = False, flags: int = os.O_PATH) -> int:
        root, parts = self.split(path)
        base = self._root_dir(root)
        try:
            return _open_dir(base, parts, create, flags)
        finally:
            os.close(base)

    def parent(self, path: str, create: bool = False) -> tuple[int, str]:
        """The open directory `path` is in, and its name there; refused for a root."""
        root, parts = self.split(path)
        if not parts:
            raise ApiError(
                400, "path_outside_workdir", f"{path} is a root of the sandbox's files, which stays"
            )
        return self.dir(posixpath.dirname(path), create), parts[-1]

    def open(self, path: str, flags: int) -> int:
        parent, name = self.parent(path)
        try:
            return openat2(parent, name, flags)
        finally:
            os.close(parent)

    def close(self) -> None:
        """Once: the fd's number may be another file's afterwards."""
        with self.closing:
            if self.root >= 0:
                os.close(self.root)
                self.root = -1


# --- the operations, each run whole in its own thread as the sandbox's user ------------


def write_file(
    tree: Tree, path: str, mode: int | None, pull: Callable[[], bytes | None]
) -> FileInfo:
    with _answering(path):
        parent, name = tree.parent(path, create=True)
        try:
            st = _lstat(parent, name)
            if st is not None and stat.S_ISDIR(st.st_mode):
                raise OSError(errno.EISDIR, "is a directory")
            _write_into(parent, name, iter(pull, None), DEFAULT_FILE_MODE if mode is None else mode)
            return _info(path, os.stat(name, dir_fd=parent, follow_symlinks=False))
        finally:
            os.close(parent)


def open_regular(tree: Tree, path: str) -> tuple[int, int]:
    """A regular file open for reading (its fd, the caller's to close) and its size."""
    with _answering(path):
        fd = tree.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO does not hold the open
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise OSError(errno.EISDIR, "is a directory")
            if not stat.S_ISREG(st.st_mode):
                raise ApiError(404, "no_such_file", f"{path!r} is not a regular file")
        except BaseException:
            os.close(fd)
            raise
        return fd, st.st_size


def file_chunks(tree: Tree, path: str) -> Iterator[bytes]:
    """A regular file's bytes; its checks are made by the first step."""
    fd, _ = open_regular(tree, path)
    try:
        while chunk := os.read(fd, CHUNK):
            yield chunk
    finally:
        os.close(fd)


def listing(tree: Tree, path: str) -> list[FileInfo]:
    with _answering(path):
        fd = tree.dir(path, flags=os.O_RDONLY)
        try:
            with os.scandir(fd) as entries:
                return [
                    _info(posixpath.join(path, e.name), e.stat(follow_symlinks=False))
                    for e in entries
                ]
        finally:
            os.close(fd)


def remove(tree: Tree, path: str) -> None:
    """A file, a symlink (not what it points to) or a directory with its contents
    (shutil's fd-based rmtree, which follows no symlink)."""
    with _answering(path):
        parent, name = tree.parent(path)
        try:
            st = _lstat(parent, name)
            if st is None:
                raise OSError(errno.ENOENT, "does not exist")
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(name, dir_fd=parent)
            else:
                os.unlink(name, dir_fd=parent)
        finally:
            os.close(parent)


def tar_chunks(tree: Tree, path: str) -> Iterator[bytes]:
    """Directory `path`'s contents as a tar (members "./NAME"), walked with directory
    fds, symlinks stored as symlinks; sockets and FIFOs are left out."""
    with _answering(path):
        top = tree.dir(path, flags=os.O_RDONLY)
        out = bytearray()
        try:
            for piece in _tar_pieces(top, ".", 0):
                out += piece
                if len(out) >= CHUNK:
                    yield bytes(out)
                    out.clear()
            yield bytes(out) + bytes(2 * tarfile.BLOCKSIZE)
        finally:
            os.close(top)


def _tar_pieces(dir_fd: int, prefix: str, depth: int) -> Iterator[bytes]:
    if depth >= MAX_DEPTH:
        raise ApiError(400, "too_deep", f"{prefix!r} is more than {MAX_DEPTH} directories deep")
    with os.scandir(dir_fd) as entries:
        for entry in entries:
            name = f"{prefix}/{entry.name}"
            st = entry.stat(follow_symlinks=False)
            info = tarfile.TarInfo(name)
            info.mode, info.mtime = stat.S_IMODE(st.st_mode), int(st.st_mtime)
            info.uid, info.gid = st.st_uid, st.st_gid
            if stat.S_ISLNK(st.st_mode):
                info.type, info.linkname = tarfile.SYMTYPE, os.readlink(entry.name, dir_fd=dir_fd)
                yield _header(info)
            elif stat.S_ISDIR(st.st_mode):
                info.type = tarfile.DIRTYPE
                yield _header(info)
                sub = openat2(dir_fd, entry.name, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    yield from _tar_pieces(sub, name, depth + 1)
                finally:
                    os.close(sub)
            elif stat.S_ISREG(st.st_mode):
                fd = openat2(dir_fd, entry.name, os.O_RDONLY | os.O_NONBLOCK)
                try:
                    yield from _file_member(fd, info)
                finally:
                    os.close(fd)


def _file_member(fd: int, info: tarfile.TarInfo) -> Iterator[bytes]:
    """A file's header and its bytes: as many as its size when opened (a file that
    shrinks meanwhile is padded with zeros, as tar does), then the block's padding."""
    info.size = left = os.fstat(fd).st_size
    yield _header(info)
    while left > 0:
        chunk = os.read(fd, min(CHUNK, left)) or bytes(min(CHUNK, left))
        left -= len(chunk)
        yield chunk
    yield bytes(-info.size % tarfile.BLOCKSIZE)


def _header(info: tarfile.TarInfo) -> bytes:
    return info.tobuf(tarfile.GNU_FORMAT, "utf-8", "surrogateescape")


class _Pulled:
    """The read() of a file object over chunks pulled one at a time (tarfile's stream)."""

    def __init__(self, pull: Callable[[], bytes | None]) -> None:
        self.pull, self.buffer, self.at = pull, b"", 0

    def read(self, size: int = -1) -> bytes:
        # tarfile reads a few KiB at a time: the buffer is copied once per chunk pulled,
        # never per read (a MiB chunk sliced per 10 KiB read cost 50x the bytes moved)
        while size < 0 or len(self.buffer) - self.at < size:
            chunk = self.pull()
            if chunk is None:
                break
            self.buffer, self.at = self.buffer[self.at :] + chunk, 0
        end = len(self.buffer) if size < 0 else self.at + size
        taken = self.buffer[self.at : end]
        self.at += len(taken)
        return taken


def write_tar(tree: Tree, path: str, pull: Callable[[], bytes | None]) -> FileInfo:
    """Unpack a tar into directory `path` (made if missing): into a staging directory
    beside its contents first, member by member, then merged in by renames."""
    with _answering(path):
        target = tree.dir(path, create=True)
        stage_name = UNTAR_PREFIX + secrets.token_hex(8)
        try:
            _mkdir(target, stage_name, 0o700)
            stage = openat2(target, stage_name, os.O_PATH | os.O_DIRECTORY)
            try:
                _unpack(stage, pull)
                _merge(stage, target, path, apply=False)  # refused before anything moves
                _merge(stage, target, path, apply=True)
            finally:
                os.close(stage)
            return _info(path, os.stat(target))
        finally:
            with contextlib.suppress(OSError):
                shutil.rmtree(stage_name, dir_fd=target)
            os.close(target)


def _member_parts(name: str) -> list[str]:
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if name.startswith("/") or ".." in parts:
        raise ApiError(
            400,
            "path_outside_workdir",
            f"tar member {name[:200]!r} would land outside the directory",
        )
    return parts


def _unpack(stage: int, pull: Callable[[], bytes | None]) -> None:
    try:
        with tarfile.open(fileobj=_Pulled(pull), mode="r|*") as tar:  # type: ignore[call-overload]
            for member in tar:
                parts = _member_parts(member.name)
                if parts:
                    _unpack_member(stage, tar, member, parts)
    except (tarfile.TarError, EOFError, zlib.error) as e:
        raise ApiError(400, "invalid_tar", f"not a tar archive this sandbox can unpack: {e}") from e


def _unpack_member(
    stage: int, tar: tarfile.TarFile, member: tarfile.TarInfo, parts: list[str]
) -> None:
    """One member, relative to its directory in the staging tree; a symlink on its way
    (one an earlier member made, too) is refused, never followed."""
    parent = _open_dir(stage, parts[:-1], create=True)
    name = parts[-1]
    try:
        existing = _lstat(parent, name)
        if member.isdir():
            if existing is not None and not stat.S_ISDIR(existing.st_mode):
                os.unlink(name, dir_fd=parent)
            _mkdir(parent, name, (member.mode | 0o700) & 0o777)  # its files go in it next
            return
        if existing is not None and stat.S_ISDIR(existing.st_mode):
            raise OSError(errno.EISDIR, "is a directory", member.name)
        if member.isreg():
            data = tar.extractfile(member)
            assert data is not None
            chunks = iter(partial(data.read, CHUNK), b"")
            _write_into(parent, name, chunks, member.mode & 0o777, member.mtime)
        elif member.issym():
            if existing is not None:
                os.unlink(name, dir_fd=parent)
            os.symlink(member.linkname, name, dir_fd=parent)
        elif member.islnk():
            _hard_link(stage, member, parent, name, existing is not None)
        else:
            raise ApiError(
                400,
                "invalid_tar",
                f"tar member {member.name[:200]!r} is a device or a FIFO: only files, "
                "directories and links are unpacked",
            )
    finally:
        os.close(parent)


def _hard_link(stage: int, member: tarfile.TarInfo, parent: int, name: str, replace: bool) -> None:
    """A hard link to a file an earlier member of the same archive made, nothing else."""
    target = _member_parts(member.linkname)
    try:
        source = _open_dir(stage, target[:-1], create=False)
    except FileNotFoundError:
        source = -1
    try:
        if source < 0 or not target or _lstat(source, target[-1]) is None:
            raise ApiError(
                400,
                "path_outside_workdir",
                f"tar member {member.name[:200]!r} links to {member.linkname[:200]!r}, "
                "which is not in the archive",
            )
        if replace:
            os.unlink(name, dir_fd=parent)
        os.link(target[-1], name, src_dir_fd=source, dst_dir_fd=parent, follow_symlinks=False)
    finally:
        if source >= 0:
            os.close(source)


def _merge(stage: int, target: int, path: str, apply: bool) -> None:
    """Move the staging tree's entries into `target`: a directory into a directory of
    the same name entry by entry, anything else by a rename onto its name (which
    replaces a file or a symlink there). With `apply` false, only check that every
    entry can go: no directory meets a non-directory, nor a symlink."""
    listed = openat2(stage, ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        names = os.listdir(listed)
    finally:
        os.close(listed)
    for name in names:
        shown = posixpath.join(path, name)
        staged = os.stat(name, dir_fd=stage, follow_symlinks=False)
        there = _lstat(target, name)
        if there is None or not stat.S_ISDIR(staged.st_mode) and not stat.S_ISDIR(there.st_mode):
            if apply:
                os.rename(name, name, src_dir_fd=stage, dst_dir_fd=target)
            continue
        if not stat.S_ISDIR(staged.st_mode):
            raise _refusal(OSError(errno.EISDIR, "is a directory"), shown)
        if not stat.S_ISDIR(there.st_mode):
            code = errno.ELOOP if stat.S_ISLNK(there.st_mode) else errno.ENOTDIR
            raise _refusal(OSError(code, os.strerror(code)), shown)
        inner_stage = openat2(stage, name, os.O_PATH | os.O_DIRECTORY)
        try:
            inner_target = openat2(target, name, os.O_PATH | os.O_DIRECTORY)
            try:
                _merge(inner_stage, inner_target, shown, apply)
            finally:
                os.close(inner_target)
        finally:
            os.close(inner_stage)


# --- the event loop's side -----------------------------------------------------------


def _open_root(pid: int, container_id: str) -> int | None:
    """An O_PATH fd of the root of container `container_id`, through its init `pid`;
    None when `pid` is not (or no longer) that init."""
    pidfd = open_in_container(pid, container_id)
    if pidfd is None:
        return None
    try:
        root = os.open(f"/proc/{pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        if select.select([pidfd], [], [], 0)[0]:  # it ended meanwhile: the PID may be another's
            os.close(root)
            return None
        return root
    finally:
        os.close(pidfd)


def _ids(root: int, user: str) -> tuple[int, int]:
    """The uid and gid of the sandbox's `user` ("uid:gid", or names as the engine finds
    them in the image's /etc/passwd and /etc/group)."""
    if (ids := numeric_user(user)) is not None:
        return ids
    name, _, group = user.partition(":")

    def lookup(table: str, key: str, field: int) -> int:
        if key.isascii() and key.isdigit():
            return int(key)
        fd = openat2(root, f"/etc/{table}", os.O_RDONLY, resolve=RESOLVE_IN_ROOT)
        with os.fdopen(fd, encoding="utf-8", errors="replace") as lines:
            for line in lines:
                fields = line.rstrip("\n").split(":")
                if fields[0] == key and len(fields) > field and fields[field].isdigit():
                    return int(fields[field])
        raise ApiError(502, "file_operation_failed", f"no {key!r} in the image's /etc/{table}")

    uid = lookup("passwd", name, 2)
    if group:
        return uid, lookup("group", group, 2)
    return uid, lookup("passwd", name, 3)


def _as_user(tree: Tree, user: str, step: Callable[[], T]) -> T:
    """`step`, in this thread, with the file system ids of the sandbox's `user`; the
    tree is closed by the thread that used it, once done (never under a step that runs)."""
    try:
        _become(*_ids(tree.root, user))
        return step()
    finally:
        tree.close()


class _Stopped(Exception):
    """The reader of a stream went away: its thread ends."""


class Files:
    def __init__(self, docker: AsyncDocker, docker_failed: Callable[[DockerOpError], None]) -> None:
        self.docker = docker
        self.docker_failed = docker_failed

    def roots(self, sandbox: Sandbox) -> tuple[str, ...]:
        return (sandbox.spec.workdir, "/tmp")

    async def _tree(self, sandbox: Sandbox) -> Tree:
        """The sandbox's files from the host, through its container's init (the PID kept
        while it is that init: Sandbox.container_init)."""
        try:
            pid = await sandbox.container_init(self.docker)
        except DockerOpError as e:
            self.docker_failed(e)
            raise ApiError(502, f"docker_{e.kind}", str(e)) from e
        if pid is not None:
            try:
                root = _open_root(pid, sandbox.record.container_id)
            except OSError as e:  # an agent without the host's PIDs (no --pid host)
                raise ApiError(
                    503, "files_unavailable", f"this agent cannot reach sandboxes' files: {e}"
                ) from e
            if root is not None:
                return Tree(root, self.roots(sandbox))
        raise ApiError(409, "sandbox_exited", f"sandbox {sandbox.id} is no longer running")

    async def _run(self, sandbox: Sandbox, tree: Tree, step: Callable[[], T]) -> T:
        """`step` in a thread of its own as the sandbox's user, which closes `tree`."""
        try:
            return await in_own_thread(partial(_as_user, tree, sandbox.user, step))
        except RuntimeError:  # no thread could start: the tree was never handed over
            tree.close()
            raise

    async def stream_out(self, sandbox: Sandbox, op: str, path: str) -> AsyncIterator[bytes]:
        """A file's bytes (op "read") or a directory's tar ("tar-get"), handed over by
        the operation's thread a chunk at a time as they are taken (at most two wait);
        its first step checks the path, so errors come before any byte."""
        loop = asyncio.get_running_loop()
        handed: asyncio.Queue[bytes] = asyncio.Queue(maxsize=2)
        stopped = threading.Event()

        def produce(tree: Tree) -> None:
            steps = (file_chunks if op == "read" else tar_chunks)(tree, path)
            with contextlib.closing(steps):
                for chunk in steps:
                    if stopped.is_set():
                        raise _Stopped
                    asyncio.run_coroutine_threadsafe(handed.put(chunk), loop).result()

        tree = await self._tree(sandbox)
        done = asyncio.ensure_future(self._run(sandbox, tree, partial(produce, tree)))

        async def taken() -> bytes | None:
            getter = asyncio.ensure_future(handed.get())
            await asyncio.wait({getter, done}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                if handed.empty():
                    done.result()  # the thread's error, if it failed
                    return None
                return handed.get_nowait()
            return getter.result()

        def stop() -> None:
            stopped.set()
            while not handed.empty():  # a put that waits for room ends
                handed.get_nowait()

        try:
            first = await taken()
        except BaseException:
            stop()
            raise

        async def chunks() -> AsyncIterator[bytes]:
            chunk = first
            try:
                while chunk is not None:
                    yield chunk
                    chunk = await taken()
            finally:
                stop()

        return chunks()

    async def write(
        self,
        sandbox: Sandbox,
        op: str,
        path: str,
        body: AsyncIterator[bytes],
        mode: int | None = None,
    ) -> FileInfo:
        """Write a file (op "write") or unpack a tar into a directory ("tar-put"); the
        operation's thread pulls the body from the event loop a chunk at a time."""
        loop = asyncio.get_running_loop()
        pending: list[concurrent.futures.Future[bytes | None]] = []

        async def gathered() -> bytes | None:
            """Up to CHUNK bytes of the body: one handover per chunk, not per frame."""
            got = bytearray()
            while len(got) < CHUNK and (frame := await anext(body, None)) is not None:
                got += frame
            return bytes(got) if got else None

        def pull() -> bytes | None:
            pending[:] = [asyncio.run_coroutine_threadsafe(gathered(), loop)]
            return pending[0].result()

        tree = await self._tree(sandbox)
        step = (
            partial(write_file, tree, path, mode, pull)
            if op == "write"
            else partial(write_tar, tree, path, pull)
        )
        try:
            return await self._run(sandbox, tree, step)
        finally:
            for waiting in pending:  # a thread still waiting on the body gives up
                waiting.cancel()

    async def open_to_send(self, sandbox: Sandbox, path: str) -> tuple[BinaryIO, int]:
        """A regular file of the sandbox open for reading, opened as its user with the
        checks every operation makes, and its size: the kernel can send it from there
        (sendfile), with no byte through this process."""
        tree = await self._tree(sandbox)
        fd, size = await self._run(sandbox, tree, partial(open_regular, tree, path))
        return os.fdopen(fd, "rb", buffering=0), size

    async def unpack_file(self, sandbox: Sandbox, path: str, archive: BinaryIO) -> FileInfo:
        """Unpack the tar `archive`, a file the agent opened or bytes it holds, into
        directory `path`: read in the operation's own thread, so no chunk goes through
        the event loop (the thread runs as the sandbox's user, who could not open the
        agent's file)."""
        tree = await self._tree(sandbox)
        step = partial(write_tar, tree, path, lambda: archive.read(CHUNK) or None)
        return await self._run(sandbox, tree, step)

    async def listing(self, sandbox: Sandbox, path: str) -> FileList:
        tree = await self._tree(sandbox)
        entries = await self._run(sandbox, tree, partial(listing, tree, path))
        return FileList(path=path, entries=sorted(entries, key=lambda e: e.name))

    async def remove(self, sandbox: Sandbox, path: str) -> None:
        tree = await self._tree(sandbox)
        await self._run(sandbox, tree, partial(remove, tree, path))
