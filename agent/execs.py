"""Commands in sandboxes, for the client holding the lease.

A command runs on the event loop (agent/docker_driver.py `Process`), holding one socket
to the engine and no thread, so one tenant's long commands cannot delay another's.
Limits are per sandbox and per node, answered at once with 429 rather than queued, so
a command's deadline counts from its start. A command that outlives its deadline (or
whose client hung up) is killed: every process that carries its marker in the
environment, with its process group (each command leads a session of its own). From the
host where the agent can (agent/host.py: a process is signalled through a pidfd checked
to be the container's, so a reused PID is never hit; no fork in the sandbox, whose pids
may all be taken, and no engine exec), else by a script inside the sandbox.

One-shot commands (`run`) return their output capped; streaming ones (`stream`, the
WebSocket route in agent/app.py) hand each chunk to a sink as it is produced and take
stdin. Both write the same audit record. What either holds of its output counts in the
node's output budget, and a sandbox's output is read no faster than its relay rate
(agent/output.py): a command with no room, or past its rate, waits with its pipe full.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from agent.audit import AuditRecord, quoted_cmd
from agent.docker_driver import (
    RUNC_INIT_DIED,
    RUNC_STOPPED,
    STDOUT,
    TIMEOUT_EXIT_CODE,
    DockerOpError,
    Process,
)
from agent.engine import Work
from agent.host import Unavailable, kill_command_from_host
from agent.output import Gathered, Held, OutputBudget, RelayRate
from agent.resident import CHUNK, RunningCommand
from agent.sandboxes import Sandbox
from dsec.httpkit import ApiError, CredentialRefused
from dsec.models import (
    ExecExit,
    ExecRequest,
    ExecResult,
    ExecStreamRequest,
    NodeLostCause,
)
from dsec.tokens import lease_token_claim, lease_token_expiry

if TYPE_CHECKING:
    from agent.config import AgentConfig
    from agent.docker_driver import AsyncDocker
    from agent.metrics import AgentMetrics
    from agent.resident import Resident
    from dsec.clock import Clock
    from dsec.models import NodeIdentity
    from dsec.tokens import LeaseClaim

log = logging.getLogger(__name__)
MARKER_ENV = "DSEC_EXEC"  # names a command's processes, for its kill
# Every process whose environment carries the marker, and its process group (never the
# init's, group 1): a child that cleared its environment still dies with its group.
KILL_SCRIPT = r"""
for f in $(grep -l "DSEC_EXEC=$1" /proc/[0-9]*/environ 2>/dev/null); do
  p=${f#/proc/}; p=${p%/environ}
  g=$(sed 's/.*) //' "/proc/$p/stat" 2>/dev/null | cut -d' ' -f3)
  [ "${g:-0}" -gt 1 ] && kill -9 "-$g" 2>/dev/null
  kill -9 "$p" 2>/dev/null
done
true
"""
KILL_TIMEOUT_S = 5.0  # a kill that takes longer: the stream is cut all the same
DRAIN_AFTER_KILL_S = 2.0  # output of a killed command still in flight
EXIT_CODE_TRIES = 20  # the output can end a moment before the engine records the exit
# the exits of a command whose container died under it: SIGKILL with the rest of its PID
# namespace, no exit recorded at all, or runc's "cannot exec" (126)
DIED_WITH_ITS_CONTAINER = frozenset({126, 128 + 9, TIMEOUT_EXIT_CODE})
DEATH_LOOKS = 10  # and the engine may see the container's end up to this many gaps later
DEATH_LOOK_GAP_S = 0.03
ENGINE_START_TRIES = 3  # an engine exec whose runc init died (see _engine_start)
RUNC_ANSWERS_WITHIN_S = 0.5  # runc's own failure to start comes this soon, or not at all
ENGINE_RESTART_AFTER_S = 0.1  # before the next try, times the tries so far

Sink = Callable[[int, bytes], Awaitable[None]]


@dataclass
class Outcome:
    exit_code: int
    timed_out: bool
    truncated: bool
    duration_ms: float
    sent: dict[int, int] = field(default_factory=dict)  # bytes per stream given to the sink


def _exited(sandbox_id: str) -> ApiError:
    """A command's sandbox whose container has died: its lease is lost, and how (killed
    from outside, its memory, the engine restarting) its node tells once its watch has
    seen it twice (agent/runtime.py): the control plane answers it then."""
    return ApiError(
        409,
        "sandbox_exited",
        f"sandbox {sandbox_id} is no longer running (its container died); release it "
        "and acquire another",
    )


def _terminal_env(attach: ExecStreamRequest | None) -> dict[str, str]:
    """What a terminal's programs expect to find (as `docker exec -t` sets it). The size
    arrives by a resize once the command runs (this engine's API takes it no sooner); not
    LINES and COLUMNS, which shells prefer to the terminal's size for good."""
    return {"TERM": "xterm"} if attach is not None and attach.tty else {}


def tenant_of(sandbox: Sandbox) -> str:
    """Whom a sandbox's output is counted against: its lease's client."""
    return sandbox.record.owner or sandbox.id


class Leases(Protocol):
    """What commands need of the node's sandboxes and their leases (agent/node.py's
    `Agent` is one), so that this module never imports the node that runs it."""

    @property
    def identity(self) -> NodeIdentity | None: ...  # None until it has joined

    @property
    def sandboxes(self) -> Mapping[str, Sandbox]: ...

    def get(self, sandbox_id: str) -> Sandbox: ...

    def adoption_refused(self, sandbox: Sandbox, claim: LeaseClaim | None) -> ApiError | None: ...

    async def adopt(self, sandbox: Sandbox, claim: LeaseClaim) -> None: ...

    async def thaw_locked(self, sandbox: Sandbox, work: Work) -> None: ...


class Execs:
    def __init__(
        self,
        *,
        leases: Leases,
        resident: Resident,
        docker: AsyncDocker,
        docker_failed: Callable[[DockerOpError], None],
        audit: Callable[[AuditRecord], Awaitable[None]],
        config: AgentConfig,
        clock: Clock,
        metrics: AgentMetrics,
    ) -> None:
        self.leases = leases
        self.resident = resident
        self.docker = docker
        self.docker_failed = docker_failed
        self.audit = audit
        self.config = config
        self.clock = clock
        self.metrics = metrics
        self.running = 0  # commands under way on this node
        self.output = OutputBudget(config.output_budget_bytes)
        metrics.output_buffered.labels(config.node_id).set_function(lambda: self.output.used)
        self.relayed = metrics.output_relayed.labels(config.node_id)
        self.throttled = metrics.output_throttled.labels(config.node_id)

    async def hold(self, sandbox_id: str, token: str | None) -> tuple[Sandbox, str]:
        """`authorize`, once the lease `token` proves by itself is taken up: the control
        plane answers a warm acquire before this node hears of the lease, and the
        client's first call may come before the control plane's grant."""
        leases = self.leases
        sandbox = leases.get(sandbox_id)
        if sandbox.record.lease_id is None and token is not None and leases.identity:
            claim = lease_token_claim(leases.identity.lease_key, token, sandbox_id)
            if claim is not None and leases.adoption_refused(sandbox, claim) is None:
                await leases.adopt(sandbox, claim)
        return self.authorize(sandbox_id, token)

    def authorize(self, sandbox_id: str, token: str | None) -> tuple[Sandbox, str]:
        """The sandbox and its lease, if `token` holds that lease (files use it too)."""
        leases = self.leases
        sandbox = leases.get(sandbox_id)
        if token is None:
            raise CredentialRefused(
                401, "unauthenticated", "missing Authorization: Bearer <lease token>"
            )
        identity = leases.identity
        if identity is None:  # it has not joined yet: it cannot check a token
            raise ApiError(
                503, "not_joined", f"node {self.config.node_id} is joining its control plane"
            )
        lease_id = sandbox.record.lease_id
        if lease_id is None:  # (`hold` took up the lease the token proves, if it could)
            claim = lease_token_claim(identity.lease_key, token, sandbox_id)
            raise leases.adoption_refused(sandbox, claim) or ApiError(
                409, "not_leased", f"sandbox {sandbox_id} is not leased"
            )
        # made with this node's lease key for this sandbox, lease and client, or refused
        owner = sandbox.record.owner
        expires_at = lease_token_expiry(identity.lease_key, token, sandbox_id, lease_id, owner)
        if expires_at is None:
            raise CredentialRefused(
                403, "forbidden", f"this token does not hold the lease on {sandbox_id}"
            )
        if expires_at <= self.clock.wall():
            raise ApiError(410, "lease_expired", f"the lease on {sandbox_id} has expired")
        return sandbox, lease_id

    def admit(self, sandbox: Sandbox) -> None:
        """Refuse a command past the sandbox's or the node's limit (429), before any
        answer has started, so the client can retry."""
        config = self.config
        if sandbox.running_execs >= config.execs_per_sandbox:
            raise ApiError(
                429,
                "too_many_execs",
                f"sandbox {sandbox.id} runs {sandbox.running_execs} commands already "
                f"(at most {config.execs_per_sandbox} at once)",
            )
        if self.running >= config.execs_per_node:
            raise ApiError(
                429,
                "node_busy",
                f"node {config.node_id} runs {self.running} commands already "
                f"(at most {config.execs_per_node} at once)",
            )

    @contextlib.asynccontextmanager
    async def running_in(self, sandbox: Sandbox, lease_id: str):
        """Count a command (or a file operation) as running in `sandbox` for its lease:
        the sandbox is thawed first, is not frozen or reset meanwhile, and its busy time
        grows by the time spent."""
        self.admit(sandbox)
        async with sandbox.lock:  # a frozen lease is thawed before the command runs
            if sandbox.record.lease_id != lease_id:  # released (or recycled) meanwhile
                raise ApiError(410, "released", f"the lease on {sandbox.id} has ended")
            await self.leases.thaw_locked(sandbox, Work.CLIENT)
            self.admit(sandbox)  # others may have started while the lock was waited for
            sandbox.running_execs += 1
            self.running += 1
        started = self.clock.now()
        try:
            yield
        finally:
            sandbox.running_execs -= 1
            self.running -= 1
            ended = self.clock.now()
            sandbox.busy_s += ended - started
            sandbox.last_active = ended

    # --- the two ways to run a command ------------------------------------------

    @contextlib.asynccontextmanager
    async def held(self, sandbox: Sandbox) -> AsyncIterator[Held]:
        """A command's account in the node's output budget, emptied when it ends."""
        held = Held(self.output, tenant_of(sandbox))
        try:
            yield held
        finally:
            held.close()

    @contextlib.asynccontextmanager
    async def run(
        self, sandbox_id: str, token: str | None, req: ExecRequest, peer: str | None
    ) -> AsyncIterator[Iterator[bytes]]:
        """Run a command to its end; its answer, an ExecResult as JSON in pieces, with its
        output capped at `req.max_output_bytes`, held in the budget until it is written."""
        sandbox, lease_id = await self.hold(sandbox_id, token)
        async with self.gathered(sandbox, lease_id, req, peer) as (result, gathered):
            yield gathered.answer(result)

    async def setup(self, sandbox: Sandbox, lease_id: str, req: ExecRequest) -> ExecResult:
        """A claim's setup command (agent/node.py, Agent.lease), run as the lease's first:
        its result, output and all."""
        async with self.gathered(sandbox, lease_id, req, peer=None) as (result, gathered):
            out, err = (bytes(b).decode(errors="replace") for b in (gathered.out, gathered.err))
            return result.model_copy(update={"stdout": out, "stderr": err})

    @contextlib.asynccontextmanager
    async def gathered(
        self, sandbox: Sandbox, lease_id: str, req: ExecRequest, peer: str | None
    ) -> AsyncIterator[tuple[ExecResult, Gathered]]:
        """Run a command to its end, its output gathered (held in the budget until the
        block ends); its result, without the output, beside it."""
        gathered = Gathered(req.encoding)

        async def keep(stream: int, data: bytes) -> None:
            gathered.add(stream, data)

        async with self.held(sandbox) as held:
            outcome = await self._audited(sandbox, lease_id, req, peer, keep, held, keeps=True)
            result = ExecResult(
                exit_code=outcome.exit_code,
                stdout="",
                stderr="",
                encoding=gathered.encoding(),
                timed_out=outcome.timed_out,
                truncated=outcome.truncated,
                duration_ms=outcome.duration_ms,
            )
            yield result, gathered

    async def stream(
        self,
        sandbox_id: str,
        token: str | None,
        req: ExecStreamRequest,
        peer: str | None,
        sink: Sink,
        on_started: Callable[[RunningCommand], None],
    ) -> ExecExit:
        """Run a command, giving each chunk of its output to `sink` as it comes;
        `on_started` gets the running process (for stdin and resizing)."""
        sandbox, lease_id = await self.hold(sandbox_id, token)
        async with self.held(sandbox) as held:
            outcome = await self._audited(
                sandbox, lease_id, req, peer, sink, held, on_started=on_started, attach=req
            )
        return ExecExit(
            exit_code=outcome.exit_code,
            timed_out=outcome.timed_out,
            truncated=outcome.truncated,
            duration_ms=outcome.duration_ms,
        )

    # --- shared ------------------------------------------------------------------

    async def _audited(
        self,
        sandbox: Sandbox,
        lease_id: str,
        req: ExecRequest,
        peer: str | None,
        sink: Sink,
        held: Held,
        *,
        keeps: bool = False,
        on_started: Callable[[RunningCommand], None] | None = None,
        attach: ExecStreamRequest | None = None,
    ) -> Outcome:
        """`sink` gets the output; with `keeps`, it keeps what it gets, which stays in
        `held`, else each chunk is given back once the sink has taken it."""
        sandbox_id = sandbox.id
        self.admit(sandbox)
        asked = self.clock.now()
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
            async with self.running_in(sandbox, lease_id):
                outcome = await self._command(sandbox, req, sink, held, keeps, on_started, attach)
        except (ApiError, asyncio.CancelledError, ConnectionError) as e:
            record.error = e.code if isinstance(e, ApiError) else "cancelled"
            record.duration_ms = (self.clock.now() - asked) * 1000
            # shielded: a client that hung up still leaves its record
            await asyncio.shield(self.audit(record))
            raise
        finally:
            self.metrics.exec_seconds.labels(self.config.node_id).observe(self.clock.now() - asked)
        record.exit_code, record.timed_out = outcome.exit_code, outcome.timed_out
        record.duration_ms, record.truncated = outcome.duration_ms, outcome.truncated
        record.stdout_bytes = outcome.sent.get(1, 0)
        record.stderr_bytes = outcome.sent.get(2, 0)
        await self.audit(record)
        return outcome

    async def _command(
        self,
        sandbox: Sandbox,
        req: ExecRequest,
        sink: Sink,
        held: Held,
        keeps: bool,
        on_started: Callable[[RunningCommand], None] | None,
        attach: ExecStreamRequest | None,
    ) -> Outcome:
        cid = sandbox.record.container_id
        marker = secrets.token_hex(16)
        # the template's environment, then the lease's, under what the command sets itself
        env = {
            **sandbox.spec.env,
            **sandbox.record.lease_env,  # the claim's (AcquireRequest.env)
            **req.env,
            **_terminal_env(attach),
            MARKER_ENV: marker,
        }
        # a terminal is the command's stdin too, even when no input is sent
        stdin = attach is not None and (attach.stdin or attach.tty)
        proc: RunningCommand | None = None
        if not stdin:  # the resident loop gives no stdin and no terminal
            workdir = req.workdir or sandbox.spec.workdir
            # a loop whose exec is starting is there in a moment: the command takes it
            # rather than an engine exec of its own
            await sandbox.loop_started()
            proc = await self.resident.start(sandbox, req.cmd, env, workdir)
        # the deadline counts from here: an engine start's look at runc's first answer
        # (_engine_start) is time the command already runs
        started = self.clock.now()
        if proc is None:
            how = {"user": sandbox.user, "env": env, "workdir": req.workdir}
            try:
                if stdin:  # the client's input may be what its first output waits for
                    proc = await self.docker.start(
                        cid, req.cmd, stdin=True, tty=attach is not None and attach.tty, **how
                    )
                else:
                    proc = await self._engine_start(cid, req.cmd, **how)
            except DockerOpError as e:
                raise await self._failure(sandbox, e) from e
        sent = {1: 0, 2: 0}
        first: list[bytes] = []  # the start of stdout, to tell runc's own error apart
        truncated = False

        async def pump() -> None:
            nonlocal truncated
            while True:
                await held.take(CHUNK)  # room for the next chunk, before it is read
                if (chunk := await proc.read()) is None:
                    held.give_back(CHUNK)
                    return
                stream, data = chunk
                taken = max(CHUNK, len(data))
                await held.take(taken - CHUNK)  # (an engine's frame may be larger)
                await self._relay_wait(sandbox, len(data))
                if not first and stream == STDOUT:
                    first.append(data[:200])
                room = req.max_output_bytes - sent[stream]
                if len(data) > room:
                    truncated, data = True, data[: max(0, room)]
                if data:
                    sent[stream] += len(data)
                    await sink(stream, data)
                held.give_back(taken - (len(data) if keeps else 0))

        timed_out = False
        try:
            if attach is not None:
                if attach.tty:
                    with contextlib.suppress(DockerOpError):
                        await proc.resize(attach.rows, attach.cols)
                if on_started is not None:
                    on_started(proc)
            try:
                async with asyncio.timeout(req.timeout_s - (self.clock.now() - started)):
                    await pump()
            except TimeoutError:
                timed_out = True
                await self._kill(cid, marker, sandbox)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(DRAIN_AFTER_KILL_S):
                        await pump()  # what the command wrote before it died
        except BaseException:
            # the client is gone (cancelled, or its connection failed): so is its command
            await asyncio.shield(self._kill(cid, marker, sandbox))
            raise
        finally:
            await proc.close()
        code = TIMEOUT_EXIT_CODE if timed_out else await self._exit_code(proc)
        if not timed_out and code in DIED_WITH_ITS_CONTAINER:
            # its container may have died under it: then the exit code is not the
            # command's own, and its client hears that the sandbox was lost. A container
            # that stopped between the exec's create and start: runc exits 126 and says
            # so, before Docker's own view of the container has caught up.
            died = await self._death(sandbox, settle=True)
            if died is not None or (code == 126 and RUNC_STOPPED in b"".join(first)):
                raise _exited(sandbox.id)
        return Outcome(
            exit_code=code,
            timed_out=timed_out,
            truncated=truncated,
            duration_ms=(self.clock.now() - started) * 1000,
            sent=sent,
        )

    async def _relay_wait(self, sandbox: Sandbox, size: int) -> None:
        """Wait as long as `size` bytes read from `sandbox` cost at its relay rate: its
        template's CPUs times relay_bytes_per_cpu_s."""
        rate = sandbox.relay_rate
        if rate is None:
            per_s = sandbox.spec.cpus * self.config.relay_bytes_per_cpu_s
            rate = sandbox.relay_rate = RelayRate(per_s)
        self.relayed.inc(size)
        if delay := rate.delay(size, self.clock.now()):
            self.throttled.inc(delay)
            await self.clock.sleep(delay)

    async def _engine_start(self, container_id: str, argv: list[str], **how) -> Process:
        """The command through the engine's exec. A sandbox at its pids limit can make
        runc's init die before the command starts (RUNC_INIT_DIED); such a start is made
        again, a few times, while the engine says it ran no process: the command never
        ran, so it never runs twice. The last try's answer, whatever it is, is the
        command's."""
        docker = self.docker
        for tries in range(1, ENGINE_START_TRIES):
            proc = await docker.start(container_id, argv, **how)
            first = await proc.first_within(RUNC_ANSWERS_WITHIN_S)
            died = bool(first) and first[0] == STDOUT and RUNC_INIT_DIED in first[1]
            if not (died and await proc.never_started()):
                return proc
            await proc.read()  # the failure's message, looked at: taken
            await proc.close()
            await self.clock.sleep(ENGINE_RESTART_AFTER_S * tries)
        return await docker.start(container_id, argv, **how)

    async def _exit_code(self, proc: RunningCommand) -> int:
        for _ in range(EXIT_CODE_TRIES):
            try:
                code = await proc.exit_code()
            except DockerOpError as e:
                self.docker_failed(e)
                break
            if code is not None:
                return code
            await self.clock.sleep(0.01)
        return TIMEOUT_EXIT_CODE  # its output ended, its exit was never recorded

    async def _kill(self, container_id: str, marker: str, sandbox: Sandbox) -> None:
        """Kill a command's processes: from the host, else inside its sandbox (see
        KILL_SCRIPT)."""
        try:
            pid = await sandbox.container_init(self.docker)
            if pid is not None:
                entry = f"{MARKER_ENV}={marker}".encode()
                if left := await kill_command_from_host(pid, container_id, entry):
                    log.warning("processes of a command in %s will not die: %s", sandbox.id, left)
                return
        except Unavailable as e:
            log.debug("a command in %s is killed through the engine: %s", sandbox.id, e)
        except DockerOpError as e:
            self.docker_failed(e)
        kill = ["sh", "-c", KILL_SCRIPT, "dsec-kill", marker]
        try:
            async with asyncio.timeout(KILL_TIMEOUT_S):
                await self.docker.run("exec_kill", container_id, kill, user=sandbox.user)
        except (DockerOpError, TimeoutError) as e:
            # no shell in the image, or a frozen engine: the stream is cut all the same,
            # and what still runs stays inside the sandbox until it goes
            log.warning("could not kill a command in %s: %s", sandbox.id, e)

    async def _failure(self, sandbox: Sandbox, e: DockerOpError) -> ApiError:
        self.docker_failed(e)
        if sandbox.id not in self.leases.sandboxes:
            return ApiError(410, "released", f"sandbox {sandbox.id} was released")
        if await self._death(sandbox) is not None:
            return _exited(sandbox.id)
        return ApiError(502, f"docker_{e.kind}", str(e))

    async def _death(self, sandbox: Sandbox, settle: bool = False) -> NodeLostCause | None:
        """How `sandbox`'s container died, or None while it runs (or when the engine
        cannot say). `settle`: a command's end may be seen before its container's, so
        look again for a moment; and an engine that cannot say then (one shutting down
        kills its containers as it goes) leaves the command's exit code unvouched for:
        502, and its client learns from the control plane whether the lease survived."""
        for _ in range(DEATH_LOOKS if settle else 1):
            try:
                if (died := await self.docker.death_of(sandbox.record.container_id)) is not None:
                    return died
            except DockerOpError as e:
                self.docker_failed(e)
                if settle:
                    raise ApiError(502, f"docker_{e.kind}", str(e)) from e
                return None  # cannot tell: the command's own result is the answer
            if settle:
                await self.clock.sleep(DEATH_LOOK_GAP_S)
        return None
