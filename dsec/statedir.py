"""The state directory and dsec's files in it: its owner's alone (0700, files 0600).

They hold credentials (the env file), what tenants ran (audit logs), what they wrote
(hibernation archives) and who holds which sandbox (stores, spent keys). A file is
created with its mode (os.open) and fchmod'ed, which also corrects one left with a
looser mode by an older version; the umask is not touched, since it is process-wide
and these processes run threads that create files of their own.

A state dir's nodes keep their command loops' directories apart from it, on /dev/shm
where that is a tmpfs (`loops_dir`): the agent uses them (agent/resident.py), and what
an agent killed outright leaves there is removed by the next agent's start once the
state dir is gone (`sweep_orphans`), or by its pool's stop (`remove_loops_of`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import stat
from pathlib import Path

log = logging.getLogger(__name__)

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600


def private_dir(path: Path) -> Path:
    """`path` made if missing, 0700 whatever it was (its parents keep their modes)."""
    path.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
    if path.stat().st_mode & stat.S_ISVTX:
        # a shared directory such as /tmp: closing it to others would break the machine
        raise ValueError(f"{path} is a shared directory (sticky bit), not a state directory")
    os.chmod(path, PRIVATE_DIR)
    return path


def open_private(path: Path, flags: int) -> int:
    """A file descriptor on `path` (made 0600 if missing, made 0600 if it was not)."""
    fd = os.open(path, flags | os.O_CREAT, PRIVATE_FILE)
    try:
        os.fchmod(fd, PRIVATE_FILE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_private(path: Path, data: bytes) -> None:
    """Replace `path`'s contents with `data`, the file 0600."""
    with os.fdopen(open_private(path, os.O_WRONLY | os.O_TRUNC), "wb") as f:
        f.write(data)


def restrict(*paths: Path) -> None:
    """Make those of `paths` that exist 0600 (files) or 0700 (directories): files kept
    from a run that created them with looser modes."""
    for path in paths:
        try:
            mode = PRIVATE_DIR if path.is_dir() else PRIVATE_FILE
            os.chmod(path, mode)
        except FileNotFoundError:
            continue


# A tmpfs every Linux host has: the loops' directories go there unless configured
SHARED_MEMORY = Path("/dev/shm")


def loops_dir(state_dir: Path, configured: Path | None = None) -> Path:
    """Where the loop directories and shell copies of a state dir's nodes go: as
    `configured` (AgentConfig.loops_dir), or the state dir's own directory under
    /dev/shm where that is a tmpfs, else the state dir. Each command makes its script
    and three pipes there and removes them after: on this machine's disk that held the
    agent's event loop 0.44 ms a command, on a tmpfs 0.03 ms (docs/operations.md)."""
    if configured is not None:
        return configured
    if not _is_tmpfs(SHARED_MEMORY):
        return state_dir
    # one directory of this user's, which nobody else may have made (/dev/shm is
    # everyone's), then one per state dir: the agents of one state dir share it
    mine = SHARED_MEMORY / f"dsec-{os.geteuid()}"
    with contextlib.suppress(FileExistsError):
        mine.mkdir(mode=0o700)
    found = os.lstat(mine)
    if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.geteuid() or found.st_mode & 0o077:
        log.warning("%s is not this user's own: the command loops stay in the state dir", mine)
        return state_dir
    digest = hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:16]
    return mine / digest


# in a directory of a state dir's own under /dev/shm: that state dir's path
STATE_DIR_MARK = "state-dir"


def sweep_orphans() -> None:
    """Remove this user's loop directories under /dev/shm whose state dir is gone (its
    agents were killed, never to run again): what they held was in the host's memory."""
    mine = SHARED_MEMORY / f"dsec-{os.geteuid()}"
    if not mine.is_dir() or mine.is_symlink():
        return
    for base in mine.iterdir():
        owner = _state_dir_of(base)
        if owner is not None and not owner.exists():
            shutil.rmtree(base, ignore_errors=True)


def remove_loops_of(state_dir: Path) -> None:
    """Remove the loop directory of `state_dir`'s nodes under /dev/shm, none of which
    runs any more: a node killed before it could remove its own leaves it, and a state
    dir that stays (a test's, a pool's kept for its next start) would keep it."""
    base = loops_dir(state_dir)
    if base != state_dir and _state_dir_of(base) == state_dir.resolve():
        shutil.rmtree(base, ignore_errors=True)


def _state_dir_of(base: Path) -> Path | None:
    """The state dir a loop directory under /dev/shm is marked as its own; None while
    it is being made, or for one that is not ours to judge."""
    try:
        return Path((base / STATE_DIR_MARK).read_text())
    except OSError:
        return None


def _is_tmpfs(path: Path) -> bool:
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return False
    return any(m.split()[1:3] == [str(path), "tmpfs"] for m in mounts if len(m.split()) > 2)
