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
)
"""


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
    # take it up again (Agent.adopt); one lease id per recycle
    ended_leases: list[str] = field(default_factory=list)
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
            self._conn.execute(SCHEMA)
        return self._conn

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _commit(self, writes: list[Write]) -> None:
        """One transaction for the group, its writes in the order asked."""
        conn = self._connect()
        with conn:
            for sql, args in writes:
                conn.execute(sql, args)

    async def _write(self, sql: str, args: tuple) -> None:
        done = asyncio.get_running_loop().create_future()
        self._waiting.append(((sql, args), done))
        if self._committing is None:
            self._committing = asyncio.ensure_future(self._commit_groups())
        await done

    async def _commit_groups(self) -> None:
        try:
            while self._waiting:
                group, self._waiting = self._waiting, []
                try:
                    await self._run(self._commit, [write for write, _ in group])
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
        rows = self._connect().execute("SELECT record FROM sandboxes").fetchall()
        return [SandboxRecord(**json.loads(r[0])) for r in rows]

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    async def put(self, record: SandboxRecord) -> None:
        await self._write(
            "INSERT OR REPLACE INTO sandboxes (id, record) VALUES (?, ?)",
            # vars, not asdict: its deep copy of every field cost 0.4 ms a write (a recycled
            # sandbox's ended_leases grows by one per lease), and json.dumps copies nothing
            (record.id, json.dumps(vars(record))),
        )

    async def delete(self, sandbox_id: str) -> None:
        await self._write("DELETE FROM sandboxes WHERE id = ?", (sandbox_id,))

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
