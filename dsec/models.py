"""Wire models: what crosses HTTP between clients, the control plane and agents.

Every model refuses unknown fields, so a typo in a request is an error the caller
sees instead of a setting silently ignored.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from itertools import chain
from typing import Annotated, Literal, NamedTuple

from pydantic import (
    AfterValidator,
    Base64Bytes,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    create_model,
    model_validator,
)

from dsec.states import SandboxState

NAME_PATTERN = r"^[a-z0-9][a-z0-9-]{0,31}$"
# A sandbox id carries its node (as DSec does), so anything can route it to the
# owning agent without a lookup: "<node>.<16 hex>".
SANDBOX_ID_PATTERN = r"^[a-z0-9][a-z0-9-]{0,31}\.[0-9a-f]{16}$"
SANDBOX_ID_RE = re.compile(SANDBOX_ID_PATTERN)

Name = Annotated[str, StringConstraints(pattern=NAME_PATTERN)]
SandboxId = Annotated[str, StringConstraints(pattern=SANDBOX_ID_PATTERN)]


def _printable(text: str) -> str:
    if not text.isprintable():
        raise ValueError("only printable characters (no control, format or line-break ones)")
    return text


LabelKey = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}$")]
# printable as Python's str.isprintable says: what a terminal or a log shows as written
LabelValue = Annotated[str, StringConstraints(max_length=256), AfterValidator(_printable)]
LeaseId = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{32}$")]
IdempotencyKey = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9._:-]{1,128}$")]
ClientId = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{16}$")]
# the control plane's seal on a lease it granted (controlplane/identities.py, grant_proof)
GrantProof = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
ImageRef = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._/:@-]{0,254}$")]
# An environment variable's name, as a shell and Docker take it.
EnvName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")]
# Its value: anything but NUL, which no process environment can hold.
EnvValue = Annotated[str, StringConstraints(pattern=r"^[^\x00]*$", max_length=32768)]
DOCKER_HUB = ("docker.io", "index.docker.io")  # an engine lists its images without it
# One argument of a command.
CmdArg = Annotated[str, StringConstraints(max_length=65536)]
# A file a claim writes: relative to the work dir, or absolute in it (checked against the
# template's work dir where the claim is made: controlplane/claims.py).
ClaimPath = Annotated[str, StringConstraints(pattern=r"^[^\x00]{1,4096}$")]


def normalise_image_ref(ref: str) -> str:
    """`ref` as an engine lists it among an image's tags: `ubuntu` is `ubuntu:latest`,
    `host:5000/app` is `host:5000/app:latest` (a port is not a tag), and Docker Hub's
    own names are short (`docker.io/library/python:3.12` is `python:3.12`,
    `docker.io/org/app` is `org/app:latest`); a reference by digest as it is."""
    if "@" in ref:
        return ref
    domain, slash, path = ref.partition("/")
    if slash and domain in DOCKER_HUB:
        ref = path
    if ref.startswith("library/") and ref.count("/") == 1:
        ref = ref.removeprefix("library/")
    return ref if ":" in ref.rsplit("/", 1)[-1] else f"{ref}:latest"


NodeKind = Literal["local", "cloud"]
SchedulePath = Literal["warm", "thaw", "cold", "overflow"]
# an operator's drain of a node: none, draining (sandboxes left), drained (it may go)
DrainState = Literal["none", "draining", "drained"]
OutputEncoding = Literal["utf-8", "base64"]

MAX_TIMEOUT_S = 3600.0
# the most a control plane may let one claim's files be (its max_claim_files_bytes)
CLAIM_FILES_CEILING = 256 * 1024 * 1024
MAX_OUTPUT_BYTES = 16 * 1024 * 1024


def node_of(sandbox_id: str) -> str:
    return sandbox_id.rsplit(".", 1)[0]


class Wire(BaseModel):
    # the schemas are built on first use, not at import: every CLI call and service
    # start imports these models, and most use a few of them
    model_config = ConfigDict(extra="forbid", defer_build=True)


# --- errors ---------------------------------------------------------------


class ErrorBody(Wire):
    code: str = Field(description="machine-readable reason, e.g. validation_error")
    message: str
    details: list[dict] | None = None


class ErrorResponse(Wire):
    error: ErrorBody


def validation_details(e: ValidationError) -> list[dict]:
    """An ErrorBody's details for a validation error: where, and what is wrong there."""
    return [{"loc": ".".join(str(p) for p in err["loc"]), "msg": err["msg"]} for err in e.errors()]


