"""The async client SDK.

    async with Client(url, token=...) as client:
        async with client.sandbox(pool="default", template="base") as sb:
            result = await sb.exec(["sh", "-c", "echo hi"], timeout=10)

Acquire and release go to the control plane; exec goes straight to the agent that
owns the sandbox, over the same pooled connections. An acquire carries an
idempotency key and is retried on connection errors with the same key, so a retry
gets the same sandbox rather than a second one. `sandbox()` releases on exit, on
error and on cancellation.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import aiohttp
from pydantic import BaseModel

from dsec.models import (
    AcquireRequest,
    ExecRequest,
    ExecResult,
    Lease,
    NodeList,
    PoolInfo,
    PoolList,
    PoolParams,
    PrewarmInfo,
    PrewarmRequest,
    Released,
    SandboxInfo,
    SandboxList,
)
from dsec.tokens import LEASE_TOKEN_HEADER

DEFAULT_URL = "http://127.0.0.1:8700"
M = TypeVar("M", bound=BaseModel)


class DsecError(Exception):
    """An error answer from dsec: the HTTP status, a machine-readable code, a message."""

    def __init__(self, status: int, code: str, message: str, details: Any = None) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message, self.details = status, code, message, details


class Sandbox:
    def __init__(self, client: Client, lease: Lease) -> None:
        self.client = client
        self.lease = lease

    @property
    def id(self) -> str:
        return self.lease.id

    @property
    def node(self) -> str:
        return self.lease.node

    async def exec(
        self,
        cmd: list[str],
        timeout: float = 60.0,
        max_output_bytes: int = 1024 * 1024,
        env: dict[str, str] | None = None,
        workdir: str | None = None,
    ) -> ExecResult:
        body = ExecRequest(
            cmd=cmd,
            timeout_s=timeout,
            max_output_bytes=max_output_bytes,
            env=env or {},
            workdir=workdir,
        )
        return await self.client._call(
            "POST",
            f"{self.lease.agent_url}/v1/sandboxes/{self.id}/exec",
            ExecResult,
            body,
            token=self.lease.lease_token,
            timeout=timeout + 30,
        )

    async def release(self) -> None:
        await self.client.release(self.id, self.lease.lease_token)


class Client:
    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        acquire_retries: int = 3,
        connection_limit: int = 512,
    ) -> None:
        self.url = (url or os.environ.get("DSEC_URL") or DEFAULT_URL).rstrip("/")
        self.token = token if token is not None else os.environ.get("DSEC_TOKEN", "")
        self.acquire_retries = acquire_retries
        self.connection_limit = connection_limit
        self._http: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Client:
        self._http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self.connection_limit, limit_per_host=0)
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def _call(
        self,
        method: str,
        url: str,
        answer: type[M],
        body: BaseModel | None = None,
        *,
        token: str | None = None,
        timeout: float = 60.0,
        headers: dict[str, str] | None = None,
    ) -> M:
        if self._http is None:
            raise RuntimeError("use the Client as `async with Client(...) as client:`")
        headers = {
            **(headers or {}),
            "Authorization": f"Bearer {token if token is not None else self.token}",
        }
        data = None
        if body is not None:
            data = body.model_dump_json(exclude_none=True)
            headers["Content-Type"] = "application/json"
        async with self._http.request(
            method, url, data=data, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            text = await resp.text()
            if resp.status >= 300:
                raise _error_from(resp.status, text)
            return answer.model_validate_json(text)

    async def acquire(
        self,
        pool: str = "default",
        template: str = "base",
        *,
        priority: int = 0,
        timeout: float = 30.0,
        idempotency_key: str | None = None,
        labels: dict[str, str] | None = None,
    ) -> Sandbox:
        body = AcquireRequest(
            pool=pool,
            template=template,
            priority=priority,
            timeout_s=timeout,
            idempotency_key=idempotency_key or uuid.uuid4().hex,
            labels=labels or {},
        )
        for attempt in range(self.acquire_retries + 1):
            try:
                lease = await self._call(
                    "POST", f"{self.url}/v1/sandboxes", Lease, body, timeout=timeout + 10
                )
                return Sandbox(self, lease)
            except (aiohttp.ClientConnectionError, TimeoutError):
                if attempt == self.acquire_retries:
                    raise
                await asyncio.sleep(0.2 * 2**attempt)  # same key: the same sandbox comes back
        raise AssertionError("unreachable")

    async def release(self, sandbox_id: str, lease_token: str | None = None) -> None:
        headers = {LEASE_TOKEN_HEADER: lease_token} if lease_token else None
        await self._call(
            "DELETE", f"{self.url}/v1/sandboxes/{sandbox_id}", Released, headers=headers
        )

    @asynccontextmanager
    async def sandbox(
        self, pool: str = "default", template: str = "base", **kw: Any
    ) -> AsyncIterator[Sandbox]:
        sb = await self.acquire(pool, template, **kw)
        try:
            yield sb
        finally:
            # shielded: a cancelled caller still gives its sandbox back
            await asyncio.shield(self._release_quietly(sb.id, sb.lease.lease_token))

    async def _release_quietly(self, sandbox_id: str, lease_token: str) -> None:
        try:
            await self.release(sandbox_id, lease_token)
        except DsecError as e:
            if e.code not in ("already_released", "unknown_sandbox"):
                raise

    async def get(self, sandbox_id: str) -> SandboxInfo:
        return await self._call("GET", f"{self.url}/v1/sandboxes/{sandbox_id}", SandboxInfo)

    async def list(self, pool: str | None = None) -> list[SandboxInfo]:
        query = f"?pool={pool}" if pool else ""
        answer = await self._call("GET", f"{self.url}/v1/sandboxes{query}", SandboxList)
        return answer.sandboxes

    async def nodes(self) -> NodeList:
        return await self._call("GET", f"{self.url}/v1/nodes", NodeList)

    async def pools(self) -> PoolList:
        return await self._call("GET", f"{self.url}/v1/pools", PoolList)

    async def set_pool(self, name: str, params: PoolParams) -> PoolInfo:
        return await self._call("PUT", f"{self.url}/v1/pools/{name}", PoolInfo, params)

    async def prewarm(
        self,
        pool: str,
        count: int,
        within_s: float,
        hold_s: float = 60.0,
        *,
        template: str | None = None,
    ) -> PrewarmInfo:
        """Announce a burst: `count` sandboxes of `pool` warm within `within_s`, held
        `hold_s` more (the pool's first template unless `template` names one). A new
        prewarm replaces the pool's last; count 0 ends it. A count beyond the pool's
        max_warm or the nodes' room answers 422 saying what fits."""
        body = PrewarmRequest(count=count, within_s=within_s, hold_s=hold_s, template=template)
        return await self._call("POST", f"{self.url}/v1/pools/{pool}/prewarm", PrewarmInfo, body)


def _error_from(status: int, text: str) -> DsecError:
    try:
        err = json.loads(text)["error"]
        return DsecError(status, err["code"], err["message"], err.get("details"))
    except (ValueError, KeyError, TypeError):
        return DsecError(status, "http_error", text[:500])
