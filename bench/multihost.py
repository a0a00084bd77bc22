"""The namespace benchmark: a pool spread over hosts against the same pool on loopback.

    python -m bench.multihost [--rounds 20] [--acquires 30] [--tls] [--json]

Layout `netns`: the control plane and three agents each in a network namespace of its
own, with an address of its own (10.213.0.0/24) on a bridge in a namespace of its own,
and the client in a fifth: every call crosses a veth pair and the bridge over real TCP,
as between hosts. The agents listen on 0.0.0.0 and say where they are with
--advertise-url. Layout `loopback`: the same processes on 127.0.0.x, as `dsec up` runs
them. Both share this machine's one Docker engine (its socket is a file, reachable from
any namespace) and run at once.

A round: `--acquires` acquires at once from a full warm pool, a command in each sandbox
on its agent (straight from the client, not through the control plane), every sandbox
released. Rounds alternate between the layouts, and each starts with both warm pools
full, so that neither is measured while the other refills; a first round of each opens
its client's connections and is not counted. The figure is the client's
warm acquire p99 (`path` warm), netns over loopback; the target (issue 15) is at most
1.5. Exits 1 on a miss, 2 when network namespaces cannot be made (root and iproute2's
`ip` are needed).

`Cluster` and `Namespaces` are what tests/test_multihost.py runs too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import docker

from agent.docker_driver import LABEL_NODE
from bench.stats import latency_summary
from controlplane.config import ControlPlaneConfig
from controlplane.identities import LOOPBACK_AGENT_URLS, Identities, load_or_make_key
from dsec.client import Client, DsecError
from dsec.image import ensure_base_image
from dsec.models import Capacity, PoolParams
from dsec.processes import (
    agent_args,
    child_env,
    dsec_argv,
    interrupt_on_termination,
    node_credentials,
    stop_process,
)
from dsec.statedir import private_dir, write_private
from dsec.tls import TlsFiles, client_ssl, make_local_pool_tls
from dsec.tokens import new_token

TARGET_RATIO = 1.5
WARMUP_ROUNDS = 1  # per layout, before those measured
NS_PREFIX = "dsec-mh"  # every namespace this module makes; leftovers are removed on start
SUBNET = "10.213.0"
START_TIMEOUT_S = 60.0
ANSWER_TIMEOUT_S = 300.0
AGENTS = 3
CONTROLPLANE_PORT, AGENT_PORT = 8700, 8701  # each namespace has ports of its own


class NamespacesUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no `ip`, no permission)."""


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise subprocess.CalledProcessError(done.returncode, ["ip", *args], stderr=done.stderr)


def ours() -> list[str]:
    """The namespaces of this module that exist now."""
    if shutil.which("ip") is None:
        return []
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    names = [line.split()[0] for line in listed.stdout.splitlines() if line.strip()]
    return [n for n in names if n.startswith(f"{NS_PREFIX}-")]


class Namespaces:
    """Network namespaces, one per host, each with one address on a bridge that lives in
    a namespace of its own: nothing is added to this machine's own network. Deleting the
    namespaces deletes their interfaces, the bridge and both ends of every veth pair."""

    def __init__(self, hosts: list[str]) -> None:
        self.hosts = hosts
        self.switch = f"{NS_PREFIX}-switch"

    def name(self, host: str) -> str:
        return f"{NS_PREFIX}-{host}"

    def address(self, host: str) -> str:
        return f"{SUBNET}.{self.hosts.index(host) + 1}"

    def create(self) -> None:
        if os.geteuid() != 0 or shutil.which("ip") is None:
            raise NamespacesUnavailable("network namespaces need root and iproute2's `ip`")
        self.delete(ours())  # a run killed before its cleanup
        try:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for i, host in enumerate(self.hosts, start=1):
                ns = self.name(host)
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name",
                    f"port{i}", "netns", self.switch)  # fmt: skip
                _ip("-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", self.switch, "link", "set", f"port{i}", "master", "br0", "up")
        except subprocess.CalledProcessError as e:
            self.delete(ours())
            raise NamespacesUnavailable(f"{' '.join(e.cmd)}: {e.stderr.strip()}") from e

    def delete(self, names: list[str] | None = None) -> None:
        for ns in names if names is not None else [self.switch, *map(self.name, self.hosts)]:
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip("netns", "del", ns)

    def exec_prefix(self, host: str) -> list[str]:
        return ["ip", "netns", "exec", self.name(host)]


