"""A sandbox's processes, files and SysV IPC as the host sees them: what the agent does
to a sandbox without the engine, where it can (the host's PIDs, `--pid host` in a
container, and root's reach into /proc).

The engine's kill and exec cost the engine a runc process each and wait their turn
behind a burst's creates: half a second a release or a reset waited under churn. From
here the same work is a few system calls:
- a release kills the container's init (`kill_pid_namespace`): the kernel then ends
  every other process of its PID namespace;
- a reset (`reset_from_host`) does what agent/reset.py's script does inside the
  container, with no engine exec: kills every process but init and the template's main
  command, empties the directories, removes the SysV IPC objects, and checks all three.
  It keeps the sandbox's command loop too where it is the very process the agent
  started, in a shell no tenant can reach into (agent/resident.py), and unchanged: the
  next lease's commands then need no engine exec to start it again;
- a command past its deadline (`kill_command_from_host`) is killed as agent/execs.py's
  script does inside, with no fork there: a sandbox whose pids are all taken cannot
  run that script.

A process is signalled only through a pidfd that was checked, once open, to be in the
container's cgroup, so a PID that another process took is never signalled. The
sandbox's files are reached through /proc/<init>/root a directory at a time, never
following a symlink, and removed with calls relative to an open directory (shutil's
fd-based rmtree): nothing the tenant made can point the agent at a host path.
"""

from __future__ import annotations

import _thread
import asyncio
import contextlib
import ctypes
import errno
import os
import shutil
import signal
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from agent.users import WORKDIR_MODE

T = TypeVar("T")
KILL_ROUNDS = 100  # rounds of stop-and-kill before a reset gives up on what forks on
SETTLE_S = 2.0  # how long killed processes may take to be gone before a reset fails
CLONE_NEWIPC = 0x08000000
IPC_RMID = 0
_IPC_KINDS = ("shm", "sem", "msg")


class Unavailable(Exception):
    """The host's side of this sandbox cannot be reached from here (an agent without
    the host's PIDs or cgroups): the engine does the work instead."""


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command's name (state first, then the parent
    PID; the start time is the 20th): the name may hold spaces or parentheses, so the
    fields are read after its last ") "."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rpartition(") ")[2].split()
    return fields if len(fields) >= 20 else None


def _in_cgroup_of(pid: int, container_id: str) -> bool:
    try:
        return container_id in Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return False


def _status_values(pid: int, name: str) -> list[str] | None:
    """The values of field `name` of /proc/PID/status; None when the process is gone or
    its status has no such field."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    prefix = f"{name}:"
    return next((line.split()[1:] for line in status.splitlines() if line.startswith(prefix)), None)


def _real_uid(pid: int) -> str | None:
    uids = _status_values(pid, "Uid")  # real, effective, saved, file system
    return uids[0] if uids else None


def is_init_of(pid: int, container_id: str) -> bool:
    """Whether process `pid` is the init of container `container_id`: PID 1 of its own
    PID namespace, in that container's cgroup. A PID kept from the engine's answer is
    taken again only so: it cannot be another's while it is."""
    nspid = _status_values(pid, "NSpid") or []
    return len(nspid) > 1 and nspid[-1] == "1" and _in_cgroup_of(pid, container_id)


