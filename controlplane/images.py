"""How a template's image reaches a node that lacks it, where no registry serves it: the
control plane's host streams it from its own Docker engine.

The control plane pushes. On every pass (PASS_S, and at once when a transfer ends) it
reads the images its templates name (`config.templates`, afresh: templates change
live), and sends each that its host's engine holds to every node that takes work
(`NodeEntry.placeable`: healthy, engine up, not failing, not draining) and whose last
report lacks it:

    PUT {agent}/v1/images?ref=<name:tag>
    Authorization: Bearer <the control plane's call token for that node>
    Content-Type: application/x-tar
    body: `docker save <name:tag>` from the host's engine, streamed as the engine writes it

The call token is the one the control plane's other calls to that agent carry
(controlplane/agents.py, controlplane/identities.py): no client and no other node knows
it, so nobody else can make a node load an image. The agent spools the body, checks it,
loads it and reads its image list again (agent/images.py), so its next report names the
image and placement may use the node for that template.

At most one transfer per node at a time, MAX_TRANSFERS in all. A transfer that fails is
logged and tried again on a later pass, after BACKOFF_FIRST_S doubling per failure in a
row up to BACKOFF_MAX_S; one that succeeded is not sent again for RESEND_AFTER_S, which
the node's next report comes well within. Every outcome is counted in
`dsec_image_transfers_total{node,outcome}`. Nothing a transfer meets stops the loop.

A control plane whose host has no engine (or whose engine is down) distributes nothing:
`available` says False for every image until the engine answers. The engine is the one
DOCKER_HOST names, else the local socket, driven on the event loop (aiodocker): a save
of hundreds of MB holds a socket, not a thread.

References: a reference without a tag means `:latest` (`normalise_image_ref`), as nodes
report their images by name and tag. A reference by digest (name@sha256:...) is never
distributed: a node's report lists tags, so it could never say it holds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import aiodocker
import aiohttp
from aiodocker.exceptions import DockerError

from controlplane.identities import Identities
from dsec.httpkit import cancel_and_wait
from dsec.models import normalise_image_ref

if TYPE_CHECKING:
    from controlplane.scheduler import Scheduler
    from controlplane.view import NodeEntry

log = logging.getLogger(__name__)

PASS_S = 2.0  # between passes when nothing ends sooner
MAX_TRANSFERS = 3  # at once in all: each reads the host's disk and fills its uplink
HOST_IMAGES_TTL_S = 5.0  # `available` answers from a list of the host's images this old
HOST_LIST_TIMEOUT_S = 10.0  # an engine slower than this to list its images: none to give
BACKOFF_FIRST_S = 5.0
BACKOFF_MAX_S = 300.0
RESEND_AFTER_S = 60.0
CHUNK = 1 << 20
# A transfer is bounded as a whole: the agent answers once it has spooled and loaded the
# image, so nothing comes back meanwhile (a GB at 20 MB/s and its load take minutes).
TRANSFER_TIMEOUT = aiohttp.ClientTimeout(total=1800, sock_connect=10)
DEFAULT_DOCKER_HOST = "unix:///var/run/docker.sock"

Outcome = Literal["ok", "refused", "failed", "no_image"]


class TransferRefused(Exception):
    """The agent answered other than 2xx."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"the agent answered {status}: {text[:500]}")
        self.status = status


@dataclass
class Tries:
    """One image's transfers to one node: failures in a row, and when the next may go."""

    failures: int = 0
    next_at: float = 0.0


