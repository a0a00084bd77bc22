"""The state directory and dsec's files in it: its owner's alone (0700, files 0600).

They hold credentials (the env file), what tenants ran (audit logs), what they wrote
(hibernation archives) and who holds which sandbox (stores, spent keys). A file is
created with its mode (os.open) and fchmod'ed, which also corrects one left with a
looser mode by an older version; the umask is not touched, since it is process-wide
and these processes run threads that create files of their own.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

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