def open_in_container(pid: int, container_id: str) -> int | None:
    """A pidfd of process `pid`, once it is checked to be in container `container_id`'s
    cgroup (checked after it is open: the pidfd holds that very process, so a PID
    reused meanwhile is found out); None when it has exited or is not the container's.
    Raises PermissionError where the host's PIDs cannot be signalled from here."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    if _in_cgroup_of(pid, container_id):
        return pidfd
    os.close(pidfd)
    return None


async def kill_pid_namespace(pid: int, container_id: str, wait_s: float = 2.0) -> bool:
    """SIGKILL process `pid`, the init of container `container_id`, and wait until it has
    exited: the kernel then kills every other process of its PID namespace. False when
    it cannot be done from here."""
    try:
        pidfd = open_in_container(pid, container_id)
    except OSError:
        # an agent that does not see the host's PIDs (a container without --pid host):
        # the engine's kill tells what happened
        return False
    if pidfd is None:
        return False  # exited and its PID another's now, or not the container's
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        loop = asyncio.get_running_loop()
        exited = loop.create_future()
        # readable: the process has exited
        loop.add_reader(pidfd, lambda: exited.done() or exited.set_result(None))
        try:
            await asyncio.wait_for(exited, wait_s)
        except TimeoutError:
            return False
        finally:
            loop.remove_reader(pidfd)
        return True
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    finally:
        os.close(pidfd)


@dataclass(frozen=True)
class LoopProcess:
    """A sandbox's command loop (agent/resident.py) as the agent started it: its PID and
    start time (a PID that another process took has another start time)."""

    pid: int
    started: int  # clock ticks since boot

    @classmethod
    def of(cls, pid: int) -> LoopProcess | None:
        fields = _stat_fields(pid)
        return cls(pid, int(fields[19])) if fields is not None else None

    def runs(self, program: os.stat_result) -> bool:
        """Whether it runs `program` (that file, not one of the same name)."""
        try:
            exe = os.stat(f"/proc/{self.pid}/exe")
        except OSError:
            return False
        return (exe.st_dev, exe.st_ino) == (program.st_dev, program.st_ino)


def booted_loop(init_pid: int, container_id: str, shell: os.stat_result) -> LoopProcess | None:
    """The command loop that container `container_id`'s boot started (agent/resident.py:
    boot_script), looked for right after the boot said so, before any lease: the one
    process other than init and the template's command that runs the node's shell
    `shell` as init's user (LOOP_USER; the template's command of a sandbox that may be
    recycled runs as KEEPER_USER). None when there is not exactly one (a reset then
    kills what it does not know, and the loop is started again), or when the host's
    side cannot be reached from here."""
    try:
        sandbox = HostSandbox(init_pid, container_id)
    except Unavailable:
        return None
    try:
        loop_uid = _real_uid(init_pid)
        if loop_uid is None:
            return None
        pids = sandbox.pids()
        found = [
            loop
            for pid in pids - {init_pid, sandbox.main(pids)}
            if (loop := LoopProcess.of(pid)) is not None
            and loop.runs(shell)
            and _real_uid(pid) == loop_uid
        ]
        return found[0] if len(found) == 1 else None
    finally:
        sandbox.close()


def _inherited(pid: int) -> tuple[str, ...] | None:
    """What a process of the same user may change in another without reaching into its
    memory, and the commands it starts inherit: resource limits, nice value, CPU
    affinity, OOM score adjustment."""
    try:
        limits = Path(f"/proc/{pid}/limits").read_text()
        status = Path(f"/proc/{pid}/status").read_text()
        oom = Path(f"/proc/{pid}/oom_score_adj").read_text()
    except OSError:
        return None
    fields = _stat_fields(pid)
    cpus = [line for line in status.splitlines() if line.startswith("Cpus_allowed_list:")]
    return (limits, fields[16] if fields else "?", *cpus, oom.strip())


class HostSandbox:
    """One running sandbox seen from the host: its init's PID and its cgroup's process
    list. `Unavailable` when either cannot be read from here."""

    def __init__(self, init_pid: int, container_id: str) -> None:
        self.init, self.container_id = init_pid, container_id
        try:
            pidfd = open_in_container(init_pid, container_id)
        except OSError as e:
            raise Unavailable(f"the host's PIDs: {e}") from e
        if pidfd is None:
            raise Unavailable(f"process {init_pid} is not container {container_id}'s init")
        os.close(pidfd)
        self.procs = self._procs_file()
        try:
            self.root = os.open(f"/proc/{init_pid}/root", os.O_PATH | os.O_DIRECTORY)
        except OSError as e:
            raise Unavailable(f"the sandbox's files through /proc: {e}") from e

    def close(self) -> None:
        os.close(self.root)

    def _procs_file(self) -> Path:
        """The cgroup.procs of the container's cgroup, in cgroup v1's pids hierarchy or
        in v2's (mounted at /sys/fs/cgroup, or at /sys/fs/cgroup/unified beside v1)."""
        base = Path("/sys/fs/cgroup")
        try:
            lines = Path(f"/proc/{self.init}/cgroup").read_text().splitlines()
        except OSError as e:
            raise Unavailable(f"the cgroups of process {self.init}: {e}") from e
        for line in lines:
            _, controllers, path = line.split(":", 2)
            if self.container_id not in path:
                continue
            if "pids" in controllers.split(","):
                candidates = [base / "pids" / path.lstrip("/")]
            elif controllers == "":
                candidates = [base / path.lstrip("/"), base / "unified" / path.lstrip("/")]
            else:
                continue
            for dir_ in candidates:
                if (dir_ / "cgroup.procs").is_file():
                    return dir_ / "cgroup.procs"
        raise Unavailable(f"no cgroup of container {self.container_id} under {base}")

    def pids(self) -> set[int]:
        """The processes of the sandbox still alive (a zombie holds nothing: its reaper
        takes it)."""
        try:
            listed = {int(p) for p in self.procs.read_text().split()}
        except OSError:
            return set()  # the cgroup is gone with its container
        return {p for p in listed if (f := _stat_fields(p)) is not None and f[0] != "Z"}

    def main(self, pids: set[int]) -> int | None:
        """The template's command: the child of init that started first (processes
        orphaned later are adopted by init too, but start after it)."""
        children = []
        for pid in pids:
            fields = _stat_fields(pid)
            if fields is not None and fields[1] == str(self.init):
                children.append((int(fields[19]), pid))
        return min(children)[1] if children else None

    async def kill_all_but(self, keep: set[int]) -> set[int]:
        """Kill every other process (`kill_chosen`)."""
        return await self.kill_chosen(lambda pids: pids - keep)

    async def kill_chosen(self, choose: Callable[[set[int]], set[int]]) -> set[int]:
        """Stop, then kill, the processes `choose` picks of those alive, round after
        round, until it picks none (stopped first, so that nothing forks while the rest
        are killed); what it still picks after KILL_ROUNDS."""
        others: set[int] = set()
        for round_ in range(KILL_ROUNDS):
            others = choose(self.pids())
            if not others:
                return set()
            pidfds = [fd for p in others if (fd := open_in_container(p, self.container_id))]
            try:
                for sig in (signal.SIGSTOP, signal.SIGKILL):
                    for fd in pidfds:
                        with contextlib.suppress(ProcessLookupError):
                            signal.pidfd_send_signal(fd, sig)
            finally:
                for fd in pidfds:
                    os.close(fd)
            await asyncio.sleep(0.01 if round_ > 3 else 0)
        return others

    def unchanged(self, loop: LoopProcess, main: int, shell: os.stat_result) -> bool:
        """Whether `loop` is still the process the agent started, running the node's
        execute-only shell (so no tenant could reach into its memory), with what its
        commands inherit as the template's command has it (which no lease can reach:
        it runs as KEEPER_USER)."""
        return (
            LoopProcess.of(loop.pid) == loop  # a zombie runs nothing: `runs` says so below
            and _in_cgroup_of(loop.pid, self.container_id)
            and loop.runs(shell)
            and (mine := _inherited(loop.pid)) is not None
            and mine == _inherited(main)
        )

    def resume(self, pid: int) -> None:
        """SIGCONT `pid` (a lease may have stopped it), if it is still the sandbox's."""
        pidfd = open_in_container(pid, self.container_id)
        if pidfd is not None:
            try:
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(pidfd, signal.SIGCONT)
            finally:
                os.close(pidfd)

    async def settled(self, keep: set[int], within_s: float = SETTLE_S) -> set[int]:
        """Wait until only `keep` runs (killed processes take a moment to exit); what
        else still runs at the end."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        while (left := self.pids() - keep) and loop.time() < deadline:
            await asyncio.sleep(0.005)
        return left


def _carries(pid: int, entry: bytes) -> bool:
    """Whether `entry` (NAME=VALUE) is in the environment process `pid` started with.
    Raises PermissionError where another user's environment cannot be read from here."""
    try:
        return entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except (FileNotFoundError, ProcessLookupError):
        return False


