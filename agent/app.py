"""The launcher agent: one per node, the source of truth for what runs there.

It registers with the control plane and heartbeats its state; it creates, leases,
pauses, thaws and removes sandboxes when the control plane asks; it runs commands
for clients holding a lease token; it refuses what it has no room for. On start it
adopts the containers labelled with its node id and removes those it cannot account
for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field

from agent.audit import AuditLog, AuditRecord, AuditRecords, quoted_cmd
from agent.docker_driver import (
    LABEL_LEASE,
    LABEL_NODE,
    LABEL_POOL,
    LABEL_SANDBOX,
    LABEL_TEMPLATE,
    RUNC_STOPPED,
    AsyncDocker,
    DockerOpError,
)
from agent.engine import Work
from agent.metrics import AgentMetrics
from agent.reset import leftovers, main_of, reset_dirs, reset_script, split_reset_output
from agent.store import SandboxRecord, SandboxStore
from dsec.clock import Clock
from dsec.httpkit import (
    Api,
    ApiError,
    bearer_token,
    model_response,
    new_app,
    read_model,
    require_token,
    sandbox_id_param,
    token_matches,
)
from dsec.models import (
    SANDBOX_ID_RE,
    Capacity,
    CreateSandbox,
    ExecRequest,
    ExecResult,
    LeaseGrant,
    Name,
    NodeKind,
    NodeReport,
    Released,
    ResetSandbox,
    SandboxReport,
    TemplateSpec,
    Usage,
    node_of,
)
from dsec.policy import Resources
from dsec.recent import TOMBSTONES, RecentMap
from dsec.states import (
    ASSIGNED,
    HIBERNATED_FROM,
    PAUSED_FROM,
    THAWED_FROM,
    SandboxState,
    transition,
)
from dsec.tokens import lease_token

log = logging.getLogger(__name__)
T = TypeVar("T")
AUDIT_READ_LIMIT = 10_000  # records one GET /v1/audit answers at most
HIBERNATED_REPOSITORY = "dsec-hibernated"
RESET_ROUNDS = 3  # kills a reset tries before it gives up on commands that keep running
RESET_EXEC_WAIT_S = 2.0  # how long a round waits for the killed commands' calls to end


def _write_file(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


class AgentConfig(BaseModel):
    node_id: Name
    kind: NodeKind = "local"
    host: str = "127.0.0.2"
    port: int = Field(0, ge=0, le=65535)
    capacity: Capacity = Capacity(cpus=64, memory_mb=65536, slots=128)
    controlplane_url: str | None = None
    agent_token: str = Field(min_length=16, repr=False)
    state_dir: Path
    heartbeat_s: float = Field(1.0, gt=0, le=60)
    images_refresh_s: float = Field(10.0, gt=0)
    engine_check_s: float = Field(1.0, gt=0, le=60, description="how often the engine is pinged")
    engine_check_timeout_s: float = Field(5.0, gt=0, le=60, description="a slower answer: down")
    cleanup_on_exit: bool = False


@dataclass
class Sandbox:
    record: SandboxRecord
    spec: TemplateSpec
    state: SandboxState
    last_active: float
    busy_s: float = 0.0
    running_execs: int = 0
    frozen_at: float | None = None  # set when paused, kept through hibernation
    reset_from: str | None = None  # the lease its last reset ended (a retry finds it done)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def occupies(self) -> bool:
        """Hibernated sandboxes hold disk only: no slot, CPU or memory."""
        return self.state != SandboxState.HIBERNATED

    def move(self, target: SandboxState) -> None:
        self.state = transition(self.state, target)

    def report(self, now: float) -> SandboxReport:
        r = self.record
        return SandboxReport(
            id=r.id,
            pool=r.pool,
            template=self.spec.name,
            state=self.state,
            created_at=r.created_at,
            lease_id=r.lease_id,
            idempotency_key=r.idempotency_key,
            owner=r.owner,
            labels=r.labels,
            cpus=self.spec.cpus,
            memory_mb=self.spec.memory_limit_mb,
            busy_s=self.busy_s,
            idle_s=0.0 if self.running_execs else max(0.0, now - self.last_active),
            frozen_s=None if self.frozen_at is None else max(0.0, now - self.frozen_at),
        )


class Agent:
    def __init__(
        self, config: AgentConfig, docker: AsyncDocker, clock: Clock, metrics: AgentMetrics
    ) -> None:
        self.config = config
        self.docker = docker
        self.clock = clock
        self.metrics = metrics
        self.store = SandboxStore(config.state_dir / f"{config.node_id}.sqlite")
        self.hibernated_dir = config.state_dir / f"{config.node_id}-hibernated"
        self.audit = AuditLog(config.state_dir / f"{config.node_id}-audit.jsonl")
        self.sandboxes: dict[str, Sandbox] = {}
        # released ids remembered, so late calls get "released", not "unknown"
        self.released: RecentMap[str, None] = RecentMap(TOMBSTONES)
        # sandboxes whose container died with the engine -> why, for their clients
        self.lost: RecentMap[str, str] = RecentMap(TOMBSTONES)
        self.engine_ok = True  # the engine answered its last check or call
        self.images: list[str] = []
        self.url = ""  # set by listening_at() once the port is known
        self.listening = asyncio.Event()
        self.incarnation = secrets.token_hex(8)
        self.operations: set[asyncio.Task] = set()  # see to_completion()

    async def to_completion(self, op: Coroutine[Any, Any, T]) -> T:
        """Run a control plane's request to its end even if the caller hangs up (a control
        plane killed mid-call): cut short, it would leave the record and the container
        disagreeing, such as a container made but never marked ready, which nothing would
        then hand out or remove. The control plane learns the outcome from the next
        heartbeat; shutdown waits for these."""
        task = asyncio.ensure_future(op)
        self.operations.add(task)
        # the caller may be gone: the outcome is retrieved here so it is never "unretrieved"
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        task.add_done_callback(self.operations.discard)
        return await asyncio.shield(task)

    def listening_at(self, url: str) -> None:
        self.url = url
        self.listening.set()

    # --- capacity -----------------------------------------------------------

    def usage(self) -> Usage:
        live = [s for s in self.sandboxes.values() if s.occupies]
        return Usage(
            cpus=round(sum(s.spec.cpus for s in live), 6),
            memory_mb=sum(s.spec.memory_limit_mb for s in live),
            slots=len(live),
        )

    def has_room_for(self, spec: TemplateSpec) -> bool:
        used, cap = self.usage(), self.config.capacity
        needs = Resources(spec.cpus, spec.memory_limit_mb, 1)
        after = Resources(used.cpus, used.memory_mb, used.slots) + needs
        return after.fits_in(Resources(cap.cpus, cap.memory_mb, cap.slots))

    def report(self) -> NodeReport:
        now = self.clock.now()
        return NodeReport(
            node_id=self.config.node_id,
            kind=self.config.kind,
            url=self.url,
            capacity=self.config.capacity,
            usage=self.usage(),
            images=self.images,
            sandboxes=[s.report(now) for s in self.sandboxes.values()],
            incarnation=self.incarnation,
            engine_ok=self.engine_ok,
            create_limit=self.docker.engine.creates.limit,
        )

    # --- lifecycle ------------------------------------------------------------

    def labels_for(self, sandbox_id: str, pool: str, template: str) -> dict[str, str]:
        return {
            LABEL_NODE: self.config.node_id,
            LABEL_POOL: pool,
            LABEL_TEMPLATE: template,
            LABEL_SANDBOX: sandbox_id,
            # created warm, before any lease exists; the lease lives in the store
            LABEL_LEASE: "",
        }

    async def create(self, req: CreateSandbox) -> tuple[Sandbox, bool]:
        """Create a sandbox; idempotent on its id. Returns (sandbox, created_now)."""
        if node_of(req.sandbox_id) != self.config.node_id:
            raise ApiError(422, "wrong_node", f"{req.sandbox_id} does not belong to this node")
        if req.sandbox_id in self.released:
            raise ApiError(409, "released", f"sandbox {req.sandbox_id} was already removed")
        existing = self.sandboxes.get(req.sandbox_id)
        if existing is not None:
            return existing, False
        work = Work.CREATE_FOR_REQUEST if req.for_request else Work.CREATE_WARM
        self._require_engine()
        if not self.has_room_for(req.template):
            raise ApiError(
                409,
                "no_capacity",
                f"node {self.config.node_id} has no room for template {req.template.name}",
            )
        record = SandboxRecord(
            id=req.sandbox_id,
            container_id="",
            pool=req.pool,
            template=req.template.model_dump(),
            created_at=self.clock.wall(),
        )
        sandbox = Sandbox(record, req.template, SandboxState.CREATING, self.clock.now())
        self.sandboxes[req.sandbox_id] = sandbox  # holds the slot while Docker works
        try:
            record.container_id = await self.docker.create(
                f"dsec-{req.sandbox_id}",
                req.template,
                self.labels_for(req.sandbox_id, req.pool, req.template.name),
                work,
            )
            await self.store.put(record)
        except DockerOpError as e:
            self.sandboxes.pop(req.sandbox_id, None)
            self._docker_failed(e)
            if record.container_id:
                with contextlib.suppress(DockerOpError):
                    await self.docker.remove(record.container_id, work)
            # an image this node lacks, or a template Docker refuses or cannot start, is a
            # refusal of the placement (the control plane tries elsewhere), not a failure
            # of Docker
            status = 422 if e.kind in ("image_not_found", "invalid", "start_failed") else 502
            raise ApiError(status, f"docker_{e.kind}", str(e)) from e
        sandbox.move(SandboxState.WARM)
        sandbox.last_active = self.clock.now()
        return sandbox, True

    def get(self, sandbox_id: str) -> Sandbox:
        sandbox = self.sandboxes.get(sandbox_id)
        if sandbox is None:
            if sandbox_id in self.lost:
                raise ApiError(410, "sandbox_lost", f"sandbox {sandbox_id} {self.lost[sandbox_id]}")
            if sandbox_id in self.released:
                raise ApiError(410, "released", f"sandbox {sandbox_id} was released")
            raise ApiError(404, "unknown_sandbox", f"no sandbox {sandbox_id} on this node")
        if sandbox.state == SandboxState.CREATING:
            raise ApiError(409, "not_ready", f"sandbox {sandbox_id} is still being created")
        return sandbox

    async def lease(self, sandbox_id: str, grant: LeaseGrant) -> Sandbox:
        sandbox = self.get(sandbox_id)
        async with sandbox.lock:
            if sandbox.record.lease_id == grant.lease_id:
                return sandbox  # a retry of the same grant
            # while the engine is away its containers may be dead: hand none out
            self._require_engine()
            # (leased with no lease id: a reset ended its lease, and failed: it goes)
            if sandbox.record.lease_id is not None or sandbox.state in ASSIGNED:
                raise ApiError(409, "already_leased", f"sandbox {sandbox_id} is leased already")
            if sandbox.state == SandboxState.PAUSED:
                container_id = sandbox.record.container_id
                await self._docker_or_502(self.docker.unpause(container_id, Work.CLIENT))
            elif sandbox.state == SandboxState.HIBERNATED:
                await self._restore_locked(sandbox)
            sandbox.frozen_at = None
            sandbox.record.pool = grant.pool
            sandbox.record.lease_id = grant.lease_id
            sandbox.record.idempotency_key = grant.idempotency_key
            sandbox.record.owner = grant.owner
            sandbox.record.labels = dict(grant.labels)
            await self.store.put(sandbox.record)
            sandbox.move(SandboxState.LEASED)
            sandbox.last_active = self.clock.now()
            return sandbox

    async def pause(self, sandbox_id: str) -> Sandbox:
        sandbox = self.get(sandbox_id)
        async with sandbox.lock:
            target = PAUSED_FROM.get(sandbox.state)
            if target is None:
                return sandbox  # already frozen: pausing is idempotent
            if sandbox.running_execs:
                raise ApiError(409, "busy", f"sandbox {sandbox_id} is running a command")
            await self._docker_or_502(self.docker.pause(sandbox.record.container_id))
            sandbox.move(target)
            sandbox.frozen_at = self.clock.now()
            return sandbox

    async def hibernate(self, sandbox_id: str) -> Sandbox:
        """Keep a frozen sandbox's files (image + work dir archive) and free its memory."""
        sandbox = self.get(sandbox_id)
        async with sandbox.lock:
            if sandbox.state == SandboxState.HIBERNATED:
                return sandbox
            if sandbox.state not in HIBERNATED_FROM:
                raise ApiError(
                    409, "not_paused", f"only a paused sandbox hibernates ({sandbox.state})"
                )
            record, spec = sandbox.record, sandbox.spec
            cid = record.container_id
            await self._docker_or_502(self.docker.unpause(cid, Work.FREEZE))  # tar runs inside
            try:
                archive = await self.docker.archive_dir(cid, spec.workdir, spec.workdir_mb << 20)
                image = await self.docker.commit(cid, HIBERNATED_REPOSITORY, sandbox_id)
            except DockerOpError as e:
                self._docker_failed(e)
                with contextlib.suppress(DockerOpError):
                    await self.docker.pause(cid)
                raise ApiError(502, f"docker_{e.kind}", str(e)) from e
            path = self.hibernated_dir / f"{sandbox_id}.tar"
            await asyncio.to_thread(_write_file, path, archive)
            await self._docker_or_502(self.docker.remove(cid, Work.FREEZE))
            record.container_id, record.hibernated_image = "", image
            record.archive_path = str(path)
            await self.store.put(record)
            sandbox.move(SandboxState.HIBERNATED)
            return sandbox

    async def _restore_locked(self, sandbox: Sandbox) -> None:
        record, spec = sandbox.record, sandbox.spec
        if not self.has_room_for(spec):
            raise ApiError(409, "no_capacity", f"no room to restore {record.id} on this node")
        assert record.hibernated_image and record.archive_path
        archive = await asyncio.to_thread(Path(record.archive_path).read_bytes)
        spec_from_snapshot = spec.model_copy(update={"image": record.hibernated_image})
        try:
            record.container_id = await self.docker.create(
                f"dsec-{record.id}",
                spec_from_snapshot,
                self.labels_for(record.id, record.pool, spec.name),
                Work.CLIENT,  # a lease waits for this restore
            )
            await self.docker.restore_dir(record.container_id, spec.workdir, archive)
        except DockerOpError as e:
            self._docker_failed(e)
            if record.container_id:
                with contextlib.suppress(DockerOpError):
                    await self.docker.remove(record.container_id, Work.CLIENT)
                record.container_id = ""
            raise ApiError(502, f"docker_{e.kind}", str(e)) from e
        await asyncio.to_thread(Path(record.archive_path).unlink, True)
        record.archive_path = None  # the image stays until the sandbox is destroyed

    async def unpause(self, sandbox_id: str) -> Sandbox:
        sandbox = self.get(sandbox_id)
        async with sandbox.lock:
            await self._thaw_locked(sandbox, Work.THAW)
            return sandbox

    async def _thaw_locked(self, sandbox: Sandbox, work: Work) -> None:
        target = THAWED_FROM.get(sandbox.state)
        if target is None:
            return
        await self._docker_or_502(self.docker.unpause(sandbox.record.container_id, work))
        sandbox.move(target)
        sandbox.frozen_at = None
        sandbox.last_active = self.clock.now()

    async def destroy(self, sandbox_id: str) -> float | None:
        """Remove a sandbox; idempotent (a second call finds it released). Returns the
        time it spent running commands, the last word on it for the control plane.

        The hot path only stops it: a kill, at once, so it uses no CPU or memory and its
        slot is free. Removing the container, its snapshot image and archive is the
        engine's last work (`Work.REMOVE`), done when nothing else waits; its label
        names this node, so an agent that restarts first removes it then (`adopt`)."""
        if sandbox_id in self.released:
            return None
        sandbox = self.get(sandbox_id)
        async with sandbox.lock:
            if sandbox_id not in self.sandboxes:
                return None  # removed while we waited for the lock
            frozen = sandbox.state in THAWED_FROM  # a frozen container takes no kill
            sandbox.move(SandboxState.DESTROYING)
            record = sandbox.record
            if record.container_id:
                stop = (
                    self.docker.remove(record.container_id, Work.CLIENT)
                    if frozen
                    else self.docker.kill(record.container_id)
                )
                await self._docker_or_502(stop)
            await self.store.delete(sandbox_id)
            self.sandboxes.pop(sandbox_id, None)
            self._remember_released(sandbox_id)
            self._remove_later(record, container_left=not frozen)
            return sandbox.busy_s

    def _remove_later(self, record: SandboxRecord, container_left: bool) -> None:
        """Remove what a destroyed sandbox leaves (its stopped container unless it is gone
        already, snapshot image, work dir archive) when the engine is quiet; shutdown
        waits for it."""

        async def remove() -> None:
            try:
                if record.container_id and container_left:
                    await self.docker.remove(record.container_id)
                if record.hibernated_image:
                    await self.docker.remove_image(record.hibernated_image)
            except DockerOpError as e:  # the container is labelled: adoption removes it
                self._docker_failed(e)
                log.warning("removing what %s left failed: %s", record.id, e)
            if record.archive_path:
                await asyncio.to_thread(Path(record.archive_path).unlink, True)

        task = asyncio.ensure_future(remove())
        self.operations.add(task)
        task.add_done_callback(self.operations.discard)

    # --- recycling ----------------------------------------------------------------

    async def reset(self, sandbox_id: str, req: ResetSandbox) -> Sandbox:
        """Recycle a released sandbox (agent/reset.py): end lease `req.lease_id`, kill
        every process but PID 1 and the template's command, empty the work dir, /tmp and
        /dev/shm, check, and make it warm again. A retry of a reset that is done answers
        as it did. A reset that fails or does not check out removes the sandbox here (it
        is never handed out, even if the control plane never asks) and answers
        `reset_failed`: 409 when the sandbox is at fault, 502 when Docker is."""
        sandbox = self.get(sandbox_id)
        async with sandbox.lock:
            record = sandbox.record
            if sandbox.reset_from == req.lease_id and sandbox.state == SandboxState.WARM:
                return sandbox  # a retry
            if record.lease_id != req.lease_id or sandbox.state not in ASSIGNED:
                raise ApiError(
                    409, "lease_mismatch", f"sandbox {sandbox_id} is not leased to {req.lease_id}"
                )
            self._require_engine()
            # No command of the ending lease starts from here (exec looks again under the
            # lock). The store keeps the lease until the reset checks out: an agent that
            # restarts meanwhile adopts the sandbox as leased, and the control plane, whose
            # reset call failed, removes it.
            record.lease_id = None
            started = self.clock.now()
            try:
                await self._reset_locked(sandbox)
            except ApiError as e:
                code = "reset_failed"
                failure = ApiError(e.status, code, e.message if e.code == code else str(e))
            else:
                record.owner = record.idempotency_key = None
                record.labels = {}
                await self.store.put(record)
                sandbox.move(SandboxState.WARM)
                sandbox.reset_from = req.lease_id
                sandbox.last_active = self.clock.now()
                log.debug("reset %s in %.0f ms", sandbox_id, (sandbox.last_active - started) * 1e3)
                return sandbox
        log.warning("reset of %s failed, removing it: %s", sandbox_id, failure.message)
        with contextlib.suppress(ApiError):
            await self.destroy(sandbox_id)
        raise failure

    async def _reset_locked(self, sandbox: Sandbox) -> None:
        spec, cid = sandbox.spec, sandbox.record.container_id
        await self._thaw_locked(sandbox, Work.CLIENT)  # a frozen lease: LEASED again first
        dirs = reset_dirs(spec.workdir)
        for _ in range(RESET_ROUNDS):
            out = await self._reset_run(cid, reset_script(dirs), spec)
            # with no command of the ended lease under way, nothing can have started after
            # the check at the script's end: what it saw is what is left
            if not sandbox.running_execs:
                break
            # its commands were killed: their calls end now, and a round runs again (one
            # whose start raced the kill is killed by it)
            await self._execs_ended(sandbox, RESET_EXEC_WAIT_S)
        else:
            raise ApiError(409, "reset_failed", "commands of the ended lease are still running")
        killed, checked = split_reset_output(out)
        if problems := leftovers(checked, main_of(killed) or "?"):
            raise ApiError(409, "reset_failed", f"not clean after the reset: {'; '.join(problems)}")

    async def _reset_run(self, container_id: str, script: str, spec: TemplateSpec) -> str:
        try:
            code, out, err = await self.docker.run_as("reset", container_id, script, spec.user)
        except DockerOpError as e:
            self._docker_failed(e)
            # a container that stopped (its main command died) is the sandbox's fault
            status = 409 if e.kind in ("conflict", "not_found") else 502
            raise ApiError(status, "reset_failed", str(e)) from e
        text = out.decode("utf-8", "replace")
        if code != 0:
            said = (text + err.decode("utf-8", "replace")).strip()[-300:]
            raise ApiError(409, "reset_failed", f"reset exited with {code}: {said}")
        return text

    async def _execs_ended(self, sandbox: Sandbox, timeout_s: float) -> bool:
        deadline = self.clock.now() + timeout_s
        while sandbox.running_execs:
            if self.clock.now() >= deadline:
                return False
            await self.clock.sleep(0.01)
        return True

    def _remember_released(self, sandbox_id: str) -> None:
        self.released.add(sandbox_id)

    def _docker_failed(self, e: DockerOpError) -> None:
        self.metrics.docker_error(e.op, e.kind)
        if e.kind == "engine_unreachable":
            self.engine_ok = False  # the engine watch brings it back

    def _require_engine(self) -> None:
        if not self.engine_ok:
            raise ApiError(
                503,
                "docker_engine_down",
                f"the Docker engine of node {self.config.node_id} is not answering; "
                "this node takes no new work until it is back",
            )

    async def _docker_or_502(self, op) -> None:
        try:
            await op
        except DockerOpError as e:
            self._docker_failed(e)
            raise ApiError(502, f"docker_{e.kind}", str(e)) from e

    async def exec(
        self, sandbox_id: str, token: str | None, req: ExecRequest, peer: str | None = None
    ) -> ExecResult:
        sandbox = self.get(sandbox_id)
        lease_id = sandbox.record.lease_id
        if lease_id is None:
            raise ApiError(409, "not_leased", f"sandbox {sandbox_id} is not leased")
        expected = lease_token(self.config.agent_token, sandbox_id, lease_id)
        if token is None:
            raise ApiError(401, "unauthenticated", "missing Authorization: Bearer <lease token>")
        if not token_matches(token, [expected]):
            raise ApiError(403, "forbidden", f"this token does not hold the lease on {sandbox_id}")
        started = self.clock.now()
        cmd, cmd_truncated = quoted_cmd(req.cmd)
        record = AuditRecord(
            time=self.clock.wall(),
            node=self.config.node_id,
            sandbox=sandbox_id,
            lease_id=lease_id,
            pool=sandbox.record.pool,
            peer=peer,
            cmd=cmd,
            cmd_truncated=cmd_truncated,
            exit_code=None,
            duration_ms=0.0,
        )
        try:
            result = await self._run(sandbox, req, started, lease_id)
        except (ApiError, asyncio.CancelledError) as e:
            record.error = e.code if isinstance(e, ApiError) else "cancelled"
            record.duration_ms = (self.clock.now() - started) * 1000
            # shielded: a client that hung up still leaves its record
            await asyncio.shield(self._audit(record))
            raise
        record.exit_code, record.timed_out = result.exit_code, result.timed_out
        record.duration_ms, record.truncated = result.duration_ms, result.truncated
        record.stdout_bytes = len(result.stdout.encode())
        record.stderr_bytes = len(result.stderr.encode())
        await self._audit(record)
        return result

    async def _run(
        self, sandbox: Sandbox, req: ExecRequest, started: float, lease_id: str
    ) -> ExecResult:
        sandbox_id = sandbox.record.id
        async with sandbox.lock:  # a frozen lease is thawed before the command runs
            if sandbox.record.lease_id != lease_id:  # released (or recycled) meanwhile
                raise ApiError(410, "released", f"the lease on {sandbox_id} has ended")
            await self._thaw_locked(sandbox, Work.CLIENT)
            sandbox.running_execs += 1
        try:
            out = await self.docker.exec(
                sandbox.record.container_id,
                req.cmd,
                req.env,
                req.workdir,
                req.timeout_s,
                req.max_output_bytes,
            )
        except DockerOpError as e:
            self._docker_failed(e)
            if sandbox_id not in self.sandboxes:
                raise ApiError(410, "released", f"sandbox {sandbox_id} was released") from e
            if await self._stopped(sandbox):
                raise _exited(sandbox_id) from e
            raise ApiError(502, f"docker_{e.kind}", str(e)) from e
        finally:
            sandbox.running_execs -= 1
            ended = self.clock.now()
            sandbox.busy_s += ended - started
            sandbox.last_active = ended
            self.metrics.exec_seconds.labels(self.config.node_id).observe(ended - started)
        # A container that stopped between the exec's create and start: runc exits 126
        # and says so, before Docker's own view of the container has caught up.
        if out.exit_code == 126 and (RUNC_STOPPED in out.stdout or await self._stopped(sandbox)):
            raise _exited(sandbox_id)
        return ExecResult(
            exit_code=out.exit_code,
            stdout=out.stdout.decode("utf-8", "replace"),
            stderr=out.stderr.decode("utf-8", "replace"),
            timed_out=out.timed_out,
            truncated=out.truncated,
            duration_ms=(self.clock.now() - started) * 1000,
        )

    async def _stopped(self, sandbox: Sandbox) -> bool:
        try:
            return not await self.docker.running(sandbox.record.container_id)
        except DockerOpError as e:
            self._docker_failed(e)
            return False  # cannot tell: the command's own result is the answer

    async def _audit(self, record: AuditRecord) -> None:
        """Append to the audit log; a failure to write is counted and logged, and the
        command's result still goes back (it ran: hiding its outcome helps no one)."""
        try:
            await self.audit.append(record)
        except OSError as e:
            self.metrics.audit_failures.labels(self.config.node_id).inc()
            log.error("audit record for %s not written: %s", record.sandbox, e)

    # --- start-up and background work -----------------------------------------

    async def adopt(self) -> None:
        """Take back this node's containers after a restart; remove what is unaccounted for."""
        records = {r.id: r for r in await self.store.all()}
        containers = await self.docker.list_labelled(self.config.node_id)
        for c in containers:
            sandbox_id = c.labels.get(LABEL_SANDBOX, "")
            record = records.pop(sandbox_id, None)
            if record is None or not c.alive:
                # no record, or its processes died with the engine: nothing to hand back
                log.info("removing unaccounted container %s (%s)", c.container_id[:12], c.status)
                await self.docker.remove(c.container_id)
                if record is not None:
                    await self.store.delete(record.id)
                continue
            state = SandboxState.LEASED if record.lease_id else SandboxState.WARM
            if c.status == "paused":
                state = SandboxState.LEASED_PAUSED if record.lease_id else SandboxState.PAUSED
            spec = TemplateSpec.model_validate(record.template)
            self.sandboxes[record.id] = Sandbox(record, spec, state, self.clock.now())
            log.info("adopted %s as %s", record.id, state)
        images = set(await self.docker.image_tags())
        for record in records.values():
            if record.hibernated_image in images and record.archive_path:
                spec = TemplateSpec.model_validate(record.template)
                sandbox = Sandbox(record, spec, SandboxState.HIBERNATED, self.clock.now())
                sandbox.frozen_at = self.clock.now()
                self.sandboxes[record.id] = sandbox
                continue
            await self.store.delete(record.id)  # recorded, but its container is gone

    async def watch_engine_forever(self) -> None:
        while True:
            await self.clock.sleep(self.config.engine_check_s)
            await self.check_engine()

    async def check_engine(self) -> None:
        """Ping the engine. When it answers again after an outage, reconcile first: an
        engine that restarted has stopped every container (there is no live restore)."""
        try:
            await asyncio.wait_for(self.docker.ping(), self.config.engine_check_timeout_s)
            if not self.engine_ok:
                await self.reconcile()
                log.info("the Docker engine is back; node %s takes work again", self.config.node_id)
            self.engine_ok = True
        except TimeoutError:
            self.engine_ok = False
        except DockerOpError as e:
            self._docker_failed(e)
            self.engine_ok = False

    async def reconcile(self) -> None:
        """Drop the sandboxes whose containers are no longer running (a paused one still
        counts as running). Their clients learn it from the control plane (a lease reported
        lost) and from this agent (410 sandbox_lost), and the pool refills without them.
        Each is looked at under its lock, so a create or restore that ends meanwhile is
        seen as it is, not as a list taken before it."""
        for sandbox in list(self.sandboxes.values()):
            async with sandbox.lock:
                if self.sandboxes.get(sandbox.record.id) is not sandbox or sandbox.state in (
                    SandboxState.CREATING,  # its create call is still in Docker's hands
                    SandboxState.HIBERNATED,  # no container: its image and archive survive
                    SandboxState.DESTROYING,
                ):
                    continue
                if await self.docker.running(sandbox.record.container_id):
                    continue
                log.warning("sandbox %s died with the Docker engine", sandbox.record.id)
                sandbox.move(SandboxState.DESTROYING)
                await self.docker.remove(sandbox.record.container_id, Work.FREEZE)
                await self.store.delete(sandbox.record.id)
                del self.sandboxes[sandbox.record.id]
                self.lost.add(
                    sandbox.record.id,
                    "was lost: its container stopped when the node's Docker engine restarted; "
                    "release it and acquire another",
                )

    async def refresh_images_forever(self) -> None:
        """The images this node holds, for placement; apart from the heartbeat, so a
        Docker engine busy with creates never delays a heartbeat."""
        while True:
            await self.clock.sleep(self.config.images_refresh_s)
            await self.refresh_images()

    async def refresh_images(self) -> None:
        try:
            self.images = await self.docker.image_tags()
        except DockerOpError as e:
            self._docker_failed(e)

    async def heartbeat_forever(self) -> None:
        assert self.config.controlplane_url
        url = f"{self.config.controlplane_url}/v1/agents/{self.config.node_id}"
        headers = {
            "Authorization": f"Bearer {self.config.agent_token}",
            "Content-Type": "application/json",
        }
        await self.listening.wait()  # the report must carry the address clients will use
        async with aiohttp.ClientSession(
            headers=headers, timeout=aiohttp.ClientTimeout(total=5)
        ) as http:
            while True:
                self.metrics.sandboxes.labels(self.config.node_id).set(len(self.sandboxes))
                self.metrics.observe_engine(self.docker.engine)
                try:
                    async with http.put(url, data=self.report().model_dump_json()) as resp:
                        if resp.status >= 300:
                            self.metrics.heartbeat_failures.labels(self.config.node_id).inc()
                            log.warning("heartbeat refused: %s %s", resp.status, await resp.text())
                except (aiohttp.ClientError, TimeoutError) as e:
                    self.metrics.heartbeat_failures.labels(self.config.node_id).inc()
                    log.warning("heartbeat to %s failed: %s", url, e)
                await self.clock.sleep(self.config.heartbeat_s)

    async def remove_all(self) -> None:
        for sandbox_id in list(self.sandboxes):
            with contextlib.suppress(ApiError):
                await self.destroy(sandbox_id)
        await self.settle()  # the removals destroy leaves for a quiet engine

    async def settle(self) -> None:
        """Wait for every operation under way, and for what those start in turn."""
        while self.operations:
            await asyncio.gather(*list(self.operations), return_exceptions=True)


