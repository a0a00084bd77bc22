"""The agent's own record of its sandboxes, on disk so it survives a restart.

Docker labels are fixed at creation, so a lease given to a warm sandbox later can
only live here. One SQLite file per node; every call runs on a single worker thread
(SQLite connections are not shared across threads, and the loop never waits on disk).

Writes are committed in groups: the writes asked for while one group commits go
together in the next, each caller answered once its group is on disk. A lease's write
then waits for at most one group, never behind each of the hundreds of creates' and
removals' writes of a burst, one transaction apiece.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from dsec.statedir import open_private, private_dir, restrict

SCHEMA = """
CREATE TABLE IF NOT EXISTS sandboxes (
    id TEXT PRIMARY KEY,
    record TEXT NOT NULL
);
-- a row per lease a sandbox had that ended while it lived on (SandboxRecord.ended_leases):
-- apart from the record, so that a recycle adds a row instead of rewriting a list that
-- grows by one a lease
CREATE TABLE IF NOT EXISTS ended_leases (
    sandbox_id TEXT NOT NULL,
    lease_id TEXT NOT NULL,
    PRIMARY KEY (sandbox_id, lease_id)
);
"""
ENDED = "ended_leases"  # the record's field kept in its own table

Write = tuple[str, tuple]  # a statement and its arguments


@dataclass
class SandboxRecord:
    id: str
    container_id: str
    pool: str
    template: dict  # the TemplateSpec it was created from, as JSON data
    created_at: float
    lease_id: str | None = None
    idempotency_key: str | None = None
    owner: str | None = None  # the client holding the lease
    # the control plane's proof that it granted the lease (LeaseGrant.grant_proof),
    # reported with it; None for a lease taken up from its token before its grant came
    grant_proof: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    # the lease's environment (LeaseGrant.env), on every command of it; a reset clears it
    lease_env: dict[str, str] = field(default_factory=dict)
    # leases this sandbox had that ended while it lived on (recycled): their tokens never
    # take it up again (Agent.adopt); one lease id per recycle, stored in a table of their
    # own (SandboxStore.put's `ended`)
    ended_leases: set[str] = field(default_factory=set)
    # set while hibernated: the committed image and the archive of the work dir
    hibernated_image: str | None = None
    archive_path: str | None = None
    # "uid:gid" its commands run as: its own, from the node's range (agent/users.py);
    # empty for a record made before sandboxes had their own (its template's user)
    user: str = ""


class SandboxStore:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._pool = ThreadPoolExecutor(1, "agent-store")
        self._conn: sqlite3.Connection | None = None
        # writes waiting for the next group, each with its caller's future
        self._waiting: list[tuple[Write, asyncio.Future[None]]] = []
        self._committing: asyncio.Task | None = None

    def _connect(self) -> sqlite3.Connection:
        if self._conn is None:
            private_dir(self.path.parent)
            # made (or made again) 0600 before SQLite opens it: SQLite gives its -wal and
            # -shm files the database's mode, and those left by an older agent get it here
            os.close(open_private(self.path, os.O_RDWR))
            restrict(*(self.path.with_name(self.path.name + s) for s in ("-wal", "-shm")))
            self._conn = sqlite3.connect(self.path)
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.executescript(SCHEMA)
        return self._conn

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _commit(self, writes: list[Write]) -> None:
        """One transaction for the group, its writes in the order asked."""
        conn = self._connect()
        with conn:
            for sql, args in writes:
                conn.execute(sql, args)

    async def _write(self, *writes: Write) -> None:
        """`writes` committed together, in the same group."""
        done = asyncio.get_running_loop().create_future()
        self._waiting.append((list(writes), done))
        if self._committing is None:
            self._committing = asyncio.ensure_future(self._commit_groups())
        await done

    async def _commit_groups(self) -> None:
        try:
            while self._waiting:
                group, self._waiting = self._waiting, []
                try:
                    await self._run(self._commit, [w for writes, _ in group for w in writes])
                except Exception as e:  # the group's callers each hear of it
                    for _, done in group:
                        if not done.done():
                            done.set_exception(e)
                else:
                    for _, done in group:
                        if not done.done():
                            done.set_result(None)
        finally:
            self._committing = None

    def _all(self) -> list[SandboxRecord]:
        conn = self._connect()
        ended: dict[str, set[str]] = {}
        for sandbox_id, lease_id in conn.execute("SELECT sandbox_id, lease_id FROM ended_leases"):
            ended.setdefault(sandbox_id, set()).add(lease_id)
        records, listed = [], []
        for (raw,) in conn.execute("SELECT record FROM sandboxes").fetchall():
            fields = json.loads(raw)
            # a record an older agent wrote holds its ended leases as a list: they become
            # rows, which the record's next write leaves in place
            sandbox_id, old = fields["id"], fields.pop(ENDED, [])
            listed += [(sandbox_id, lease_id) for lease_id in old]
            kept = ended.get(sandbox_id, set()) | set(old)
            records.append(SandboxRecord(**fields, ended_leases=kept))
        if listed:
            with conn:
                conn.executemany("INSERT OR IGNORE INTO ended_leases VALUES (?, ?)", listed)
        return records

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    async def put(self, record: SandboxRecord, ended: str | None = None) -> None:
        """Write `record`, and with it `ended`, a lease of its that has just ended (added
        to its ended_leases here)."""
        if ended is not None:
            record.ended_leases.add(ended)
        # vars, not asdict: asdict deep-copies every field (0.4 ms a write, measured), and
        # json.dumps copies nothing
        fields = {name: value for name, value in vars(record).items() if name != ENDED}
        writes = [("INSERT OR REPLACE INTO sandboxes (id, record) VALUES (?, ?)",
                   (record.id, json.dumps(fields)))]  # fmt: skip
        if ended is not None:
            writes.append(
                ("INSERT OR IGNORE INTO ended_leases (sandbox_id, lease_id) VALUES (?, ?)",
                 (record.id, ended))
            )  # fmt: skip
        await self._write(*writes)

    async def delete(self, sandbox_id: str) -> None:
        await self._write(
            ("DELETE FROM sandboxes WHERE id = ?", (sandbox_id,)),
            ("DELETE FROM ended_leases WHERE sandbox_id = ?", (sandbox_id,)),
        )

    async def all(self) -> list[SandboxRecord]:
        """Every record, as written: reads wait for the writes asked for before them."""
        if self._committing is not None:
            await asyncio.shield(self._committing)
        return await self._run(self._all)

    async def close(self) -> None:
        if self._committing is not None:
            await asyncio.shield(self._committing)  # what was asked is written first
        await self._run(self._close)
        self._pool.shutdown(wait=True)
