"""The typed interface through which the control plane acts on nodes, and its HTTP
implementation. The simulator implements the same interface (`bench.sim.agents`).

Every call names its node (`AgentAddress`: an id and, for HTTP, a URL) and carries a
request id, so an agent can recognise a retry. Failures come back as data in a
`CallResult`, never raised: the next tick decides what to do about them.
"""

from __future__ import annotations

import json
import ssl
from dataclasses import dataclass
from typing import Literal, Protocol

import aiohttp
from pydantic import BaseModel

from controlplane.identities import Identities
from dsec.httpkit import form_body
from dsec.models import (
    GRANT_FILES_PART,
    GRANT_PART,
    CreateSandbox,
    LeaseEnd,
    LeaseGrant,
    ResetSandbox,
)


@dataclass(frozen=True)
class CallResult:
    ok: bool
    status: int  # HTTP status; 0 when the agent could not be reached
    code: str  # the agent's error code, or "unreachable"
    message: str
    busy_s: float | None = None  # a removal: what the sandbox ran, all time
    details: list[dict] | None = None  # the agent's error details (a failed setup's output)
    answer: dict | None = None  # a success's JSON body, for the calls that answer one

    @property
    def refused(self) -> bool:
        """The agent said no for good (no room, wrong node): try another node."""
        return self.status in (409, 422)

    @property
    def node_fault(self) -> bool:
        """The node failed (unreachable, or its agent or Docker broke), rather than
        answering no: what counts towards taking it out of placement."""
        return self.status == 0 or self.status >= 500

    @property
    def gone(self) -> bool:
        """The agent no longer has the sandbox: for a removal, as good as done."""
        return self.status in (404, 410)


OK = CallResult(True, 200, "ok", "")


class AgentAddress(Protocol):
    """Where a node's agent is: the control plane's NodeEntry is one."""

    id: str
    url: str


class AgentClient(Protocol):
    """What the control plane asks of an agent: one method per operation."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def create(self, node: AgentAddress, spec: CreateSandbox) -> CallResult:
        """Create and start a sandbox (idempotent on spec.sandbox_id)."""

    async def lease(self, node: AgentAddress, sandbox_id: str, grant: LeaseGrant) -> CallResult:
        """Hand a sandbox to a client, thawing or restoring it first if it is frozen."""

    async def pause(self, node: AgentAddress, sandbox_id: str) -> CallResult: ...

    async def unpause(self, node: AgentAddress, sandbox_id: str) -> CallResult: ...

    async def hibernate(self, node: AgentAddress, sandbox_id: str) -> CallResult:
        """Keep a paused sandbox's files, remove its container."""

    async def destroy(
        self, node: AgentAddress, sandbox_id: str, ended: LeaseEnd = "released"
    ) -> CallResult:
        """Remove a sandbox and all it keeps; `busy_s` says what it ran, all time.
        `ended` is what the agent tells a client that still calls it."""

    async def reset(self, node: AgentAddress, sandbox_id: str, req: ResetSandbox) -> CallResult:
        """Recycle a released sandbox: end its lease, kill its processes, empty its work
        dir, /tmp and /dev/shm, check, and make it warm again. Any failure: not warm."""

    async def snapshot(self, node: AgentAddress, sandbox_id: str) -> CallResult:
        """A fork's copy of a sandbox's work dir and /tmp (`answer`: a SnapshotMade)."""

    async def drop_snapshot(self, node: AgentAddress, snapshot_id: str) -> CallResult:
        """The forks have their copies: the node drops it."""


# A create waits its turn in its agent's engine queue (agent/engine.py), behind the
# creates a burst gave that node, so it may take far longer than any other call. Given
# up at the calls' 30 s, it is not undone: the agent makes the sandbox anyway and then
# removes it, and the node counts as failing. On a loaded machine a tune's live check
# gave up on 700 creates in 3 minutes, every node out of placement in turn, the engine
# busy with work that served no one.
CREATE_TIMEOUT_S = 600.0