def _exited(sandbox_id: str) -> ApiError:
    return ApiError(
        409,
        "sandbox_exited",
        f"sandbox {sandbox_id} is no longer running (its main process exited, for example "
        "because PID 1 was signalled); release it and acquire another",
    )


AGENT = web.AppKey("agent", Agent)


def _agent(request: web.Request) -> Agent:
    return request.app[AGENT]


def _control_plane_only(request: web.Request) -> Agent:
    agent = _agent(request)
    require_token(request, [agent.config.agent_token])
    return agent


async def create_sandbox(request: web.Request) -> web.Response:
    agent = _control_plane_only(request)
    req = await read_model(request, CreateSandbox)
    sandbox, created = await agent.to_completion(agent.create(req))
    return model_response(sandbox.report(agent.clock.now()), 201 if created else 200)


async def lease_sandbox(request: web.Request) -> web.Response:
    agent = _control_plane_only(request)
    sandbox_id = sandbox_id_param(request)
    grant = await read_model(request, LeaseGrant)
    sandbox = await agent.to_completion(agent.lease(sandbox_id, grant))
    return model_response(sandbox.report(agent.clock.now()))


async def pause_sandbox(request: web.Request) -> web.Response:
    agent = _control_plane_only(request)
    sandbox = await agent.to_completion(agent.pause(sandbox_id_param(request)))
    return model_response(sandbox.report(agent.clock.now()))


