"""What the control plane and the agent share as HTTP services.

Routes are declared once with their request and answer models; the same
declaration registers the handler and writes the OpenAPI document. Every error,
including aiohttp's own (404, 405, 413) and validation failures, leaves as JSON of
the form {"error": {"code", "message", "details"}}.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import signal
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, Field, ValidationError
from pydantic.json_schema import models_json_schema

from dsec.models import SANDBOX_ID_RE, ErrorResponse, validation_details

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1024 * 1024
# a JSON body (at most MAX_BODY_BYTES) is read within this; a streamed one (a file) may
# take as long as it needs, but no byte for this long ends it
BODY_TIMEOUT_S = 30.0
BODY_IDLE_TIMEOUT_S = 60.0
# How long a stopping service lets the requests in progress finish before it cancels
# them (aiohttp waits that long, then as long again for the cancelled): a client's long
# command or stream must not hold it past its supervisor's grace
# (dsec.processes.STOP_GRACE_S), nor keep an agent from removing its sandboxes.
REQUESTS_GRACE_S = 5.0

# A background task that goes on after its cancellation is cancelled again this often:
# a service's shutdown must never wait for one for good.
CANCEL_AGAIN_AFTER_S = 1.0
M = TypeVar("M", bound=BaseModel)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ApiError(Exception):
    """An answer other than success, with a status and a reason the caller can act on."""

    def __init__(
        self, status: int, code: str, message: str, details: list[dict] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.details = details


class CredentialRefused(ApiError):
    """A request without the credential its route needs (401), or with one that does not
    hold it (403). Refusals are logged, and recorded where a service keeps an audit log,
    with the caller's address and the route: never the token presented."""


def error_response(status: int, code: str, message: str, details: list | None = None):
    body: dict[str, Any] = {"code": code, "message": message}
    if details:
        body["details"] = details
    return web.json_response({"error": body}, status=status)


_STATUS_CODES = {
    404: "not_found",
    405: "method_not_allowed",
    413: "body_too_large",
    400: "bad_request",
}


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as e:
        return error_response(e.status, e.code, e.message, e.details)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        message = e.reason if e.status != 413 else f"request body is over {MAX_BODY_BYTES} bytes"
        return error_response(e.status, _STATUS_CODES.get(e.status, "http_error"), message)
    except Exception:  # a bug: answer in JSON and keep serving
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(500, "internal_error", "internal error; see the service log")


async def read_model(request: web.Request, model: type[M]) -> M:
    """Parse and validate a JSON body, or raise an ApiError saying what is wrong."""
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            raw = await request.read()
    except TimeoutError as e:
        raise ApiError(408, "body_timeout", f"request body not read in {BODY_TIMEOUT_S:g} s") from e
    if not raw:
        data: Any = {}
    else:
        try:
            data = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ApiError(400, "malformed_json", f"request body is not valid JSON: {e}") from e
        except RecursionError as e:  # no request of ours nests deeper than a few levels
            raise ApiError(400, "malformed_json", "request body is nested too deeply") from e
    if not isinstance(data, dict):
        raise ApiError(400, "malformed_json", "request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ApiError(
            422, "validation_error", "request body is invalid", validation_details(e)
        ) from e


async def body_chunks(request: web.Request, size: int) -> AsyncIterator[bytes]:
    """A streamed body, in chunks of up to `size` bytes as they arrive: it may take as
    long as it needs, but a client that sends nothing for BODY_IDLE_TIMEOUT_S is
    answered 408."""
    while True:
        try:
            async with asyncio.timeout(BODY_IDLE_TIMEOUT_S):
                chunk = await request.content.read(size)
        except TimeoutError as e:
            raise ApiError(
                408, "body_timeout", f"no byte of the body in {BODY_IDLE_TIMEOUT_S:g} s"
            ) from e
        if not chunk:
            return
        yield chunk


def model_response(obj: BaseModel, status: int = 200) -> web.Response:
    return web.Response(body=obj.model_dump_json(), status=status, content_type="application/json")


def sandbox_id_param(request: web.Request) -> str:
    sandbox_id = request.match_info["sandbox_id"]
    if not SANDBOX_ID_RE.match(sandbox_id):
        raise ApiError(400, "invalid_sandbox_id", f"not a sandbox id: {sandbox_id!r}")
    return sandbox_id