# --- client <-> control plane --------------------------------------------


# A multipart/form-data acquire's parts (docs/contracts.md): the request's JSON without
# `files`, then a part per file (its filename the path) or one tar, bytes as they are
ACQUIRE_PART, ACQUIRE_FILE_PART, ACQUIRE_TAR_PART = "request", "file", "tar"


class AcquireRequest(Wire):
    pool: Name = "default"
    template: Name = "base"
    priority: int = Field(0, ge=-1000, le=1000, description="higher is served first")
    timeout_s: float = Field(
        30.0, gt=0, le=MAX_TIMEOUT_S, description="how long to wait for a sandbox"
    )
    idempotency_key: IdempotencyKey | None = Field(
        None, description="a retry with the same key gets the same sandbox, not a second one"
    )
    new_key: bool = Field(
        False,
        description="the client made idempotency_key for this acquire and sends it for the "
        "first time: no lease can hold it, so a control plane that has just started serves it "
        "without waiting for its agents to report their leases (resync_s)",
    )
    labels: dict[LabelKey, LabelValue] = Field(default_factory=dict, max_length=32)
    # A personalised claim: applied to the warm sandbox it gets, before the answer
    # (docs/contracts.md, "Personalised claims").
    env: dict[EnvName, EnvValue] = Field(
        default_factory=dict,
        max_length=256,
        description="environment variables of every command of the lease, over the "
        "template's (a command's own env is over these)",
    )
    files: dict[ClaimPath, Base64Bytes] | Base64Bytes | None = Field(
        None,
        description="written into the work dir before the answer: {path: base64 of its "
        "bytes}, a path relative to the work dir or absolute in it, or the base64 of a tar "
        "unpacked there; at most the control plane's max_claim_files_bytes",
    )
    setup: list[CmdArg] | None = Field(
        None,
        min_length=1,
        max_length=4096,
        description="argv of a command run in the sandbox, with the lease's env and after "
        "its files, before the answer, within timeout_s; if it fails so does the acquire "
        "(422 setup_failed, with its output) and the sandbox is removed, never handed out",
    )

    @property
    def personalised(self) -> bool:
        return bool(self.env or self.files or self.setup)


class SandboxInfo(Wire):
    id: SandboxId
    node: Name
    agent_url: str = Field(description="where exec and files for this sandbox are served")
    pool: Name
    template: Name
    state: SandboxState
    created_at: float
    lease_id: str | None = None
    labels: dict[str, str] | None = Field(
        default_factory=dict,
        description="the lease's labels; null where this control plane does not know them: "
        "it restarted since the lease was made (heartbeats carry no labels; the agent keeps "
        "them)",
    )


class Lease(SandboxInfo):
    """The acquire answer: a sandbox plus the credential to use it."""

    lease_id: str
    lease_token: str = Field(description="bearer token for exec on the owning agent")
    path: SchedulePath = Field(description="how it was scheduled: warm, thaw, cold, overflow")
    schedule_ms: float = Field(description="from the request's arrival to a usable sandbox")
    lease_idle_timeout_s: float | None = Field(
        None, description="renew the lease within this, or run a command (None: no timeout)"
    )
    setup_ms: float | None = Field(
        None,
        description="of schedule_ms, the time its node took to apply the claim's env, files "
        "and setup (None: the claim had none)",
    )


# the most forks one call makes: a GRPO group is 4-64 rollouts
MAX_FORK = 64


class ForkRequest(Wire):
    """`POST /v1/sandboxes/{id}/fork`: `count` new leases on copies of the sandbox's work
    dir and /tmp as they are at the call (docs/contracts.md, "Fork")."""

    count: int = Field(ge=1, le=MAX_FORK, description="how many copies")
    pool: Name | None = Field(None, description="the copies' pool (None: the source's)")
    timeout_s: float = Field(
        60.0, gt=0, le=MAX_TIMEOUT_S, description="how long to wait for all the copies"
    )
    labels: dict[LabelKey, LabelValue] = Field(default_factory=dict, max_length=32)


