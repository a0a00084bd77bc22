"""The control plane's configuration: pools, templates, credentials, timers, cloud nodes."""

from __future__ import annotations

import importlib.util
from functools import cached_property
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from controlplane.identities import LOOPBACK_AGENT_URLS, AgentUrlRule
from dsec.httpkit import ApiError, MetricsAccess
from dsec.image import BASE_IMAGE
from dsec.models import CLAIM_FILES_CEILING, MAX_PREWARM_S, Capacity, Name, PoolParams, TemplateSpec
from dsec.policies import PolicyName
from dsec.tokens import client_id, new_token


def unknown_name(field: str, name: str, known) -> ApiError:
    """The 422 for a request naming a pool or template that does not exist."""
    return ApiError(
        422,
        f"unknown_{field}",
        f"no {field} named {name!r}",
        [{"loc": field, "msg": f"known: {sorted(known)}"}],
    )


def default_templates() -> dict[str, TemplateSpec]:
    # the base image has what a reset needs (sh, kill, rm, chmod): it may be recycled
    return {"base": TemplateSpec(name="base", image=BASE_IMAGE, recyclable=True)}


DEFAULT_MAX_PENDING = 4096  # a flood of acquires from one client stops here
# a client holds at most this many leases unless its quota says otherwise: one token
# cannot take a whole cluster by default (DSec's scale needs an operator's quota)
DEFAULT_MAX_LEASES = 4096
# a request priority above this jumps every other client's queue: an operator's grant
DEFAULT_MAX_PRIORITY = 0
# a prewarm holds warm sandboxes no longer than this past its within_s unless configured
DEFAULT_MAX_PREWARM_HOLD_S = 3600.0


def not_recyclable(params: PoolParams, templates: dict[str, TemplateSpec]) -> list[str]:
    """The templates of a pool with `recycle` on that do not allow it (empty when it is
    off): such a pool is refused, by the config file and by PUT /v1/pools/{name}."""
    if not params.recycle:
        return []
    return [t for t in params.templates if t in templates and not templates[t].recyclable]


class ClientQuota(BaseModel):
    """What one client token may do; None (sent as null): no limit of that kind."""

    model_config = ConfigDict(extra="forbid")

    max_leases: int | None = Field(DEFAULT_MAX_LEASES, ge=0, description="leases held at once")
    max_pending: int | None = Field(
        DEFAULT_MAX_PENDING, ge=0, description="acquires waiting at once"
    )
    pools: list[Name] | None = Field(None, description="the pools it may use (None: all)")
    max_priority: int | None = Field(
        DEFAULT_MAX_PRIORITY,
        ge=-1000,
        le=1000,
        description="the highest request priority it may ask for",
    )
    prewarm_pools: list[Name] | None = Field(
        None,
        description="the pools it may prewarm (None: every pool it may use; []: none, "
        "an admin token prewarms for it)",
    )


class ClientSpec(BaseModel):
    """A client token with a quota of its own (it is a client token too)."""

    model_config = ConfigDict(extra="forbid")

    token: str = Field(min_length=16, repr=False)
    quota: ClientQuota = Field(default_factory=ClientQuota)


# --- cloud nodes: the settings of their providers (controlplane/cloud.py, ray_cloud.py) ---


class NodeSettings(BaseModel):
    """What every provider gives the agents it starts, and when it gives a node back."""

    model_config = ConfigDict(extra="forbid")

    idle_release_s: float = Field(
        60.0, gt=0, le=86_400, description="a cloud node empty this long is given back"
    )
    capacity: Capacity = Capacity(cpus=16, memory_mb=65536, slots=64)
    state_dir: Path = Path.home() / ".dsec" / "cloud"
    heartbeat_s: float = Field(1.0, gt=0, le=60)


class CloudConfig(NodeSettings):
    """Cloud nodes as agent processes on this machine's 127.0.1.x (LocalCloudProvider)."""

    provider: Literal["local"] = "local"
    max_nodes: int = Field(ge=1, le=200)
    node_prefix: Name = "cloud"
    boot_delay_s: float = Field(2.0, ge=0, le=3600)


# a Ray node's id is "<prefix>-<12 hex of its Ray node id>": a Name, 32 characters at most
RAY_NODE_PREFIX = r"^[a-z0-9][a-z0-9-]{0,18}$"


class RayConfig(NodeSettings):
    """The pool on a Ray cluster (RayNodes, controlplane/ray_cloud.py): an agent on every
    node that offers `node_resource`; cloud nodes, those that also offer
    `cloud_resource`, asked of Ray's autoscaler when local utilisation passes the
    overflow threshold."""

    provider: Literal["ray"]
    address: str = Field("auto", description="the Ray cluster, as ray.init takes it")
    namespace: str = Field("dsec", min_length=1, description="the Ray namespace of its actors")
    node_resource: str = Field(
        "dsec_node", min_length=1, description="the resource a Ray node offers to be a sandbox node"
    )
    cloud_resource: str = Field(
        "dsec_cloud",
        min_length=1,
        description="the resource a node type of the autoscaler offers to be a cloud node",
    )
    node_prefix: str = Field("ray", pattern=RAY_NODE_PREFIX)
    max_nodes: int = Field(
        0, ge=0, le=200, description="cloud nodes the autoscaler may be asked for (0: none)"
    )
    poll_s: float = Field(1.0, gt=0, le=60, description="how often the cluster's nodes are listed")
    agent_restarts: int = Field(
        -1, ge=-1, description="how often Ray restarts a node's agent that died (-1: always)"
    )

    @model_validator(mode="after")
    def _ray_installed(self) -> RayConfig:
        if importlib.util.find_spec("ray") is None:
            raise ValueError("the ray provider needs Ray: pip install 'dsec[ray]'")
        return self


