"""An image this node lacks, loaded from what the control plane sends.

Where no registry serves a template's image, the control plane streams it from its own
host's engine (controlplane/images.py), and this agent takes it:

    PUT /v1/images?ref=<name:tag>
    Authorization: Bearer <the control plane's call token for this node>
    body: what `docker save <name:tag>` writes (application/x-tar)

Only the control plane can make a node load an image: the route takes its call token
for this node alone (agent/app.py), which no client and no other node knows. The body
is spooled to a file of the node's own (`<state_dir>/<node>-images/`, 0700) as it comes,
never held in memory, then checked: a tar whose manifest names one image, tagged `ref`
and nothing else. Only then is it loaded into the engine (`docker load`), and the node's
image list is read again at once, so its next report says it holds the image. What is
not such an archive (not a tar, cut short, another image, a layer whose digest does not
match) is answered 422 and leaves nothing behind: the spool file is removed, and the
engine keeps nothing of a load it refused. One load at a time: another while one runs
is answered 409, and the control plane tries again later.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import tarfile
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import BinaryIO

from pydantic import BaseModel

from agent import runtime
from agent.docker_driver import DockerOpError
from agent.node import Agent
from dsec.httpkit import ApiError
from dsec.statedir import private_dir

SPOOL_WRITE_BYTES = 1 << 20  # the body reaches the file in writes of this size
MAX_MANIFEST_BYTES = 1 << 20  # a save's manifest.json lists layer paths: a few KiB
# a tagged reference (what a node's report lists): the ImageRef of dsec.models, less a
# digest, with a tag after the last "/"
TAGGED_REF = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:-]{0,254}$")


class ImageLoaded(BaseModel):
    ref: str
    bytes: int  # the archive's size


def checked_ref(ref: str | None) -> str:
    """`ref` if it names an image by name and tag, else a 400."""
    if ref is None or not TAGGED_REF.match(ref) or ":" not in ref.rsplit("/", 1)[-1]:
        raise ApiError(
            400, "invalid_ref", f"?ref= names an image by name and tag (name:tag): {ref!r}"
        )
    return ref


def check_archive(path: Path, ref: str) -> None:
    """Refuse (422) a file that is not what `docker save ref` writes: a tar whose
    manifest lists one image, tagged `ref` alone. A save writes its manifest after the
    layers, so an archive cut short has none."""
    try:
        with tarfile.open(path, "r:") as tar:
            member = tar.getmember("manifest.json")
            manifest_file = tar.extractfile(member)
            if manifest_file is None or member.size > MAX_MANIFEST_BYTES:
                raise KeyError("manifest.json is not a small file")
            manifest = json.load(manifest_file)
    except (tarfile.TarError, KeyError, ValueError) as e:
        raise ApiError(
            422, "invalid_image_archive", f"not an image archive (docker save): {e}"
        ) from e
    tags = [entry.get("RepoTags") for entry in manifest] if isinstance(manifest, list) else None
    if tags != [[ref]]:
        raise ApiError(
            422,
            "invalid_image_archive",
            f"the archive does not hold image {ref} alone: its manifest tags {tags}",
        )


class ImageLoader:
    """The node's side of an image transfer: spool, check, load, report."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.spool_dir = agent.config.state_dir / f"{agent.config.node_id}-images"
        self.loading = False

    async def receive(self, ref: str | None, body: AsyncIterator[bytes]) -> ImageLoaded:
        """Load image `ref` from `body`, a `docker save` of it."""
        ref = checked_ref(ref)
        self.agent.require_engine()
        if self.loading:
            raise ApiError(409, "image_load_in_progress", "this node is loading another image")
        self.loading = True
        try:
            path = await asyncio.to_thread(self._new_spool_file)
            try:
                size = await self._spool(body, path)
                await asyncio.to_thread(check_archive, path, ref)
                await self._load(path)
                # an image loaded again may start otherwise than the one read before it
                self.agent.docker.entrypoints.pop(ref, None)
            finally:
                await asyncio.to_thread(path.unlink, missing_ok=True)
        finally:
            self.loading = False
        await runtime.refresh_images(self.agent)  # the next report says it has it
        return ImageLoaded(ref=ref, bytes=size)

    def _new_spool_file(self) -> Path:
        """A new empty file (0600) in the spool dir, emptied first: with one load at a
        time, whatever is there was left by an agent that stopped mid-transfer."""
        private_dir(self.spool_dir)
        for left in self.spool_dir.iterdir():
            left.unlink(missing_ok=True)
        fd, name = tempfile.mkstemp(prefix="load-", suffix=".tar", dir=self.spool_dir)
        os.close(fd)
        return Path(name)

    async def _spool(self, body: AsyncIterator[bytes], path: Path) -> int:
        """Write `body` to `path` in threads (the event loop never waits on the disk);
        its size."""
        size = 0
        pending = bytearray()
        with await asyncio.to_thread(path.open, "wb") as spool:
            async for chunk in body:
                pending += chunk
                size += len(chunk)
                if len(pending) >= SPOOL_WRITE_BYTES:
                    await _write(spool, pending)
            await _write(spool, pending)
        return size

    async def _load(self, path: Path) -> None:
        try:
            await self.agent.docker.load_image(path)
        except DockerOpError as e:
            self.agent.docker_failed(e)
            if e.kind == "engine_unreachable":
                raise ApiError(503, "docker_engine_unreachable", str(e)) from e
            if e.kind == "disk_full":
                raise ApiError(507, "insufficient_storage", str(e)) from e
            raise ApiError(422, "invalid_image_archive", f"the engine refused it: {e}") from e


async def _write(spool: BinaryIO, pending: bytearray) -> None:
    """`pending` to the spool file, from a thread; then `pending` is empty."""
    try:
        await asyncio.to_thread(spool.write, pending)
    except OSError as e:
        raise ApiError(
            507, "insufficient_storage", f"the image archive does not fit on this node: {e}"
        ) from e
    pending.clear()
