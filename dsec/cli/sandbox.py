"""`dsec acquire`, `dsec exec`, `dsec shell`, `dsec cp`, `dsec fork` and `dsec release`: a
sandbox from the command line.

Every command but acquire names the sandbox by its id and fetches its lease from the
control plane (`GET /v1/sandboxes/{id}/lease`), so a sandbox acquired by one process
(`dsec acquire`, a script) is used from another with the same client token.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import posixpath
import re
import shutil
import signal
import sys
import termios
import threading
import tty
from collections.abc import Iterator
from pathlib import Path

from dsec.cli.common import UsageError
from dsec.cli.remote import add_connection_args, run_remote
from dsec.client import Client, DsecError, ExecChunk, ExecStream
from dsec.models import MAX_TIMEOUT_S, SANDBOX_ID_PATTERN

# dsec itself failed (refused, unreachable), not the command: docker exec's convention
EXEC_FAILED = 125
STDIN_READ_BYTES = 1 << 16
# `ID:/path` in dsec cp: a sandbox id, a colon, a path in the sandbox
SANDBOX_PATH_RE = re.compile(rf"^({SANDBOX_ID_PATTERN.strip('^$')}):(.*)$")


def _assignments(items: list[str], what: str) -> dict[str, str]:
    pairs = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"{what} must be KEY=VALUE, got {item!r}")
        pairs[key] = value
    return pairs


def _local_bytes(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise UsageError(f"--file: cannot read {path}: {e.strerror}") from e


# --- dsec acquire / release ----------------------------------------------------------


def cmd_acquire(args: argparse.Namespace) -> int:
    labels = _assignments(args.label, "--label")
    claim = {
        "env": _assignments(args.env, "--env"),
        "files": {
            path: _local_bytes(local) for path, local in _assignments(args.file, "--file").items()
        },
        "setup": ["sh", "-c", args.setup] if args.setup else None,
    }

    async def acquire(client: Client) -> int:
        try:
            sb = await client.acquire(
                args.pool, args.template, timeout=args.timeout, labels=labels, **claim
            )
        except DsecError as e:
            if e.code != "setup_failed" or not e.details:
                raise
            ran = e.details[0]  # the setup's output, then why it failed
            sys.stdout.write(ran.get("stdout", ""))
            sys.stderr.write(ran.get("stderr", ""))
            print(f"{args.prog}: {e.message} ({e.status} {e.code})", file=sys.stderr)
            return 1
        print(sb.lease.model_dump_json() if args.json else sb.id)
        return 0

    return run_remote(args, acquire)


def cmd_release(args: argparse.Namespace) -> int:
    async def release(client: Client) -> int:
        sb = await client.lease(args.id)
        released = await sb.release()
        print(released.model_dump_json() if args.json else f"{released.id} {released.state}")
        return 0

    return run_remote(args, release)


def cmd_fork(args: argparse.Namespace) -> int:
    labels = _assignments(args.label, "--label")

    async def fork(client: Client) -> int:
        sb = await client.lease(args.id)
        forks = await sb.fork(args.count, pool=args.pool, timeout=args.timeout, labels=labels)
        for copy in forks:
            print(copy.lease.model_dump_json() if args.json else copy.id)
        return 0

    return run_remote(args, fork)


# --- dsec exec / shell ---------------------------------------------------------------


def cmd_exec(args: argparse.Namespace) -> int:
    env = _assignments(args.env, "--env")

    async def run(client: Client) -> int:
        sb = await client.lease(args.id)
        stream = sb.exec_stream(
            args.cmd, args.timeout, stdin=args.interactive, env=env, workdir=args.workdir
        )
        return await _attach(stream, args.prog, forward_stdin=args.interactive)

    return run_remote(args, run, failure_status=EXEC_FAILED)


def cmd_shell(args: argparse.Namespace) -> int:
    env = _assignments(args.env, "--env")
    # a terminal here gets one there, in raw mode, so keys such as Ctrl-C reach the
    # sandbox; piped input is forwarded as it is, with no terminal
    on_terminal = sys.stdin.isatty()

    async def run(client: Client) -> int:
        sb = await client.lease(args.id)
        rows, cols = _window_size()
        stream = sb.exec_stream(
            args.cmd or ["sh"],
            args.timeout,
            stdin=True,
            tty=on_terminal,
            rows=rows,
            cols=cols,
            env=env,
            workdir=args.workdir,
        )
        if not on_terminal:
            return await _attach(stream, args.prog, forward_stdin=True)
        with _raw_terminal(sys.stdin.fileno()), _following_window(stream):
            return await _attach(stream, args.prog, forward_stdin=True)

    return run_remote(args, run, failure_status=EXEC_FAILED)


async def _attach(stream: ExecStream, prog: str, *, forward_stdin: bool) -> int:
    """Copy the command's output to ours as it comes, and our stdin to it; its exit code."""
    async with stream:
        pump = asyncio.create_task(_pump_stdin(stream)) if forward_stdin else None
        try:
            async for chunk in stream:
                _write(chunk)
        finally:
            if pump is not None:
                pump.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pump
    if stream.timed_out:
        print(
            f"{prog}: the command timed out after {stream.request.timeout_s:g} s", file=sys.stderr
        )
    assert stream.exit_code is not None  # the stream ends with the exit or raises
    return stream.exit_code