class Forked(Wire):
    """A fork's answer: every copy's lease, or none (a fork that fails leaves nothing)."""

    source: SandboxId
    leases: list[Lease]
    bytes: int = Field(description="the copy's size: the tars of the work dir and /tmp")
    snapshot_ms: float = Field(description="taking the copy on the source's node")
    fork_ms: float = Field(description="from the call to the last copy usable")


class SnapshotMade(Wire):
    """What a node answers the control plane for a fork's copy of one of its sandboxes:
    the copy's id, the token that reads it (given only to the nodes the forks go to)."""

    snapshot: str = Field(pattern=r"^[0-9a-f]{32}$")
    token: str = Field(pattern=r"^[0-9a-f]{64}$")
    roots: list[str] = Field(description="the directories copied, one tar each, in order")
    bytes: int


class ForkSource(Wire):
    """In a fork's grant: where its node reads the copy from (agent to agent)."""

    node: Name
    agent_url: str = Field(max_length=2048)
    snapshot: str = Field(pattern=r"^[0-9a-f]{32}$")
    token: str = Field(pattern=r"^[0-9a-f]{64}$")
    roots: list[str] = Field(min_length=1, max_length=8)


class LeaseRenewed(Wire):
    id: SandboxId
    idle_timeout_s: float | None = Field(
        description="renew within this to keep the lease (None: its pool has no idle timeout)"
    )
    expires_in_s: float | None = Field(
        description="when the lease ends if nothing more happens (None: not before release)"
    )


LeaseEnd = Literal["released", "lease_expired"]  # why a sandbox went, as its clients hear

# How a lease ended: one of these for every lease, kept an hour past its end
# (GET /v1/leases/{lease_id}; docs/contracts.md, "Lease outcomes").
LeaseOutcome = Literal[
    "released",  # its client (or its `sandbox()` block) gave it back
    "expired",  # it reached its pool's max_lease_s
    "idle_timeout",  # no command and no renewal for its pool's lease_idle_timeout_s
    "node_lost",  # its node stopped answering, or no longer had it after a restart
    "engine_lost",  # its node's Docker engine restarted, which stops every container
    "container_died",  # its container stopped from outside the lease (docker kill, rm)
    "oom_killed",  # its container died of its own memory use past the template's limit
    "evicted",  # an operator removed it while it was leased
    "setup_failed",  # its claim's setup command failed: it was never handed out
]
# The outcomes that are the infrastructure's doing, not the lease's client's or its
# workload's: a sample cut short by one of these says nothing of the policy that ran it.
# `expired` and `idle_timeout` are limits the pool sets and the client can see coming;
# `oom_killed` and `setup_failed` are the workload's own.
INFRA_FAULTS: frozenset[str] = frozenset({"node_lost", "engine_lost", "container_died", "evicted"})
# what an agent can tell of a sandbox it dropped because its container died
NodeLostCause = Literal["engine_lost", "container_died", "oom_killed"]
# what a client is told of a sandbox its node lost, by the node's word (node_lost: none)
LOST_CAUSES = {
    "node_lost": "its node no longer has it (its agent restarted without it)",
    "engine_lost": "its container stopped when its node's Docker engine restarted",
    "container_died": "its container was stopped from outside the lease",
    "oom_killed": "its container was killed for its memory use past the template's memory_mb",
}


class LeaseStatus(Wire):
    """A lease, running or ended: GET /v1/leases/{lease_id}."""

    lease_id: str
    sandbox_id: SandboxId
    pool: str
    ended: bool
    outcome: LeaseOutcome | None = Field(None, description="how it ended (None: it has not)")
    infra_fault: bool | None = Field(
        None,
        description="whether it ended by the infrastructure's fault, not its client's or its "
        "workload's (None: it has not ended)",
    )
    message: str | None = Field(None, description="what happened, in words")
    ended_at: float | None = Field(None, description="when it ended, Unix seconds")
    lost_within_s: float = Field(
        description="how long, at most, after its node stops answering the control plane "
        "calls it node_lost: a client that cannot reach the node asks again within this"
    )


class Released(Wire):
    id: SandboxId
    state: SandboxState
    busy_s: float | None = Field(None, description="its time running commands, all told")


class SandboxList(Wire):
    sandboxes: list[SandboxInfo]


# --- exec (client <-> agent) ----------------------------------------------


