"""A fork's copy of a sandbox (docs/contracts.md, "Fork"): its work dir and /tmp as they
are at one moment, taken on the source's node as one tar per directory into this node's
state dir, and read from there by the nodes the forks go to, agent to agent.

The control plane asks for the copy (`make`, node-authenticated) and gets its id and a
token that reads it; it hands both only to the nodes its forks are granted on, in their
grants (LeaseGrant.fork_from). A node the copy is for reads its files directly when they
are on this node; when not, it fetches them once from the source's agent
(`GET /v1/snapshots/{id}/{i}`, that token) into its own state dir for every fork granted
on it. Each fork's copy is unpacked from those files with the file API's own confined
unpack, in the unpack's own thread. The control plane drops the copy on the source's
node and on its forks' nodes when the fork is done; in any case each goes SNAPSHOT_TTL_S
after it was made or fetched, so that a control plane that went away leaves nothing
behind for long. Processes and memory are not copied: a container's live state has no copy here.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
import shutil
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import aiohttp

from agent.files import Files
from agent.sandboxes import Sandbox
from dsec.clock import Clock
from dsec.httpkit import ApiError, CredentialRefused
from dsec.models import ForkSource, SnapshotMade

log = logging.getLogger(__name__)

SNAPSHOT_TTL_S = 600.0  # a copy no fork has asked to drop by then goes by itself
READ_CHUNK = 1 << 20
# a fork's node reading a copy from another: connecting is quick on a working network,
# and a stalled transfer must fail the fork rather than hold its acquire to its end
FETCH_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=30)


@dataclass
class Snapshot:
    id: str
    token: str
    files: list[Path]  # one tar per root, in order
    made_at: float


class Snapshots:
    def __init__(
        self,
        directory: Path,
        node_id: str,
        files: Files,
        clock: Clock,
        verify: ssl.SSLContext | Literal[True],
    ) -> None:
        self.directory = directory
        self.node_id = node_id
        self.files = files
        self.clock = clock
        self.verify = verify
        self.made: dict[str, Snapshot] = {}
        # copies of other nodes' snapshots, fetched for the forks granted here: by
        # (snapshot, token), the fetch (its tars once done) and when it began
        self.fetched: dict[tuple[str, str], asyncio.Future[list[Path]]] = {}
        self.fetched_at: dict[tuple[str, str], float] = {}
        self._http: aiohttp.ClientSession | None = None

    def clear(self) -> None:
        """At start: copies an earlier run made are no one's any more."""
        shutil.rmtree(self.directory, ignore_errors=True)
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)

    async def make(self, sandbox: Sandbox) -> SnapshotMade:
        """Copy `sandbox`'s roots as they are now into one tar each."""
        await self._expire()
        snapshot = Snapshot(secrets.token_hex(16), secrets.token_hex(32), [], self.clock.now())
        roots = list(self.files.roots(sandbox))
        self.made[snapshot.id] = snapshot
        size = 0
        try:
            for i, root in enumerate(roots):
                path = self.directory / f"{snapshot.id}.{i}.tar"
                snapshot.files.append(path)
                chunks = await self.files.stream_out(sandbox, "tar-get", root)
                size += await _write_file(path, chunks)
        except BaseException:
            await self.drop(snapshot.id)
            raise
        log.info("snapshot %s of %s: %d bytes", snapshot.id, sandbox.id, size)
        return SnapshotMade(snapshot=snapshot.id, token=snapshot.token, roots=roots, bytes=size)

    def path_of(self, snapshot_id: str, token: str | None, index: int) -> Path:
        """The file of root `index` of a copy, for the holder of its token: 401 without
        one, 403 for a token that reads no copy here by that id (kept or not: a stranger
        learns nothing of which copies there are), 404 for a part it does not have."""
        if not token:
            raise CredentialRefused(401, "unauthorized", "a snapshot's token is required")
        snapshot = self.made.get(snapshot_id)
        if (
            snapshot is None
            or not hmac.compare_digest(token.encode(), snapshot.token.encode())
            or self.clock.now() - snapshot.made_at > SNAPSHOT_TTL_S
        ):
            raise CredentialRefused(403, "forbidden", "this token reads no such snapshot here")
        if not 0 <= index < len(snapshot.files):
            raise ApiError(404, "unknown_snapshot", f"snapshot {snapshot_id} has no part {index}")
        return snapshot.files[index]

    async def drop(self, snapshot_id: str) -> bool:
        """Drop a copy made here, and what was fetched of it here; whether there was any."""
        files: list[Path] = []
        snapshot = self.made.pop(snapshot_id, None)
        if snapshot is not None:
            files += snapshot.files
        for key in [k for k in self.fetched if k[0] == snapshot_id]:
            files += await self._forget_fetched(key)
        await asyncio.to_thread(_unlink_all, files)
        return snapshot is not None or bool(files)

    async def _forget_fetched(self, key: tuple[str, str]) -> list[Path]:
        fetching = self.fetched.pop(key)
        del self.fetched_at[key]
        if not fetching.done():
            fetching.cancel()
        with contextlib.suppress(BaseException):
            return await fetching
        return []

    async def _expire(self) -> None:
        now = self.clock.now()
        for old in [s.id for s in self.made.values() if now - s.made_at > SNAPSHOT_TTL_S]:
            await self.drop(old)
        for key in [k for k, at in self.fetched_at.items() if now - at > SNAPSHOT_TTL_S]:
            await asyncio.to_thread(_unlink_all, await self._forget_fetched(key))

    async def copy_into(self, sandbox: Sandbox, source: ForkSource) -> None:
        """Unpack the copy `source` names into `sandbox`'s roots, which are the same
        directories (a fork has its source's template)."""
        mine = self.files.roots(sandbox)
        if any(root not in mine for root in source.roots):
            raise ApiError(422, "fork_roots", f"the copy's {source.roots} are not {list(mine)}")
        for root, path in zip(source.roots, await self._parts_here(source), strict=True):
            try:
                archive = await asyncio.to_thread(open, path, "rb")
            except FileNotFoundError:
                raise ApiError(404, "unknown_snapshot", "the snapshot was dropped") from None
            try:
                await self.files.unpack_file(sandbox, root, archive)
            finally:
                archive.close()

    async def _parts_here(self, source: ForkSource) -> list[Path]:
        """The copy's tars on this node: its own, or fetched from the source's node once
        for all the forks granted here (a failed fetch is not kept: the next tries)."""
        if source.node == self.node_id:
            return [
                self.path_of(source.snapshot, source.token, i) for i in range(len(source.roots))
            ]
        key = (source.snapshot, source.token)
        fetching = self.fetched.get(key)
        if fetching is None:
            fetching = asyncio.ensure_future(self._fetch(source))
            self.fetched[key] = fetching
            self.fetched_at[key] = self.clock.now()

            def forget_failed(done: asyncio.Future) -> None:
                if (done.cancelled() or done.exception() is not None) and self.fetched.get(
                    key
                ) is done:
                    del self.fetched[key], self.fetched_at[key]

            fetching.add_done_callback(forget_failed)
        return await asyncio.shield(fetching)

    async def _fetch(self, source: ForkSource) -> list[Path]:
        await self._expire()
        paths = []
        try:
            for index in range(len(source.roots)):
                path = self.directory / f"fetched-{source.snapshot}.{index}.tar"
                path.unlink(missing_ok=True)  # a failed fetch's, or another token's
                paths.append(path)
                url = f"{source.agent_url}/v1/snapshots/{source.snapshot}/{index}"
                headers = {"Authorization": f"Bearer {source.token}"}
                async with self._session().get(url, headers=headers) as resp:
                    if resp.status != 200:
                        said = (await resp.text())[:500]
                        raise ApiError(
                            502, "fork_copy_failed", f"node {source.node}: {resp.status} {said}"
                        )
                    await _write_file(path, resp.content.iter_chunked(READ_CHUNK))
        except BaseException as e:
            await asyncio.to_thread(_unlink_all, paths)
            if isinstance(e, aiohttp.ClientError | TimeoutError):
                raise ApiError(
                    502, "fork_copy_failed", f"node {source.node}: {type(e).__name__}: {e}"
                ) from e
            raise
        return paths

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None:
            self._http = aiohttp.ClientSession(
                timeout=FETCH_TIMEOUT,
                connector=aiohttp.TCPConnector(limit=0, ssl=self.verify),
            )
        return self._http

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
        for snapshot_id in {*self.made, *(k[0] for k in self.fetched)}:
            await self.drop(snapshot_id)


async def _write_file(path: Path, chunks: AsyncIterator[bytes]) -> int:
    size = 0
    out = await asyncio.to_thread(open, path, "xb")
    try:
        async for chunk in chunks:
            await asyncio.to_thread(out.write, chunk)
            size += len(chunk)
    finally:
        await asyncio.to_thread(out.close)
    return size


def _unlink_all(paths: list[Path]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)
