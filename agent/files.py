"""Files in a sandbox, for the client holding the lease: write, read, list, remove, and
a directory as a tar either way.

The work dir and /tmp are tmpfs mounts, which the Engine API's archive calls cannot
see, so every operation is a short script run inside the sandbox as its own user
(FILES_SCRIPT): paths are resolved there, symlinks included, and must land under the
work dir or /tmp (400 `path_outside_workdir`). Running as the sandbox's user, an
operation can do nothing its lease's commands could not; the confinement is the API's
promise, not the sandbox's wall. Bytes go through the command's stdin and stdout
untouched. A write lands in a temporary file that is renamed into place, so a write
that does not fit (413) leaves nothing behind.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from agent.docker_driver import STDOUT, DockerOpError, Process
from agent.sandboxes import Sandbox
from dsec.httpkit import ApiError
from dsec.models import FileInfo, FileList, FileType

if TYPE_CHECKING:
    from agent.node import Agent

MAX_PATH = 4096
CHUNK = 1 << 16
READY = b"dsec-ok\n"  # the script's first stdout line once the path checked out
# $1 operation, $2 path, $3 and $4 the roots, $5 declared size or mode
FILES_SCRIPT = r"""
op=$1; p=$2; a=$3; b=$4
inside() { case "$1" in "$a"|"$a"/*|"$b"|"$b"/*) return 0;; esac; return 1; }
# paths are absolute (checked by the agent): busybox realpath takes no "--"
resolve() { r=$(realpath "$1" 2>/dev/null) || exit 4; inside "$r" || exit 3; }
parent() { d=${p%/*}; [ -n "$d" ] || d=/; }
fmt='%s/%a/%Y/%F/%n'
info() { stat -c "$fmt" -- "$1"; }
case "$op" in
read)
  resolve "$p"; [ -d "$r" ] && exit 5; [ -f "$r" ] || exit 4
  printf 'dsec-ok\n'; exec cat -- "$r" ;;
list)
  resolve "$p"; [ -d "$r" ] || exit 6
  printf 'dsec-ok\n'; exec find "$r" -mindepth 1 -maxdepth 1 -exec stat -c "$fmt" -- {} + ;;
write)
  parent; mkdir -p -- "$d" 2>/dev/null; resolve "$d"; [ -d "$r" ] || exit 6
  t="$r/${p##*/}"; [ -d "$t" ] && [ ! -L "$t" ] && exit 5
  tmp="$r/.dsec-upload-$$"
  if ! cat > "$tmp"; then rm -f -- "$tmp"; exit 7; fi
  [ -n "$5" ] && chmod "$5" "$tmp"
  mv -f -- "$tmp" "$t" || { rm -f -- "$tmp"; exit 7; }
  printf 'dsec-ok\n'; info "$t" ;;
remove)
  parent; resolve "$d"; t="$r/${p##*/}"; inside "$t" || exit 3
  [ "$t" = "$a" ] || [ "$t" = "$b" ] && exit 8
  [ -e "$t" ] || [ -L "$t" ] || exit 4
  rm -rf -- "$t" && printf 'dsec-ok\n' ;;
tar-get)
  resolve "$p"; [ -d "$r" ] || exit 6
  printf 'dsec-ok\n'; exec tar -C "$r" -cf - . ;;
tar-put)
  mkdir -p -- "$p" 2>/dev/null; resolve "$p"; [ -d "$r" ] || exit 6
  tmp="$r/.dsec-untar-$$"; mkdir -- "$tmp" || exit 7
  if ! tar -C "$tmp" -xf - 2>"$tmp.err"; then
    grep -q 'No space' "$tmp.err" && c=7 || c=10; rm -rf -- "$tmp" "$tmp.err"; exit $c
  fi
  rm -f -- "$tmp.err"
  if ! cp -a "$tmp/." "$r/"; then rm -rf -- "$tmp"; exit 7; fi
  rm -rf -- "$tmp"; printf 'dsec-ok\n'; info "$r" ;;