def _write(chunk: ExecChunk) -> None:
    out = sys.stdout.buffer if chunk.stream == "stdout" else sys.stderr.buffer
    out.write(chunk.data)
    out.flush()


async def _pump_stdin(stream: ExecStream) -> None:
    chunks = _read_stdin_in_background()
    while data := await chunks.get():
        try:
            await stream.write(data)
        except DsecError as e:
            if e.code == "exec_finished":
                return
            raise
    await stream.close_stdin()


def _read_stdin_in_background() -> asyncio.Queue[bytes]:
    """Our stdin's bytes as they come, b"" at its end. Read on a daemon thread: a read
    of a terminal blocks, and unlike the loop's executor, a daemon thread does not keep
    the process from exiting once the command is over."""
    loop = asyncio.get_running_loop()
    chunks: asyncio.Queue[bytes] = asyncio.Queue()

    def read() -> None:
        data = b"x"
        while data:
            try:
                data = os.read(sys.stdin.fileno(), STDIN_READ_BYTES)
            except OSError:
                data = b""
            try:
                loop.call_soon_threadsafe(chunks.put_nowait, data)
            except RuntimeError:  # the loop is gone: the command ended
                return

    threading.Thread(target=read, name="dsec-stdin", daemon=True).start()
    return chunks


def _window_size() -> tuple[int, int]:
    size = shutil.get_terminal_size()
    return max(1, min(size.lines, 1000)), max(1, min(size.columns, 1000))


@contextlib.contextmanager
def _raw_terminal(fd: int) -> Iterator[None]:
    saved = termios.tcgetattr(fd)
    tty.setraw(fd)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


@contextlib.contextmanager
def _following_window(stream: ExecStream) -> Iterator[None]:
    """Send the terminal's new size to the sandbox's whenever it changes (SIGWINCH)."""
    loop = asyncio.get_running_loop()
    resizes: set[asyncio.Task] = set()

    def resized() -> None:
        task = loop.create_task(stream.resize(*_window_size()))
        resizes.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(resizes.discard)

    loop.add_signal_handler(signal.SIGWINCH, resized)
    try:
        yield
    finally:
        loop.remove_signal_handler(signal.SIGWINCH)


# --- dsec cp ---------------------------------------------------------------------------


def _side(text: str) -> tuple[str | None, str]:
    """(sandbox id, path in it) for `ID:/path`; (None, text) for a local path."""
    match = SANDBOX_PATH_RE.match(text)
    return (match.group(1), match.group(2)) if match else (None, text)


def cmd_cp(args: argparse.Namespace) -> int:
    (src_id, src), (dst_id, dst) = _side(args.src), _side(args.dst)
    if (src_id is None) == (dst_id is None):
        raise UsageError("one side must be a sandbox path (ID:/path), the other a local path")
    if src_id is None and not Path(src).exists():
        raise UsageError(f"no such local file or directory: {src}")
    remote = src if src_id else dst
    if not remote.startswith("/"):
        raise UsageError(f"a sandbox path is absolute (/work/..., /tmp/...), not {remote!r}")

    async def copy(client: Client) -> int:
        if src_id is None:
            await _upload(client, Path(src), dst_id, dst)
        else:
            await _download(client, src_id, src, Path(dst))
        return 0

    return run_remote(args, copy)


