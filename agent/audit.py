"""The audit log: one JSON line per command run in a sandbox.

It lives in the agent's state dir (`<state_dir>/<node_id>-audit.jsonl`), which no
sandbox can see (sandboxes have no host mounts), and it outlives the sandbox it
describes: removing a sandbox never touches it. Lines are only ever appended. Writes
run in order on one worker thread, so the event loop never waits on disk and lines
never interleave; each line is flushed to the kernel before the exec is answered, so
a kill -9 of the agent loses no answered command (a crash of the host may lose the
last lines: no fsync, which would cost every exec a disk round trip).
"""

from __future__ import annotations

import asyncio
import os
import shlex
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO

from pydantic import BaseModel, Field

# Enough to read what was run; an argv may be megabytes (4096 args of 64 KiB).
CMD_CHARS = 1024


def quoted_cmd(cmd: list[str]) -> tuple[str, bool]:
    """The argv as one shell-quoted string, cut at CMD_CHARS; and whether it was cut."""
    text = shlex.join(cmd)
    return text[:CMD_CHARS], len(text) > CMD_CHARS


class AuditRecord(BaseModel):
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


class AuditRecords(BaseModel):
    records: list[AuditRecord]


class AuditLog:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._writer = ThreadPoolExecutor(1, "agent-audit")
        self._file: IO[str] | None = None

    def _append(self, line: str) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # commands may carry secrets: the log is for the node's operators alone
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            self._file = os.fdopen(fd, "a", encoding="utf-8")
        self._file.write(line)
        self._file.flush()

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _read(self, sandbox: str | None, limit: int) -> list[AuditRecord]:
        found: deque[AuditRecord] = deque(maxlen=limit)
        try:
            with open(self.path, encoding="utf-8") as f:
                for line in f:
                    # a line being appended right now has no newline yet: not a record
                    if not line.endswith("\n"):
                        break
                    record = AuditRecord.model_validate_json(line)
                    if sandbox is None or record.sandbox == sandbox:
                        found.append(record)
        except FileNotFoundError:
            pass  # nothing was run on this node yet
        return list(found)

    async def append(self, record: AuditRecord) -> None:
        line = record.model_dump_json() + "\n"
        await asyncio.get_running_loop().run_in_executor(self._writer, self._append, line)

    async def read(self, sandbox: str | None, limit: int) -> list[AuditRecord]:
        """The last `limit` records, of one sandbox or of all.

        Read on a thread of its own: a scan of a long log must not hold up the writes
        that execs wait for.
        """
        return await asyncio.to_thread(self._read, sandbox, limit)

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._writer, self._close)
        self._writer.shutdown(wait=True)