def bearer_token(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def token_matches(presented: str | None, accepted: Iterable[str]) -> bool:
    if presented is None:
        return False
    # compare against every accepted token so timing tells nothing about which matched
    found = False
    for token in accepted:
        found |= hmac.compare_digest(presented.encode(), token.encode())
    return found


def require_token(request: web.Request, accepted: Iterable[str]) -> None:
    presented = bearer_token(request)
    if presented is None:
        raise CredentialRefused(401, "unauthenticated", "missing Authorization: Bearer <token>")
    if not token_matches(presented, accepted):
        raise CredentialRefused(403, "forbidden", "this token may not do that")


class MetricsAccess(BaseModel):
    """Who may read a service's /metrics (and the control plane's service discovery,
    which lists every agent's address): Prometheus, with a token of its own, so that it
    needs none that can do anything else."""

    metrics_token: str | None = Field(
        None,
        min_length=16,
        repr=False,
        description="the bearer token Prometheus sends (DSEC_METRICS_TOKEN)",
    )
    require_metrics_token: bool | None = Field(
        None,
        description="true: /metrics (and /v1/sd/prometheus) need the metrics token (the "
        "control plane also takes an admin token); false: open to anyone who can connect; "
        "unset: true when a metrics token is set",
    )

    def metrics_readers(self, *also: str) -> list[str] | None:
        """The tokens /metrics accepts (the metrics token and `also`), or None: open.

        Open unless a metrics token is set (or required), so a Prometheus configured
        before there was one keeps scraping; `dsec up` sets one when asked."""
        required = self.require_metrics_token
        if required is None:
            required = self.metrics_token is not None
        if not required:
            return None
        return [t for t in (self.metrics_token, *also) if t]


RefusalHook = Callable[[web.Request, CredentialRefused], Awaitable[None]]


def refusals_recorded(record: RefusalHook | None) -> Callable:
    """A middleware that logs every credential refusal with the caller's address and the
    route, and hands it to `record` (the agent's audit log), then lets it answer."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except CredentialRefused as e:
            log.warning(
                "refused %s %s from %s: %s %s",
                request.method,
                route_of(request),
                request.remote,
                e.status,
                e.code,
            )
            if record is not None:
                await record(request, e)
            raise

    return middleware


def route_of(request: web.Request) -> str:
    """The route a request matched, as declared (`/v1/sandboxes/{sandbox_id}/exec`): a
    bounded name, where the path itself is whatever the caller sent."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else request.path


@dataclass
class Api:
    """A route table that also writes its OpenAPI document."""

    title: str
    version: str = "1"
    routes: list[tuple[str, str, Handler, type[BaseModel] | None, type[BaseModel] | None, str]] = (
        field(default_factory=list)
    )

    def route(
        self,
        method: str,
        path: str,
        handler: Handler,
        *,
        body: type[BaseModel] | None = None,
        answer: type[BaseModel] | None = None,
        summary: str = "",
    ) -> None:
        self.routes.append((method, path, handler, body, answer, summary))

    def install(self, app: web.Application) -> None:
        for method, path, handler, *_ in self.routes:
            app.router.add_route(method, path, handler)
        document = self.openapi()

        async def openapi(_: web.Request) -> web.Response:
            return web.json_response(document)

        app.router.add_get("/openapi.json", openapi)

    def openapi(self) -> dict:
        models = {m for _, _, _, b, a, _ in self.routes for m in (b, a) if m} | {ErrorResponse}
        refs, schema = models_json_schema(
            [(m, "validation") for m in sorted(models, key=lambda m: m.__name__)],
            ref_template="#/components/schemas/{model}",
        )
        paths: dict[str, dict] = {}
        error = {
            "description": "error",
            "content": {
                "application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}
            },
        }
        for method, path, _, body, answer, summary in self.routes:
            op: dict[str, Any] = {"summary": summary, "responses": {"default": error}}
            params = [p[1:-1] for p in path.split("/") if p.startswith("{")]
            if params:
                op["parameters"] = [
                    {"name": p, "in": "path", "required": True, "schema": {"type": "string"}}
                    for p in params
                ]
            if body:
                op["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": refs[(body, "validation")]}},
                }
            ok = {"description": "success"}
            if answer:
                ok["content"] = {"application/json": {"schema": refs[(answer, "validation")]}}
            op["responses"]["200"] = ok
            paths.setdefault(path, {})[method.lower()] = op
        return {
            "openapi": "3.1.0",
            "info": {"title": self.title, "version": self.version},
            "paths": paths,
            "components": {
                "schemas": schema.get("$defs", {}),
                "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            },
            "security": [{"bearer": []}],
        }


def new_app(api: Api, on_refused: RefusalHook | None = None) -> web.Application:
    """The app serving `api`; `on_refused` records each credential refusal (after it is
    logged), before it answers."""
    app = web.Application(
        client_max_size=MAX_BODY_BYTES, middlewares=[json_errors, refusals_recorded(on_refused)]
    )
    api.install(app)
    return app


def listening_line(url: str) -> str:
    """The one line a service prints on stdout once it listens; `dsec up` reads it."""
    return json.dumps({"event": "listening", "url": url})


@dataclass(frozen=True)
class ServerLimits:
    """How long a server waits on a client, and how many it serves at once, so that
    clients that connect and send nothing, or send slowly, hold only so much of it.

    aiohttp has no limit on connections and, by default, keeps an idle one an hour:
    `serve` closes an idle connection after `idle_timeout_s` (aiohttp's keep-alive
    timer, which starts when a connection opens, so it also bounds how long a request's
    line and headers may take to arrive), a TLS handshake after `handshake_timeout_s`,
    and answers a connection past `max_connections` 503 and closes it. Bodies have
    timeouts of their own (read_model, body_chunks)."""

    idle_timeout_s: float = 30.0  # above aiohttp clients' 15 s: they close theirs first
    handshake_timeout_s: float = 10.0
    # counted once past the TLS handshake (the handshake timeout bounds the others)
    max_connections: int = 4096


# what a connection past the limit is answered, before it is closed unread
_TOO_MANY_CONNECTIONS = json.dumps(
    {"error": {"code": "too_many_connections", "message": "the server is at its connection limit"}}
).encode()
_TOO_MANY_CONNECTIONS_ANSWER = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
    % (len(_TOO_MANY_CONNECTIONS), _TOO_MANY_CONNECTIONS)
)


