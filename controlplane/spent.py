"""Idempotency keys and their sandboxes, kept in a file of the state dir and read back
at start, so that a restarted control plane answers a retry as the old one would.

Two logs: the keys whose sandbox was released (spent: reusing one is refused), and the
keys that hold a live lease (held: written before the agent is asked to lease, so a retry
after a restart waits for that sandbox however late its node reports, and never gets a
second one). A line is [key, sandbox id], or [key, null] when a held key lets go.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path

from dsec.recent import RecentMap
from dsec.statedir import open_private, private_dir, restrict, write_private

log = logging.getLogger(__name__)
MIN_KEYS_TO_COMPACT = 1000  # with fewer keys, a file of twice this many lines is fine


class KeyLog:
    def __init__(self, path: Path | None, limit: int) -> None:
        self.path = path
        self.limit = limit  # the most recent this many are kept
        self.keys: RecentMap[str, str] = RecentMap(limit)  # key -> its sandbox
        self.lines = 0  # in the file: once past twice the keys that count, it is rewritten
        self._rewriting: asyncio.Future[None] | None = None
        if path is not None:
            # the state dir is the operators' alone, also one an older version left open
            private_dir(path.parent)
            restrict(path)
        if path is not None and path.exists():
            for number, line in enumerate(path.read_text().splitlines(), start=1):
                try:
                    key, sandbox_id = json.loads(line)
                except ValueError:  # a line cut short by a crash mid-write
                    log.warning("%s:%d is not a spent key; skipped", path, number)
                    continue
                if sandbox_id is None:
                    self.keys.pop(key)
                else:
                    self._remember(key, sandbox_id)
                self.lines += 1

    def __contains__(self, key: str) -> bool:
        return key in self.keys

    def sandbox_of(self, key: str) -> str:
        return self.keys[key]

    async def add(self, key: str, sandbox_id: str) -> None:
        self._remember(key, sandbox_id)
        await self._log([key, sandbox_id])

    def add_now(self, key: str, sandbox_id: str) -> bool:
        """`add` where it needs no wait; False, and nothing done, while the file is being
        rewritten or is due to be (then `add` it)."""
        if self.path is not None and (self._rewriting is not None or self._compaction_due()):
            return False
        self._remember(key, sandbox_id)
        if self.path is not None:
            self._append_line([key, sandbox_id])
        return True

    async def drop(self, key: str) -> None:
        if self.keys.pop(key) is not None:
            await self._log([key, None])

    async def _log(self, item: list) -> None:
        if self.path is None:
            return
        if self._rewriting is not None:  # a line appended now would land in the old file
            await asyncio.shield(self._rewriting)
        if self._compaction_due():
            self.lines = len(self.keys)
            rewriting = asyncio.ensure_future(
                asyncio.to_thread(self._rewrite, list(self.keys.items()))
            )
            # cleared when the file is replaced, not when this caller stops waiting
            rewriting.add_done_callback(lambda _: setattr(self, "_rewriting", None))
            self._rewriting = rewriting
            await asyncio.shield(rewriting)
        else:
            self._append_line(item)

    def _compaction_due(self) -> bool:
        """Whether one more line makes the file mostly lines that no longer count: then
        it is rewritten instead."""
        return self.lines + 1 > 2 * max(len(self.keys), min(self.limit, MIN_KEYS_TO_COMPACT))

    def _append_line(self, item: list) -> None:
        # on the loop, not a thread: one short line into the page cache (no fsync)
        # takes microseconds, a thread's turn 3-10 ms on a busy 2-core node (measured
        # on the warm acquire path, which waits for this line); and lines stay in the
        # order asked, so a key let go is never read back as held
        self.lines += 1
        self._append(json.dumps(item) + "\n")

    def _remember(self, key: str, sandbox_id: str) -> None:
        self.keys.add(key, sandbox_id)  # the most recent; past the limit, the oldest go

    def _append(self, line: str) -> None:
        assert self.path is not None
        fd = open_private(self.path, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    def _rewrite(self, items: list[tuple[str, str]]) -> None:
        assert self.path is not None
        fresh = self.path.with_suffix(".tmp")
        write_private(fresh, "".join(json.dumps(item) + "\n" for item in items).encode())
        fresh.replace(self.path)  # atomic: a crash leaves the old file or the new one
