"""The launcher agent: one per node, the source of truth for what runs there.

`Agent` holds the node's sandboxes and carries out the control plane's lifecycle calls:
create, lease, pause, hibernate, thaw, destroy and reset. Commands run through
agent/execs.py, files through agent/files.py; adoption, the engine watch and the
heartbeat are in agent/runtime.py, the HTTP routes in agent/app.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import io
import logging
import re
import secrets
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from agent.audit import AuditLog, AuditRecord, RefusalRecord
from agent.config import AgentConfig
from agent.docker_driver import (
    LABEL_LEASE,
    LABEL_NODE,
    LABEL_POOL,
    LABEL_SANDBOX,
    LABEL_TEMPLATE,
    AsyncDocker,
    DockerOpError,
)
from agent.engine import EngineWideCreates, Work
from agent.execs import Execs
from agent.files import Files
from agent.host import LoopProcess, Unavailable, booted_loop, reset_from_host
from agent.metrics import AgentMetrics
from agent.reset import leftovers, main_of, reset_dirs, reset_script, split_reset_output
from agent.resident import BOOTED, NO_COMMAND, Resident
from agent.sandboxes import Sandbox
from agent.snapshots import Snapshots
from agent.store import SandboxRecord, SandboxStore
from dsec.clock import Clock
from dsec.httpkit import ApiError, CredentialRefused
from dsec.models import (
    LOST_CAUSES,
    MAX_NODE_SANDBOXES,
    CreateSandbox,
    ExecRequest,
    LeaseEnd,
    LeaseGrant,
    NodeIdentity,
    NodeLostCause,
    ResetSandbox,
    TemplateSpec,
    Usage,
    node_of,
)
from dsec.policy import Resources
from dsec.recent import TOMBSTONES, RecentMap
from dsec.statedir import private_dir, restrict, write_private
from dsec.states import (
    ASSIGNED,
    HIBERNATED_FROM,
    PAUSED_FROM,
    THAWED_FROM,
    SandboxState,
)
from dsec.tls import client_ssl
from dsec.tokens import LeaseClaim

log = logging.getLogger(__name__)
T = TypeVar("T")
HIBERNATED_REPOSITORY = "dsec-hibernated"
RESET_ROUNDS = 3  # kills a reset tries before it gives up on commands that keep running
RESET_EXEC_WAIT_S = 2.0  # how long a round waits for the killed commands' calls to end
REMOVE_ALL_ROUNDS = 3  # looks at what is left when the agent stops
# A stopping agent waits at most this long for the operations under way, and as long
# again for its sandboxes' removals; then it removes whatever container of the node is
# left, whatever holds it (an engine call that never answers), within the grace its
# supervisor gives it before a SIGKILL (dsec.processes.STOP_GRACE_S).
SHUTDOWN_WAIT_S = 15.0
SETUP_OUTPUT_BYTES = 64 * 1024  # of each stream, in a failed setup's answer
RESET_TIMEOUT_S = 60.0  # a reset that takes longer is stuck: the sandbox goes


def _write_archive(path: Path, data: bytes) -> None:
    private_dir(path.parent)  # a sandbox's files: its tenant's and the operators' alone
    write_private(path, data)


@dataclass(frozen=True)
class LostSandbox:
    """A sandbox dropped because its container died under it (agent/runtime.py)."""

    cause: NodeLostCause
    at: float  # on the agent's clock

    def error(self, sandbox_id: str) -> ApiError:
        return ApiError(
            410,
            "sandbox_lost",
            f"sandbox {sandbox_id} was lost: {LOST_CAUSES[self.cause]}; release it and "
            "acquire another",
            [{"outcome": self.cause}],
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
        self.audit = AuditLog(
            config.state_dir / f"{config.node_id}-audit.jsonl",
            config.audit_max_bytes,
            config.audit_files,
        )
        self.sandboxes: dict[str, Sandbox] = {}
        # released ids remembered, so late calls get "released", not "unknown"
        # (and why: released, or its lease expired)
        self.released: RecentMap[str, LeaseEnd] = RecentMap(TOMBSTONES)
        self.stopping = False  # remove_all has begun: no create starts
        # sandboxes whose container died under them -> how, for their clients and reports
        self.lost: RecentMap[str, LostSandbox] = RecentMap(TOMBSTONES)
        self.engine_ok = True  # the engine answered its last check or call
        # how many times the engine has gone away: a container seen dead before one
        # died with the engine, not of its own (agent/runtime.py)
        self.engine_outages = 0
        self.images: list[str] = []
        self.engine_id = ""  # the engine's own id, once it has answered (runtime.py)
        self.url = ""  # set by listening_at() once the port is known
        self.listening = asyncio.Event()
        self.incarnation = secrets.token_hex(8)
        # its credentials, once it has joined its control plane (agent/runtime.py join)
        self.identity: NodeIdentity | None = None
        self.operations: set[asyncio.Task] = set()  # see to_completion()
        self.resident = Resident(config, docker, clock, self.docker_failed, self.operations)
        self.files = Files(docker, self.docker_failed)
        # forks' copies of this node's sandboxes, and the reading of others' (agent/snapshots.py)
        self.snapshots = Snapshots(
            config.state_dir / f"{config.node_id}-snapshots",
            config.node_id,
            self.files,
            clock,
            client_ssl(config.ca),
        )
        self.execs = Execs(
            leases=self,
            resident=self.resident,
            docker=docker,
            docker_failed=self.docker_failed,
            audit=self.audit_record,
            config=config,
            clock=clock,
            metrics=metrics,
        )
        self.uids = config.sandbox_uids

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

    def protect_state_dir(self) -> None:
        """The state dir 0700 and this node's files in it 0600 (the store's are the
        store's to open), also those an older agent left with looser modes: they hold
        what tenants ran and wrote."""
        private_dir(self.config.state_dir)
        self.audit.protect()
        if self.hibernated_dir.is_dir():
            restrict(self.hibernated_dir, *self.hibernated_dir.iterdir())

    def listening_at(self, url: str) -> None:
        self.url = url
        self.listening.set()

    # --- capacity -----------------------------------------------------------

    def share_engine_bound(self) -> None:
        """Bound creates with every agent of this state dir on the same engine (the
        agents of `dsec up`), by the engine's id: agent/engine.py EngineWideCreates."""
        if self.engine_id:
            name = re.sub(r"[^A-Za-z0-9-]", "-", self.engine_id)[:80]
            directory = self.config.state_dir / f"engine-{name}-creates"
            self.docker.engine_wide = EngineWideCreates(directory)

    def usage(self) -> Usage:
        live = [s for s in self.sandboxes.values() if s.occupies]
        return Usage(
            cpus=round(sum(s.spec.cpus for s in live), 6),
            memory_mb=sum(s.spec.memory_limit_mb for s in live),
            slots=len(live),
        )

    def has_room_for(self, spec: TemplateSpec) -> bool:
        if len(self.sandboxes) >= MAX_NODE_SANDBOXES:  # hibernated ones too: each is reported
            return False
        used, cap = self.usage(), self.config.capacity
        needs = Resources(spec.cpus, spec.memory_limit_mb, 1)
        after = Resources(used.cpus, used.memory_mb, used.slots) + needs
        return after.fits_in(Resources(cap.cpus, cap.memory_mb, cap.slots))

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
        if self.stopping:
            raise ApiError(503, "node_stopping", f"node {self.config.node_id} is stopping")
        work = Work.CREATE_FOR_REQUEST if req.for_request else Work.CREATE_WARM
        self.require_engine()
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
            user=self.uids.user_for(req.template.user, (s.user for s in self.sandboxes.values())),
        )
        sandbox = Sandbox(record, req.template, SandboxState.CREATING, self.clock.now())
        self.sandboxes[req.sandbox_id] = sandbox  # holds the slot while Docker works
        try:
            booted = await self.make_container(sandbox, req.template, work)
            if self.sandboxes.get(req.sandbox_id) is not sandbox:
                # removed while Docker made it (a shutdown's remove_all): so is its container
                with contextlib.suppress(DockerOpError):
                    await self.docker.remove(record.container_id, Work.CLIENT)
                self.resident.remove(req.sandbox_id)
                raise ApiError(409, "released", f"sandbox {req.sandbox_id} was removed")
            await self.store.put(record)
        except DockerOpError as e:
            self.sandboxes.pop(req.sandbox_id, None)
            self.resident.remove(req.sandbox_id)
            self.docker_failed(e)
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
        self.loop_started_with(sandbox, booted)
        return sandbox, True

    async def make_container(self, sandbox: Sandbox, spec: TemplateSpec, work: Work) -> bool:
        """Create and start the sandbox's container from `spec` (its template, or a
        snapshot's image for a restore) into its record; True when the container
        started its command loop itself (agent/resident.py). A template command the
        image lacks is the engine's start_failed, as when the engine looks for it."""
        record = sandbox.record
        sandbox.loop = None  # a new container: a loop a reset keeps is one of its own
        resident_dir = self.resident.prepare(sandbox)  # a few small local writes
        entrypoint = await self.resident.entrypoint(sandbox) if resident_dir else None
        if entrypoint is None and resident_dir is not None:  # a loop needs its boot
            self.resident.remove(record.id)
            resident_dir = None
        labels = self.labels_for(record.id, record.pool, sandbox.spec.name)
        create = functools.partial(
            self.docker.create,
            f"dsec-{record.id}",
            spec,
            labels,
            work,
            resident_dir,
            entrypoint,
            user=sandbox.user,
        )
        if entrypoint is None:
            record.container_id = await create()
            return False
        async with self.resident.boot_heard(record.id) as boot:
            record.container_id = await create()
            said = await boot.said()
        if said == NO_COMMAND:
            raise DockerOpError(
                "create",
                "start_failed",
                f"the template's command {spec.command[0]!r} is not in image {spec.image} "
                "(not in its PATH, or not executable by its user)",
            )
        if said != BOOTED:
            log.warning("sandbox %s: its container's boot said %r: loop by exec", record.id, said)
            return False
        if spec.recyclable:
            # a reset keeps the loop it knows (agent/host.py), and so saves the next
            # lease an engine exec to start it again: this one, found from the host
            sandbox.loop = await self._booted_loop(sandbox)
        return True

    async def _booted_loop(self, sandbox: Sandbox) -> LoopProcess | None:
        shell = self.resident.node_shell()
        try:
            init = await sandbox.container_init(self.docker)
        except DockerOpError as e:
            self.docker_failed(e)
            return None
        if shell is None or init is None:
            return None
        return booted_loop(init, sandbox.record.container_id, shell)

    def loop_started_with(self, sandbox: Sandbox, booted: bool) -> None:
        """A new container's loop: started with it, or by an engine exec from here on."""
        if booted:
            sandbox.resident_tried_at = self.clock.now()
        else:
            sandbox.resident_tried_at = None
            self.resident.ensure_loop(sandbox)

    def get(self, sandbox_id: str) -> Sandbox:
        sandbox = self.sandboxes.get(sandbox_id)
        if sandbox is None:
            if (lost := self.lost.get(sandbox_id)) is not None:
                raise lost.error(sandbox_id)
            if (ended := self.released.get(sandbox_id)) is not None:
                what = "its lease expired" if ended == "lease_expired" else "it was released"
                raise ApiError(410, ended, f"sandbox {sandbox_id} is gone: {what}")
            raise ApiError(404, "unknown_sandbox", f"no sandbox {sandbox_id} on this node")
        if sandbox.state == SandboxState.CREATING:
            raise ApiError(409, "not_ready", f"sandbox {sandbox_id} is still being created")
        return sandbox

    async def lease(self, sandbox_id: str, grant: LeaseGrant) -> Sandbox:
        """Hand `sandbox_id` to the lease `grant` makes, and apply the grant's claim (its
        files, then its setup) before answering: a claim that cannot be applied removes
        the sandbox and answers 422 setup_failed."""
        sandbox = self.get(sandbox_id)
        async with sandbox.lock:
            record = sandbox.record
            if record.lease_id == grant.lease_id:
                # a retry of the same grant, or the lease was taken up from its token first
                granted = (grant.pool, grant.idempotency_key, grant.labels, grant.grant_proof)
                if (record.pool, record.idempotency_key, record.labels, record.grant_proof) != (
                    granted
                ):
                    record.pool, record.idempotency_key = grant.pool, grant.idempotency_key
                    record.labels = dict(grant.labels)
                    record.grant_proof = grant.grant_proof
                    await self.store.put(record)
                applying = sandbox.claim_applied
            else:
                applying = await self._lease_locked(sandbox, grant)
        self.resident.hurry(sandbox)  # (out of the lock, which its loop's start must not find)
        if applying is not None:  # a retry waits for the first call's files and setup
            await asyncio.shield(applying)
        return sandbox

    async def _lease_locked(self, sandbox: Sandbox, grant: LeaseGrant) -> asyncio.Task | None:
        """The lease taken up; its claim being applied, if it makes one."""
        sandbox_id = sandbox.id
        # while the engine is away its containers may be dead: hand none out
        self.require_engine()
        # (leased with no lease id: a reset ended its lease, and failed: it goes)
        if sandbox.record.lease_id is not None or sandbox.state in ASSIGNED:
            raise ApiError(409, "already_leased", f"sandbox {sandbox_id} is leased already")
        if sandbox.state == SandboxState.PAUSED:
            container_id = sandbox.record.container_id
            await self.docker_or_502(self.docker.unpause(container_id, Work.CLIENT))
        elif sandbox.state == SandboxState.HIBERNATED:
            await self._restore_locked(sandbox)
        sandbox.frozen_at = None
        sandbox.record.pool = grant.pool
        sandbox.record.lease_id = grant.lease_id
        sandbox.record.idempotency_key = grant.idempotency_key
        sandbox.record.owner = grant.owner
        sandbox.record.labels = dict(grant.labels)
        sandbox.record.grant_proof = grant.grant_proof
        sandbox.record.lease_env = dict(grant.env)
        await self.store.put(sandbox.record)
        sandbox.move(SandboxState.LEASED)
        sandbox.last_active = self.clock.now()
        if not (grant.files_tar or grant.setup or grant.fork_from):
            return None
        # (a task of its own: the lock is left for the setup's command to take)
        sandbox.claim_applied = asyncio.ensure_future(self._apply_claim(sandbox, grant))
        return sandbox.claim_applied

    async def _apply_claim(self, sandbox: Sandbox, grant: LeaseGrant) -> None:
        """The claim's files, then its setup command; if either fails, the sandbox goes
        and the failure is 422 setup_failed (with the setup's result as its details)."""
        try:
            if grant.fork_from:
                await self.snapshots.copy_into(sandbox, grant.fork_from)
            if grant.files_tar:
                archive = io.BytesIO(grant.files_tar)
                await self.files.unpack_file(sandbox, sandbox.spec.workdir, archive)
            if grant.setup:
                req = ExecRequest(
                    cmd=grant.setup,
                    timeout_s=grant.setup_timeout_s,
                    max_output_bytes=SETUP_OUTPUT_BYTES,
                )
                result = await self.execs.setup(sandbox, grant.lease_id, req)
                if result.exit_code != 0:
                    how = "timed out" if result.timed_out else f"exited {result.exit_code}"
                    found = {"sandbox": sandbox.id, **result.model_dump()}
                    raise ApiError(422, "setup_failed", f"its setup command {how}", [found])
        except ApiError as e:
            log.info("claim on %s failed, removing it: %s", sandbox.id, e.message)
            with contextlib.suppress(ApiError):
                await self.destroy(sandbox.id)
            if e.code == "setup_failed":
                raise
            message = f"its files were not written: {e.message}"
            raise ApiError(422, "setup_failed", message, [{"sandbox": sandbox.id}]) from e

    def adoption_refused(self, sandbox: Sandbox, claim: LeaseClaim | None) -> ApiError | None:
        """Why a lease token's own claim (None: the token proves no lease here) may not
        take up `sandbox`, which holds no lease; None if it may. Only a warm sandbox is
        taken up, and never for a lease it had before (recycled since) or a lapsed one.
        Its grant may still be on its way, so "not leased" is said only to a token that
        proves a lease here."""
        if claim is None:
            return CredentialRefused(
                403, "forbidden", f"this token does not hold a lease on {sandbox.id}"
            )
        if claim.lease_id in sandbox.record.ended_leases:
            return ApiError(410, "released", f"the lease on {sandbox.id} has ended")
        if claim.expires_at <= self.clock.wall():
            return ApiError(410, "lease_expired", f"the lease on {sandbox.id} has expired")
        if sandbox.state != SandboxState.WARM or sandbox.record.lease_id is not None:
            return ApiError(
                409, "not_leased", f"sandbox {sandbox.id} is {sandbox.state}, not leased"
            )
        return None

    async def adopt(self, sandbox: Sandbox, claim: LeaseClaim) -> None:
        """Take up the lease a token proves (Execs.hold) before the control plane's grant
        for it arrives: the control plane answers a warm acquire without waiting for this
        node, so the client's first command may come first. The grant then finds the
        lease held and adds its pool, key and labels."""
        async with sandbox.lock:
            if sandbox.record.lease_id == claim.lease_id:
                return  # the grant, or another command, took it up meanwhile
            if self.adoption_refused(sandbox, claim) is not None:
                return  # the caller's authorize says why
            self.require_engine()
            sandbox.record.lease_id, sandbox.record.owner = claim.lease_id, claim.owner
            await self.store.put(sandbox.record)
            sandbox.move(SandboxState.LEASED)
            sandbox.last_active = self.clock.now()
        self.resident.hurry(sandbox)  # (out of the lock, which its loop's start must not find)

    async def pause(self, sandbox_id: str) -> Sandbox:
        sandbox = self.get(sandbox_id)
        async with sandbox.lock:
            target = PAUSED_FROM.get(sandbox.state)
            if target is None:
                return sandbox  # already frozen: pausing is idempotent
            if sandbox.running_execs:
                raise ApiError(409, "busy", f"sandbox {sandbox_id} is running a command")
            await sandbox.loop_started()
            await self.docker_or_502(self.docker.pause(sandbox.record.container_id))
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
            await self.docker_or_502(self.docker.unpause(cid, Work.FREEZE))  # tar runs inside
            try:
                archive = await self.docker.archive_dir(
                    cid, spec.workdir, spec.workdir_mb << 20, sandbox.user
                )
                image = await self.docker.commit(cid, HIBERNATED_REPOSITORY, sandbox_id)
            except DockerOpError as e:
                self.docker_failed(e)
                with contextlib.suppress(DockerOpError):
                    await self.docker.pause(cid)
                raise ApiError(502, f"docker_{e.kind}", str(e)) from e
            path = self.hibernated_dir / f"{sandbox_id}.tar"
            await asyncio.to_thread(_write_archive, path, archive)
            await self.docker_or_502(self.docker.remove(cid, Work.FREEZE))
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
            # a lease waits for this restore
            booted = await self.make_container(sandbox, spec_from_snapshot, Work.CLIENT)
            await self.docker.restore_dir(record.container_id, spec.workdir, archive, sandbox.user)
        except DockerOpError as e:
            self.docker_failed(e)
            if record.container_id:
                with contextlib.suppress(DockerOpError):
                    await self.docker.remove(record.container_id, Work.CLIENT)
                record.container_id = ""
            raise ApiError(502, f"docker_{e.kind}", str(e)) from e
        await asyncio.to_thread(Path(record.archive_path).unlink, True)
        record.archive_path = None  # the image stays until the sandbox is destroyed
        self.loop_started_with(sandbox, booted)

    async def unpause(self, sandbox_id: str) -> Sandbox:
        sandbox = self.get(sandbox_id)
        async with sandbox.lock:
            await self.thaw_locked(sandbox, Work.THAW)
            return sandbox

    async def thaw_locked(self, sandbox: Sandbox, work: Work) -> None:
        target = THAWED_FROM.get(sandbox.state)
        if target is None:
            return
        await self.docker_or_502(self.docker.unpause(sandbox.record.container_id, work))
        sandbox.move(target)
        sandbox.frozen_at = None
        sandbox.last_active = self.clock.now()

    async def destroy(self, sandbox_id: str, ended: LeaseEnd = "released") -> float | None:
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
                await self.docker_or_502(stop)
                self.resident.abort_all(sandbox_id)  # their processes went with the rest
            await self.store.delete(sandbox_id)
            self.sandboxes.pop(sandbox_id, None)
            self.released.add(sandbox_id, ended)
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
                self.docker_failed(e)
                log.warning("removing what %s left failed: %s", record.id, e)
            if record.archive_path:
                await asyncio.to_thread(Path(record.archive_path).unlink, True)
            await asyncio.to_thread(self.resident.remove, record.id)

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
            self.require_engine()
            # No command of the ending lease starts from here (exec looks again under the
            # lock). The store keeps the lease until the reset checks out: an agent that
            # restarts meanwhile adopts the sandbox as leased, and the control plane, whose
            # reset call failed, removes it.
            record.lease_id = None
            started = self.clock.now()
            try:
                path = await self._reset_locked(sandbox)
            except ApiError as e:
                code = "reset_failed"
                failure = ApiError(e.status, code, e.message if e.code == code else str(e))
            else:
                record.owner = record.idempotency_key = record.grant_proof = None
                record.labels, record.lease_env = {}, {}
                await self.store.put(record, ended=req.lease_id)
                sandbox.move(SandboxState.WARM)
                sandbox.reset_from = req.lease_id
                sandbox.last_active = self.clock.now()
                self.metrics.observe_reset(path, sandbox.last_active - started)
                # a loop kept (sandbox.loop) serves the next lease's commands as it is
                if sandbox.loop is None and path == "engine":
                    # the engine's reset, as the tenant's user, leaves the loop running
                    sandbox.resident_tried_at = started
                elif sandbox.loop is None:  # killed with the rest: started again, in time
                    sandbox.resident_tried_at = None
                    self.resident.ensure_loop(sandbox)
                return sandbox
        log.warning("reset of %s failed, removing it: %s", sandbox_id, failure.message)
        with contextlib.suppress(ApiError):
            await self.destroy(sandbox_id)
        raise failure

    async def _reset_locked(self, sandbox: Sandbox) -> str:
        """Reset from the host's side (agent/host.py), or where that cannot be reached,
        with one engine exec (agent/reset.py); which of the two did: "host" or "engine"."""
        await self.thaw_locked(sandbox, Work.CLIENT)  # a frozen lease: LEASED again first
        await sandbox.loop_started()
        dirs = reset_dirs(sandbox.spec.workdir)
        for _ in range(RESET_ROUNDS):
            path, problems = await self._reset_once(sandbox, dirs)
            self.resident.abort_all(sandbox.id)  # the reset killed their processes
            # with no command of the ended lease under way, nothing can have started after
            # the check at the reset's end: what it saw is what is left
            if not sandbox.running_execs:
                break
            # its commands were killed: their calls end now, and a round runs again (one
            # whose start raced the kill is killed by it)
            await self._execs_ended(sandbox, RESET_EXEC_WAIT_S)
        else:
            raise ApiError(409, "reset_failed", "commands of the ended lease are still running")
        if problems:
            raise ApiError(409, "reset_failed", f"not clean after the reset: {'; '.join(problems)}")
        return path

    async def _reset_once(self, sandbox: Sandbox, dirs: list[str]) -> tuple[str, list[str]]:
        """One round: which way it went, and what it found left. Keeps `sandbox.loop`
        only where the loop outlived it unchanged."""
        container_id = sandbox.record.container_id
        loop, sandbox.loop = sandbox.loop, None
        try:
            pid = await sandbox.container_init(self.docker)
        except DockerOpError as e:
            raise self._reset_docker_failed(e) from e
        if pid is None:
            raise ApiError(409, "reset_failed", "its container is not running")
        try:
            async with asyncio.timeout(RESET_TIMEOUT_S):
                done = await reset_from_host(
                    pid, container_id, dirs, loop, self.resident.node_shell()
                )
            if done.kept_loop:
                sandbox.loop = loop
            return "host", done.problems
        except Unavailable as e:
            log.debug("reset of %s through the engine: %s", container_id[:12], e)
        except TimeoutError as e:
            raise ApiError(
                409, "reset_failed", f"reset still running after {RESET_TIMEOUT_S} s"
            ) from e
        out = await self._reset_run(container_id, reset_script(dirs), sandbox.user)
        killed, checked = split_reset_output(out)
        return "engine", leftovers(checked, main_of(killed) or "?")

    async def _reset_run(self, container_id: str, script: str, user: str) -> str:
        try:
            async with asyncio.timeout(RESET_TIMEOUT_S):
                code, out, err = await self.docker.run(
                    "reset", container_id, ["sh", "-c", script], user=user
                )
        except TimeoutError as e:
            raise ApiError(
                409, "reset_failed", f"reset still running after {RESET_TIMEOUT_S} s"
            ) from e
        except DockerOpError as e:
            raise self._reset_docker_failed(e) from e
        text = out.decode("utf-8", "replace")
        if code != 0:
            said = (text + err.decode("utf-8", "replace")).strip()[-300:]
            raise ApiError(409, "reset_failed", f"reset exited with {code}: {said}")
        return text

    def _reset_docker_failed(self, e: DockerOpError) -> ApiError:
        self.docker_failed(e)
        # a container that stopped (its main command died) is the sandbox's fault
        status = 409 if e.kind in ("conflict", "not_found") else 502
        return ApiError(status, "reset_failed", str(e))

    async def _execs_ended(self, sandbox: Sandbox, timeout_s: float) -> bool:
        deadline = self.clock.now() + timeout_s
        while sandbox.running_execs:
            if self.clock.now() >= deadline:
                return False
            await self.clock.sleep(0.01)
        return True

    def docker_failed(self, e: DockerOpError) -> None:
        self.metrics.docker_error(e.op, e.kind)
        if e.kind == "engine_unreachable":
            self.engine_away()  # the engine watch brings it back

    def engine_away(self) -> None:
        if self.engine_ok:
            self.engine_outages += 1
        self.engine_ok = False

    def require_engine(self) -> None:
        if not self.engine_ok:
            raise ApiError(
                503,
                "docker_engine_down",
                f"the Docker engine of node {self.config.node_id} is not answering; "
                "this node takes no new work until it is back",
            )

    async def docker_or_502(self, op) -> None:
        try:
            await op
        except DockerOpError as e:
            self.docker_failed(e)
            raise ApiError(502, f"docker_{e.kind}", str(e)) from e

    async def audit_record(self, record: AuditRecord | RefusalRecord) -> None:
        """Append to the audit log; a failure to write is counted and logged, and the
        command's result still goes back (it ran: hiding its outcome helps no one)."""
        try:
            await self.audit.append(record)
        except OSError as e:
            self.metrics.audit_failures.labels(self.config.node_id).inc()
            log.error("audit record for %s not written: %s", record.sandbox, e)

    async def remove_all(self) -> None:
        """Remove every sandbox of the node, at shutdown: through `destroy`, for at most
        SHUTDOWN_WAIT_S; then every container labelled with the node that is still there
        (one whose removal something stuck holds up, or a create's not yet recorded)."""
        self.stopping = True  # no create starts from here
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(SHUTDOWN_WAIT_S):
                # a create under way at the first round is gone by the next
                for _ in range(REMOVE_ALL_ROUNDS):
                    if not self.sandboxes:
                        break
                    for sandbox_id in list(self.sandboxes):
                        with contextlib.suppress(ApiError):
                            await self.destroy(sandbox_id)
                    await self.settle()  # the removals destroy leaves for a quiet engine
        try:
            left = await self.docker.list_labelled(self.config.node_id)
        except DockerOpError as e:
            log.warning("the node's containers left at shutdown cannot be listed: %s", e)
            return
        for container in left:
            log.warning("removing container %s, left at shutdown", container.container_id[:12])
            with contextlib.suppress(DockerOpError):
                await self.docker.remove(container.container_id, Work.CLIENT)

    async def settle(self, within_s: float | None = None) -> None:
        """Wait for every operation under way, and for what those start in turn; for at
        most `within_s`, past which what is still under way is named in the log."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within_s):
                while self.operations:
                    await asyncio.gather(*list(self.operations), return_exceptions=True)
                return
        stuck = sorted(t.get_coro().__qualname__ for t in self.operations)
        log.warning("going on after %s s without %d operations: %s", within_s, len(stuck), stuck)
