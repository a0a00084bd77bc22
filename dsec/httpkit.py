"""What the control plane and the agent share as HTTP services.

Routes are declared once with their request and answer models; the same
declaration registers the handler and writes the OpenAPI document. Every error,
including aiohttp's own (404, 405, 413) and validation failures, leaves as JSON of
the form {"error": {"code", "message", "details"}}.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import secrets
import signal
import ssl
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
from aiohttp import web
from pydantic import BaseModel, Field, ValidationError
from pydantic.json_schema import models_json_schema
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from dsec.models import SANDBOX_ID_RE, ErrorResponse, validation_details

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1024 * 1024
# arrays and objects within one another in a JSON body: far past any request of ours
MAX_JSON_DEPTH = 32
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
        # the answer names the log line, whose route is the declared one, never the
        # path as sent (it may decode to anything, newlines included)
        request_id = secrets.token_hex(8)
        log.exception(
            "unhandled error in %s %s (request %s)", request.method, route_of(request), request_id
        )
        return error_response(
            500, "internal_error", f"internal error; see the service log for request {request_id}"
        )


def parse_json(raw: bytes | str) -> Any:
    """A JSON document a peer sent, or an ApiError (400) saying why it is not one: every
    body and message of both services is parsed here. One nested deeper than
    MAX_JSON_DEPTH is refused, however it parses: no request of ours nests more than a
    few levels, and what does would cost every recursive walk of it (validation,
    serialisation) its stack."""
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ApiError(400, "malformed_json", f"request body is not valid JSON: {e}") from e
    except RecursionError as e:  # the parser's own bound, far past ours
        raise _too_deep() from e
    if _depth_over(data, MAX_JSON_DEPTH):
        raise _too_deep()
    return data


def _too_deep() -> ApiError:
    return ApiError(
        400, "malformed_json", f"request body nests deeper than {MAX_JSON_DEPTH} levels"
    )


def _depth_over(data: Any, limit: int) -> bool:
    """Whether `data` nests arrays and objects more than `limit` deep (`[]` is 1), found
    level by level rather than by recursion."""
    level = [data] if isinstance(data, (list, dict)) else []
    for _ in range(limit):
        level = [
            child
            for value in level
            for child in (value.values() if isinstance(value, dict) else value)
            if isinstance(child, (list, dict))
        ]
        if not level:
            return False
    return bool(level)


def body_limit_with_files(files_bytes: int) -> int:
    """The body limit of a route whose JSON carries up to `files_bytes` of files in
    base64 (4 bytes per 3) beside the rest: an acquire's claim, its grant."""
    return MAX_BODY_BYTES + files_bytes * 4 // 3 + 4


async def read_model(request: web.Request, model: type[M], max_bytes: int | None = None) -> M:
    """Parse and validate a JSON body, or raise an ApiError saying what is wrong;
    `max_bytes` is a route's own limit, over the service's (MAX_BODY_BYTES)."""
    return parse_model(await read_body(request, max_bytes) or b"{}", model)


async def read_body(request: web.Request, max_bytes: int | None = None) -> bytes:
    """A (JSON) body whole, read within BODY_TIMEOUT_S, or an ApiError (408, 413)."""
    if max_bytes is not None:
        request = request.clone(client_max_size=max_bytes)
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            raw = await request.read()
    except TimeoutError as e:
        raise ApiError(408, "body_timeout", f"request body not read in {BODY_TIMEOUT_S:g} s") from e
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(
            413, "body_too_large", f"request body is over {max_bytes or MAX_BODY_BYTES} bytes"
        ) from None
    return raw


def parse_model(raw: bytes | str, model: type[M], what: str = "request body") -> M:
    """A JSON object a peer sent (`what`: a body, a message) as `model`, or an ApiError
    saying what is wrong with it."""
    data = parse_json(raw)
    if not isinstance(data, dict):
        raise ApiError(400, "malformed_json", f"{what} must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ApiError(422, "validation_error", f"{what} is invalid", validation_details(e)) from e


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


FORM_TYPE = "multipart/form-data"


def is_form(request: web.Request) -> bool:
    """Whether the body is a multipart/form-data one: read off the header, not through
    aiohttp's `content_type`, which parses it with the email package (a few per cent of
    a personalised claim's CPU in the control plane and the agent, measured)."""
    kind = request.headers.get("Content-Type", "")
    return kind[: len(FORM_TYPE)].lower() == FORM_TYPE


@dataclass(frozen=True)
class FormPart:
    name: str | None
    filename: str | None
    data: bytes


@functools.lru_cache(maxsize=1024)
def part_names(disposition: str | None) -> tuple[str | None, str | None]:
    """A form part's name and filename, from its Content-Disposition header, as aiohttp's
    BodyPartReader.name and .filename give them (RFC 2231's `filename*` too), ~20 us a
    parse. The same files come with every rollout of a task, so each header is parsed
    once."""
    _, params = aiohttp.multipart.parse_content_disposition(disposition)
    return (
        aiohttp.multipart.content_disposition_filename(params, "name"),
        aiohttp.multipart.content_disposition_filename(params, "filename"),
    )


def form_body(parts: Iterable[tuple[str, str | None, bytes | str]]) -> aiohttp.MultipartWriter:
    """A multipart/form-data body of (name, filename, data) parts: a str part is JSON, a
    bytes part is sent as it is (no base64: a claim's files and a grant's tar)."""
    form = aiohttp.MultipartWriter("form-data")
    for name, filename, data in parts:
        if isinstance(data, str):
            part = form.append(data, {"Content-Type": "application/json"})
        else:
            part = form.append(data, {"Content-Type": "application/octet-stream"})
        names = {"name": name} if filename is None else {"name": name, "filename": filename}
        part.set_content_disposition("form-data", **names)
    return form


class _FormParts:
    """A form's parts as python-multipart's parser finds them (its callbacks), whole."""

    def __init__(self, max_parts: int) -> None:
        self.max_parts = max_parts
        self.parts: list[FormPart] = []
        self.ended = False  # the closing boundary was read
        self._data: list[bytes] = []
        self._disposition: str | None = None
        self._field, self._value = b"", b""

    def callbacks(self) -> dict[str, Callable[..., None]]:
        return {
            "on_part_begin": self._begin,
            "on_header_field": self._header_field,
            "on_header_value": self._header_value,
            "on_header_end": self._header_end,
            "on_part_data": self._part_data,
            "on_part_end": self._part_end,
            "on_end": self._end,
        }

    def _begin(self) -> None:
        if len(self.parts) == self.max_parts:
            raise ApiError(413, "body_too_large", f"more than {self.max_parts} parts")
        self._data, self._disposition = [], None

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._field += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def _header_end(self) -> None:
        if self._field.lower() == b"content-disposition":
            self._disposition = self._value.decode("utf-8", "surrogateescape")
        self._field, self._value = b"", b""

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        self._data.append(data[start:end])

    def _part_end(self) -> None:
        name, filename = part_names(self._disposition)
        self.parts.append(FormPart(name, filename, b"".join(self._data)))
        self._data = []

    def _end(self) -> None:
        self.ended = True


async def read_form(request: web.Request, max_bytes: int, max_parts: int) -> list[FormPart]:
    """A multipart/form-data body's parts whole, read within BODY_TIMEOUT_S, or an
    ApiError: 413 past `max_bytes` of body or `max_parts` parts, 400 if not a form.

    The parts are found by python-multipart's parser, fed the body as it arrives: it
    parses a 1 MiB form in 0.2 ms of CPU, where aiohttp's reader, which copies a part's
    every chunk into a window to look for the boundary and parses each part's headers
    again, cost about 1.7 ms more than reading the same body raw (measured in process)."""
    _, options = parse_options_header(request.headers.get("Content-Type", ""))
    boundary = options.get(b"boundary")
    if not boundary:
        raise ApiError(400, "malformed_form", "a form's Content-Type names no boundary")
    found = _FormParts(max_parts)
    parser = MultipartParser(boundary, found.callbacks())  # type: ignore[arg-type]
    size = 0
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            async for chunk in request.content.iter_any():
                size += len(chunk)
                if size > max_bytes:
                    raise ApiError(413, "body_too_large", f"the form is over {max_bytes} bytes")
                parser.write(chunk)
    except TimeoutError as e:
        raise ApiError(408, "body_timeout", f"request body not read in {BODY_TIMEOUT_S:g} s") from e
    except (MultipartParseError, aiohttp.ClientPayloadError) as e:
        raise ApiError(400, "malformed_form", f"request body is not a valid form: {e}") from e
    if not found.ended:
        raise ApiError(400, "malformed_form", "request body ends before the form's last boundary")
    return found.parts


def model_response(obj: BaseModel, status: int = 200) -> web.Response:
    return web.Response(body=obj.model_dump_json(), status=status, content_type="application/json")


def sandbox_id_param(request: web.Request) -> str:
    sandbox_id = request.match_info["sandbox_id"]
    if not SANDBOX_ID_RE.match(sandbox_id):
        raise ApiError(400, "invalid_sandbox_id", f"not a sandbox id: {sandbox_id!r}")
    return sandbox_id


def bearer_token(request: web.Request) -> str | None:
    """The request's bearer token, None without one; refused (401) if not valid UTF-8."""
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return _utf8_token(token.strip(), "Authorization")


def token_header(request: web.Request, name: str) -> str:
    """A token sent in header `name` ("" without one); refused (401) if not valid UTF-8."""
    return _utf8_token(request.headers.get(name, ""), name)


def _utf8_token(token: str, header: str) -> str:
    # aiohttp hands a header's undecodable bytes on as lone surrogates, which no
    # comparison with a token can take (they do not encode): such a token is no token
    try:
        token.encode()
    except UnicodeEncodeError:
        raise CredentialRefused(
            401, "malformed_token", f"the token in {header} is not valid UTF-8"
        ) from None
    return token


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
    count_authenticated(request)


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
    """How long a server waits on a client, and how many connections it keeps, so that
    clients that connect and send nothing, send slowly, or connect again and again hold
    only so much of it, and no address holds what other clients need.

    aiohttp has no limit on connections and, by default, keeps an idle one an hour:
    `serve` closes an idle connection after `idle_timeout_s` (aiohttp's keep-alive
    timer, which starts when a connection is read, so it also bounds how long a
    request's line and headers may take to arrive) and a TLS handshake after
    `handshake_timeout_s`. Past its handshake a connection is counted by what it proved
    (ConnectionGate): until a request on it passed its route's credential, against its
    peer (its remote address), never against the others; once one did, against the
    limit every client shares. Bodies have timeouts of their own (read_model,
    body_chunks)."""

    idle_timeout_s: float = 30.0  # above aiohttp clients' 15 s: they close theirs first
    handshake_timeout_s: float = 10.0
    # connections on which a request authenticated, all peers together; a request that
    # authenticates past it is answered 503 and its connection closed
    max_connections: int = 4096
    # a peer's connections that have not authenticated: this many are read at once, the
    # next held unread until one of those authenticates or ends (a client's burst of new
    # connections waits its turn), and one past `unauthenticated_per_peer` in all is
    # answered 503 and closed, as is one past `max_unauthenticated` over every peer
    reading_per_peer: int = 32
    unauthenticated_per_peer: int = 1024
    max_unauthenticated: int = 4096
    # from its handshake's end, a connection that has not authenticated is closed then
    # (one held unread is answered 503 first)
    authenticate_within_s: float = 10.0


# what a connection the gate will not serve is answered, before it is closed unread
_TOO_MANY_CONNECTIONS = json.dumps(
    {"error": {"code": "too_many_connections", "message": "the server is at its connection limit"}}
).encode()
_TOO_MANY_CONNECTIONS_ANSWER = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
    % (len(_TOO_MANY_CONNECTIONS), _TOO_MANY_CONNECTIONS)
)

_REFUSED, _WAITING, _READING, _AUTHENTICATED = "refused", "waiting", "reading", "authenticated"


class _Connection(asyncio.Protocol):
    """One accepted connection: held unread while the gate says so, then served by
    aiohttp's handler, which gets every event of the transport from here on."""

    def __init__(self, gate: ConnectionGate) -> None:
        self.gate = gate
        self.transport: asyncio.Transport | None = None
        self.peer = ""
        self.state = _REFUSED
        self.handler: web.RequestHandler | None = None
        self.early = bytearray()  # what came before reading was paused (TLS may buffer)
        self.deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.peer = peer[0] if isinstance(peer, tuple) else str(peer)
        self.gate.arrived(self)

    def refuse(self) -> None:
        assert self.transport is not None
        self.transport.write(_TOO_MANY_CONNECTIONS_ANSWER)
        self.transport.close()

    def hold(self) -> None:
        assert self.transport is not None
        self.transport.pause_reading()

    def read(self, handler: web.RequestHandler) -> None:
        assert self.transport is not None
        self.handler = handler
        handler.connection_made(self.transport)
        if self.early:
            handler.data_received(bytes(self.early))
            self.early.clear()
        self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        if self.handler is not None:
            self.handler.data_received(data)
        elif self.state == _WAITING:
            self.early += data

    def eof_received(self) -> bool | None:
        return self.handler.eof_received() if self.handler is not None else None

    def pause_writing(self) -> None:
        if self.handler is not None:
            self.handler.pause_writing()

    def resume_writing(self) -> None:
        if self.handler is not None:
            self.handler.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.gate.left(self)
        if self.handler is not None:
            self.handler.connection_lost(exc)


