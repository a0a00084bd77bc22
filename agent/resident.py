"""Commands started by a resident loop inside the sandbox, without an engine exec.

An engine exec costs the engine about 40 ms of its own work (dockerd, containerd and a
runc process per command), and the engine does that work for every sandbox of the node
in turn: under load a `true` waits seconds. A shell loop already running in the
sandbox starts a command with one fork. The agent hands it commands through named
pipes in a directory of its own per sandbox, bind-mounted read-only at `/.dsec`:

- `serve`, the loop (serve_script), as LOOP_USER (root in the container, with only the
  capabilities to become the sandbox's user: agent/docker_driver.py): started with the
  container by `boot` (boot_script, its entrypoint, which then runs the template's
  command as the sandbox's user, or KEEPER_USER for a template that may be recycled,
  whose reset keeps the loop: agent/host.py). Where that loop is gone (a reset that
  could not keep it, a boot that never said so), by one detached engine exec: for a
  warm sandbox when no more urgent work waits for the engine (`Work.RESIDENT`), for a
  new container's leased sandbox at once, as a client's work (`Resident.hurry`), since
  each of its commands until then costs the engine an exec as the start does;
- `booted`, a pipe on which the boot says whether it started the loop, or found no
  template command to run;
- `sh`, the shell the loop runs in: the host's static busybox, execute-only (mode 0111,
  one copy per node hard-linked into every directory), whose `nsenter` and `setsid`
  start each command as the sandbox's user in a session of its own;
- `ctl`, a pipe the loop reads command ids from;
- per command `ID.cmd` (the script: workdir, environment, argv), and pipes `ID.out`,
  `ID.err` and `ID.rc` (its exit code, written when it ends).

The loop is not the tenant's: the workload in the sandbox, whatever its user may do
(kill, open, /proc, ptrace), can neither signal the loop nor read or trace it (another
uid), nor open ctl, a script or a status pipe (0600, root's), so it cannot take a
command's place, read another command's script and environment from here, or change
what a command's status says. A sandbox whose user is root or a name, or a node
without a static busybox, gets no loop: its commands take the engine's exec. What a
command's own processes are, while they run, is the sandbox user's as under an engine
exec: anything else of that user's running beside them can reach them as the kernel
lets one process of a user reach another (docs/contracts.md, "The node's data plane").

The mount is read-only, so nothing in the sandbox can create, replace or remove an
entry there (no symlink for the agent to follow, no file to fill the host's disk).
The loop runs each command in its own session with the command's marker in its
environment, so a timeout kills it as it kills an engine exec's (agent/execs.py).
Pipes are unlinked before they are closed: a command that starts after its caller gave
up finds no pipe to block on.

Commands with stdin or a terminal, and sandboxes whose loop is not there (an image
without `sh`, a loop that ended, a sandbox just made), take the engine's exec;
the loop is started again, at most every RESTART_AFTER_S. So does a command the loop
could not start because the sandbox had no process to spare (its pids limit reached, by
a fork bomb, say, or while its init reaps one's remains): a fork inside the sandbox
fails there, where the engine's exec joins the sandbox from outside and still runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import secrets
import shlex
import shutil
import stat
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from agent.docker_driver import (
    KEEPER_USER,
    LOOP_USER,
    STDERR,
    STDOUT,
    AsyncDocker,
    DockerOpError,
    Process,
)
from agent.docker_driver import RESIDENT_MOUNT as MOUNT
from agent.engine import Work
from agent.host import LoopProcess
from agent.users import numeric_user
from dsec.image import ImageBuildError, find_static_busybox
from dsec.statedir import STATE_DIR_MARK, loops_dir
from dsec.states import SandboxState

if TYPE_CHECKING:
    from agent.config import AgentConfig
    from agent.sandboxes import Sandbox
    from dsec.clock import Clock

log = logging.getLogger(__name__)
RESTART_AFTER_S = 10.0  # a loop that is not there is started again at most this often
CHUNK = 1 << 16
# Output chunks read ahead of the consumer: more wait in the pipe, so a slow client
# slows its own command and holds no memory of the agent's.
CHUNKS_AHEAD = 4
RC_LINE_MAX = 64  # a status line's bytes read; the shell writes a few
OPENED = b"opened"  # the loop's copy holds ID.rc: its end is now the end of ID.rc
STARTED = b"started"  # then: the command's fork is made, it runs
ACK_WAIT_S = 1.0  # how long a start waits to learn whether the loop could start it
# a loop starts in a running container: a frozen one would hang its exec in the engine
LOOP_STATES = frozenset({SandboxState.WARM, SandboxState.LEASED})
KILLED_EXIT_CODE = 137  # a command whose waiting copy of the loop was killed: as SIGKILL's
NOT_STARTED_EXIT_CODE = 126  # as the engine's exec answers a command it cannot start
NOT_STARTED = b"dsec: the sandbox could not start the command: no fork (its pids limit?)\n"

# Runs as LOOP_USER (agent/docker_driver.py). Reads ids from ctl; for each, a copy of
# the loop opens ID.rc and ID.cmd and says "opened" on ID.rc, starts the command in a
# session of its own, as the sandbox's user (busybox's nsenter with no namespace to
# enter only sets the ids), with its output on ID.out and ID.err, says "started" once
# that fork is made, and writes the command's exit code when it ends. Every pipe and
# the script are the loop's alone (0600, root's): the command holds its ID.out and
# ID.err and its script (fd 5, read by its own shell, RUN_SCRIPT, then closed), never
# ID.rc or ctl, so no process of the tenant's can read another command's script, nor
# say anything on a command's status. A fork that fails (the sandbox at its pids limit)
# ends the shell that made it: the copy's, so ID.rc ends before "started"; the
# subshell's that forks the copy, and the loop says "nofork" (`1<>` opens the pipe
# without waiting for a reader, so the loop never blocks on it); or the loop's own,
# which the agent finds gone (`Resident._runs`). The copy holds ID.rc open until it
# ends, so the agent sees its end even when something kills it before it could write
# the code. It is orphaned at once, so the sandbox's init reaps it, not the loop (which
# would leave zombies, counted against the pids limit, until its next command). The
# command runs in the image's own /bin/sh, named by its path: busybox, where the loop
# runs, would take its own applets before the image's programs.
RUN_SCRIPT = """s=
while IFS= read -r l <&5; do s="$s$l
"; done
exec 5<&-
eval "$s"
"""


def serve_script(uid: int, gid: int) -> str:
    """The loop of a sandbox whose commands run as `uid`:`gid`."""
    return f"""\