def _own_group(pid: int) -> int | None:
    """Process `pid`'s group, by its host PGID, where the group is one of the
    container's own (as the container sees it: neither init's, 1, nor one led from
    outside, 0); None otherwise."""
    ids = _status_values(pid, "NSpgid") or []  # the host's PGID first, the container's last
    return int(ids[0]) if len(ids) > 1 and int(ids[-1]) > 1 else None


async def kill_command_from_host(init_pid: int, container_id: str, marker_entry: bytes) -> set[int]:
    """Kill a command's processes without the engine, and without a fork in the sandbox
    (whose pids may all be taken): every process that carries `marker_entry` in its
    environment, and every process of their own groups (a child that cleared its
    environment still dies with its group), as agent/execs.py's KILL_SCRIPT does inside.
    What still runs after KILL_ROUNDS; `Unavailable` when it cannot be done from here."""
    sandbox = HostSandbox(init_pid, container_id)

    def command(pids: set[int]) -> set[int]:
        marked = {p for p in pids if _carries(p, marker_entry)}
        if not marked:
            return set()
        group_of = {p: _own_group(p) for p in pids}  # each process's status read once
        groups = {group_of[p] for p in marked} - {None}
        return (marked | {p for p in pids if group_of[p] in groups}) - {init_pid}

    try:
        return await sandbox.kill_chosen(command)
    except PermissionError as e:
        raise Unavailable(f"the environment of the sandbox's processes: {e}") from e
    finally:
        sandbox.close()


