"""What the SDK's acquire sends: a key it made is new on its first send only, so a
control plane that has just started need not hold it back (AcquireRequest.new_key)."""

from __future__ import annotations

import json

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from dsec.client import Client
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