[ -x /bin/sh ] || exit 1
run={shlex.quote(RUN_SCRIPT)}
exec 3<>{MOUNT}/ctl
while read -r id <&3; do
  case $id in ''|*[!0-9a-f]*) continue ;; esac
  ( (exec 4>"{MOUNT}/$id.rc" 5<"{MOUNT}/$id.cmd"; echo {OPENED.decode()} >&4
     setsid nsenter -S {uid} -G {gid} -F -- /bin/sh -c "$run" sh </dev/null \\
       >"{MOUNT}/$id.out" 2>"{MOUNT}/$id.err" 3<&- 4>&- &
     echo {STARTED.decode()} >&4
     wait $!; echo $? >&4) & ) 3<&- || echo nofork 1<>"{MOUNT}/$id.rc"
done
"""


SHELL = "sh"  # the loop's shell in its directory
BOOTED, NO_COMMAND = b"booted", b"nocommand"  # what a boot says on its `booted` pipe
BOOT_WAIT_S = 10.0  # how long a create waits for its boot's word before going without
# Where a boot looks for the command when the container's environment has no PATH:
# runc's own default.
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


# The entrypoint of every container with a loop, in the node's shell, ahead of the
# image's entrypoint and the template's command ("$@"), as LOOP_USER (the engine gives
# an exec capabilities only in a container whose user is root). It finds the command in
# PATH itself, as runc would: busybox runs its own applets before the image's programs
# of the same names; the command then replaces the boot's shell as `main_user`, the
# sandbox's user (KEEPER_USER for a template that may be recycled), with its own
# argv[0]. A command not there is said on `booted` (the agent refuses the template, as
# the engine refuses to start a command it cannot find). The boot starts the loop too,
# which then costs the engine no exec (about 40 ms of its work per sandbox, taken while
# creates wait) and serves the sandbox's first command: ctl is held open from before
# the loop starts (the loop inherits it), so a command id written as soon as the agent
# hears "booted" waits in the pipe for the loop. The loop is orphaned at once, for the
# sandbox's init to reap; the agent finds it from the host where a reset is to keep it
# (agent/host.py: booted_loop).
def boot_script(main_user: tuple[int, int]) -> str:
    uid, gid = main_user
    booted = f"1<>{MOUNT}/booted"
    started = f"""exec 3<>{MOUNT}/ctl