async def _upload(client: Client, local: Path, sandbox_id: str, remote: str) -> None:
    sb = await client.lease(sandbox_id)
    # as cp -r: into a directory that exists, under the source's own name
    if remote.endswith("/") or await sb.files.is_dir(remote):
        remote = posixpath.join(remote, local.resolve().name)
    await sb.files.upload(local, remote)


async def _download(client: Client, sandbox_id: str, remote: str, local: Path) -> None:
    sb = await client.lease(sandbox_id)
    if local.is_dir():
        local = local / posixpath.basename(posixpath.normpath(remote))
    await sb.files.download(remote, local)


# --- the parsers -----------------------------------------------------------------------


def register(sub: argparse._SubParsersAction) -> None:
    """Add `dsec acquire`, `dsec exec`, `dsec shell`, `dsec cp`, `dsec fork` and `dsec release`."""
    acq = sub.add_parser("acquire", help="acquire a sandbox and print its id")
    acq.add_argument("--pool", default="default")
    acq.add_argument("--template", default="base")
    acq.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for one")
    acq.add_argument("--label", action="append", default=[], metavar="KEY=VALUE")
    acq.add_argument(
        "--env", action="append", default=[], metavar="KEY=VALUE", help="on every command"
    )
    acq.add_argument(
        "--file",
        action="append",
        default=[],
        metavar="PATH=LOCAL",
        help="write local file LOCAL at PATH in the work dir before the answer",
    )
    acq.add_argument(
        "--setup", metavar="SCRIPT", help="a sh script run before the answer; its failure fails"
    )
    acq.add_argument("--json", action="store_true", help="the whole lease, token included")
    acq.set_defaults(run=cmd_acquire)

    ex = sub.add_parser(
        "exec",
        usage="dsec exec [options] ID -- CMD [ARG ...]",
        help="run a command in a sandbox, output as it comes; exits with its exit code",
        description="Exit status: the command's (124 when it timed out), or 125 when dsec "
        "failed (refused, unknown sandbox, no answer).",
    )
    ex.add_argument("id", help="sandbox id")
    ex.add_argument("cmd", nargs="+", metavar="CMD", help="the command and its arguments")
    ex.add_argument("-i", "--interactive", action="store_true", help="forward our stdin to it")
    ex.add_argument("--timeout", type=float, default=600.0)
    ex.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    ex.add_argument("--workdir")
    ex.set_defaults(run=cmd_exec)

    sh = sub.add_parser(
        "shell",
        usage="dsec shell [options] ID [-- CMD [ARG ...]]",
        help="an interactive shell in a sandbox (a terminal when ours is one)",
        description="Runs sh (or CMD) with our stdin; on a terminal, in raw mode with the "
        "window size followed, restored at the end. Exit status as dsec exec.",
    )
    sh.add_argument("id", help="sandbox id")
    sh.add_argument("cmd", nargs="*", metavar="CMD", help="instead of sh")
    sh.add_argument("--timeout", type=float, default=MAX_TIMEOUT_S)
    sh.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    sh.add_argument("--workdir")
    sh.set_defaults(run=cmd_shell)

    cp = sub.add_parser(
        "cp",
        help="copy a file or directory into or out of a sandbox (one side ID:/path)",
        description="As cp -r: DST names the copy, or, when it is a directory that exists "
        "(or ends with /), the copy goes into it under SRC's name.",
    )
    cp.add_argument("src")
    cp.add_argument("dst")
    cp.set_defaults(run=cmd_cp)

    rel = sub.add_parser("release", help="release a sandbox")
    rel.add_argument("id", help="sandbox id")
    rel.add_argument("--json", action="store_true")
    rel.set_defaults(run=cmd_release)

    fk = sub.add_parser(
        "fork",
        help="copies of a sandbox's /work and /tmp on new sandboxes; prints their ids",
        description="All or none: the new sandboxes are the caller's, each to be released. "
        "Processes and memory are not copied.",
    )
    fk.add_argument("id", help="the sandbox to copy (held by this client)")
    fk.add_argument("--count", type=int, default=1, help="how many copies (1 to 64)")
    fk.add_argument("--pool", help="the copies' pool (default: the source's)")
    fk.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for all")
    fk.add_argument("--label", action="append", default=[], metavar="KEY=VALUE")
    fk.add_argument("--json", action="store_true", help="each lease, token included")
    fk.set_defaults(run=cmd_fork)

    for parser in (acq, ex, sh, cp, rel, fk):
        add_connection_args(parser)
        parser.set_defaults(prog=parser.prog)