@dataclass
class Child:
    name: str
    proc: asyncio.subprocess.Process
    url: str = ""
    drain: asyncio.Task | None = None


@dataclass
class Cluster:
    """A control plane, `agents` agents and a client process, in namespaces (`netns`) or
    on loopback. `async with` starts it and stops it, whatever happens in between."""

    name: str  # prefix of its node ids: one per cluster
    work: Path
    netns: bool
    tls: bool = False
    agents: int = AGENTS
    warm: int = 30
    namespaces: Namespaces | None = None
    controlplane: Child | None = None
    nodes: list[Child] = field(default_factory=list)
    client: ClientProcess | None = None
    tokens: dict[str, str] = field(default_factory=dict)
    files: TlsFiles | None = None

    @property
    def node_ids(self) -> list[str]:
        return [f"{self.name}-{i}" for i in range(1, self.agents + 1)]

    @property
    def layout(self) -> str:
        return "netns" if self.netns else "loopback"

    def host_of(self, part: str) -> str:
        """The address of `part` (controlplane, a node id, client)."""
        if self.namespaces is not None:
            return self.namespaces.address(part)
        if part in ("controlplane", "client"):
            return "127.0.0.1"
        return f"127.0.0.{self.node_ids.index(part) + 2}"

    def audit_log(self, node_id: str) -> Path:
        return self.work / "state" / f"{node_id}-audit.jsonl"

    async def __aenter__(self) -> Cluster:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        await asyncio.to_thread(ensure_base_image, docker.from_env())
        state = private_dir(self.work / "state")
        (self.work / "logs").mkdir(parents=True, exist_ok=True)
        if self.netns:
            self.namespaces = Namespaces(["controlplane", *self.node_ids, "client"])
            await asyncio.to_thread(self.namespaces.create)
        scheme = "https" if self.tls else "http"
        self.tokens = {
            "DSEC_TOKEN": new_token(),
            "DSEC_ADMIN_TOKEN": new_token(),
            "DSEC_AGENT_TOKEN": new_token(),
        }
        hosts = ["controlplane", *self.node_ids]
        if self.tls:
            self.files = make_local_pool_tls(
                self.work / "tls", self.name, [self.host_of(h) for h in hosts]
            )
        config = ControlPlaneConfig(
            host=self.host_of("controlplane"),
            port=CONTROLPLANE_PORT if self.netns else 0,
            admin_tokens=[self.tokens["DSEC_ADMIN_TOKEN"]],
            client_tokens=[self.tokens["DSEC_TOKEN"]],
            agent_token=self.tokens["DSEC_AGENT_TOKEN"],
            identity_key=load_or_make_key(state),
            # the agents' addresses: the namespaces' network, or loopback
            agent_urls=[f"{scheme}://{SUBNET}.0/24"] if self.netns else list(LOOPBACK_AGENT_URLS),
            pools={
                "default": PoolParams(
                    min_warm=self.warm, max_warm=self.warm, warm_fraction=0, refill_concurrency=8
                )
            },
            state_dir=state,
        )
        config_path = self.work / "controlplane.json"
        secrets = {"client_tokens", "admin_tokens", "agent_token", "identity_key"}
        write_private(config_path, config.model_dump_json(exclude=secrets).encode())
        tls_args = self.files.args() if self.files else []
        self.controlplane = await self._spawn(
            "controlplane",
            "controlplane",
            ["controlplane", "--config", str(config_path), *tls_args],
            self.tokens,
        )
        identities = Identities.of(config)
        for node_id in self.node_ids:
            args = agent_args(
                node_id,
                # in its namespace: every address there, and it says which one is its own
                host="0.0.0.0" if self.netns else self.host_of(node_id),
                port=AGENT_PORT if self.netns else 0,
                controlplane=self.controlplane.url,
                # room for its share of the warm pool and no more: every node holds some
                capacity=Capacity(cpus=32, memory_mb=65536, slots=-(-self.warm // self.agents)),
                state_dir=state,
                heartbeat_s=1.0,
                tls=self.files,
            )
            if self.netns:  # no port: the one it listens on
                args += ["--advertise-url", f"{scheme}://{self.host_of(node_id)}"]
            credentials = node_credentials(identities.node_token(node_id), None)
            self.nodes.append(await self._spawn(node_id, node_id, args, credentials))
        self.client = ClientProcess(
            await self._spawn(
                "client",
                "client",
                [],
                self.tokens,
                argv=[sys.executable, "-m", "bench.multihost", "client", self.controlplane.url]
                + (["--ca", str(self.files.ca)] if self.files else []),
            )
        )
        await self.client.ask(op="ready", nodes=self.node_ids, warm=self.warm)

    async def _spawn(
        self,
        name: str,
        host: str,
        args: list[str],
        credentials: dict[str, str],
        argv: list[str] | None = None,
    ) -> Child:
        prefix = self.namespaces.exec_prefix(host) if self.namespaces else []
        with (self.work / "logs" / f"{name}.log").open("ab") as log:
            proc = await asyncio.create_subprocess_exec(
                *prefix, *(argv or dsec_argv(*args)),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=log,
                env=child_env(credentials), start_new_session=True,
            )  # fmt: skip
        child = Child(name, proc)
        if argv is not None:
            return child  # the client: it answers on stdout
        assert proc.stdout is not None
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), START_TIMEOUT_S)
            child.url = json.loads(line)["url"]
        except (TimeoutError, ValueError, KeyError) as e:
            await stop_process(proc)
            raise RuntimeError(f"{name} did not start: {self.log_tail(name)}") from e
        child.drain = asyncio.create_task(proc.stdout.read())  # never let its pipe fill
        return child

    def log_tail(self, name: str, lines: int = 15) -> str:
        path = self.work / "logs" / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    async def stop(self) -> None:
        """Everything goes, in order: client, agents (which remove their sandboxes), the
        control plane, any container left with one of its node ids, the namespaces."""
        if self.client is not None:
            await self.client.close()
        await asyncio.gather(*(stop_process(n.proc) for n in self.nodes))
        if self.controlplane is not None:
            await stop_process(self.controlplane.proc)
        for child in [*self.nodes, self.controlplane]:
            if child is not None and child.drain is not None:
                with contextlib.suppress(Exception):
                    await child.drain
        await asyncio.to_thread(self._sweep_containers)
        if self.namespaces is not None:
            await asyncio.to_thread(self.namespaces.delete)

    def _sweep_containers(self) -> None:
        client = docker.from_env()
        for node_id in self.node_ids:
            for c in client.containers.list(all=True, filters={"label": f"{LABEL_NODE}={node_id}"}):
                with contextlib.suppress(docker.errors.NotFound):
                    c.remove(force=True)