class ImageDistributor:
    """Sends the images `scheduler.config.templates` name to the nodes of
    `scheduler.view` that lack them, from this host's Docker engine."""

    def __init__(
        self,
        scheduler: Scheduler,
        identities: Identities,
        verify: ssl.SSLContext | Literal[True] = True,
    ) -> None:
        self.scheduler = scheduler  # its config and view read afresh on every pass
        self.clock = scheduler.clock
        self.metrics = scheduler.metrics
        self.identities = identities
        self.verify = verify  # what https agents are verified with, as HttpAgents does
        self.host_images: frozenset[str] = frozenset()
        self.host_images_at = -HOST_IMAGES_TTL_S  # never listed yet
        self.host_engine_ok: bool | None = None  # unknown until first listed
        self.tries: dict[tuple[str, str], Tries] = {}  # (node, ref) ->
        self.sending: dict[str, asyncio.Task] = {}  # node -> its transfer under way
        self.wakeup = asyncio.Event()
        self._docker: aiodocker.Docker | None = None
        self._http: aiohttp.ClientSession | None = None

    def available(self, image: str) -> bool:
        """Whether this distributor can supply `image`: the host's engine held it when
        last listed (at most HOST_IMAGES_TTL_S and a pass ago)."""
        return normalise_image_ref(image) in self.host_images

    # --- the loop ---------------------------------------------------------------

    async def start(self) -> None:
        # made inside the running loop that owns their connections
        self._docker = aiodocker.Docker(os.environ.get("DOCKER_HOST") or DEFAULT_DOCKER_HOST)
        self._http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=self.verify))

    async def close(self) -> None:
        await cancel_and_wait(*self.sending.values())
        if self._http is not None:
            await self._http.close()
        if self._docker is not None:
            await self._docker.close()

    async def run_forever(self) -> None:
        while True:
            try:
                await self.run_pass()
            except Exception:  # a bug must not stop distribution: log it, pass again
                log.exception("image distribution pass failed")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(PASS_S):
                    await self.wakeup.wait()
            self.wakeup.clear()

    async def run_pass(self) -> None:
        """Start the transfers that are due, as far as the bounds allow."""
        now = self.clock.now()
        if now - self.host_images_at >= HOST_IMAGES_TTL_S:
            await self._list_host_images()
        templates = self.scheduler.config.templates.values()
        wanted = {normalise_image_ref(t.image) for t in templates}
        supplied = sorted(ref for ref in wanted if ref in self.host_images)
        nodes = self.scheduler.view.nodes
        # what is no longer wanted, or whose node has gone, is forgotten
        for key in [k for k in self.tries if k[0] not in nodes or k[1] not in wanted]:
            del self.tries[key]
        for node_id, node in sorted(nodes.items()):
            if len(self.sending) >= MAX_TRANSFERS:
                return
            if node_id in self.sending or not node.placeable(now):
                continue
            for ref in supplied:
                if ref in node.images:
                    continue
                tries = self.tries.setdefault((node_id, ref), Tries())
                if now >= tries.next_at:
                    self.sending[node_id] = asyncio.create_task(
                        self._transfer(node, ref, tries), name=f"image {ref} to {node_id}"
                    )
                    break

    async def _list_host_images(self) -> None:
        assert self._docker is not None, "ImageDistributor.start() was not awaited"
        try:
            async with asyncio.timeout(HOST_LIST_TIMEOUT_S):
                images = await self._docker.images.list()
        except (DockerError, aiohttp.ClientError, OSError, TimeoutError) as e:
            if self.host_engine_ok is not False:
                log.warning(
                    "no images to distribute: the host's Docker engine: %s", str(e) or type(e)
                )
            self.host_engine_ok = False
            self.host_images = frozenset()
        else:
            if self.host_engine_ok is False:
                log.info("the host's Docker engine answers again: its images are distributed")
            self.host_engine_ok = True
            self.host_images = frozenset(t for i in images for t in i.get("RepoTags") or [])
        self.host_images_at = self.clock.now()

    async def _transfer(self, node: NodeEntry, ref: str, tries: Tries) -> None:
        started = self.clock.now()
        outcome: Outcome = "failed"
        try:
            sent = await self._send(node, ref)
        except TransferRefused as e:
            outcome = "refused" if e.status < 500 else "failed"
            self._failed(node.id, ref, tries, e)
        except DockerError as e:  # the host's engine could not save it
            outcome = "no_image"
            self.host_images_at = -HOST_IMAGES_TTL_S  # listed again at the next pass
            self._failed(node.id, ref, tries, e)
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            self._failed(node.id, ref, tries, e)
        except Exception as e:  # a bug must not stop distribution
            log.exception("image %s to node %s", ref, node.id)
            self._failed(node.id, ref, tries, e)
        else:
            outcome = "ok"
            tries.failures = 0
            tries.next_at = self.clock.now() + RESEND_AFTER_S
            took = self.clock.now() - started
            log.info(
                "image %s sent to node %s: %.1f MiB in %.2f s", ref, node.id, sent / 2**20, took
            )
        finally:
            del self.sending[node.id]
            self.wakeup.set()  # its slot is free
        # not reached by a cancellation (a shutdown): that is no outcome of the transfer
        self.metrics.image_transfers.labels(node.id, outcome).inc()

    def _failed(self, node_id: str, ref: str, tries: Tries, e: Exception) -> None:
        tries.failures += 1
        backoff = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (tries.failures - 1))
        tries.next_at = self.clock.now() + backoff
        log.warning(
            "image %s to node %s failed (%d in a row; again in %.0f s): %s",
            ref, node_id, tries.failures, backoff, str(e) or type(e).__name__,
        )  # fmt: skip

    async def _send(self, node: NodeEntry, ref: str) -> int:
        """Stream `docker save ref` to the node's agent; the bytes sent."""
        assert self._docker is not None and self._http is not None
        sent = 0
        async with self._docker.images.export_image(ref) as archive:

            async def body() -> AsyncIterator[bytes]:
                nonlocal sent
                async for chunk in archive.iter_chunked(CHUNK):
                    sent += len(chunk)
                    yield chunk

            headers = {
                "Authorization": f"Bearer {self.identities.call_token(node.id)}",
                "Content-Type": "application/x-tar",
            }
            async with self._http.put(
                f"{node.url}/v1/images",
                params={"ref": ref},
                data=body(),
                headers=headers,
                timeout=TRANSFER_TIMEOUT,
            ) as resp:
                text = await resp.text()
                if resp.status >= 300:
                    raise TransferRefused(resp.status, text)
        return sent