def _provider(data: object) -> str:
    if isinstance(data, dict):
        return data.get("provider", "local")
    return getattr(data, "provider", "local")


# the control plane's `cloud` setting: {"provider": "ray", ...}, else the local provider
CloudSettings = Annotated[
    Annotated[CloudConfig, Tag("local")] | Annotated[RayConfig, Tag("ray")],
    Discriminator(_provider),
]


MAX_CLAIM_FILES_BYTES = 8 * 1024 * 1024  # by default


class ControlPlaneConfig(MetricsAccess):
    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8700, ge=0, le=65535)
    client_tokens: list[str] = Field(default_factory=list, repr=False)
    clients: list[ClientSpec] = Field(
        default_factory=list, description="client tokens with quotas of their own"
    )
    default_quota: ClientQuota = Field(
        default_factory=ClientQuota, description="the quota of every other client token"
    )
    admin_tokens: list[str] = Field(min_length=1, repr=False)
    agent_token: str = Field(
        min_length=16,
        repr=False,
        description="the join token (DSEC_AGENT_TOKEN): a node that presents it may join as "
        "any node id; nodes dsec starts join with their own node token instead",
    )
    identity_key: str = Field(
        default_factory=new_token,
        min_length=16,
        repr=False,
        description="the key every node's credentials and every lease token derive from "
        "(controlplane/identities.py); `dsec controlplane` keeps it in "
        "<state_dir>/controlplane.key. Unset and without a state_dir: new at every start, "
        "and the nodes join again",
    )
    agent_urls: list[AgentUrlRule] = Field(
        default_factory=lambda: list(LOOPBACK_AGENT_URLS),
        max_length=1000,
        description="the addresses agents may report: http(s)://network or host name, any "
        "port (http://10.1.0.0/16, https://node-1.example.org); loopback unless set",
    )
    pools: dict[Name, PoolParams] = Field(default_factory=lambda: {"default": PoolParams()})
    templates: dict[Name, TemplateSpec] = Field(default_factory=default_templates)
    max_claim_files_bytes: int = Field(
        MAX_CLAIM_FILES_BYTES,
        ge=0,
        le=CLAIM_FILES_CEILING,
        description="the most bytes of files one acquire may write (AcquireRequest.files)",
    )
    tick_s: float = Field(0.25, gt=0, le=60, description="the policy also runs on every event")
    min_tick_gap_s: float = Field(
        0.0, ge=0, le=1, description="events closer than this are decided in one tick"
    )
    heartbeat_timeout_s: float = Field(5.0, gt=0, le=3600)
    resync_s: float = Field(
        3.0,
        ge=0,
        le=3600,
        description="after a start, keyed acquires wait this long for agents to report leases",
    )
    refusal_cooldown_s: float = Field(
        5.0, ge=0, le=3600, description="no placements on a node this long after it refused one"
    )
    node_failure_threshold: int = Field(
        3, ge=1, le=1000, description="failed calls in a row that take a node out of placement"
    )
    node_failure_backoff_s: float = Field(
        2.0, gt=0, le=60, description="first time out of placement; doubles per failure, to 60 s"
    )
    peak_window_s: float = Field(600.0, gt=0, le=86_400, description="'recent' in recent peak")
    cloud: CloudSettings | None = Field(
        None,
        description="cloud overflow: the local provider, or the pool on Ray "
        '({"provider": "ray"}: RayConfig)',
    )
    state_dir: Path | None = Field(
        None, description="where released idempotency keys are kept across restarts"
    )
    policy: PolicyName = Field("dsec", description="dsec, or a baseline to compare it with")
    max_prewarm_hold_s: float = Field(
        DEFAULT_MAX_PREWARM_HOLD_S,
        ge=0,
        le=MAX_PREWARM_S,
        description="the longest hold_s a prewarm may ask for (past it: 422 hold_too_long)",
    )

    @model_validator(mode="after")
    def _consistent(self) -> ControlPlaneConfig:
        for name, spec in self.templates.items():
            if spec.name != name:
                raise ValueError(f"template {name!r} names itself {spec.name!r}")
        for pool, params in self.pools.items():
            unknown = [t for t in params.templates if t not in self.templates]
            if unknown:
                raise ValueError(f"pool {pool!r} keeps unknown templates warm: {unknown}")
            if refused := not_recyclable(params, self.templates):
                raise ValueError(
                    f"pool {pool!r} recycles templates that do not allow it "
                    f"(recyclable: false): {refused}"
                )
        # a token with a quota of its own is a client token like any other
        listed = set(self.client_tokens)
        self.client_tokens += [c.token for c in self.clients if c.token not in listed]
        return self

    @cached_property
    def _quotas(self) -> dict[str, ClientQuota]:
        return {client_id(c.token): c.quota for c in self.clients}

    def quota_of(self, owner: str) -> ClientQuota:
        """The quota of the client `owner` (dsec.tokens.client_id of its token)."""
        return self._quotas.get(owner, self.default_quota)