esac
"""
# what the script's exit codes mean, as answers
FAILURES = {
    3: (400, "path_outside_workdir", "resolves outside the work dir and /tmp"),
    4: (404, "no_such_file", "does not exist"),
    5: (400, "is_a_directory", "is a directory"),
    6: (400, "not_a_directory", "is not a directory"),
    7: (413, "file_too_large", "does not fit in the sandbox's space (nothing was written)"),
    8: (400, "path_outside_workdir", "is a root of the sandbox's files, which stays"),
    10: (400, "invalid_tar", "is not a tar archive this sandbox can unpack"),
}
STAT_LINE = re.compile(rb"^(\d+)/([0-7]+)/(\d+)/([^/]*)/(/.*)$", re.S)


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


def _info(line: bytes) -> FileInfo:
    size, mode, mtime, kind, path = STAT_LINE.match(line).groups()  # type: ignore[union-attr]
    text = path.decode("utf-8", "surrogateescape")
    kind_text = kind.decode()
    file_type: FileType = (
        "dir"
        if "directory" in kind_text
        else "link"
        if "link" in kind_text
        else "file"
        if "regular" in kind_text
        else "other"
    )
    return FileInfo(
        path=text,
        name=posixpath.basename(text),
        type=file_type,
        size=int(size),
        mode=int(mode, 8),
        mtime=float(mtime),
    )


def _infos(listing: bytes) -> list[FileInfo]:
    """stat lines, one per entry; a name with a newline in it continues on the next."""
    entries: list[bytes] = []
    for line in listing.removesuffix(b"\n").split(b"\n"):
        if STAT_LINE.match(line) or not entries:
            entries.append(line)
        else:
            entries[-1] += b"\n" + line
    return [_info(e) for e in entries if STAT_LINE.match(e)]


class Files:
    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    def roots(self, sandbox: Sandbox) -> tuple[str, ...]:
        return (sandbox.spec.workdir, "/tmp")

    async def _start(
        self, sandbox: Sandbox, op: str, path: str, extra: str = "", stdin: bool = False
    ) -> Process:
        roots = self.roots(sandbox)
        cmd = ["sh", "-c", FILES_SCRIPT, "dsec-files", op, path, *roots, extra]
        try:
            return await self.agent.docker.start(
                sandbox.record.container_id, cmd, user=sandbox.user, stdin=stdin
            )
        except DockerOpError as e:
            self.agent.docker_failed(e)
            raise ApiError(502, f"docker_{e.kind}", str(e)) from e

    async def _ready(self, proc: Process, path: str) -> bytes:
        """Wait for the script's READY line; answer its failure if it ends first. Returns
        the stdout that came after READY so far."""
        out = bytearray()
        while (chunk := await proc.read()) is not None:
            if chunk[0] != STDOUT:
                continue
            out += chunk[1]
            if out.startswith(READY):
                return bytes(out[len(READY) :])
            if len(out) >= len(READY):
                break
        raise await self._failed(proc, path, bytes(out))

    async def _failed(self, proc: Process, path: str, said: bytes = b"") -> ApiError:
        try:
            code = await proc.exit_code()
        except DockerOpError as e:  # its sandbox went meanwhile (released), or Docker erred
            self.agent.docker_failed(e)
            return ApiError(502, f"docker_{e.kind}", f"{path}: {e}")
        status, error, what = FAILURES.get(
            code or 0, (502, "file_operation_failed", f"failed ({code}): {said[:200]!r}")
        )
        return ApiError(status, error, f"{path} {what}")

    async def _rest(self, proc: Process, head: bytes) -> bytes:
        out = bytearray(head)
        while (chunk := await proc.read()) is not None:
            if chunk[0] == STDOUT:
                out += chunk[1]
        return bytes(out)

    async def stream_out(self, sandbox: Sandbox, op: str, path: str) -> AsyncIterator[bytes]:
        """Read a file or a directory's tar, chunk by chunk; the first step checks the path
        (so errors come before any byte), the rest stream."""
        proc = await self._start(sandbox, op, path)
        try:
            head = await self._ready(proc, path)
        except BaseException:
            await proc.close()
            raise

        async def chunks() -> AsyncIterator[bytes]:
            try:
                if head:
                    yield head
                while (chunk := await proc.read()) is not None:
                    if chunk[0] == STDOUT:
                        yield chunk[1]
                if (code := await proc.exit_code()) not in (0, None):
                    message = f"{op} of {path} ended with {code}"
                    raise ApiError(502, "file_operation_failed", message)
            finally:
                await proc.close()

        return chunks()

    async def write(
        self,
        sandbox: Sandbox,
        op: str,
        path: str,
        body: AsyncIterator[bytes],
        extra: str = "",
    ) -> FileInfo:
        """Write a file (op "write") or unpack a tar into a directory ("tar-put")."""
        proc = await self._start(sandbox, op, path, extra, stdin=True)
        try:
            try:
                async for chunk in body:
                    await proc.write(chunk)
            except DockerOpError:
                pass  # the script stopped reading: its exit code says why
            proc.close_stdin()
            out = await self._rest(proc, b"")
            if not out.startswith(READY):
                raise await self._failed(proc, path, out)
            return _info(out[len(READY) :].rstrip(b"\n"))
        finally:
            await proc.close()

    async def listing(self, sandbox: Sandbox, path: str) -> FileList:
        proc = await self._start(sandbox, "list", path)
        try:
            out = await self._rest(proc, await self._ready(proc, path))
        finally:
            await proc.close()
        return FileList(path=path, entries=sorted(_infos(out), key=lambda e: e.name))

    async def remove(self, sandbox: Sandbox, path: str) -> None:
        proc = await self._start(sandbox, "remove", path)
        try:
            await self._ready(proc, path)
        finally:
            await proc.close()
