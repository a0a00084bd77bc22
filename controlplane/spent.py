"""Idempotency keys whose sandbox was released: an acquire that reuses one is refused.

Agents report the keys of live leases, so a restarted control plane relearns those from
the heartbeats; a released key is known to the control plane alone. With a state dir it
is appended to a file before the release is answered, and read back at start, so a
retry after a restart is still refused instead of getting a fresh sandbox.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

from dsec.recent import RecentMap

log = logging.getLogger(__name__)


class SpentKeys:
    def __init__(self, path: Path | None, limit: int) -> None:
        self.path = path
        self.limit = limit  # the most recent this many are kept
        self.keys: RecentMap[str, str] = RecentMap(limit)  # key -> its sandbox
        self.lines = 0  # in the file: once past twice the limit, it is rewritten
        if path is not None and path.exists():
            for number, line in enumerate(path.read_text().splitlines(), start=1):
                try:
                    key, sandbox_id = json.loads(line)
                except ValueError:  # a line cut short by a crash mid-write
                    log.warning("%s:%d is not a spent key; skipped", path, number)
                    continue
                self._remember(key, sandbox_id)
                self.lines += 1

    def __contains__(self, key: str) -> bool:
        return key in self.keys

    def sandbox_of(self, key: str) -> str:
        return self.keys[key]

    async def add(self, key: str, sandbox_id: str) -> None:
        self._remember(key, sandbox_id)
        if self.path is None:
            return
        self.lines += 1
        if self.lines > 2 * self.limit:
            self.lines = len(self.keys)
            await asyncio.to_thread(self._rewrite, list(self.keys.items()))
        else:
            await asyncio.to_thread(self._append, json.dumps([key, sandbox_id]) + "\n")

    def _remember(self, key: str, sandbox_id: str) -> None:
        self.keys.add(key, sandbox_id)  # the most recent; past the limit, the oldest go

    def _append(self, line: str) -> None:
        assert self.path is not None
        with self.path.open("a") as f:
            f.write(line)

    def _rewrite(self, items: list[tuple[str, str]]) -> None:
        assert self.path is not None
        fresh = self.path.with_suffix(".tmp")
        fresh.write_text("".join(json.dumps(item) + "\n" for item in items))
        fresh.replace(self.path)  # atomic: a crash leaves the old file or the new one
