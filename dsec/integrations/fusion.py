"""SandboxFusion's API on a pool: `dsec serve fusion` (see docs/integrations.md).

verl's and SkyRL's code rewards and code tools call SandboxFusion (`POST /run_code`,
whose client is the `sandbox-fusion` package); this service answers the same requests
in the same shapes, so such a config changes only its URL. Each request runs in a
sandbox of its own, taken warm from the pool and released after (recycled where the
pool recycles its template), so no request sees another's files or processes:

1. its files and its code are unpacked into the work dir in one tar, its stdin (if any)
   written to a file in /tmp;
2. the compile command (cpp) runs, then, if that finished with 0, the run command,
   each through the resident loop with its own timeout;
3. `fetch_files` are read back; one that is not a regular file is left out, as
   SandboxFusion does.

The service carries payloads, so it is a process of its own, never the control plane,
and more of them scale it out. At most `concurrency` requests hold a sandbox at once;
the rest wait in line, and one whose wait passes its own timeouts (compile_timeout +
run_timeout) is answered `SandboxError` rather than dropped. A request SandboxFusion
would refuse is refused as it does (422, FastAPI's `{"detail": [...]}`); what is wrong
in a request it would take (a base64 that does not decode, a path outside the work dir,
code over the limit) is a 400 or 413 `{"detail": "..."}`, decided before any sandbox is
taken.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import posixpath
import secrets
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, ValidationError

from dsec.archives import tar_of_files
from dsec.buckets import LATENCY_BUCKETS
from dsec.client import Client, DsecError, Sandbox
from dsec.clock import Clock
from dsec.httpkit import ApiError, count_authenticated
from dsec.models import MAX_TIMEOUT_S

log = logging.getLogger(__name__)

WORKDIR = "/work"
STDIN_PATH = "/tmp/dsec-fusion-stdin"
MAX_OUTPUT_BYTES = 1024 * 1024  # per stream, as SandboxFusion captures

# SandboxFusion's languages, by its names; a request naming another is refused (422)
Language = Literal[
    "python", "python2", "cpp", "nodejs", "go", "go_test", "java", "php", "csharp", "bash",
    "typescript", "sql", "rust", "cuda", "lua", "R", "perl", "D_ut", "ruby", "scala",
    "julia", "pytest", "junit", "kotlin_script", "jest", "verilog", "python_gpu", "lean",
    "swift", "racket", "gtest", "react",
]  # fmt: skip


class RunCodeRequest(BaseModel):
    """SandboxFusion's request; a field it has and this service does not use
    (`memory_limit_MB`: the pool's limits hold) is taken and ignored, as are others."""

    model_config = ConfigDict(extra="ignore")

    compile_timeout: float = 10
    run_timeout: float = 10
    code: str
    stdin: str | None = None
    language: Language
    files: dict[str, str | None] = {}
    fetch_files: list[str] = []


class CommandRunResult(BaseModel):
    status: Literal["Finished", "Error", "TimeLimitExceeded"]
    execution_time: float | None = None
    return_code: int | None = None  # None when it ran out of time
    stdout: str | None = None
    stderr: str | None = None


class RunCodeResponse(BaseModel):
    status: Literal["Success", "Failed", "SandboxError"]
    message: str
    compile_result: CommandRunResult | None = None
    run_result: CommandRunResult | None = None
    executor_pod_name: str | None = None  # the sandbox that ran it
    files: dict[str, str] = {}


@dataclass(frozen=True)
class Runner:
    """How a language runs: the tool the template must have, and the commands, in
    which `{file}` is the code's file."""

    suffix: str
    tool: str
    run: tuple[str, ...]
    compile: tuple[str, ...] | None = None


# SandboxFusion's commands for each language whose toolchain a Debian template can hold;
# a template serves those whose tool it has (probed once, on its first request)
RUNNERS = {
    "python": Runner(".py", "python3", ("python3", "{file}")),
    "pytest": Runner(".py", "pytest", ("pytest", "{file}")),
    "bash": Runner(".sh", "bash", ("bash", "{file}")),
    "cpp": Runner(".cpp", "g++", ("./test",), ("g++", "-std=c++17", "{file}", "-o", "test")),
    "perl": Runner(".pl", "perl", ("perl", "{file}")),
}
PROBE = " ".join(sorted({r.tool for r in RUNNERS.values()}))


@dataclass(frozen=True)
class FusionSettings:
    template: str
    pool: str = "default"
    concurrency: int = 32  # requests holding a sandbox at once; the rest wait in line
    max_code_bytes: int = 1 << 20
    max_request_bytes: int = 64 << 20  # the whole body: code, stdin and files, base64
    acquire_timeout_s: float = 60.0


class Refused(Exception):
    """A request refused before it runs: its status and FastAPI's `detail`."""

    def __init__(self, status: int, detail: Any) -> None:
        super().__init__(str(detail))
        self.status, self.detail = status, detail


@dataclass(frozen=True)
class Prepared:
    """A request checked and ready to run: what goes into the work dir, and where."""

    request: RunCodeRequest
    source: str  # the code's file, in the work dir
    tar: bytes
    stdin: bytes | None
    fetch: dict[str, str]  # as the request named it -> the absolute path


def workdir_path(name: str, field: str) -> str:
    """`name` (relative to the work dir, or absolute) as an absolute path strictly
    inside the work dir; anything else is refused."""
    if not name or "\x00" in name:
        raise Refused(400, f"{field}: {name!r} is not a path")
    path = posixpath.normpath(posixpath.join(WORKDIR, name))
    if not path.startswith(WORKDIR + "/"):
        raise Refused(400, f"{field}: {name!r} is outside the work dir {WORKDIR}")
    return path


def prepare(request: RunCodeRequest, settings: FusionSettings, mtime: float) -> Prepared:
    for field in ("compile_timeout", "run_timeout"):
        value = getattr(request, field)
        if not 0 < value <= MAX_TIMEOUT_S:
            raise Refused(
                400, f"{field} is {value:g}: it must be above 0 and at most {MAX_TIMEOUT_S:g}"
            )
    code = request.code.encode()
    if len(code) > settings.max_code_bytes:
        raise Refused(
            413,
            f"code is {len(code)} bytes, over this service's limit of {settings.max_code_bytes}",
        )
    runner = RUNNERS.get(request.language)
    source = f"tmp{secrets.token_hex(4)}{runner.suffix if runner else ''}"
    contents: dict[str, bytes] = {}
    for name, encoded in request.files.items():
        path = workdir_path(name, "files")
        if encoded is None:
            continue  # SandboxFusion writes no file for a null
        try:
            contents[path] = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError) as e:
            raise Refused(400, f"files: {name!r} is not base64: {e}") from e
    contents[f"{WORKDIR}/{source}"] = code
    fetch = {name: workdir_path(name, "fetch_files") for name in request.fetch_files}
    stdin = request.stdin.encode() if request.stdin is not None else None
    relative = {posixpath.relpath(path, WORKDIR): data for path, data in contents.items()}
    return Prepared(request, source, tar_of_files(relative, mtime), stdin, fetch)


