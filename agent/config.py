"""The agent's configuration: which node it is, where it listens, what it may hold."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, Field, model_validator

from agent.users import UserRange, default_uid_base
from dsec.addresses import advertised_url, check_advertise_url, listens_everywhere
from dsec.httpkit import MetricsAccess
from dsec.models import Capacity, Name, NodeKind

# The agent relays about 250 MiB per CPU-second of its own at this rate (bench.hostile
# measures it: 32 MiB/s for a 0.5-CPU sandbox took 0.13 cores), so a sandbox flooding
# its output costs the agent about a quarter of its own CPU quota.
RELAY_BYTES_PER_CPU_S = 64 << 20


class AgentConfig(MetricsAccess):
    node_id: Name
    kind: NodeKind = "local"
    host: str = "127.0.0.2"
    port: int = Field(0, ge=0, le=65535)
    advertise_url: Annotated[str, AfterValidator(check_advertise_url)] | None = Field(
        None,
        description="where the control plane and clients reach this agent (http(s)://host"
        "[:port]; without a port, the one it listens on); None: the address it listens on",
    )
    capacity: Capacity = Capacity(cpus=64, memory_mb=65536, slots=128)
    controlplane_url: str | None = None
    ca: Path | None = Field(
        None, description="CA bundle verifying an https control plane (DSEC_CA); None: system's"
    )
    agent_token: str = Field(
        min_length=16,
        repr=False,
        description="what it joins its control plane with: its own node token "
        "(DSEC_NODE_TOKEN) or the pool's join token (DSEC_AGENT_TOKEN)",
    )
    state_dir: Path
    loops_dir: Path | None = Field(
        None,
        description="where the command loops' pipes and scripts go (agent/resident.py); "
        "None: a directory of the state dir's own under /dev/shm where that is a tmpfs, "
        "else the state dir. Every command makes and removes four files there",
    )
    heartbeat_s: float = Field(1.0, gt=0, le=60)
    images_refresh_s: float = Field(10.0, gt=0)
    engine_check_s: float = Field(1.0, gt=0, le=60, description="how often the engine is pinged")
    engine_check_timeout_s: float = Field(5.0, gt=0, le=60, description="a slower answer: down")
    container_check_s: float = Field(
        2.0, gt=0, le=60, description="how often the node looks for containers that died"
    )
    cleanup_on_exit: bool = False
    execs_per_sandbox: int = Field(
        64, ge=1, le=10_000, description="commands one sandbox runs at once; more answer 429"
    )
    execs_per_node: int = Field(
        2048, ge=1, le=1_000_000, description="commands the node runs at once; more answer 429"
    )
    sandbox_uid_base: int | None = Field(
        None,
        ge=1,
        le=2**31 - 1,
        description="the first uid of the node's range, one per sandbox (agent/users.py); "
        "None: derived from the node id",
    )
    sandbox_uid_count: int = Field(65_536, ge=1, le=1 << 24, description="uids in that range")
    output_budget_bytes: int = Field(
        128 << 20,
        ge=1 << 20,
        description="output the node's commands hold in memory at once (one-shot answers "
        "being gathered, chunks being relayed); a tenant holds at most budget / (tenants "
        "holding or waiting + 1), and a command with no room waits, its pipe full",
    )
    relay_bytes_per_cpu_s: int = Field(
        RELAY_BYTES_PER_CPU_S,
        ge=64 << 10,
        description="a sandbox's output relayed per second for each CPU of its template, so "
        "relaying a flood costs the agent less than the sandbox's own CPU quota",
    )
    audit_max_bytes: int = Field(
        64 << 20, ge=4096, description="the audit log's size at which it is rotated"
    )
    audit_files: int = Field(
        5, ge=2, le=1000, description="audit log files kept: the current one and older ones"
    )

    @model_validator(mode="after")
    def _reachable(self) -> AgentConfig:
        # 0.0.0.0 is every address of this machine: not one the control plane can dial
        if listens_everywhere(self.host) and self.advertise_url is None:
            raise ValueError(
                f"host {self.host!r} listens on every address, which is no address to "
                "advertise: say where the control plane and clients reach this agent with "
                "--advertise-url (advertise_url), e.g. http://10.0.0.12:8701"
            )
        return self

    @property
    def sandbox_uids(self) -> UserRange:
        count = self.sandbox_uid_count
        base = self.sandbox_uid_base or default_uid_base(self.node_id, count)
        return UserRange(base, count)

    def advertised(self, bound_url: str) -> str:
        """The URL this agent reports, once it listens at `bound_url`."""
        return advertised_url(bound_url, self.advertise_url)

    @model_validator(mode="after")
    def _metrics_readable(self) -> AgentConfig:
        # an agent has no operator token: a required metrics token must be its own
        if self.require_metrics_token and self.metrics_token is None:
            raise ValueError("require_metrics_token needs a metrics_token (DSEC_METRICS_TOKEN)")
        return self