class ExecRequest(Wire):
    cmd: list[CmdArg] = Field(
        min_length=1, max_length=4096, description="argv; no shell unless you run one"
    )
    timeout_s: float = Field(60.0, gt=0, le=MAX_TIMEOUT_S)
    max_output_bytes: int = Field(
        1024 * 1024, ge=0, le=MAX_OUTPUT_BYTES, description="cap per stream; the rest is dropped"
    )
    env: dict[EnvName, str] = Field(default_factory=dict, max_length=256)
    workdir: Annotated[str, StringConstraints(pattern=r"^/[^\x00]{0,1023}$")] | None = None
    encoding: OutputEncoding = Field(
        "utf-8", description="base64 returns stdout and stderr byte for byte"
    )


class ExecResult(Wire):
    exit_code: int = Field(description="the command's exit code; 124 when it timed out")
    stdout: str
    stderr: str
    encoding: OutputEncoding = Field(
        "utf-8",
        description="how stdout and stderr are written: utf-8 text (undecodable bytes "
        "replaced) or base64 of the exact bytes, as the request asked",
    )
    timed_out: bool = False
    truncated: bool = Field(False, description="output went past max_output_bytes")
    duration_ms: float


MAX_STREAM_OUTPUT_BYTES = 1 << 40


class ExecStreamRequest(ExecRequest):
    """The first message of a streaming exec (WebSocket, see docs/contracts.md): the command,
    and whether stdin stays open and a terminal is wanted."""

    max_output_bytes: int = Field(
        MAX_STREAM_OUTPUT_BYTES,
        ge=0,
        le=MAX_STREAM_OUTPUT_BYTES,
        description="bytes per stream sent before the rest is dropped (and truncated set)",
    )
    stdin: bool = Field(False, description="keep the command's stdin open for input frames")
    tty: bool = Field(False, description="run on a terminal (stdout and stderr merged)")
    rows: int = Field(24, ge=1, le=1000)
    cols: int = Field(80, ge=1, le=1000)


class ExecExit(Wire):
    """The last message of a streaming exec."""

    type: Literal["exit"] = "exit"
    exit_code: int
    timed_out: bool = False
    truncated: bool = False
    duration_ms: float


FileType = Literal["file", "dir", "link", "other"]


class FileInfo(Wire):
    path: str = Field(description="absolute path inside the sandbox")
    name: str
    type: FileType
    size: int = Field(ge=0)
    mode: int = Field(ge=0, description="permission bits, e.g. 0o644")
    mtime: float


class FileList(Wire):
    path: str
    entries: list[FileInfo]


class FileRemoved(Wire):
    path: str
    removed: bool = True


# --- templates, pools, nodes ----------------------------------------------


# A template's default user: not a uid to run as, but "a uid of each sandbox's own", from
# its node's range (agent/users.py). Any other value is used as it is, by every sandbox.
OWN_USER = "1000:1000"


class TemplateFields(Wire):
    """A template's settings, as `PUT /v1/templates/{name}` takes them (the name is the
    path's); `TemplateSpec` is a template with its name."""

    image: ImageRef
    cpus: float = Field(0.5, ge=0.01, le=256)
    memory_mb: int = Field(256, ge=16, le=1024 * 1024)
    may_overflow: bool = Field(True, description="may run on cloud nodes")
    user: str = Field(
        OWN_USER,
        pattern=r"^[A-Za-z0-9_:-]{1,64}$",
        description=f"who its commands run as; {OWN_USER} (the default): a uid of each "
        "sandbox's own, from its node's range",
    )
    workdir: str = Field("/work", pattern=r"^/[A-Za-z0-9._-][A-Za-z0-9._/-]{0,254}$")
    workdir_mb: int = Field(256, ge=1, le=1024 * 1024, description="size of the writable work dir")
    tmp_mb: int = Field(64, ge=1, le=1024 * 1024, description="size of /tmp")
    read_only_root: bool = True
    pids_limit: int = Field(256, ge=8, le=1_000_000)
    nofile_limit: int = Field(1024, ge=16, le=1_048_576)
    command: list[str] = Field(
        default_factory=lambda: ["sleep", "2147483647"], min_length=1, max_length=64
    )
    recyclable: bool = Field(
        False,
        description="a pool with `recycle` on may reset a released sandbox of this template "
        "and hand it out again instead of removing it (needs sh, kill, rm and chmod in the "
        "image)",
    )
    env: dict[EnvName, EnvValue] = Field(
        default_factory=dict,
        max_length=256,
        description="environment variables of its sandboxes: of the template's command and "
        "of every command, unless the command sets its own",
    )