async def hibernate_sandbox(request: web.Request) -> web.Response:
    agent = _control_plane_only(request)
    sandbox = await agent.to_completion(agent.hibernate(sandbox_id_param(request)))
    return model_response(sandbox.report(agent.clock.now()))


async def unpause_sandbox(request: web.Request) -> web.Response:
    agent = _control_plane_only(request)
    sandbox = await agent.to_completion(agent.unpause(sandbox_id_param(request)))
    return model_response(sandbox.report(agent.clock.now()))


async def reset_sandbox(request: web.Request) -> web.Response:
    agent = _control_plane_only(request)
    sandbox_id = sandbox_id_param(request)
    req = await read_model(request, ResetSandbox)
    sandbox = await agent.to_completion(agent.reset(sandbox_id, req))
    return model_response(sandbox.report(agent.clock.now()))


async def destroy_sandbox(request: web.Request) -> web.Response:
    agent = _control_plane_only(request)
    sandbox_id = sandbox_id_param(request)
    busy_s = await agent.to_completion(agent.destroy(sandbox_id))
    return model_response(Released(id=sandbox_id, state=SandboxState.GONE, busy_s=busy_s))


async def get_sandbox(request: web.Request) -> web.Response:
    agent = _control_plane_only(request)
    return model_response(agent.get(sandbox_id_param(request)).report(agent.clock.now()))