( {MOUNT}/{SHELL} {MOUNT}/serve </dev/null >/dev/null 2>&1 & )
echo {BOOTED.decode()} {booted}
exec 3<&-
"""
    return f"""\
set -f
cmd=$1
case $cmd in
*/*) ;;
*) IFS=:
   for dir in ${{PATH:-{DEFAULT_PATH}}}; do
     if [ -f "${{dir:-.}}/$1" ] && [ -x "${{dir:-.}}/$1" ]; then cmd=${{dir:-.}}/$1; break; fi
   done
   unset IFS ;;
esac
if ! [ -f "$cmd" ] || ! [ -x "$cmd" ]; then
  echo {NO_COMMAND.decode()} {booted}
  exit 127
fi
{started}name=$1
shift
exec nsenter -S {uid} -G {gid} -F -- {MOUNT}/{SHELL} -c 'exec -a "$0" "$@"' "$name" "$cmd" "$@"
"""


def command_script(argv: list[str], env: dict[str, str], workdir: str) -> str:
    """What the loop runs for one command: as an engine exec would, 126 when it cannot
    start (no such directory, no such program), else the program's own exit code."""
    q = shlex.quote
    lines = [
        f"cd -- {q(workdir)} 2>/dev/null || "
        f"{{ echo {q(f'dsec: chdir to {workdir} failed: no such directory')} >&2; exit 126; }}",
        *(f"export {name}={q(value)}" for name, value in env.items()),
        f"command -v -- {q(argv[0])} >/dev/null 2>&1 || "
        f"{{ echo {q(f'dsec: exec: {argv[0]}: executable file not found in $PATH')} >&2; "
        "exit 126; }",
        "exec " + " ".join(q(a) for a in argv),
    ]
    return "\n".join(lines) + "\n"


def _open_fifo(dir_fd: int | None, name: str, flags: int) -> int:
    return os.open(name, flags | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)


def _make_fifo(path: Path) -> None:
    """A pipe only the loop may open (root's, 0600: see LOOP_USER)."""
    if not path.is_fifo():
        path.unlink(missing_ok=True)
        os.mkfifo(path, 0o600)
    path.chmod(0o600)


class BootWord:
    """The line a container's boot writes on `booted` (boot_script), read with a write
    end of our own held, so the pipe shows no end before the boot has written."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.reader = asyncio.StreamReader(limit=RC_LINE_MAX)
        self.transport: asyncio.ReadTransport | None = None
        self.holder: int | None = None

    async def open(self) -> None:
        pipe = os.fdopen(_open_fifo(None, str(self.path), os.O_RDONLY), "rb", buffering=0)
        self.transport, _ = await asyncio.get_running_loop().connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(self.reader), pipe
        )
        self.holder = _open_fifo(None, str(self.path), os.O_WRONLY)

    async def said(self, within_s: float = BOOT_WAIT_S) -> bytes | None:
        """BOOTED or NO_COMMAND; None when nothing came in time (the engine slow to
        run it: a boot that cannot run at all fails the container's start instead)."""
        with contextlib.suppress(
            TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError
        ):
            async with asyncio.timeout(within_s):
                return (await self.reader.readuntil(b"\n"))[:-1]
        return None

    def close(self) -> None:
        if self.holder is not None:
            os.close(self.holder)
            self.holder = None
        if self.transport is not None:
            self.transport.close()


class ResidentProcess:
    """A command the loop runs: the same calls as an engine exec's `Process`, without
    stdin or a terminal."""

    tty = False

    def __init__(self, dir_fd: int, command_id: str) -> None:
        self.dir_fd, self.id = dir_fd, command_id
        self.names = [f"{command_id}.{part}" for part in ("cmd", "out", "err", "rc")]
        self.chunks: asyncio.Queue[tuple[int, bytes] | None] = asyncio.Queue(CHUNKS_AHEAD)
        self.code: int | None = None
        self.transports: list[asyncio.ReadTransport] = []
        self.holders: dict[str, int] = {}  # our write ends, held until the loop's copy has its own
        self.tasks: list[asyncio.Task] = []
        self.on_close: Callable[[], None] | None = None
        self.answered = asyncio.Event()  # "started" or another line on ID.rc, or its end
        self.opened = False  # the loop's copy said "opened"
        self.ran = True  # False once ID.rc says the command never ran

    async def open(self, script: str) -> None:
        """Make the pipes and the script, and open our ends: read ends, each with a write
        end held, so that no end is seen before the loop's copy has opened the pipes."""
        d = self.dir_fd
        cmd, out, err, rc = self.names
        fd = os.open(cmd, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=d)
        try:
            os.write(fd, script.encode())
        finally:
            os.close(fd)
        for name in (out, err, rc):
            os.mkfifo(name, 0o600, dir_fd=d)  # the loop's alone: it opens them for the command
        loop = asyncio.get_running_loop()
        readers = []
        for name in (out, err, rc):
            pipe = os.fdopen(_open_fifo(d, name, os.O_RDONLY), "rb", buffering=0)
            reader = asyncio.StreamReader(limit=CHUNK)
            transport, _ = await loop.connect_read_pipe(
                lambda r=reader: asyncio.StreamReaderProtocol(r), pipe
            )
            self.transports.append(transport)
            readers.append(reader)
        self.holders = {name: _open_fifo(d, name, os.O_WRONLY) for name in (out, err, rc)}
        self.tasks = [
            asyncio.create_task(self._pump(readers[0], readers[1])),
            asyncio.create_task(self._status(readers[2])),
        ]

    async def _pump(self, out: asyncio.StreamReader, err: asyncio.StreamReader) -> None:
        async def one(reader: asyncio.StreamReader, stream: int) -> None:
            while data := await reader.read(CHUNK):
                await self.chunks.put((stream, data))

        await asyncio.gather(one(out, STDOUT), one(err, STDERR))
        await self.chunks.put(None)

    async def _status(self, rc: asyncio.StreamReader) -> None:
        """ "opened" once the loop's copy holds ID.rc (our own write end goes: its end is
        now the copy's end), "started" once the command runs, then the exit code; no
        "started": it never ran (serve_script). An end before the code: the copy was
        killed, so was its command (a reset, or the container's end)."""
        try:
            line = (await rc.readuntil(b"\n"))[:-1]
            if line == OPENED:
                self.opened = True
                self._release(self.names[3])
                line = (await rc.readuntil(b"\n"))[:-1]
            self.ran = line == STARTED
            self.answered.set()
            if self.ran:
                self.code = int((await rc.readuntil(b"\n"))[:RC_LINE_MAX])
            else:
                self.code = NOT_STARTED_EXIT_CODE
                await self.chunks.put((STDERR, NOT_STARTED))
        except asyncio.IncompleteReadError:
            self.code = KILLED_EXIT_CODE  # the copy ended with no code: killed, as its command
        except (ValueError, asyncio.LimitOverrunError):
            self.code = 255  # not a code: the loop is not what it should be
        finally:
            if not self.answered.is_set():  # ended before "started": it never ran
                self.ran = False
                self.answered.set()
        # the command has ended: its output ends when whatever it left running lets go
        self.abort()

    async def runs(self, within_s: float) -> bool:
        """False when the loop says, within `within_s`, that the command never ran (it
        could not fork); True once it runs, or when nothing is said in time (it may
        yet run: its end is awaited as any command's)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within_s):
                await self.answered.wait()
        return self.ran

    def _release(self, *names: str) -> None:
        for name in names or list(self.holders):
            fd = self.holders.pop(name, None)
            if fd is not None:
                os.close(fd)

    def abort(self) -> None:
        """Its processes are gone (killed by a reset, or with their container): the
        exit code, if none came, is SIGKILL's, and the output ends with what was written.
        Killed, not refused: a start waiting to learn whether it ran does not take the
        engine's exec instead."""
        if self.code is None:
            self.code = KILLED_EXIT_CODE
        self.answered.set()
        self._release()

    async def read(self) -> tuple[int, bytes] | None:
        return await self.chunks.get()

    async def write(self, data: bytes) -> None:
        raise DockerOpError("exec_stdin", "closed", "this command was started without stdin")

    def close_stdin(self) -> None:
        """It has none: its stdin is /dev/null."""

    async def resize(self, rows: int, cols: int) -> None:
        """It has no terminal."""

    async def exit_code(self) -> int | None:
        return self.code

    async def close(self) -> None:
        """Stop reading and remove its files; it owns `dir_fd` and closes it last."""
        if self.on_close is not None:
            self.on_close()
        for name in self.names:  # first: a late start finds nothing to block on
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=self.dir_fd)
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self._release()
        for transport in self.transports:
            transport.close()
        os.close(self.dir_fd)


# a command under way, however it was started
RunningCommand = Process | ResidentProcess


class Resident:
    """The node's resident loops: their directories, starting them, and starting
    commands through them."""

    def __init__(
        self,
        config: AgentConfig,
        docker: AsyncDocker,
        clock: Clock,
        docker_failed: Callable[[DockerOpError], None],
        operations: set[asyncio.Task],
    ) -> None:
        self.docker = docker
        self.clock = clock
        self.docker_failed = docker_failed
        self.operations = operations  # the node's, which its shutdown waits for
        self.base = loops_dir(config.state_dir, config.loops_dir)
        self.state_dir = config.state_dir
        # a directory of the state dir's own, made here: removed when its last node goes
        self.own_base = config.loops_dir is None and self.base != config.state_dir
        self.root = self.base / f"{config.node_id}-resident"
        # the node's one copy of the loop's shell (beside root: what is in root is
        # sandboxes' directories); None until made, False where there is none
        self.shell_path = self.base / f"{config.node_id}-resident-sh"
        self.shell: os.stat_result | None | bool = None
        self.starting: set[str] = set()  # sandboxes whose loop start waits for the engine
        self.running: dict[str, set[ResidentProcess]] = {}  # commands under way, by sandbox

    def dir_of(self, sandbox_id: str) -> Path:
        return self.root / sandbox_id

    def prepare(self, sandbox: Sandbox) -> Path | None:
        """The directory a new container mounts: the loop's scripts, its shell and its
        ctl pipe; None where the sandbox gets no loop (its commands take the engine's
        exec): without the node's shell (nothing else can become the sandbox's user
        while out of its reach), or for a user that is root or a name (LOOP_USER could
        not be kept from it, or has no number to become)."""
        ids = numeric_user(sandbox.user)
        if self.node_shell() is None or ids is None or ids[0] == 0:
            return None
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = self.dir_of(sandbox.id)
        path.mkdir(mode=0o711, exist_ok=True)
        # the sandbox's user passes through (its boot runs the template's command in the
        # shell here, as that user) but lists nothing; only the agent writes
        path.chmod(0o711)
        (path / "serve").write_text(serve_script(*ids))
        main = numeric_user(KEEPER_USER) if sandbox.spec.recyclable else ids
        assert main is not None
        (path / "boot").write_text(boot_script(main))
        for script in ("serve", "boot"):
            (path / script).chmod(0o600)  # the loop's alone: see LOOP_USER
        _make_fifo(path / "ctl")
        _make_fifo(path / "booted")
        (path / SHELL).unlink(missing_ok=True)
        try:
            os.link(self.shell_path, path / SHELL)
        except OSError as e:  # another file system, say: no loop, the engine's exec
            log.warning("the command loop's shell cannot be linked for %s: %s", sandbox.id, e)
            shutil.rmtree(path, ignore_errors=True)
            return None
        return path

    def node_shell(self) -> os.stat_result | None:
        """The node's execute-only copy of the host's static busybox, made once (None
        where the host has none: its sandboxes then have no loop)."""
        if self.shell is None:
            try:
                busybox = find_static_busybox()
            except ImageBuildError:
                log.warning(
                    "no static busybox on this host: no command loops, every "
                    "command takes the engine's exec"
                )
                self.shell = False
                return None
            made = self.shell_path.with_suffix(".new")
            self.base.mkdir(mode=0o700, parents=True, exist_ok=True)
            if self.own_base:
                (self.base / STATE_DIR_MARK).write_text(str(self.state_dir.resolve()))
            shutil.copyfile(busybox, made)
            made.chmod(0o111)  # run, never read: what keeps the loop undumpable
            made.replace(self.shell_path)
            self.shell = self.shell_path.stat()
        return self.shell or None

    async def entrypoint(self, sandbox: Sandbox) -> list[str] | None:
        """The entrypoint of a sandbox's container (boot_script), with the image's own
        after it; None when the image cannot be looked at (say, a restore whose
        template's image is gone)."""
        try:
            own = await self.docker.image_entrypoint(sandbox.spec.image)
        except DockerOpError:
            return None
        return [f"{MOUNT}/{SHELL}", f"{MOUNT}/boot", *own]

    @contextlib.asynccontextmanager
    async def boot_heard(self, sandbox_id: str) -> AsyncIterator[BootWord]:
        """Listen for the boot's word on `booted`, from before its container starts: what
        a boot writes with no reader there is lost."""
        word = BootWord(self.dir_of(sandbox_id) / "booted")
        try:
            await word.open()
            yield word
        finally:
            word.close()

    def has_loop(self, sandbox_id: str) -> bool:
        """Whether the sandbox was made with a loop of LOOP_USER's (`prepare`): not one
        made without, nor by an agent whose loops ran as the tenant's user (their pipes
        open to it), whose commands take the engine's exec."""
        try:
            mode = os.lstat(self.dir_of(sandbox_id) / "ctl").st_mode
        except OSError:
            return False
        return stat.S_ISFIFO(mode) and not mode & 0o077

    def abort_all(self, sandbox_id: str) -> None:
        """The sandbox's processes were all killed (a reset, a release): its commands
        end, also those the loop had not yet started (it died before reading them)."""
        for proc in self.running.get(sandbox_id, ()):
            proc.abort()

    def remove(self, sandbox_id: str) -> None:
        shutil.rmtree(self.dir_of(sandbox_id), ignore_errors=True)

    def close(self, keep: set[str]) -> None:
        """At a shutdown that removed the node's sandboxes (`keep`: those it could not):
        the loop directories of the others, and once none is left, the node's directory
        and shell copy, and the state dir's own directory once no node of it has any
        (the memory of a tmpfs is the host's)."""
        self.remove_all_but(keep)
        if self.root.is_dir() and any(self.root.iterdir()):
            return  # a sandbox whose removal failed keeps its loop for the next agent
        with contextlib.suppress(FileNotFoundError):
            self.root.rmdir()
        self.shell_path.unlink(missing_ok=True)
        if not self.own_base:
            return
        try:
            left = {p.name for p in self.base.iterdir()}
        except FileNotFoundError:  # another node of the state dir, closing too, went first
            return
        if left <= {STATE_DIR_MARK}:  # (kept while another node of it has anything there)
            with contextlib.suppress(OSError):
                (self.base / STATE_DIR_MARK).unlink()
                self.base.rmdir()

    def remove_all_but(self, keep: set[str]) -> None:
        """Directories of sandboxes this node no longer has (an agent that stopped before
        removing them)."""
        if self.root.is_dir():
            for path in self.root.iterdir():
                if path.name not in keep:
                    shutil.rmtree(path, ignore_errors=True)

    def ensure_loop(self, sandbox: Sandbox) -> None:
        """Start the sandbox's loop in the background, unless one ended less than
        RESTART_AFTER_S ago. The first start of a leased sandbox's container is a
        client's work (`hurry`); any other waits until nothing more urgent does. A start
        already waiting for the engine is hurried if it has become such a first start."""
        tried = sandbox.resident_tried_at
        if not self.has_loop(sandbox.id):
            return
        if sandbox.id in self.starting:
            self.hurry(sandbox)
            return
        if tried is not None and self.clock.now() - tried < RESTART_AFTER_S:
            return
        self.starting.add(sandbox.id)
        work = Work.CLIENT if _first_start_for_a_lease(sandbox) else Work.RESIDENT
        container_id = sandbox.record.container_id

        async def start() -> None:
            started = True
            try:
                pid = await self.docker.start_detached(
                    container_id,
                    [f"{MOUNT}/{SHELL}", f"{MOUNT}/serve"],
                    user=LOOP_USER,
                    work=work,
                    hold=lambda: _unchanging(sandbox, container_id),
                    key=_loop_start_key(sandbox.id),
                )
                started = pid is not None
                # known by PID and start time, which the loop's exec keeps: the engine
                # may answer before runc's init has become the loop's shell, so what it
                # runs is left for a reset to check (agent/host.py), as it does anyway
                sandbox.loop = LoopProcess.of(pid) if pid else None
            except DockerOpError as e:  # gone, or no sh: commands take the engine's exec
                self.docker_failed(e)
            finally:
                self.starting.discard(sandbox.id)
                if started:  # one not started now may be the next exec's to start
                    sandbox.resident_tried_at = self.clock.now()

        task = asyncio.ensure_future(start())
        self.operations.add(task)
        task.add_done_callback(self.operations.discard)

    def hurry(self, sandbox: Sandbox) -> None:
        """A leased sandbox's commands come now, and each one until its loop runs is an
        engine exec, which costs the engine what the loop's own start does: the first
        start of its container, still waiting for the engine, is a client's work from
        here on."""
        if sandbox.id in self.starting and _first_start_for_a_lease(sandbox):
            self.docker.promote(_loop_start_key(sandbox.id), Work.CLIENT)

    async def start(
        self, sandbox: Sandbox, argv: list[str], env: dict[str, str], workdir: str
    ) -> ResidentProcess | None:
        """Start a command through the sandbox's loop; None when the loop is not there
        (the caller takes the engine's exec, and the loop is started again) or could
        not start it."""
        if not self.has_loop(sandbox.id):
            return None
        try:
            dir_fd = os.open(self.dir_of(sandbox.id), os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            return None  # removed meanwhile
        command_id = secrets.token_hex(8)
        proc = ResidentProcess(dir_fd, command_id)
        try:
            await proc.open(command_script(argv, env, workdir))
            ctl = _open_fifo(dir_fd, "ctl", os.O_WRONLY)
            try:
                os.write(ctl, f"{command_id}\n".encode())
            finally:
                os.close(ctl)
        except OSError as e:
            await proc.close()
            # ENXIO: nothing reads ctl (the loop ended); EAGAIN: ctl is full (it hangs)
            if e.errno in (errno.ENXIO, errno.EAGAIN, errno.EPIPE):
                self.ensure_loop(sandbox)
            else:  # the host's side (its disk full, say): the engine's exec works still
                log.warning("the command loop of %s cannot take a command: %s", sandbox.id, e)
            return None
        running = self.running.setdefault(sandbox.id, set())
        running.add(proc)
        proc.on_close = lambda: _forget(self.running, sandbox.id, proc)
        if not await self._runs(proc):
            await proc.close()  # never ran: the engine's exec, which needs no fork inside
            return None
        return proc

    async def _runs(self, proc: ResidentProcess) -> bool:
        """Whether the command runs, or may yet. Not when the loop or its copy says it
        never ran, nor when nothing came and the loop has gone: a fork that fails ends
        the shell that made it, the loop's own too (a sandbox with no pid left). The
        loop is then started again."""
        if not await proc.runs(ACK_WAIT_S):
            return False
        return proc.answered.is_set() or proc.opened or _loop_reads_ctl(proc.dir_fd)


def _first_start_for_a_lease(sandbox: Sandbox) -> bool:
    """Whether a loop start is a client's work: the sandbox is leased and its container
    never had its loop started. A start after a reset waits as a warm one's does: the
    next reset waits for a start under way (Sandbox.loop_started), and a recycled
    sandbox's leases are short, so a start in one delays its return to the pool."""
    return sandbox.state == SandboxState.LEASED and sandbox.resident_tried_at is None


def _loop_start_key(sandbox_id: str) -> tuple[str, str]:
    """What a loop's start waits for the engine under (EngineQueue.promote)."""
    return ("loop-start", sandbox_id)


@contextlib.asynccontextmanager
async def _unchanging(sandbox: Sandbox, container_id: str) -> AsyncIterator[bool]:
    """Whether the loop may start now: not while another operation has the sandbox (a
    pause, a thaw, a reset, a release: this lowest work never waits for them), nor once
    it is frozen, gone or in a new container. Holds `loop_start` meanwhile, not the
    sandbox's lock, so a lease never waits for it; a pause or a reset waits for it
    (`Sandbox.loop_started`)."""
    if sandbox.lock.locked() or sandbox.state not in LOOP_STATES:
        yield False
        return
    async with sandbox.loop_start:
        # looked at again once held: an operation that took the sandbox before waits not
        yield (
            not sandbox.lock.locked()
            and sandbox.state in LOOP_STATES
            and sandbox.record.container_id == container_id
        )


def _loop_reads_ctl(dir_fd: int) -> bool:
    """Whether a loop still reads ctl. The loop holds it open for reading as long as it
    runs, and nothing else of the sandbox's can (ctl is LOOP_USER's alone): a loop that
    has gone leaves no reader. Known so
    whether the loop started with its container, whose PID the agent never learns, or by
    an engine exec that answered before the loop's program ran."""
    try:
        os.close(_open_fifo(dir_fd, "ctl", os.O_WRONLY))
    except OSError as e:
        return e.errno != errno.ENXIO  # anything else (the sandbox gone): as any command
    return True


def _forget(running: dict[str, set[ResidentProcess]], sandbox_id: str, proc: ResidentProcess):
    procs = running.get(sandbox_id)
    if procs is not None:
        procs.discard(proc)
        if not procs:
            del running[sandbox_id]