class TemplateSpec(TemplateFields):
    """How to run a sandbox: the image and its limits. Safe by default."""

    name: Name

    @property
    def memory_limit_mb(self) -> int:
        """What a sandbox may hold in RAM, and so what a node sets aside for it: its
        processes' memory_mb plus the work dir and /tmp, tmpfs file systems whose pages
        are charged to the container's memory cgroup."""
        return self.memory_mb + self.workdir_mb + self.tmp_mb


class PoolParams(Wire):
    """A pool's elastic-policy parameters (docs/policy.md, 'Pool parameters')."""

    priority: int = Field(
        0, ge=-1000, le=1000, description="served before lower pools; may take their idle sandboxes"
    )
    min_warm: int = Field(2, ge=0, le=100_000)
    max_warm: int = Field(64, ge=0, le=100_000)
    warm_fraction: float = Field(0.15, ge=0, le=1)
    scale_up_k: float = Field(2.0, gt=0, le=1000)
    scale_up_step: float = Field(0.5, gt=0, le=10)
    freeze_after_s: float = Field(30.0, gt=0, le=86_400)
    scale_down_step: float = Field(0.2, gt=0, le=1)
    hibernate_after_s: float = Field(120.0, gt=0, le=86_400)
    frozen_ttl_s: float = Field(300.0, gt=0, le=7 * 86_400)
    lease_idle_freeze_s: float = Field(600.0, gt=0, le=7 * 86_400)
    overflow_threshold: float = Field(0.8, gt=0, le=1)
    refill_concurrency: int = Field(
        2, ge=1, le=10_000, description="warm-pool creates in flight at once, per template"
    )
    max_lease_s: float | None = Field(
        None,
        gt=0,
        le=30 * 86_400,
        description="a lease ends this long after it began, renewed or not (None: never)",
    )
    lease_idle_timeout_s: float | None = Field(
        3600.0,
        gt=0,
        le=30 * 86_400,
        description="a lease ends when its client ran no command and renewed nothing for "
        "this long (the SDK renews while a sandbox() block is open; None: never)",
    )
    recycle: bool = Field(
        False,
        description="reset a released sandbox and put it back in the warm pool instead of "
        "removing it; only for templates that allow it (`recyclable`)",
    )
    templates: list[Name] = Field(
        default_factory=lambda: ["base"], max_length=64, description="templates kept warm"
    )

    @model_validator(mode="after")
    def _consistent(self) -> PoolParams:
        if self.max_warm < self.min_warm:
            raise ValueError(f"max_warm ({self.max_warm}) is below min_warm ({self.min_warm})")
        return self


# PATCH /v1/pools/{name}: every PoolParams field, optional, none of their own checks: the
# fields sent are merged into the pool's current parameters and the whole is validated
# as PoolParams, so a pair that only clashes with a value not sent is caught as well.
PoolPatch = create_model(
    "PoolPatch",
    __base__=Wire,
    __doc__="Some of a pool's parameters: the fields sent change, the others keep theirs.",
    **{
        name: (field.annotation | None, Field(None, description=field.description))
        for name, field in PoolParams.model_fields.items()
    },
)


class PoolInfo(Wire):
    name: Name
    params: PoolParams
    queue_depth: int
    sandboxes: dict[str, int] = Field(description="count by state")


class PoolList(Wire):
    pools: list[PoolInfo]


class TemplateBody(TemplateFields):
    """The body of `PUT /v1/templates/{name}`: a template without its name, or with the
    path's name."""

    name: Name | None = None


class TemplateInfo(Wire):
    name: Name
    spec: TemplateSpec
    pools: list[Name] = Field(description="the pools that keep it warm")
    nodes_with_image: list[str] = Field(description="the nodes whose engine holds its image")
    distributable: bool = Field(
        description="the control plane's host holds its image and sends it to nodes that lack it"
    )
    sandboxes: dict[str, int] = Field(description="its sandboxes, count by state")


class TemplateList(Wire):
    templates: list[TemplateInfo]


