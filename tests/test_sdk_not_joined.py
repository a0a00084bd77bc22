"""The SDK asks again, a moment later, an agent that answered 503 `not_joined` (it has
just started or restarted and not yet joined its control plane: nothing ran), and gives
up with that error after about 10 s. Over a real socket, against a stand-in agent that
answers `not_joined` as the real one does."""

from __future__ import annotations

import pytest
from aiohttp import web

from dsec.client import NOT_JOINED_RETRIES_S, Client, DsecError, Sandbox
from dsec.models import ExecResult, Lease

pytestmark = pytest.mark.asyncio


def not_joined() -> web.Response:
    error = {"code": "not_joined", "message": "node n1 is joining its control plane"}
    return web.json_response({"error": error}, status=503)


async def agent_joining_after(answers_before: int) -> tuple[web.AppRunner, str, list[int]]:
    calls: list[int] = []

    async def exec_(request: web.Request) -> web.Response:
        calls.append(1)
        if len(calls) <= answers_before:
            return not_joined()
        result = ExecResult(exit_code=0, stdout="aGkK", stderr="", encoding="base64", duration_ms=1)
        return web.json_response(text=result.model_dump_json())

    app = web.Application()
    app.router.add_post("/v1/sandboxes/{id}/exec", exec_)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}", calls


def sandbox_on(client: Client, agent_url: str) -> Sandbox:
    lease = Lease(
        id="n1.0123456789abcdef",
        node="n1",
        agent_url=agent_url,
        pool="default",
        template="base",
        state="leased",
        created_at=0.0,
        lease_id="l1",
        lease_token="t" * 32,
        path="warm",
        schedule_ms=1.0,
    )
    return Sandbox(client, lease)


async def test_an_agent_that_joins_a_moment_later_runs_the_command():
    runner, url, calls = await agent_joining_after(3)
    try:
        async with Client("http://127.0.0.1:9", token="c" * 32) as client:
            out = await sandbox_on(client, url).exec(["echo", "hi"])
        assert (out.exit_code, out.stdout, len(calls)) == (0, "hi\n", 4)
    finally:
        await runner.cleanup()


async def test_an_agent_that_never_joins_answers_not_joined_in_the_end(monkeypatch):
    monkeypatch.setattr("dsec.client.NOT_JOINED_RETRIES_S", (0.01, 0.01))
    runner, url, calls = await agent_joining_after(1000)
    try:
        async with Client("http://127.0.0.1:9", token="c" * 32) as client:
            with pytest.raises(DsecError) as refused:
                await sandbox_on(client, url).exec(["echo", "hi"])
        assert (refused.value.status, refused.value.code, len(calls)) == (503, "not_joined", 3)
        assert sum(NOT_JOINED_RETRIES_S) >= 10  # the default gives a restart that long
    finally:
        await runner.cleanup()