class HttpAgents:
    """AgentClient over the agents' HTTP API (`agent.app`). Each call carries the call
    token of the node it goes to (controlplane/identities.py), which no other node knows."""

    def __init__(
        self,
        identities: Identities,
        timeout_s: float = 30.0,
        verify: ssl.SSLContext | Literal[True] = True,
        create_timeout_s: float = CREATE_TIMEOUT_S,
    ) -> None:
        self.identities = identities
        self.timeout_s = timeout_s
        self.create_timeout = aiohttp.ClientTimeout(total=create_timeout_s)
        self.verify = verify  # what https agents are verified with (dsec.tls.client_ssl)
        self.http: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self.http = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=64, ssl=self.verify),
        )

    async def close(self) -> None:
        if self.http is not None:
            await self.http.close()

    async def create(self, node: AgentAddress, spec: CreateSandbox) -> CallResult:
        url = f"{node.url}/v1/sandboxes"
        return await self._call(node, "POST", url, spec, spec.request_id, self.create_timeout)

    async def lease(self, node: AgentAddress, sandbox_id: str, grant: LeaseGrant) -> CallResult:
        url = f"{node.url}/v1/sandboxes/{sandbox_id}/lease"
        # a claim's setup runs before the agent answers: the call waits for it
        timeout = None
        if grant.setup or grant.fork_from:
            timeout = aiohttp.ClientTimeout(total=grant.setup_timeout_s + self.timeout_s)
        body: LeaseGrant | aiohttp.MultipartWriter = grant
        if grant.files_tar:  # its bytes as they are, not in base64 JSON
            body = form_body(
                [
                    (GRANT_PART, None, grant.model_dump_json(exclude={"files_tar"})),
                    (GRANT_FILES_PART, None, grant.files_tar),
                ]
            )
        return await self._call(node, "POST", url, body, grant.request_id, timeout)

    async def pause(self, node: AgentAddress, sandbox_id: str) -> CallResult:
        return await self._verb(node, sandbox_id, "pause")

    async def unpause(self, node: AgentAddress, sandbox_id: str) -> CallResult:
        return await self._verb(node, sandbox_id, "unpause")

    async def hibernate(self, node: AgentAddress, sandbox_id: str) -> CallResult:
        return await self._verb(node, sandbox_id, "hibernate")

    async def destroy(
        self, node: AgentAddress, sandbox_id: str, ended: LeaseEnd = "released"
    ) -> CallResult:
        url = f"{node.url}/v1/sandboxes/{sandbox_id}?ended={ended}"
        return await self._call(node, "DELETE", url, None, sandbox_id)

    async def reset(self, node: AgentAddress, sandbox_id: str, req: ResetSandbox) -> CallResult:
        url = f"{node.url}/v1/sandboxes/{sandbox_id}/reset"
        return await self._call(node, "POST", url, req, req.request_id)

    async def snapshot(self, node: AgentAddress, sandbox_id: str) -> CallResult:
        url = f"{node.url}/v1/sandboxes/{sandbox_id}/snapshot"
        # a copy of a full work dir takes longer than a control call
        return await self._call(node, "POST", url, None, sandbox_id, self.create_timeout)

    async def drop_snapshot(self, node: AgentAddress, snapshot_id: str) -> CallResult:
        url = f"{node.url}/v1/snapshots/{snapshot_id}"
        return await self._call(node, "DELETE", url, None, snapshot_id)

    async def _verb(self, node: AgentAddress, sandbox_id: str, verb: str) -> CallResult:
        url = f"{node.url}/v1/sandboxes/{sandbox_id}/{verb}"
        return await self._call(node, "POST", url, None, sandbox_id)

    async def _call(
        self,
        node: AgentAddress,
        method: str,
        url: str,
        body: BaseModel | aiohttp.MultipartWriter | None,
        request_id: str,
        timeout: aiohttp.ClientTimeout | None = None,  # the session's (timeout_s) if None
    ) -> CallResult:
        assert self.http is not None, "HttpAgents.start() was not awaited"
        headers = {
            "Authorization": f"Bearer {self.identities.call_token(node.id)}",
            "X-Request-Id": request_id,
        }
        data: str | aiohttp.MultipartWriter | None = None
        if isinstance(body, BaseModel):
            data = body.model_dump_json()
            headers["Content-Type"] = "application/json"
        elif body is not None:
            data = body  # (a form says its own type)
        try:
            async with self.http.request(
                method, url, data=data, headers=headers, timeout=timeout or self.http.timeout
            ) as resp:
                # (JSON is UTF-8: no charset to parse out of the answer's content type)
                text = (await resp.read()).decode("utf-8", "replace")
                try:
                    payload = json.loads(text) if text else None
                except json.JSONDecodeError:
                    payload = None
                payload = payload if isinstance(payload, dict) else {}
                if resp.status < 300:
                    busy_s = payload.get("busy_s")
                    return CallResult(True, resp.status, "ok", "", busy_s=busy_s, answer=payload)
                err = payload.get("error")
                err = err if isinstance(err, dict) else {}
                details = err.get("details")
                return CallResult(
                    False,
                    resp.status,
                    err.get("code", "http_error"),
                    err.get("message", text),
                    details=details if isinstance(details, list) else None,
                )
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            return CallResult(False, 0, "unreachable", f"{type(e).__name__}: {e}")