async def get_node(request: web.Request) -> web.Response:
    agent = _control_plane_only(request)
    return model_response(agent.report())


async def exec_in_sandbox(request: web.Request) -> web.Response:
    agent = _agent(request)
    sandbox_id = sandbox_id_param(request)
    req = await read_model(request, ExecRequest)
    result = await agent.exec(sandbox_id, bearer_token(request), req, request.remote)
    return model_response(result)


async def read_audit(request: web.Request) -> web.Response:
    agent = _control_plane_only(request)
    sandbox_id = request.query.get("sandbox")
    if sandbox_id is not None and not SANDBOX_ID_RE.match(sandbox_id):
        raise ApiError(400, "invalid_sandbox_id", f"not a sandbox id: {sandbox_id!r}")
    raw_limit = request.query.get("limit", str(AUDIT_READ_LIMIT))
    if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= AUDIT_READ_LIMIT:
        raise ApiError(400, "invalid_limit", f"limit must be 1 to {AUDIT_READ_LIMIT}")
    records = await agent.audit.read(sandbox_id, int(raw_limit))
    return model_response(AuditRecords(records=records))


async def healthz(request: web.Request) -> web.Response:
    agent = _agent(request)
    return web.json_response(
        {"status": "ok", "node": agent.config.node_id, "sandboxes": len(agent.sandboxes)}
    )


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(_agent(request).metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def agent_api() -> Api:
    api = Api("dsec agent")
    api.route(
        "POST",
        "/v1/sandboxes",
        create_sandbox,
        body=CreateSandbox,
        answer=SandboxReport,
        summary="create and start a sandbox (control plane only); idempotent on its id",
    )
    api.route(
        "GET",
        "/v1/sandboxes/{sandbox_id}",
        get_sandbox,
        answer=SandboxReport,
        summary="one sandbox (control plane only)",
    )
    api.route(
        "DELETE",
        "/v1/sandboxes/{sandbox_id}",
        destroy_sandbox,
        answer=Released,
        summary="remove a sandbox (control plane only); idempotent",
    )
    api.route(
        "POST",
        "/v1/sandboxes/{sandbox_id}/lease",
        lease_sandbox,
        body=LeaseGrant,
        answer=SandboxReport,
        summary="hand a sandbox to a lease (control plane only)",
    )
    api.route(
        "POST",
        "/v1/sandboxes/{sandbox_id}/pause",
        pause_sandbox,
        answer=SandboxReport,
        summary="freeze a sandbox (control plane only)",
    )
    api.route(
        "POST",
        "/v1/sandboxes/{sandbox_id}/hibernate",
        hibernate_sandbox,
        answer=SandboxReport,
        summary="keep a paused sandbox's files, release its memory (control plane only)",
    )
    api.route(
        "POST",
        "/v1/sandboxes/{sandbox_id}/unpause",
        unpause_sandbox,
        answer=SandboxReport,
        summary="thaw a sandbox (control plane only)",
    )
    api.route(
        "POST",
        "/v1/sandboxes/{sandbox_id}/reset",
        reset_sandbox,
        body=ResetSandbox,
        answer=SandboxReport,
        summary="recycle a released sandbox: end its lease, kill its processes, empty its "
        "work dir, /tmp and /dev/shm, check, make it warm (control plane only); a failed "
        "reset removes it",
    )
    api.route(
        "POST",
        "/v1/sandboxes/{sandbox_id}/exec",
        exec_in_sandbox,
        body=ExecRequest,
        answer=ExecResult,
        summary="run a command (lease token)",
    )
    api.route("GET", "/v1/node", get_node, answer=NodeReport, summary="this node's report")
    api.route(
        "GET",
        "/v1/audit",
        read_audit,
        answer=AuditRecords,
        summary="the last commands run on this node (?sandbox=, ?limit=; control plane only)",
    )
    api.route("GET", "/healthz", healthz, summary="liveness")
    api.route("GET", "/metrics", metrics, summary="Prometheus metrics")
    return api


def create_agent_app(agent: Agent) -> web.Application:
    app = new_app(agent_api())
    app[AGENT] = agent

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        await agent.adopt()
        await agent.refresh_images()  # the first heartbeat already says what it holds
        loops = [
            asyncio.create_task(agent.refresh_images_forever(), name="images"),
            asyncio.create_task(agent.watch_engine_forever(), name="engine"),
        ]
        if agent.config.controlplane_url:
            loops.append(asyncio.create_task(agent.heartbeat_forever(), name="heartbeat"))
        yield
        for task in loops:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        # the control plane's requests cut short by the shutdown finish first
        await agent.settle()
        if agent.config.cleanup_on_exit:
            await agent.remove_all()
        await agent.store.close()
        await agent.audit.close()
        agent.docker.close()

    app.cleanup_ctx.append(lifecycle)
    return app