class ClientProcess:
    """The client, in its own namespace (or on loopback): one JSON command a line in, one
    JSON answer a line out (`client_main`)."""

    def __init__(self, child: Child) -> None:
        self.child = child

    async def ask(self, **command) -> dict:
        proc = self.child.proc
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps(command).encode() + b"\n")
        await proc.stdin.drain()
        line = await asyncio.wait_for(proc.stdout.readline(), ANSWER_TIMEOUT_S)
        if not line:
            raise RuntimeError(f"the client exited ({await proc.wait()}) on {command['op']}")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"client {command['op']}: {answer['error']}")
        return answer

    async def close(self) -> None:
        proc = self.child.proc
        if proc.stdin is not None and not proc.stdin.is_closing():
            proc.stdin.close()
        await stop_process(proc, grace_s=10)


# --- the client -----------------------------------------------------------------


async def ready(client: Client, nodes: list[str], warm: int, timeout_s: float = 180) -> dict:
    """Until every node is registered and healthy and the default pool holds `warm`."""
    started = time.monotonic()
    while True:
        healthy = {n.node_id for n in (await client.nodes()).nodes if n.healthy}
        pool = await client.pool("default")
        if healthy >= set(nodes) and pool.sandboxes.get("warm", 0) >= warm:
            return {"waited_s": round(time.monotonic() - started, 3)}
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"healthy {sorted(healthy)}, pool {pool.sandboxes}")
        await asyncio.sleep(0.1)


async def acquire_round(client: Client, acquires: int) -> dict:
    """`acquires` at once; a command in each on its own agent; every sandbox released."""

    async def acquire() -> tuple:
        started = time.perf_counter()
        sb = await client.acquire(timeout=60)
        return sb, (time.perf_counter() - started) * 1000

    held = await asyncio.gather(*(acquire() for _ in range(acquires)))
    outputs = await asyncio.gather(*(sb.exec(["echo", sb.id]) for sb, _ in held))
    await asyncio.gather(*(sb.release() for sb, _ in held))
    return {
        "samples": [
            {
                "ms": round(ms, 3),
                "path": sb.lease.path,
                "schedule_ms": sb.lease.schedule_ms,
                "node": sb.node,
                "sandbox": sb.id,
                "agent_url": sb.lease.agent_url,
                "exec_ok": out.exit_code == 0 and out.stdout == f"{sb.id}\n",
            }
            for (sb, ms), out in zip(held, outputs, strict=True)
        ]
    }


def first_report(node_id: str, url: str, clock: float = 0.0) -> dict:
    """The smallest heartbeat a node can register with: the first of its incarnation, of
    a node that holds nothing."""
    return {
        "node_id": node_id, "kind": "local", "url": url,
        "capacity": {"cpus": 1, "memory_mb": 1024, "slots": 1},
        "usage": {"cpus": 0, "memory_mb": 0, "slots": 0},
        "incarnation": "probe", "clock": clock, "seq": 1,
    }  # fmt: skip


async def advertise(client: Client, node_id: str, urls: list[str]) -> dict:
    """Join as `node_id` with the join token and register with each of `urls` (a node
    advertising an address others cannot reach): each answer's status and error, and
    the nodes listed after."""
    join = {"Authorization": f"Bearer {os.environ['DSEC_AGENT_TOKEN']}"}
    answers = []
    connector = aiohttp.TCPConnector(ssl=client_ssl(client.ca))
    async with aiohttp.ClientSession(connector=connector) as http:
        async with http.post(f"{client.url}/v1/agents/{node_id}/join", headers=join) as resp:
            node_token = (await resp.json())["node_token"]
        headers = {
            "Authorization": f"Bearer {node_token}",
            "Content-Type": "application/json",
            "Content-Encoding": "gzip",
        }
        for url in urls:
            body = gzip.compress(json.dumps(first_report(node_id, url, time.time())).encode())
            put = http.put(f"{client.url}/v1/agents/{node_id}", data=body, headers=headers)
            async with put as r:
                error = (await r.json()).get("error")
                answers.append({"url": url, "status": r.status, "error": error})
    return {"answers": answers, "listed": [n.node_id for n in (await client.nodes()).nodes]}


async def client_main(url: str, ca: str | None) -> int:
    ops = {
        "ready": lambda c, cmd: ready(c, cmd["nodes"], cmd["warm"]),
        "round": lambda c, cmd: acquire_round(c, cmd["acquires"]),
        "advertise": lambda c, cmd: advertise(c, cmd["node_id"], cmd["urls"]),
    }
    async with Client(url, os.environ["DSEC_ADMIN_TOKEN"], ca=ca) as client:
        while line := await asyncio.to_thread(sys.stdin.readline):
            command = json.loads(line)
            try:
                answer = await ops[command["op"]](client, command)
            except (DsecError, aiohttp.ClientError, TimeoutError, KeyError, OSError) as e:
                answer = {"error": f"{type(e).__name__}: {e}"}
            print(json.dumps(answer), flush=True)
    return 0


