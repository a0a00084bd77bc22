"""What the SDK's acquire sends: a key it made is new on its first send only, so a
control plane that has just started need not hold it back (AcquireRequest.new_key);
a claim's files as one tar, which the control plane passes on as it is."""

from __future__ import annotations

import io
import json
import tarfile
from urllib.parse import unquote

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from dsec.client import Client
from dsec.clock import SystemClock
from dsec.models import Lease

pytestmark = pytest.mark.asyncio

LEASE = Lease(
    id="n1.0123456789abcdef", node="n1", agent_url="http://127.0.0.1:1", pool="default",
    template="base", state="leased", created_at=0.0, lease_id="a" * 32, lease_token="t",
    path="warm", schedule_ms=1.0,
)  # fmt: skip


async def test_a_key_the_sdk_made_is_new_on_its_first_send_only():
    sent: list[dict] = []

    async def acquire(request: web.Request) -> web.StreamResponse:
        sent.append(json.loads(await request.read()))
        if len(sent) == 1:  # the first send is lost with its connection: the SDK retries
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        return web.json_response(json.loads(LEASE.model_dump_json()), status=201)

    app = web.Application()
    app.router.add_post("/v1/sandboxes", acquire)
    async with TestServer(app, host="127.0.0.1") as server:
        url = str(server.make_url("")).rstrip("/")
        async with Client(url, token="x" * 32, acquire_retries=1) as client:
            await client.acquire()
            await client.acquire(idempotency_key="mine-7")
    made, retried, given = sent
    assert made["new_key"] is True and retried["new_key"] is False
    assert made["idempotency_key"] == retried["idempotency_key"]
    assert given["idempotency_key"] == "mine-7" and given["new_key"] is False


class HeldClock(SystemClock):
    def wall(self) -> float:
        return 1_700_000_000.75


async def test_a_claim_s_files_go_as_one_tar_dated_by_the_client_s_clock():
    """One part per file costs the control plane's CPU a part's parse each and a tar to
    build; a tar is checked and passed on. Files whose paths only the control plane can
    check (absolute: against the template's work dir) still go a part each."""
    forms: list[list[tuple[str | None, str | None, bytes]]] = []

    async def acquire(request: web.Request) -> web.StreamResponse:
        reader = await request.multipart()
        parts = []
        while (part := await reader.next()) is not None:
            assert isinstance(part, aiohttp.BodyPartReader)
            parts.append((part.name, part.filename, bytes(await part.read())))
        forms.append(parts)
        return web.json_response(json.loads(LEASE.model_dump_json()), status=201)

    app = web.Application()
    app.router.add_post("/v1/sandboxes", acquire)
    files = {"task/a.py": b"print(1)\n", "naïve b.bin": bytes(range(256))}
    async with TestServer(app, host="127.0.0.1") as server:
        url = str(server.make_url("")).rstrip("/")
        async with Client(url, token="x" * 32, clock=HeldClock()) as client:
            await client.acquire(files=files)
            await client.acquire(files={**files, "/work/c": b"c"})
    tarred, one_each = forms
    assert [(name, filename) for name, filename, _ in tarred] == [("request", None), ("tar", None)]
    with tarfile.open(fileobj=io.BytesIO(tarred[1][2]), mode="r:") as tar:
        members = {m.name: (m.mode, m.mtime, tar.extractfile(m).read()) for m in tar}
    assert members == {path: (0o644, 1_700_000_000, data) for path, data in files.items()}
    # (a filename is percent-encoded on the wire, as RFC 7578 lets a client send it)
    assert [(name, unquote(filename or "")) for name, filename, _ in one_each[1:]] == [
        ("file", "task/a.py"), ("file", "naïve b.bin"), ("file", "/work/c")
    ]  # fmt: skip