class TemplateRemoved(Wire):
    name: Name
    removed: bool = True
    sandboxes_removed: int = Field(description="its sandboxes no client held, removed now")
    leases_left: int = Field(description="its sandboxes held by clients: they run to their end")


MAX_PREWARM_S = 86_400.0


class PrewarmRequest(Wire):
    """An announced burst: `count` warm sandboxes ready within `within_s`, held `hold_s`
    more, then the pool's normal warm target again. A new one replaces the client's last
    of the pool, never another client's (controlplane/prewarm.py)."""

    count: int = Field(
        ge=0, le=100_000, description="warm sandboxes wanted; 0 ends this client's prewarm"
    )
    within_s: float = Field(ge=0, le=MAX_PREWARM_S, description="when the burst starts, from now")
    hold_s: float = Field(
        60.0, ge=0, le=MAX_PREWARM_S, description="how long past within_s the raise holds"
    )
    template: Name | None = Field(None, description="the pool's first template unless named")


class PrewarmInfo(Wire):
    """An accepted prewarm."""

    pool: Name
    template: Name
    count: int
    within_s: float
    hold_s: float
    ready_by: float = Field(
        description="wall-clock time (Unix seconds) by which the count can be warm, at the "
        "engines' measured create rate (now, when it is warm already)"
    )
    meets_deadline: bool = Field(
        description="ready_by is within within_s: false says the burst will meet a pool "
        "that is not yet all warm (the prewarm still holds, and fills as fast as it can)"
    )
    until: float = Field(description="wall-clock time (Unix seconds) the raise ends")
    warm: int = Field(description="sandboxes of the pool and template warm or on the way now")
    replaced: bool = Field(description="it replaced this client's earlier prewarm of the pool")


# The most sandboxes a node holds, of every state (hibernated ones hold no slot but are
# reported): a report of this many always fits the heartbeat's body limit below.
MAX_NODE_SANDBOXES = 20_000
MAX_NODE_IMAGES = 10_000
MAX_IMAGE_REF_CHARS = 512


class Capacity(Wire):
    cpus: float = Field(gt=0, le=100_000)
    memory_mb: int = Field(gt=0, le=1 << 40)
    slots: int = Field(gt=0, le=MAX_NODE_SANDBOXES)


class Usage(Wire):
    cpus: float = 0.0
    memory_mb: int = 0
    slots: int = 0


class SandboxReport(Wire):
    """An agent's account of one of its sandboxes."""

    id: SandboxId
    pool: Name
    template: Name
    state: SandboxState
    created_at: float
    lease_id: str | None = None
    idempotency_key: str | None = None
    owner: ClientId | None = Field(None, description="the client holding the lease")
    labels: dict[str, str] = Field(default_factory=dict)
    cpus: float
    memory_mb: int
    busy_s: float = Field(0.0, ge=0, description="seconds spent running commands, all time")
    frozen_s: float | None = Field(None, ge=0, description="seconds since it was first frozen")
    idle_s: float = Field(0.0, ge=0, description="seconds since the last command ended (or start)")


FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class SandboxRow(NamedTuple):
    """One sandbox in a heartbeat: what the control plane schedules by, and no field a
    client can make long (labels stay with the agent, which serves them on GET). Times
    are instants on the agent's clock (NodeReport.clock), not ages, so a row changes only
    when something happens to its sandbox, and a delta report carries only those rows."""

    id: str
    pool: str
    template: str
    state: SandboxState
    created_at: float  # wall clock (Unix seconds)
    cpus: float
    memory_mb: int
    lease_id: str | None
    idempotency_key: str | None
    owner: str | None  # the client holding the lease
    busy_s: float  # seconds spent running commands, all time
    active_at: float | None  # when its last command ended (or it was made); None while one runs
    frozen_at: float | None  # when it was first frozen
    # its lease's LeaseGrant.grant_proof: without it the control plane takes no lease it
    # does not hold already (after its restart, none)
    grant_proof: str | None = None


def _column():
    return Field(default_factory=list, max_length=MAX_NODE_SANDBOXES)