def sandbox_error(message: str) -> RunCodeResponse:
    """SandboxFusion's answer for a fault on the sandbox's side: its clients raise it and
    try again."""
    return RunCodeResponse(status="SandboxError", message=message)


class FusionMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "dsec_fusion_requests",
            "run_code requests answered, by language and status (Success, Failed, "
            "SandboxError, or refused: the request was not valid)",
            ["language", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "dsec_fusion_request_seconds",
            "from a run_code request's arrival to its answer, its wait in line included",
            ["language"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.waiting = Gauge(
            "dsec_fusion_waiting",
            "requests waiting in line for one of the service's sandboxes",
            registry=self.registry,
        )
        self.running = Gauge(
            "dsec_fusion_running", "requests holding a sandbox", registry=self.registry
        )


class FusionService:
    def __init__(
        self, client: Client, settings: FusionSettings, clock: Clock, metrics: FusionMetrics
    ) -> None:
        self.client, self.settings, self.clock, self.metrics = client, settings, clock, metrics
        self.slots = asyncio.Semaphore(settings.concurrency)
        self.tools: frozenset[str] | None = None  # the template's, once probed

    async def run_code(self, request: web.Request) -> web.Response:
        started = self.clock.now()
        language = "unknown"
        try:
            parsed = parse_request(await request.read())
            language = parsed.language
            prepared = prepare(parsed, self.settings, self.clock.wall())
        except Refused as e:
            self.metrics.requests.labels(language, "refused").inc()
            return web.json_response({"detail": e.detail}, status=e.status)
        answer = await self._answer(prepared)
        self.metrics.requests.labels(language, answer.status).inc()
        self.metrics.latency.labels(language).observe(self.clock.now() - started)
        return web.json_response(answer.model_dump(mode="json"))

    async def _answer(self, prepared: Prepared) -> RunCodeResponse:
        request = prepared.request
        if self.tools is not None and (refusal := self._unsupported(request.language)):
            return refusal
        budget = request.compile_timeout + request.run_timeout
        self.metrics.waiting.inc()
        try:
            async with asyncio.timeout(budget):
                await self.slots.acquire()
        except TimeoutError:
            return sandbox_error(
                f"waited {budget:g} s (the request's compile_timeout + run_timeout) for one "
                f"of this service's {self.settings.concurrency} sandboxes; none came free"
            )
        finally:
            self.metrics.waiting.dec()
        self.metrics.running.inc()
        try:
            return await self._in_sandbox(prepared)
        except (DsecError, aiohttp.ClientError, TimeoutError) as e:
            log.warning("run_code failed on the pool's side: %s", e)
            return sandbox_error(f"the pool failed this request: {e or type(e).__name__}")
        finally:
            self.metrics.running.dec()
            self.slots.release()

    def _unsupported(self, language: str) -> RunCodeResponse | None:
        runner = RUNNERS.get(language)
        assert self.tools is not None
        if runner is not None and runner.tool in self.tools:
            return None
        served = ", ".join(sorted(lang for lang, r in RUNNERS.items() if r.tool in self.tools))
        return sandbox_error(
            f"language {language!r} is not served by template {self.settings.template!r} "
            f"(it serves: {served or 'none'})"
        )

    async def _in_sandbox(self, prepared: Prepared) -> RunCodeResponse:
        request, settings = prepared.request, self.settings
        async with self.client.sandbox(
            settings.pool, settings.template, timeout=settings.acquire_timeout_s
        ) as sb:
            if self.tools is None:
                self.tools = await probe_tools(sb)
            if refusal := self._unsupported(request.language):
                return refusal
            runner = RUNNERS[request.language]
            await sb.files.write_tar(WORKDIR, prepared.tar)
            if prepared.stdin is not None:
                await sb.files.write(STDIN_PATH, prepared.stdin)
            compiled = None
            if runner.compile is not None:
                argv = [a.format(file=prepared.source) for a in runner.compile]
                compiled = await run_command(sb, argv, request.compile_timeout, None)
            ran = None
            if compiled is None or (compiled.status == "Finished" and compiled.return_code == 0):
                argv = [a.format(file=prepared.source) for a in runner.run]
                stdin = STDIN_PATH if prepared.stdin is not None else None
                ran = await run_command(sb, argv, request.run_timeout, stdin)
            files = await fetch_files(sb, prepared.fetch)
        # the run ran only after a compile (if any) that finished with 0
        passed = ran is not None and ran.return_code == 0
        return RunCodeResponse(
            status="Success" if passed else "Failed",
            message="",
            compile_result=compiled,
            run_result=ran,
            executor_pod_name=sb.id,
            files=files,
        )


def parse_request(raw: bytes) -> RunCodeRequest:
    """The body as SandboxFusion's request, or FastAPI's 422 for what it would refuse."""
    try:
        return RunCodeRequest.model_validate_json(raw)
    except ValidationError as e:
        detail = [
            {"type": err["type"], "loc": ["body", *err["loc"]], "msg": err["msg"]}
            for err in e.errors(include_url=False, include_input=False)
        ]
        raise Refused(422, detail) from e


async def probe_tools(sb: Sandbox) -> frozenset[str]:
    """Which of the runners' tools the template has."""
    found = await sb.exec(
        ["sh", "-c", f"for t in {PROBE}; do command -v $t >/dev/null && echo $t; done; true"]
    )
    return frozenset(found.stdout.split())


async def run_command(
    sb: Sandbox, argv: list[str], timeout: float, stdin_path: str | None
) -> CommandRunResult:
    if stdin_path is not None:
        argv = ["sh", "-c", f'exec "$@" < {stdin_path}', "sh", *argv]
    done = await sb.exec(argv, timeout=timeout, max_output_bytes=MAX_OUTPUT_BYTES, workdir=WORKDIR)
    return CommandRunResult(
        status="TimeLimitExceeded" if done.timed_out else "Finished",
        execution_time=done.duration_ms / 1000,
        return_code=None if done.timed_out else done.exit_code,
        stdout=done.stdout,
        stderr=done.stderr,
    )


async def fetch_files(sb: Sandbox, fetch: dict[str, str]) -> dict[str, str]:
    files = {}
    for name, path in fetch.items():
        try:
            data = await sb.files.read(path)
        except DsecError as e:
            if e.status >= 500:
                raise
            continue  # missing, a directory, a symlink: not a file to fetch
        files[name] = base64.b64encode(data).decode()
    return files


@web.middleware
async def open_api(request: web.Request, handler: Any) -> web.StreamResponse:
    """SandboxFusion's API takes no credential, so every request counts as one that
    passed it (httpkit's ConnectionGate keeps a connection that has not for seconds
    only); aiohttp's own refusals (a body over the limit, an unknown route) are answered
    in FastAPI's shape, as SandboxFusion's clients read them."""
    try:
        count_authenticated(request)
        return await handler(request)
    except ApiError as e:
        return web.json_response({"detail": e.message}, status=e.status)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return web.json_response({"detail": e.text or e.reason}, status=e.status)


def create_fusion_app(
    client: Client, settings: FusionSettings, clock: Clock, metrics: FusionMetrics | None = None
) -> web.Application:
    """The service's app; `client` (the caller's, open) reaches the pool."""
    metrics = metrics or FusionMetrics()
    service = FusionService(client, settings, clock, metrics)
    app = web.Application(client_max_size=settings.max_request_bytes, middlewares=[open_api])

    async def ping(_: web.Request) -> web.Response:
        return web.Response(text=json.dumps("pong"), content_type="application/json")

    async def metrics_page(_: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    app.router.add_post("/run_code", service.run_code)
    app.router.add_get("/v1/ping", ping)
    app.router.add_get("/metrics", metrics_page)
    return app
