"""Calls from the control plane to agents. Failures come back as data, never raised."""

from __future__ import annotations

import json
from dataclasses import dataclass

import aiohttp
from pydantic import BaseModel


@dataclass(frozen=True)
class CallResult:
    ok: bool
    status: int  # HTTP status; 0 when the agent could not be reached
    code: str  # the agent's error code, or "unreachable"
    message: str
    body: dict | None = None

    @property
    def refused(self) -> bool:
        """The agent said no for good (no room, wrong node): try another node."""
        return self.status in (409, 422)

    @property
    def node_fault(self) -> bool:
        """The node failed (unreachable, or its agent or Docker broke), rather than
        answering no: what counts towards taking it out of placement."""
        return self.status == 0 or self.status >= 500


class AgentGateway:
    def __init__(self, agent_token: str, timeout_s: float = 30.0) -> None:
        self.agent_token = agent_token
        self.timeout_s = timeout_s
        self.http: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self.http = aiohttp.ClientSession(
            headers={"Authorization": f"Bearer {self.agent_token}"},
            timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=64),
        )

    async def close(self) -> None:
        if self.http is not None:
            await self.http.close()

    async def call(
        self, method: str, url: str, body: BaseModel | None = None, request_id: str = ""
    ) -> CallResult:
        assert self.http is not None, "AgentGateway.start() was not awaited"
        headers = {"X-Request-Id": request_id} if request_id else {}
        data = None
        if body is not None:
            data = body.model_dump_json()
            headers["Content-Type"] = "application/json"
        try:
            async with self.http.request(method, url, data=data, headers=headers) as resp:
                text = await resp.text()
                try:
                    payload = json.loads(text) if text else None
                except json.JSONDecodeError:
                    payload = None
                if resp.status < 300:
                    return CallResult(True, resp.status, "ok", "", payload)
                err = (payload or {}).get("error", {}) if isinstance(payload, dict) else {}
                return CallResult(
                    False, resp.status, err.get("code", "http_error"), err.get("message", text)
                )
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            return CallResult(False, 0, "unreachable", f"{type(e).__name__}: {e}")