class SandboxTable(Wire):
    """Sandboxes column by column, one list per SandboxRow field, all of one length:
    no key repeated per sandbox, and 14 lists of 5,000 validate several times faster
    than 5,000 objects (bench/report_scale.py)."""

    id: list[SandboxId] = _column()
    pool: list[Name] = _column()
    template: list[Name] = _column()
    state: list[SandboxState] = _column()
    created_at: list[FiniteFloat] = _column()
    cpus: list[Annotated[float, Field(gt=0, le=256)]] = _column()
    memory_mb: list[Annotated[int, Field(gt=0, le=1 << 40)]] = _column()
    lease_id: list[LeaseId | None] = _column()
    idempotency_key: list[IdempotencyKey | None] = _column()
    owner: list[ClientId | None] = _column()
    busy_s: list[Seconds] = _column()
    active_at: list[FiniteFloat | None] = _column()
    frozen_at: list[FiniteFloat | None] = _column()
    grant_proof: list[GrantProof | None] = _column()

    @model_validator(mode="after")
    def _same_length(self) -> SandboxTable:
        if len({len(getattr(self, name)) for name in SandboxRow._fields}) > 1:
            raise ValueError("the columns differ in length")
        return self

    @classmethod
    def of(cls, rows: Collection[SandboxRow]) -> SandboxTable:
        columns = map(list, zip(*rows, strict=True))  # none at all for no rows: defaults
        return cls(**dict(zip(SandboxRow._fields, columns, strict=False)))

    def rows(self) -> list[SandboxRow]:
        columns = (getattr(self, name) for name in SandboxRow._fields)
        return list(map(SandboxRow._make, zip(*columns, strict=True)))


class NodeReport(Wire):
    """The heartbeat: everything the control plane knows about a node comes from here.

    A full report (`base` unset) lists every sandbox of the node; a delta lists those
    that changed since report `base` of the same incarnation, and in `removed` those
    gone since. The control plane answers a ReportAck (agent/report.py says why)."""

    node_id: Name
    kind: NodeKind
    url: str = Field(max_length=2048)
    capacity: Capacity
    usage: Usage
    images: list[Annotated[str, StringConstraints(max_length=MAX_IMAGE_REF_CHARS)]] = Field(
        default_factory=list, max_length=MAX_NODE_IMAGES
    )
    incarnation: str = Field(
        max_length=64, description="changes every time the agent process starts"
    )
    engine_ok: bool = Field(True, description="the node's Docker engine answered its last check")
    create_limit: int = Field(
        4,
        ge=1,
        le=1024,
        description="creates the node runs at once: past this its engine only gets slower "
        "(the agent measures it)",
    )
    engine_id: str = Field(
        "",
        max_length=128,
        description="its Docker engine's own id: nodes that share an engine report the same "
        "(what a prewarm's estimate counts once); empty until the engine has answered",
    )
    clock: FiniteFloat = Field(
        description="the agent's clock when it made the report, in seconds: the times in "
        "`sandboxes` are on it"
    )
    seq: int = Field(ge=1, description="the report's number, from 1 in each incarnation")
    base: int | None = Field(
        None,
        ge=0,
        description="set on a delta: the report of this incarnation it is based on, which the "
        "control plane acknowledged; unset on a full report",
    )
    sandboxes: SandboxTable = Field(default_factory=SandboxTable)
    removed: list[SandboxId] = Field(
        default_factory=list,
        max_length=MAX_NODE_SANDBOXES,
        description="a delta's sandboxes gone since report `base`",
    )
    lost: dict[SandboxId, NodeLostCause] = Field(
        default_factory=dict,
        max_length=MAX_NODE_SANDBOXES,
        description="sandboxes the agent dropped lately because their container died, and "
        "why (kept in its reports for a few minutes, whatever the control plane acknowledged)",
    )

    @model_validator(mode="after")
    def _consistent(self) -> NodeReport:
        if self.base is None and self.removed:
            raise ValueError("a full report lists every sandbox: none is removed")
        if self.base is not None and self.base >= self.seq:
            raise ValueError(f"base ({self.base}) must be an earlier report than seq ({self.seq})")
        mine = self.node_id + "."
        if not all(i.startswith(mine) for i in chain(self.sandboxes.id, self.removed, self.lost)):
            raise ValueError(f"every sandbox id must be of node {self.node_id}")
        return self


class ReportAck(Wire):
    """The control plane's answer to a heartbeat."""

    seq: int = Field(
        ge=0,
        description="the last report of the agent's incarnation the control plane has applied "
        "(0: none): the agent's next delta may be based on it",
    )
    full_report: bool = Field(
        False,
        description="send a full report now: this delta's base is not one the control plane "
        "applied (it restarted, or the agent did)",
    )