class _Refused(asyncio.Protocol):
    """A connection past the limit: answered 503 and closed, whatever it sends."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        transport.write(_TOO_MANY_CONNECTIONS_ANSWER)
        transport.close()


def _limited(server: web.Server, max_connections: int) -> Callable[[], asyncio.BaseProtocol]:
    """`server`'s protocol factory, which refuses connections past `max_connections`."""
    at_limit = False

    def protocol() -> asyncio.BaseProtocol:
        nonlocal at_limit
        if len(server.connections) < max_connections:
            at_limit = False
            return server()
        if not at_limit:  # once per episode: a flood must not flood the log as well
            log.warning("at the limit of %d connections: refusing more", max_connections)
            at_limit = True
        return _Refused()

    return protocol


async def serve(
    app: web.Application,
    host: str,
    port: int,
    stop: asyncio.Event,
    on_listening: Callable[[str], None] | None = None,
    *,
    ssl_context: ssl.SSLContext | None = None,
    limits: ServerLimits = ServerLimits(),
) -> None:
    """Run `app` on host:port until `stop` is set, printing the listening line: over TLS
    (https) with `ssl_context`, within `limits`."""
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        keepalive_timeout=limits.idle_timeout_s,
        shutdown_timeout=REQUESTS_GRACE_S,
    )
    await runner.setup()
    assert runner.server is not None
    try:
        # a listener of our own rather than web.TCPSite, which takes neither a protocol
        # factory (the connection limit) nor a handshake timeout
        listener = await asyncio.get_running_loop().create_server(
            _limited(runner.server, limits.max_connections),
            host,
            port,
            ssl=ssl_context,
            ssl_handshake_timeout=limits.handshake_timeout_s if ssl_context else None,
            backlog=1024,
        )
        try:
            bound = listener.sockets[0].getsockname()[1]
            url = f"{'https' if ssl_context else 'http'}://{host}:{bound}"
            if on_listening is not None:
                on_listening(url)
            print(listening_line(url), flush=True)
            await stop.wait()
        finally:
            listener.close()  # no new connections; the runner ends those it has
    finally:
        await runner.cleanup()


async def cancel_and_wait(*tasks: asyncio.Task) -> None:
    """Cancel an app's background `tasks` and wait for their end, cancelling again one
    that swallowed its cancellation (as Python 3.11's asyncio.wait_for can, when what it
    waits for ends as the cancellation comes). What one of them raised is logged."""
    cancelled: set[asyncio.Task] = set()
    while pending := [t for t in tasks if not t.done()]:
        for task in pending:
            if task in cancelled:
                log.warning("%s went on after its cancellation: cancelled again", task.get_name())
            task.cancel()
            cancelled.add(task)
        await asyncio.wait(pending, timeout=CANCEL_AGAIN_AFTER_S)
    for task in tasks:
        if not task.cancelled() and task.exception() is not None:
            log.error("%s ended with an error", task.get_name(), exc_info=task.exception())


def stop_on_signals() -> asyncio.Event:
    """An event set by SIGINT or SIGTERM, so a service shuts down through its cleanup."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop
