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
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema

from dsec.models import SANDBOX_ID_RE, ErrorResponse

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1024 * 1024
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


def validation_details(e: ValidationError) -> list[dict]:
    return [{"loc": ".".join(str(p) for p in err["loc"]), "msg": err["msg"]} for err in e.errors()]


async def read_model(request: web.Request, model: type[M]) -> M:
    """Parse and validate a JSON body, or raise an ApiError saying what is wrong."""
    raw = await request.read()
    if not raw:
        data: Any = {}
    else:
        try:
            data = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ApiError(400, "malformed_json", f"request body is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ApiError(400, "malformed_json", "request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ApiError(
            422, "validation_error", "request body is invalid", validation_details(e)
        ) from e


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
        raise ApiError(401, "unauthenticated", "missing Authorization: Bearer <token>")
    if not token_matches(presented, accepted):
        raise ApiError(403, "forbidden", "this token may not do that")


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


def new_app(api: Api) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[json_errors])
    api.install(app)
    return app


def listening_line(url: str) -> str:
    """The one line a service prints on stdout once it listens; `dsec up` reads it."""
    return json.dumps({"event": "listening", "url": url})


async def serve(
    app: web.Application,
    host: str,
    port: int,
    stop: asyncio.Event,
    on_listening: Callable[[str], None] | None = None,
) -> None:
    """Run `app` on host:port until `stop` is set, printing the listening line."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024)
    try:
        await site.start()
        bound = runner.addresses[0][1]
        url = f"http://{host}:{bound}"
        if on_listening is not None:
            on_listening(url)
        print(listening_line(url), flush=True)
        await stop.wait()
    finally:
        await runner.cleanup()


def stop_on_signals() -> asyncio.Event:
    """An event set by SIGINT or SIGTERM, so a service shuts down through its cleanup."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop
