"""The pool on a Ray cluster: an agent on every Ray node that offers a sandbox-node
resource, and cloud overflow through Ray's autoscaler (the `ray` extra).

`RayNodes` is the control plane's cloud provider (controlplane/cloud.py) when its config
says `"cloud": {"provider": "ray"}`, and a Ray driver. Every `poll_s` it lists the
cluster's live nodes and gives each one that offers `node_resource` an agent: a Ray
actor pinned to that node (NodeAffinitySchedulingStrategy, not soft) that holds one unit
of the resource, so Ray's autoscaler never takes the node for idle while it serves, and
that Ray restarts if it dies (`agent_restarts`). The actor runs `dsec agent` on the
node's own address as its child process, which dies with it (PR_SET_PDEATHSIG); when the
agent dies on its own, the actor exits too, so Ray restarts both. A restarted agent keeps
its node id (from the Ray node's id) and adopts its sandboxes. A node that leaves the
cluster takes its agent with it; the control plane then hears nothing from that node and
reports its sandboxes lost (heartbeat timeout).

Overflow: each ProvisionCloud of the policy adds a bundle `{cloud_resource: 1}` to one
standing request to the autoscaler (ray.autoscaler.sdk.request_resources), which
launches a node of a type that offers it; its agent registers as kind `cloud`. The agent
holds `node_resource`, not `cloud_resource`, so a node that serves still counts towards
the request and no second node is launched for it. ReleaseCloud (a cloud node that
stayed empty) stops that node's agent, which removes its sandboxes, and withdraws one
bundle: the node is then idle, and the autoscaler removes it after its
`idle_timeout_minutes`. Until it does, no agent is started there again, unless the
policy asks for a cloud node meanwhile: then it serves again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# read as Ray is imported: no failure-signal handler of Ray's in the control plane, which
# would report the SIGTERM that stops it as a crash
os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")

import ray  # noqa: E402
from ray.autoscaler.sdk import request_resources  # noqa: E402
from ray.exceptions import ActorUnavailableError  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

from controlplane.config import RayConfig  # noqa: E402
from controlplane.identities import Identities  # noqa: E402
from dsec.httpkit import cancel_and_wait  # noqa: E402
from dsec.models import NodeKind  # noqa: E402
from dsec.processes import (  # noqa: E402
    agent_args,
    child_env,
    dsec_argv,
    node_credentials,
    signalled_at_parent_death,
)
from dsec.statedir import write_private  # noqa: E402
from dsec.tls import TlsFiles  # noqa: E402

log = logging.getLogger(__name__)

AGENT_READY_TIMEOUT_S = 60.0
AGENT_STOP_GRACE_S = 60.0
RETRY_FAILED_S = 10.0  # an agent that could not start (its engine down, say) is tried again


def ray_node_id(ray_id: str, prefix: str) -> str:
    """The dsec node id of a Ray node: the same on every restart of its agent."""
    return f"{prefix}-{ray_id[-12:]}"


@ray.remote(num_cpus=0)
class NodeAgent:
    """`dsec agent` on the Ray node this actor is pinned to, as its child process. A
    restart listens on the port the last start had, kept in the node's state dir, so the
    lease tokens and agent URLs that clients hold still reach it."""

    def __init__(self, node_id: str, settings: dict[str, Any], credentials: dict[str, str]):
        self.node_id, self.settings, self.credentials = node_id, settings, credentials
        self.stopping = False
        self.port_file = Path(settings["state_dir"]) / f"{node_id}-ray-port"
        with contextlib.suppress(OSError, ValueError):
            if self._start(int(self.port_file.read_text())):
                return
        if not self._start(0):
            raise RuntimeError(f"agent {node_id} did not start (exit code {self.proc.poll()})")
        write_private(self.port_file, self.url.rsplit(":", 1)[1].encode())

    def _start(self, port: int) -> bool:
        """Start the agent on `port` (0: any); whether it listens."""
        host = ray.util.get_node_ip_address()
        args = agent_args(self.node_id, host=host, port=port, **self.settings)
        self.url = ""
        self.proc = subprocess.Popen(
            dsec_argv(*args),
            stdout=subprocess.PIPE,
            env=child_env(self.credentials),  # its node token: none of the control plane's
            # killed when the actor's process dies: its sandboxes stay, for the agent Ray
            # restarts to adopt; a node that leaves takes them
            preexec_fn=signalled_at_parent_death(signal.SIGKILL),
        )
        listening = threading.Event()
        threading.Thread(target=self._follow, args=(self.proc, listening), daemon=True).start()
        if listening.wait(AGENT_READY_TIMEOUT_S) and self.url:
            return True
        self.proc.kill()
        self.proc.wait()
        return False

    def _follow(self, proc: subprocess.Popen, listening: threading.Event) -> None:
        assert proc.stdout is not None
        with contextlib.suppress(ValueError, KeyError):
            self.url = json.loads(proc.stdout.readline())["url"]
        listening.set()
        if not self.url:
            return  # it never listened: the start fails instead
        for _ in proc.stdout:  # never let its pipe fill
            pass
        proc.wait()
        if not self.stopping:
            # the agent died on its own: so does this actor, and Ray restarts both
            os._exit(1)

    def ready(self) -> str:
        return self.url

    def stop(self) -> int:
        """SIGTERM: the agent removes its sandboxes on the way out; SIGKILL past the grace."""
        self.stopping = True
        self.proc.terminate()
        try:
            return self.proc.wait(AGENT_STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


@dataclass
class RayAgent:
    node_id: str
    kind: NodeKind
    actor: Any  # ray.actor.ActorHandle
    probe: Any  # ray.ObjectRef of NodeAgent.ready: answered while it lives, failed once dead


class RayNodes:
    """The pool's nodes on a Ray cluster; the control plane's cloud provider."""

    def __init__(
        self,
        config: RayConfig,
        identities: Identities,
        metrics_token: str | None = None,
        tls: TlsFiles | None = None,
    ) -> None:
        self.config = config
        self.max_nodes = config.max_nodes
        self.idle_release_s = config.idle_release_s
        self.identities = identities
        self.metrics_token = metrics_token
        self.tls = tls
        self.agents: dict[str, RayAgent] = {}  # by Ray node id
        self.released: dict[str, NodeKind] = {}  # Ray nodes given back, until they leave
        self.failed_at: dict[str, float] = {}  # Ray nodes whose agent failed for good
        self.asked = 0  # cloud nodes in the standing request to the autoscaler
        self._url = ""
        self._watch: asyncio.Task | None = None
        self._lock = asyncio.Lock()  # one change of agents at a time

    @property
    def controlplane_url(self) -> str:
        return self._url

    @controlplane_url.setter
    def controlplane_url(self, url: str) -> None:
        """The control plane listens at `url`: agents register there; start watching."""
        self._url = url
        if self._watch is None:
            self._watch = asyncio.get_running_loop().create_task(self._watch_nodes())

    # --- CloudProvider ----------------------------------------------------------

    def booting(self, registered: set[str]) -> int:
        serving = sum(
            1 for a in self.agents.values() if a.kind == "cloud" and a.node_id in registered
        )
        return max(0, self.asked - serving)

    async def start_node(self) -> str:
        async with self._lock:
            self.asked += 1
            # a cloud node given back that the autoscaler has not removed yet serves again
            again = next((r for r, kind in self.released.items() if kind == "cloud"), None)
            if again is not None:
                del self.released[again]
            await asyncio.to_thread(self._ask)
        return f"{self.asked} asked of Ray's autoscaler"

    async def stop_node(self, node_id: str) -> None:
        async with self._lock:
            ray_id = next((r for r, a in self.agents.items() if a.node_id == node_id), None)
            if ray_id is None:
                return
            agent = self.agents.pop(ray_id)
            self.released[ray_id] = agent.kind  # no agent there until the node leaves
            await asyncio.to_thread(self._stop_agent, agent)
            if agent.kind == "cloud" and self.asked:
                self.asked -= 1
                await asyncio.to_thread(self._ask)
        log.info("gave back Ray node %s (%s)", ray_id, node_id)

    async def close(self) -> None:
        if self._watch is not None:
            await cancel_and_wait(self._watch)
        async with self._lock:
            agents = list(self.agents.values())
            self.agents.clear()
            await asyncio.gather(*(asyncio.to_thread(self._stop_agent, a) for a in agents))
            if ray.is_initialized():
                if self.asked:
                    self.asked = 0
                    await asyncio.to_thread(self._ask)
                await asyncio.to_thread(ray.shutdown)

    # --- watching the cluster ---------------------------------------------------------

    async def _watch_nodes(self) -> None:
        while True:
            try:
                async with self._lock:
                    await self._look()
            except Exception as e:  # the cluster out of reach a while: the next look may do
                log.warning("looking at the Ray cluster failed: %s", e)
            await asyncio.sleep(self.config.poll_s)

    async def _look(self) -> None:
        if not ray.is_initialized():
            await asyncio.to_thread(self._connect)
        nodes = await asyncio.to_thread(self._sandbox_nodes)
        failed = await asyncio.to_thread(self._failed_agents)
        now = time.monotonic()
        for ray_id in [r for r in self.agents if r not in nodes or r in failed]:
            agent = self.agents.pop(ray_id)
            if ray_id in failed:
                self.failed_at[ray_id] = now
                log.warning("agent %s failed, not restarted: %s", agent.node_id, failed[ray_id])
            else:
                log.warning("Ray node %s left; %s goes with it", ray_id, agent.node_id)
            with contextlib.suppress(Exception):
                await asyncio.to_thread(ray.kill, agent.actor, no_restart=True)
        for gone in [r for r in (*self.released, *self.failed_at) if r not in nodes]:
            self.released.pop(gone, None)
            self.failed_at.pop(gone, None)
        for ray_id, kind in nodes.items():
            if ray_id in self.agents or ray_id in self.released:
                continue
            if now - self.failed_at.get(ray_id, -RETRY_FAILED_S) < RETRY_FAILED_S:
                continue
            agent = await asyncio.to_thread(self._start_agent, ray_id, kind)
            self.agents[ray_id] = agent
            log.info("agent %s starting on Ray node %s (%s)", agent.node_id, ray_id, kind)

    # blocking Ray calls, each run in a thread: the control plane's loop never waits on Ray

    def _connect(self) -> None:
        # in a thread, so Ray sets no SIGTERM handler of its own over the control plane's
        ray.init(
            address=self.config.address,
            namespace=self.config.namespace,
            log_to_driver=False,
            logging_level=logging.WARNING,
        )

    def _sandbox_nodes(self) -> dict[str, NodeKind]:
        """The live Ray nodes that offer a sandbox node, and their kind."""
        found: dict[str, NodeKind] = {}
        for n in ray.nodes():
            resources = n.get("Resources", {})
            if n.get("Alive") and resources.get(self.config.node_resource, 0) >= 1:
                cloud = resources.get(self.config.cloud_resource, 0) > 0
                found[n["NodeID"]] = "cloud" if cloud else "local"
        return found

    def _failed_agents(self) -> dict[str, str]:
        """The agents found dead for good since the last look (a start that failed, or
        restarts used up), and why; each one that answered is probed again."""
        probes = {a.probe: r for r, a in self.agents.items()}
        if not probes:
            return {}
        answered, _ = ray.wait(list(probes), num_returns=len(probes), timeout=0)
        failed = {}
        for ref in answered:
            agent = self.agents[probes[ref]]
            try:
                ray.get(ref)
            except ActorUnavailableError:
                pass  # Ray is restarting it (its agent died): asked again next look
            except Exception as e:
                failed[probes[ref]] = str(e).splitlines()[0] if str(e) else type(e).__name__
                continue
            agent.probe = agent.actor.ready.remote()
        return failed

    def _start_agent(self, ray_id: str, kind: NodeKind) -> RayAgent:
        node_id = ray_node_id(ray_id, self.config.node_prefix)
        settings = {
            "kind": kind,
            "controlplane": self._url,
            "capacity": self.config.capacity,
            "state_dir": self.config.state_dir,
            "heartbeat_s": self.config.heartbeat_s,
            "tls": self.tls,
        }
        credentials = node_credentials(self.identities.node_token(node_id), self.metrics_token)
        actor = NodeAgent.options(
            resources={self.config.node_resource: 1},
            scheduling_strategy=NodeAffinitySchedulingStrategy(ray_id, soft=False),
            max_restarts=self.config.agent_restarts,
        ).remote(node_id, settings, credentials)
        return RayAgent(node_id, kind, actor, probe=actor.ready.remote())

    def _stop_agent(self, agent: RayAgent) -> None:
        with contextlib.suppress(Exception):  # an actor already gone has nothing to stop
            ray.get(agent.actor.stop.remote(), timeout=AGENT_STOP_GRACE_S + 10)
        with contextlib.suppress(Exception):
            ray.kill(agent.actor, no_restart=True)

    def _ask(self) -> None:
        """The standing request to the autoscaler: `asked` cloud nodes (none withdraws it)."""
        request_resources(bundles=[{self.config.cloud_resource: 1}] * self.asked)
