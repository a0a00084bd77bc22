"""The audit log: one JSON line per command run in a sandbox, and one per request
refused for its credential (who tried, from where, on which route; never the token).

It lives in the agent's state dir (`<state_dir>/<node_id>-audit.jsonl`, 0600), which
no sandbox can see (sandboxes have no host mounts), and it outlives the sandbox it
describes: removing a sandbox never touches it. Lines are only ever appended. Writes
run in order on one worker thread, so the event loop never waits on disk and lines
never interleave; each line is flushed to the kernel before the exec is answered, so
a kill -9 of the agent loses no answered command (a crash of the host may lose the
last lines: no fsync, which would cost every exec a disk round trip).

Past `max_bytes` the log is rotated, on the same writer thread between two lines:
`...jsonl` becomes `...jsonl.1`, `.1` becomes `.2`, and so on; `files` are kept in all
and the oldest goes. A read opens every kept file under the same lock as the renames,
so it sees each line once, oldest first, whenever a rotation comes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shlex
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Annotated, Literal

from pydantic import BaseModel, Field

from dsec.statedir import open_private, private_dir, restrict

log = logging.getLogger(__name__)

# Enough to read what was run; an argv may be megabytes (4096 args of 64 KiB).
CMD_CHARS = 1024


def quoted_cmd(cmd: list[str]) -> tuple[str, bool]:
    """The argv as one shell-quoted string, cut at CMD_CHARS; and whether it was cut."""
    text = shlex.join(cmd)
    return text[:CMD_CHARS], len(text) > CMD_CHARS


class AuditRecord(BaseModel):
    event: Literal["exec"] = "exec"
    time: float = Field(description="wall clock when the command was asked for, Unix seconds")
    node: str
    sandbox: str
    lease_id: str | None = Field(description="the lease, which identifies the client")
    pool: str
    peer: str | None = Field(description="the address the request came from")
    cmd: str = Field(description=f"the argv, shell-quoted, cut at {CMD_CHARS} characters")
    cmd_truncated: bool
    exit_code: int | None = Field(description="null when the command could not be run")
    timed_out: bool = False
    duration_ms: float
    stdout_bytes: int = Field(0, description="bytes returned to the client")
    stderr_bytes: int = 0
    truncated: bool = Field(False, description="output went past max_output_bytes")
    error: str | None = Field(None, description="the error code answered instead of a result")


class RefusalRecord(BaseModel):
    """A request the agent refused for its credential (401 or 403)."""

    event: Literal["refused"] = "refused"
    time: float = Field(description="wall clock when it was refused, Unix seconds")
    node: str
    peer: str | None = Field(description="the address the request came from")
    method: str
    route: str = Field(description="the route as declared, e.g. /v1/sandboxes/{sandbox_id}/exec")
    sandbox: str | None = Field(description="the sandbox the request named, if any")
    status: int = Field(description="401: no credential; 403: one that does not hold the route")
    code: str


Record = Annotated[AuditRecord | RefusalRecord, Field(discriminator="event")]


class AuditRecords(BaseModel):
    records: list[Record]


def parse_record(line: str) -> AuditRecord | RefusalRecord:
    data = json.loads(line)
    if not isinstance(data, dict):
        raise ValueError("not a record")
    # lines written before refusals were recorded have no "event": commands, all of them
    return (RefusalRecord if data.get("event") == "refused" else AuditRecord).model_validate(data)


class AuditLog:
    def __init__(self, path: Path, max_bytes: int, files: int) -> None:
        assert files >= 2, "a rotation keeps the file it closes"
        self.path = path
        self.max_bytes = max_bytes
        self.files = files
        self._writer = ThreadPoolExecutor(1, "agent-audit")
        self._file: IO[str] | None = None
        self._renaming = threading.Lock()  # a rotation's renames against a read's opens

    def kept(self) -> list[Path]:
        """The log's files, oldest first: `.jsonl.{files-1}` ... `.jsonl.1`, `.jsonl`."""
        return [self._nth(i) for i in range(self.files - 1, -1, -1)]

    def _nth(self, n: int) -> Path:
        return self.path if n == 0 else self.path.with_name(f"{self.path.name}.{n}")

    def protect(self) -> None:
        """The kept files 0600, also those an older agent left readable to others:
        commands may carry secrets, the log is for the node's operators alone."""
        restrict(*self.kept())

    def _append(self, line: str) -> None:
        if self._file is None:
            private_dir(self.path.parent)
            fd = open_private(self.path, os.O_WRONLY | os.O_APPEND)
            self._file = os.fdopen(fd, "a", encoding="utf-8")
        self._file.write(line)
        self._file.flush()
        if os.fstat(self._file.fileno()).st_size >= self.max_bytes:
            self._rotate()

    def _rotate(self) -> None:
        self._close()  # the next line opens a fresh file
        with self._renaming:
            for n in range(self.files - 1, 0, -1):  # over the oldest kept: it goes
                with contextlib.suppress(FileNotFoundError):
                    self._nth(n - 1).replace(self._nth(n))

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _read(self, sandbox: str | None, limit: int) -> list[AuditRecord | RefusalRecord]:
        found: deque[AuditRecord | RefusalRecord] = deque(maxlen=limit)
        opened: list[IO[str]] = []
        with self._renaming:  # open descriptors follow their files through later renames
            for path in self.kept():
                with contextlib.suppress(FileNotFoundError):  # not that many rotations yet
                    opened.append(open(path, encoding="utf-8"))
        for f in opened:
            with f:
                for line in f:
                    # a line being appended right now has no newline yet: not a record
                    if not line.endswith("\n"):
                        break
                    try:
                        record = parse_record(line)
                    except ValueError:  # cut short by a crash mid-write (or not JSON at all)
                        log.warning("%s: skipped a line that is not a record", f.name)
                        continue
                    if sandbox is None or record.sandbox == sandbox:
                        found.append(record)
        return list(found)

    async def append(self, record: AuditRecord | RefusalRecord) -> None:
        line = record.model_dump_json() + "\n"
        await asyncio.get_running_loop().run_in_executor(self._writer, self._append, line)

    async def read(self, sandbox: str | None, limit: int) -> list[AuditRecord | RefusalRecord]:
        """The last `limit` records of the kept files, of one sandbox or of all.

        Read on a thread of its own: a scan of a long log must not hold up the writes
        that execs wait for.
        """
        return await asyncio.to_thread(self._read, sandbox, limit)

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._writer, self._close)
        self._writer.shutdown(wait=True)