@dataclass
class _Peer:
    reading: int = 0
    waiting: deque[_Connection] = field(default_factory=deque)
    refusing: bool = False  # its refusals are logged once, until it has no connection left

    @property
    def unauthenticated(self) -> int:
        return self.reading + len(self.waiting)


# A held connection with less time than this left to authenticate is refused, not read.
LAST_MOMENT_S = 0.05


class ConnectionGate:
    """Which connections a server reads and keeps (ServerLimits says how many): a
    connection is its peer's until a request on it authenticates (`authenticated`),
    and only then takes one of the slots every client shares, so that connections
    that prove nothing, however many one address opens, never keep another client
    out."""

    def __init__(self, limits: ServerLimits, make_handler: Callable[[], web.RequestHandler]):
        self.limits = limits
        self.make_handler = make_handler
        self.authenticated_count = 0
        self.unauthenticated_count = 0
        self.peers: dict[str, _Peer] = {}
        self.reading: dict[web.RequestHandler, _Connection] = {}  # not yet authenticated
        # each logged once per episode, as is each peer's refusal
        self.shared_full = False
        self.unauthenticated_full = False

    def protocol(self) -> asyncio.Protocol:
        return _Connection(self)

    def arrived(self, conn: _Connection) -> None:
        peer = self.peers.get(conn.peer)
        if peer is not None and peer.unauthenticated >= self.limits.unauthenticated_per_peer:
            if not peer.refusing:  # a flood must not flood the log as well
                log.warning(
                    "refusing connections from %s: %d have not authenticated",
                    conn.peer,
                    peer.unauthenticated,
                )
                peer.refusing = True
            conn.refuse()  # state _REFUSED: counted nowhere
            return
        if self.unauthenticated_count >= self.limits.max_unauthenticated:
            if not self.unauthenticated_full:
                log.warning(
                    "at the limit of %d connections that have not authenticated",
                    self.limits.max_unauthenticated,
                )
                self.unauthenticated_full = True
            conn.refuse()
            return
        self.unauthenticated_full = False
        peer = self.peers.setdefault(conn.peer, _Peer())
        self.unauthenticated_count += 1
        loop = asyncio.get_running_loop()
        conn.deadline = loop.call_later(self.limits.authenticate_within_s, self._late, conn)
        if peer.reading < self.limits.reading_per_peer:
            self._read(conn, peer)
        else:
            conn.state = _WAITING
            conn.hold()
            peer.waiting.append(conn)

    def _read(self, conn: _Connection, peer: _Peer) -> None:
        conn.state = _READING
        peer.reading += 1
        handler = self.make_handler()
        self.reading[handler] = conn
        conn.read(handler)

    def authenticated(self, handler: web.RequestHandler) -> bool:
        """Count `handler`'s connection against the shared limit, now that a request on
        it authenticated; False if that limit is reached (it stays its peer's)."""
        conn = self.reading.get(handler)
        if conn is None:  # counted already, or not a connection of ours (a test server)
            return True
        if self.authenticated_count >= self.limits.max_connections:
            if not self.shared_full:
                log.warning("at the limit of %d connections", self.limits.max_connections)
                self.shared_full = True
            return False
        self.shared_full = False
        self.authenticated_count += 1
        self._unauthenticated_gone(conn)
        conn.state = _AUTHENTICATED
        return True

    def left(self, conn: _Connection) -> None:
        if conn.state == _AUTHENTICATED:
            self.authenticated_count -= 1
        elif conn.state in (_READING, _WAITING):
            self._unauthenticated_gone(conn)
        conn.state = _REFUSED

    def _unauthenticated_gone(self, conn: _Connection) -> None:
        """`conn` authenticated or ended: its peer may read the next it holds."""
        self.unauthenticated_count -= 1
        if conn.deadline is not None:
            conn.deadline.cancel()
        peer = self.peers[conn.peer]
        if conn.state == _WAITING:
            peer.waiting.remove(conn)
        else:
            assert conn.handler is not None
            del self.reading[conn.handler]
            peer.reading -= 1
            self._read_next(peer)
        if peer.unauthenticated == 0:
            del self.peers[conn.peer]  # its next refusal is a new episode

    def _read_next(self, peer: _Peer) -> None:
        """Read the next connection `peer` holds. One whose time to authenticate has all
        but run out is answered 503 instead: read, it would only be closed unanswered
        (its deadline falls with the one that made room for it, or a moment after)."""
        now = asyncio.get_running_loop().time()
        while peer.waiting:
            conn = peer.waiting.popleft()
            assert conn.deadline is not None
            if conn.deadline.when() - now > LAST_MOMENT_S:
                self._read(conn, peer)
                return
            conn.deadline.cancel()
            self.unauthenticated_count -= 1
            conn.state = _REFUSED
            conn.refuse()

    def _late(self, conn: _Connection) -> None:
        """`conn` did not authenticate in time: closed (answered 503 if never read)."""
        if conn.state == _WAITING:
            conn.refuse()
        elif conn.state == _READING and conn.handler is not None:
            conn.handler.force_close()

    def close_held(self) -> None:
        """Close the connections held unread (the server's handlers close the others)."""
        for peer in self.peers.values():
            for conn in peer.waiting:
                assert conn.transport is not None
                conn.transport.close()


CONNECTIONS = web.AppKey("connections", ConnectionGate)


def count_authenticated(request: web.Request) -> None:
    """`request` passed its route's credential: its connection takes a shared slot
    (ServerLimits), or, with none left, the request is answered 503 and the connection
    closed once that answer is written."""
    gate = request.app.get(CONNECTIONS)
    if gate is not None and not gate.authenticated(request.protocol):
        request.protocol.close()
        raise ApiError(503, "too_many_connections", "the server is at its connection limit")


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
    gate = ConnectionGate(limits, lambda: server())
    app[CONNECTIONS] = gate  # before the runner freezes the app
    await runner.setup()
    server = runner.server
    assert server is not None
    try:
        # a listener of our own rather than web.TCPSite, which takes neither a protocol
        # factory (the connection gate) nor a handshake timeout
        listener = await asyncio.get_running_loop().create_server(
            gate.protocol,
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
            gate.close_held()
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
    """An event set by SIGINT, SIGTERM or SIGHUP (its terminal closed), so a service shuts
    down through its cleanup."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, stop.set)
    return stop