async def in_own_thread(fn: Callable[[], T]) -> T:
    """Run blocking `fn` in a thread of its own, not the shared pool: a tenant's million
    files hold no thread that another sandbox's work needs."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if done.done():
            return  # its caller gave up (a timeout)
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            result = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller as is
            loop.call_soon_threadsafe(settle, None, e)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    # _thread's start, not threading.Thread's: Thread.start() waits until the new thread
    # has run, which on a busy node held the event loop (every sandbox's requests) about
    # 1 ms a thread, 6.5 s over a run of 3,000 personalised claims; `fn` never asks the
    # threading module which thread it is in, so none of its bookkeeping is missed
    _thread.start_new_thread(run, ())
    return await done


def _open_dir(root: int, path: str) -> int:
    """`path` inside the sandbox, opened a directory at a time from its root, following
    no symlink (nothing the sandbox made can lead out of it)."""
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise OSError(errno.EINVAL, "a path with '..'")
    fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY, dir_fd=root)
    for part in parts:
        try:
            nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
        finally:
            os.close(fd)
        fd = nxt
    return fd


def _empty(root: int, path: str) -> list[str]:
    """Remove everything in directory `path` (dotfiles, unreadable directories: root
    reads them), and give it back its mode where the tenant owns it (the work dir: a
    lease's `chmod 0` would fail the next lease's commands); what is left, as "file
    PATH"."""
    try:
        fd = _open_dir(root, path)
    except FileNotFoundError:
        return []  # not there: nothing in it (as the in-container reset)
    except OSError as e:
        return [f"dir {path}: {e.strerror}"]
    try:
        if os.fstat(fd).st_uid != 0:
            os.fchmod(fd, WORKDIR_MODE)
        for name in os.listdir(fd):
            try:
                if stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                    shutil.rmtree(name, dir_fd=fd)
                else:
                    os.unlink(name, dir_fd=fd)
            except (OSError, RecursionError):
                pass  # a tree too deep to walk, say: the check names what is left
        return [f"file {path.rstrip('/')}/{name}" for name in os.listdir(fd)]
    finally:
        os.close(fd)


def _clear_ipc(init_pid: int) -> list[str]:
    """Remove the SysV IPC objects of the sandbox's IPC namespace; what is left, as "ipc
    KIND ID". Joins that namespace: call it only from a thread of its own (setns moves
    the calling thread alone, and this one ends afterwards)."""
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        fd = os.open(f"/proc/{init_pid}/ns/ipc", os.O_RDONLY)
    except OSError as e:
        raise Unavailable(f"the sandbox's IPC namespace: {e}") from e
    try:
        if libc.setns(fd, CLONE_NEWIPC) != 0:
            raise Unavailable(
                f"joining the sandbox's IPC namespace: {os.strerror(ctypes.get_errno())}"
            )
    finally:
        os.close(fd)
    remove = {
        "shm": lambda i: libc.shmctl(i, IPC_RMID, None),
        "sem": lambda i: libc.semctl(i, 0, IPC_RMID),
        "msg": lambda i: libc.msgctl(i, IPC_RMID, None),
    }

    def listed(kind: str) -> list[int]:
        # the reading thread's IPC namespace is the one /proc/sysvipc shows
        lines = Path(f"/proc/sysvipc/{kind}").read_text().splitlines()[1:]
        return [int(line.split()[1]) for line in lines if line.strip()]

    for kind in _IPC_KINDS:
        for ipc_id in listed(kind):
            remove[kind](ipc_id)
    return [f"ipc {kind} {i}" for kind in _IPC_KINDS for i in listed(kind)]


@dataclass
class HostReset:
    problems: list[str]  # what is not as a fresh sandbox has it: empty when clean
    kept_loop: bool  # the command loop was kept, for the next lease


async def reset_from_host(
    init_pid: int,
    container_id: str,
    dirs: Iterable[str],
    loop: LoopProcess | None = None,
    shell: os.stat_result | None = None,
) -> HostReset:
    """Kill every process but init and the template's command (and the command loop
    `loop`, when it is unchanged: `HostSandbox.unchanged`), empty `dirs`, remove the
    SysV IPC objects, and check. `Unavailable` when the host's side cannot be reached:
    the engine's reset, which redoes it all, runs instead."""
    sandbox = HostSandbox(init_pid, container_id)
    try:
        pids = sandbox.pids()
        main = sandbox.main(pids)
        if main is None:
            return HostReset(["no main process: the sandbox's command has exited"], False)
        keep = {init_pid, main}
        if loop is not None and shell is not None and sandbox.unchanged(loop, main, shell):
            keep.add(loop.pid)
        if stubborn := await sandbox.kill_all_but(keep):
            return HostReset([f"processes that will not die: {sorted(stubborn)}"], False)
        if loop is not None and loop.pid in keep:
            sandbox.resume(loop.pid)
        dirs = list(dirs)

        def empty_and_clear() -> list[str]:
            found = [line for d in dirs for line in _empty(sandbox.root, d)]
            return found + _clear_ipc(init_pid)

        problems = await in_own_thread(empty_and_clear)
        if left := await sandbox.settled(keep):
            problems.append(f"processes left: {sorted(left)}")
        if gone := {init_pid, main} - sandbox.pids():
            problems.append(f"processes gone: {sorted(gone)} (init and the main command must run)")
        kept = loop is not None and loop.pid in keep and loop.pid in sandbox.pids()
        return HostReset(problems, kept)
    finally:
        sandbox.close()