# --- the benchmark ----------------------------------------------------------------


async def measure(work: Path, rounds: int, acquires: int, tls: bool) -> dict:
    async with (  # namespaces first: where they cannot be made, nothing else starts
        Cluster("mh-ns", work / "netns", netns=True, tls=tls, warm=acquires) as netns,
        Cluster("mh-lo", work / "loopback", netns=False, tls=tls, warm=acquires) as loopback,
    ):
        clusters = [loopback, netns]
        samples: dict[str, list[dict]] = {c.layout: [] for c in clusters}
        # the first round of each opens its client's connections: not counted
        for r in range(-WARMUP_ROUNDS, rounds):
            for cluster in clusters if r % 2 == 0 else clusters[::-1]:
                for each in clusters:  # both full: no refill runs beside the measured round
                    assert each.client is not None
                    await each.client.ask(op="ready", nodes=each.node_ids, warm=acquires)
                assert cluster.client is not None
                answer = await cluster.client.ask(op="round", acquires=acquires)
                if r >= 0:
                    samples[cluster.layout] += answer["samples"]
    return summarise(samples, rounds, acquires, tls)


def warm_figures(got: list[dict]) -> dict:
    """The figures of acquire_round's samples: warm acquires as the client and the
    server timed them, how many were not warm, the nodes, the commands that failed."""
    warm = [s for s in got if s["path"] == "warm"]
    return {
        "warm_acquire_ms": latency_summary([s["ms"] for s in warm]),
        "server_schedule_ms": latency_summary([s["schedule_ms"] for s in warm]),
        "not_warm": len(got) - len(warm),
        "nodes": sorted({s["node"] for s in got}),
        "execs_failed": sum(not s["exec_ok"] for s in got),
    }


def summarise(samples: dict[str, list[dict]], rounds: int, acquires: int, tls: bool) -> dict:
    layouts = {layout: warm_figures(got) for layout, got in samples.items()}
    p99 = {layout: figures["warm_acquire_ms"]["p99"] for layout, figures in layouts.items()}
    ratio = p99["netns"] / p99["loopback"]
    return {
        "rounds": rounds,
        "acquires": acquires,
        "tls": tls,
        "layouts": layouts,
        "p99_ratio": round(ratio, 3),
        "target_ratio": TARGET_RATIO,
        "met": ratio <= TARGET_RATIO,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.multihost", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    client = sub.add_parser("client", help="(internal) the client process of a cluster")
    client.add_argument("url")
    client.add_argument("--ca")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--acquires", type=int, default=30)
    parser.add_argument("--tls", action="store_true", help="every service on HTTPS, both layouts")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "client":
        return asyncio.run(client_main(args.url, args.ca))
    if args.rounds < 1 or args.acquires < 1:
        parser.error("--rounds and --acquires must be at least 1")
    with tempfile.TemporaryDirectory(prefix="dsec-multihost-") as work:
        try:
            report = asyncio.run(measure(Path(work), args.rounds, args.acquires, args.tls))
        except NamespacesUnavailable as e:
            print(f"bench.multihost: {e}", file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps(report))
    else:
        for layout, figures in report["layouts"].items():
            ms = figures["warm_acquire_ms"]
            print(
                f"{layout:9} warm acquire p50 {ms['p50']:.1f} ms  p99 {ms['p99']:.1f} ms  "
                f"(n={ms['n']}, not warm {figures['not_warm']}, nodes {len(figures['nodes'])}, "
                f"failed execs {figures['execs_failed']})"
            )
        print(
            f"netns / loopback warm acquire p99: {report['p99_ratio']:.2f} "
            f"(target <= {TARGET_RATIO}{', TLS' if report['tls'] else ''}): "
            f"{'met' if report['met'] else 'MISSED'}"
        )
    return 0 if report["met"] else 1


if __name__ == "__main__":
    interrupt_on_termination()  # the pool it starts is stopped on SIGTERM, SIGHUP
    sys.exit(main())