HexKey = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]


class NodeIdentity(Wire):
    """What a node is given when it joins (`POST /v1/agents/{node_id}/join`): its own
    credentials, each bound to its node id (controlplane/identities.py)."""

    node_id: Name
    node_token: HexKey = Field(description="its heartbeats' bearer token")
    call_token: HexKey = Field(
        description="the bearer token the control plane's calls to this node carry"
    )
    lease_key: HexKey = Field(description="the key of the lease tokens of its sandboxes")


# JSON bytes of the longest row a live agent sends (longest ids, names and keys; times to
# the millisecond), with room to spare: tests/test_report_density.py checks it.
MAX_SANDBOX_ROW_BYTES = 512
# The heartbeat route's body limit: a full report of MAX_NODE_SANDBOXES sandboxes and
# MAX_NODE_IMAGES images fits. A delta is never larger (the agent sends a full report
# instead). Client-facing routes keep dsec.httpkit.MAX_BODY_BYTES.
MAX_REPORT_BYTES = (
    64 * 1024
    + MAX_NODE_IMAGES * (MAX_IMAGE_REF_CHARS + 3)
    + MAX_NODE_SANDBOXES * MAX_SANDBOX_ROW_BYTES
)


class NodeInfo(Wire):
    node_id: Name
    kind: NodeKind
    url: str
    healthy: bool
    placeable: bool = Field(
        description="takes new sandboxes: heartbeats in time, engine up, calls not failing"
    )
    engine_ok: bool
    failures: int = Field(description="calls to it that failed in a row")
    create_limit: int = Field(description="creates its engine runs at once, as its agent measured")
    engine_id: str = Field("", description="its Docker engine's id: nodes sharing one say the same")
    heartbeat_age_s: float
    capacity: Capacity
    usage: Usage
    sandboxes: int
    images: list[str]
    drain: DrainState = Field(
        "none",
        description="an operator's drain (POST /v1/nodes/{id}/drain): draining while it still "
        "holds sandboxes (no new ones; idle ones removed; leases run on), drained once it "
        "holds none and may go",
    )


class NodeList(Wire):
    nodes: list[NodeInfo]


# --- control plane -> agent -----------------------------------------------


class CreateSandbox(Wire):
    sandbox_id: SandboxId
    pool: Name
    template: TemplateSpec
    request_id: str = Field(max_length=128)
    for_request: bool = Field(
        False, description="a client waits for it: the agent runs it before warm-pool creates"
    )


# A grant with files goes to its agent as a form of two parts: the grant's JSON without
# `files_tar`, then the tar as it is
GRANT_PART, GRANT_FILES_PART = "grant", "files"


class LeaseGrant(Wire):
    lease_id: LeaseId
    pool: Name = Field(description="the pool it now serves (a higher one may take it over)")
    idempotency_key: IdempotencyKey | None = None
    owner: ClientId | None = Field(None, description="the client the lease is for")
    labels: dict[LabelKey, LabelValue] = Field(default_factory=dict, max_length=32)
    request_id: str = Field(max_length=128)
    grant_proof: GrantProof | None = Field(
        None,
        description="the control plane's proof of this grant, which no node can make: the "
        "agent keeps it with the lease and reports it (SandboxRow.grant_proof)",
    )
    # the claim's own (AcquireRequest): applied before the agent answers
    env: dict[EnvName, EnvValue] = Field(default_factory=dict, max_length=256)
    files_tar: Base64Bytes | None = Field(None, description="a tar unpacked into the work dir")
    setup: list[CmdArg] | None = Field(None, min_length=1, max_length=4096)
    setup_timeout_s: float = Field(60.0, gt=0, le=MAX_TIMEOUT_S)
    fork_from: ForkSource | None = Field(
        None, description="a fork's: the copy unpacked into the work dir and /tmp"
    )

    @property
    def personalised(self) -> bool:
        return bool(self.env or self.files_tar or self.setup or self.fork_from)


class ResetSandbox(Wire):
    """Recycle a released sandbox: end `lease_id` and make the sandbox warm again."""

    lease_id: LeaseId = Field(description="the lease it ends; a retry once ended is a no-op")
    request_id: str = Field(max_length=128)
