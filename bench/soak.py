"""Soak: many acquire -> exec -> release cycles on a live pool, checking for leaks.

    python -m bench.soak [--cycles 1000] [--concurrency 16] [--nodes 3] [--warmup 100]
                         [--hostile 0] [--json]

A local pool (a control plane and `--nodes` agents, real processes) serves `--cycles`
cycles, `--concurrency` at a time; each acquires a sandbox, runs `echo` in it, checks
the output and releases it (which removes its container). First come `--warmup` cycles
that are not judged, so allocator and connection-pool warm-up is not called a leak.

Measured at two quiet points, after warm-up and after the run, each time once the
pool has been drained (the policy pauses and destroys every warm sandbox): the
dsec-labelled containers of the pool's nodes, and the open file descriptors, threads
and RSS of the control plane and of each agent; peaks while the cycles run; and,
after the pool stops, the containers its final sweep had to remove (the agents should
have removed their own) and any still there.

A leak, and a non-zero exit, is any of: a failed cycle; a container of the pool left
after a drain or after the stop; a sandbox still leased after the run or the drain; a
process whose fds grew by more than FD_SLACK; a process whose RSS grew by more than
RSS_FLOOR_MB + RSS_SLACK_MB per 1000 cycles it served.

With `--hostile N` (the issue's run uses 2), N hostile tenants, each with a client token
of its own (quota: one lease, their own pool, priority 0), acquire a sandbox after the
warm-up's drain, hold it for the whole judged run and attack without pause while the
cycles run. Odd tenants burn CPU and flood output: a fork bomb of spinning processes up
to the pids limit (a few killed again, to keep room for their own commands),
`yes > /proc/1/fd/1` (the container log), and one command after another that prints as
fast as it can past a small max_output_bytes. Even tenants hold 40 concurrent long
commands (`sleep 600`, cancelled at the end), fill their /work through the files API (a
file nearly its size, then writes that no longer fit, and every tenth one bigger than
the whole work dir: 413 file_too_large), try path escapes (400) and, every few seconds,
more commands at once than the agent allows (429 too_many_execs). Every tenant also asks
for a second lease (429 lease_quota), another pool (403), a higher priority (403), lists
sandboxes (only its own), and reaches for its neighbour's sandbox (lease 404, release
403, exec with its own lease token 401/403). Every answer is counted by attack and
outcome; one that is not the expected one (an escape that worked, a 5xx, a dropped
connection) is a failure, and a non-zero exit. The cycles start once each tenant has
made every attack it repeats; the RSS baseline is taken then (fds are still judged from
the quiet point after warm-up). At the end their sandboxes are released, and their
containers must be gone within GONE_TIMEOUT_S. With or without them, no sandbox of the
control plane may hold a lease (`Client.list()` with the operator token) after the run
and after the drain.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import docker
from docker.errors import DockerException

from agent.config import AgentConfig
from agent.docker_driver import LABEL_NODE, LABEL_SANDBOX
from agent.node import HIBERNATED_REPOSITORY
from bench.stats import summary_ms
from controlplane.config import ClientQuota, ClientSpec, default_templates
from dsec.client import Client, DsecError, Sandbox
from dsec.launch.local import LocalPool, LocalPoolError, LocalPoolSpec
from dsec.models import Capacity, PoolParams
from dsec.processes import interrupt_on_termination
from dsec.tables import format_table
from dsec.tokens import new_token

# Socket pools (the Docker SDK's towards the engine, aiohttp's between the control plane
# and the agents) and thread pools fill lazily and keep what they opened: drained and
# idle, an agent's fd count wandered within 12 over 2000 cycles (measured, 3 nodes,
# concurrency 16). A leak of one fd per cycle shows as hundreds.
FD_SLACK = 20
# RSS may grow by RSS_FLOOR_MB plus RSS_SLACK_MB per 1000 cycles the process served (all
# for the control plane, its own sandboxes' for an agent). The floor: Python's allocator
# takes memory in 1 MiB arenas, so RSS moves in steps. The slope: by design the processes
# keep bounded tombstones (released ids and idempotency keys, 100k each: ~0.35 KB a
# cycle); measured, the Python heap grows by no more than that (tracemalloc) while RSS
# grows 1-3 MB per 1000 cycles served after a 100-cycle warm-up, the allocator's own.
RSS_FLOOR_MB = 2.0
RSS_SLACK_MB = 4.0
DRAIN_TIMEOUT_S = 180.0
SAMPLE_EVERY_S = 1.0
ACQUIRE_TIMEOUT_S = 120.0
QUIET_S = 2.0  # after a drain, for closed connections and ended tasks to be let go
# the sandbox's CPU time in ns: cgroup v1 (cpuacct, mounted alone or with cpu), else v2
CPU_USAGE_NS = (
    "cat /sys/fs/cgroup/cpuacct/cpuacct.usage 2>/dev/null"
    " || cat /sys/fs/cgroup/cpu,cpuacct/cpuacct.usage 2>/dev/null"
    " || awk '/^usage_usec/ {printf \"%d\\n\", $2 * 1000}' /sys/fs/cgroup/cpu.stat"
)

# Warm sandboxes past the target are paused at once, and paused ones destroyed at
# once (before they could hibernate): the policy itself empties the pool.
DRAIN = PoolParams(
    min_warm=0, max_warm=0, templates=[], freeze_after_s=0.01, scale_down_step=1.0,
    frozen_ttl_s=0.01, hibernate_after_s=86_400,
)  # fmt: skip


# --- a pool and its containers (shared with bench.neighbour) ---------------------


@dataclass
class Teardown:
    swept: int = -1  # containers LocalPool.stop removed itself: the agents had not
    left: int = -1  # containers of the pool still present after the stop


def pool_containers(node_ids: list[str]) -> int:
    """Containers (any state, as `docker ps -a`) labelled with one of these nodes."""
    client = docker.from_env()
    found = client.containers.list(all=True, sparse=True, filters={"label": LABEL_NODE})
    nodes = set(node_ids)
    return sum(1 for c in found if (c.attrs.get("Labels") or {}).get(LABEL_NODE) in nodes)


def hibernated_images(node_ids: list[str]) -> int:
    """Snapshots of hibernated sandboxes of these nodes (tagged with the sandbox id)."""
    client = docker.from_env()
    tags = [t for img in client.images.list(name=HIBERNATED_REPOSITORY) for t in img.tags]
    prefixes = tuple(f"{HIBERNATED_REPOSITORY}:{n}." for n in node_ids)
    return sum(1 for t in tags if t.startswith(prefixes))


def bench_spec(kind: str, nodes: int, slots: int) -> LocalPoolSpec:
    """A pool of its own (unique name, fresh state dir) that serves nothing until told."""
    return LocalPoolSpec(
        name=f"bench-{kind}-{uuid.uuid4().hex[:6]}", nodes=nodes, port=0,
        capacity=Capacity(cpus=1000, memory_mb=1 << 20, slots=slots),
        pool=PoolParams(min_warm=0), state_dir=Path(tempfile.mkdtemp()),
    )  # fmt: skip


@asynccontextmanager
async def local_pool(spec: LocalPoolSpec, teardown: Teardown) -> AsyncIterator[LocalPool]:
    """A started pool, stopped on the way out however the body ends (error, Ctrl-C)."""
    pool = LocalPool(spec)
    try:
        async with pool:
            yield pool
    finally:
        teardown.swept = pool.swept
        teardown.left = await asyncio.to_thread(pool_containers, pool.node_ids)
        shutil.rmtree(spec.state_dir, ignore_errors=True)  # bench_spec's temporary dir


def run_to_report(
    name: str, bench: Coroutine[Any, Any, dict], render: Callable[[dict], str], as_json: bool
) -> dict:
    """Run a live benchmark and print its report (JSON or table). On Ctrl-C or a
    failure, the pool is stopped and the process exits: 130, or 1 with the reason."""
    try:
        report = asyncio.run(bench)
    except KeyboardInterrupt:
        print(f"{name}: interrupted; the pool was stopped", file=sys.stderr)
        raise SystemExit(130) from None
    except (LocalPoolError, RuntimeError, DsecError, aiohttp.ClientError, DockerException) as e:
        print(f"{name}: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    print(json.dumps(report, indent=2) if as_json else render(report))
    return report


# --- process figures ---------------------------------------------------------------


@dataclass
class ProcessSample:
    fds: int
    threads: int
    rss_kb: int


def sample_process(pid: int) -> ProcessSample:
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(re.findall(r"^(\w+):\s+(\d+)", status, re.MULTILINE))
    return ProcessSample(
        fds=len(os.listdir(f"/proc/{pid}/fd")),
        threads=int(fields["Threads"]),
        rss_kb=int(fields["VmRSS"]),
    )


def pool_pids(pool: LocalPool) -> dict[str, int]:
    assert pool.controlplane is not None
    return {"controlplane": pool.controlplane.proc.pid} | {a.name: a.proc.pid for a in pool.agents}


@dataclass
class Snapshot:
    containers: int
    processes: dict[str, ProcessSample]


async def snapshot(pool: LocalPool) -> Snapshot:
    containers = await asyncio.to_thread(pool_containers, pool.node_ids)
    return Snapshot(containers, {n: sample_process(p) for n, p in pool_pids(pool).items()})


@dataclass
class Peaks:
    containers: int = 0
    processes: dict[str, ProcessSample] = field(default_factory=dict)

    def add(self, snap: Snapshot) -> None:
        self.containers = max(self.containers, snap.containers)
        for name, s in snap.processes.items():
            p = self.processes.setdefault(name, s)
            self.processes[name] = ProcessSample(
                max(p.fds, s.fds), max(p.threads, s.threads), max(p.rss_kb, s.rss_kb)
            )


async def sample_until(pool: LocalPool, peaks: Peaks, done: asyncio.Event) -> None:
    while not done.is_set():
        peaks.add(await snapshot(pool))
        try:
            await asyncio.wait_for(done.wait(), SAMPLE_EVERY_S)
        except TimeoutError:
            pass


# --- the cycles ------------------------------------------------------------------


@dataclass
class CycleStats:
    acquire_s: list[float] = field(default_factory=list)
    exec_s: list[float] = field(default_factory=list)
    release_s: list[float] = field(default_factory=list)
    completed: int = 0
    by_node: Counter[str] = field(default_factory=Counter)  # cycles each node served
    errors: list[str] = field(default_factory=list)


async def one_cycle(client: Client, pool: str, i: int, stats: CycleStats) -> None:
    started = time.perf_counter()
    sb = await client.acquire(pool=pool, timeout=ACQUIRE_TIMEOUT_S)
    stats.acquire_s.append(time.perf_counter() - started)
    stats.by_node[sb.node] += 1
    try:
        started = time.perf_counter()
        result = await sb.exec(["echo", f"cycle-{i}"], timeout=30)
        stats.exec_s.append(time.perf_counter() - started)
        if (result.exit_code, result.stdout) != (0, f"cycle-{i}\n"):
            raise RuntimeError(f"exec answered {result.exit_code} {result.stdout!r}")
    finally:
        started = time.perf_counter()
        await sb.release()
        stats.release_s.append(time.perf_counter() - started)


async def run_cycles(pool: LocalPool, name: str, cycles: int, concurrency: int) -> CycleStats:
    """On a client of their own, closed at the end: the sockets its keep-alive connections
    hold open in the agents are not the agents' to answer for."""
    stats = CycleStats()
    todo = iter(range(cycles))

    async def worker(client: Client) -> None:
        while (i := next(todo, None)) is not None:
            try:
                await one_cycle(client, name, i, stats)
                stats.completed += 1
            except Exception as e:  # counted and reported: the soak goes on
                stats.errors.append(f"cycle {i}: {type(e).__name__}: {e}")

    async with Client(pool.url, token=pool.tokens.client) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return stats


async def drain(operator: Client, name: str) -> float:
    """Empty pool `name` through the policy; returns the seconds until the control plane
    knew none of its sandboxes. Docker should then show none of their containers either
    (a removal is done before it is answered): any it shows has leaked."""
    await operator.set_pool(name, DRAIN)
    started = time.perf_counter()
    while await operator.list(pool=name):
        if time.perf_counter() - started > DRAIN_TIMEOUT_S:
            raise RuntimeError(f"pool {name} still had sandboxes {DRAIN_TIMEOUT_S:.0f} s on")
        await asyncio.sleep(0.25)
    took = time.perf_counter() - started
    await asyncio.sleep(QUIET_S)
    return took


# --- hostile tenants ----------------------------------------------------------------

HOSTILE_POOL = "hostile"  # theirs alone: created for each request, removed on release
# Requests only (nothing kept warm); their quota allows one lease, this pool, priority 0.
HOSTILE_PARAMS = PoolParams(min_warm=0, max_warm=0, templates=[])
HOSTILE_QUOTA = ClientQuota(max_leases=1, max_pending=2, pools=[HOSTILE_POOL], max_priority=0)
TEMPLATE = default_templates()["base"]  # what every sandbox here runs
MiB = 1 << 20
PIDS_RESERVE = 16  # pids the fork bomb gives back, for the burner's own commands
FLOOD_CAP = 64 * 1024  # max_output_bytes of a flooding command
FLOOD_S = 2.0  # each flooding command runs this long (then times out: 124)
LONG_EXECS = 40  # `sleep 600` held at once by an exec-holding tenant
EXEC_LIMIT = AgentConfig.model_fields["execs_per_sandbox"].default  # the agents' default
EXEC_BURST = EXEC_LIMIT - LONG_EXECS + 8  # beside the long ones: some must be refused
EXEC_BURST_EVERY_S = 10.0
BALLAST_BYTES = (TEMPLATE.workdir_mb - 8) * MiB  # fits, and leaves /work nearly full
OVERFLOW_BYTES = 16 * MiB  # no longer fits beside the ballast
WHOLE_BYTES = (TEMPLATE.workdir_mb + 1) * MiB  # more than the whole work dir holds
PROBE_EVERY_S = 1.0  # quota, neighbour and path-escape attempts, one per period
GONE_TIMEOUT_S = 60.0  # a released container goes within 30 s at the latest (docs/architecture.md)
ARM_TIMEOUT_S = 120.0
PRIME_TIMEOUT_S = 300.0
SETTLE_TIMEOUT_S = 60.0  # for the agent to end the commands of a tenant that hung up

# The fork bomb: spinners that first block on a FIFO (so forking is not starved by the
# ones already spinning in the sandbox's CPU quota), forked until the pids limit refuses;
# then PIDS_RESERVE of them are killed (builtins only until then: nothing else could
# fork), the rest reniced to 19, so that the tenant's floods (and the agent's kills of
# its timed-out commands) get its CPU first and the spinners all the rest, and released.
BURN = r"""
rm -f /tmp/spin /tmp/gate; mkfifo /tmp/gate; exec 3<>/tmp/gate
( i=0; while [ $i -lt 4096 ]; do
    sh -c 'read x; while :; do :; done' <&3 >/dev/null 2>&1 &
    echo $! >> /tmp/spin; i=$((i+1))
  done ) </dev/null >/dev/null 2>&1
n=0; while [ $n -lt RESERVE ] && read p; do kill $p; n=$((n+1)); done < /tmp/spin
all=; while read p; do all="$all $p"; done < /tmp/spin
renice -n 19 $all >/dev/null 2>&1
i=0; while [ $i -lt 4096 ]; do echo; i=$((i+1)); done >&3
g=/sys/fs/cgroup/pids; [ -r $g/pids.events ] || g=/sys/fs/cgroup
read e < $g/pids.events; read c < $g/pids.current; read m < $g/pids.max
echo "events $e current $c max $m killed $n"
""".replace("RESERVE", str(PIDS_RESERVE))
LOG_FLOOD = "yes > /proc/1/fd/1 2>/dev/null </dev/null & echo started"
OUTPUT_FLOOD = ["sh", "-c", "yes out & yes err >&2"]
COUNT_LONG = "ps -o args | grep -c '^sleep 600$' || true"  # grep answers 1 on none
COUNT_FLOODS = "ps -o args | grep -cE '^yes (out|err)$' || true"
BURNED = re.compile(r"events max (\d+) current (\d+) max (\S+) killed (\d+)")


# the attacks each role repeats, which it makes once before the judged run starts
REPEATED = {
    "cpu": {"output_flood"},
    "execs": {"write_bigger_than_work_dir", "write_into_full_work_dir", "exec_past_limit"},
}
QUOTA_PROBES = {"acquire_past_quota", "acquire_other_pool", "acquire_high_priority"}
NEIGHBOUR_PROBES = {"lease_neighbours", "release_neighbours", "exec_in_neighbours"}


def repeated(role: str, tenants: int) -> set[str]:
    """Every attack a tenant of `role` repeats, among `tenants` tenants."""
    return (
        REPEATED[role] | QUOTA_PROBES | {"list_sandboxes"}
        | (NEIGHBOUR_PROBES if tenants > 1 else set())
        | ({"path_escape"} if role == "execs" else set())
    )  # fmt: skip


def outcome_of(e: BaseException) -> str:
    """An answer as counted: `status code` for a refusal, `error Type` for the rest."""
    if isinstance(e, DsecError):
        return f"{e.status} {e.code}"
    return f"error {type(e).__name__}"


@dataclass
class Tenant:
    name: str
    role: str  # "cpu": burn and flood; "execs": long commands, files, escapes
    token: str = field(repr=False)
    outcomes: dict[str, Counter[str]] = field(default_factory=dict)
    unexpected: int = 0
    unexpected_samples: list[str] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)
    sandbox: Sandbox | None = None
    tasks: list[asyncio.Task] = field(default_factory=list)  # its attacks under way
    # primed: every attack it repeats has been made once (its first round allocated
    # whatever the agent keeps for such work); `pending` are those not made yet
    pending: set[str] = field(default_factory=set)
    primed: asyncio.Event = field(default_factory=asyncio.Event)
    container_gone_s: float | None = None
    containers_left: int = 0

    async def attack(self, name: str, action: Awaitable[str], *expect: str) -> str:
        """Run one attempt; its outcome is what `action` returns (a success, described)
        or the refusal it raised. One that starts with none of `expect` is unexpected."""
        detail = ""
        try:
            outcome = await action
        except Exception as e:  # every answer is data here
            outcome = outcome_of(e)
            detail = str(e)[:160]
        self.outcomes.setdefault(name, Counter())[outcome] += 1
        self.pending.discard(name)
        if not self.pending:
            self.primed.set()
        if not outcome.startswith(expect):
            self.unexpected += 1
            if len(self.unexpected_samples) < 10:
                self.unexpected_samples.append(f"{name}: {outcome} {detail}".rstrip())
        return outcome

    def result(self) -> dict:
        refusals: Counter[str] = Counter()
        for counts in self.outcomes.values():
            refusals.update({o: n for o, n in counts.items() if re.match(r"[45]\d\d ", o)})
        return {
            "tenant": self.name,
            "role": self.role,
            "own_token": True,
            "sandbox": self.sandbox.id if self.sandbox else None,
            "node": self.sandbox.node if self.sandbox else None,
            "attacks": {
                name: {"n": sum(c.values()), "outcomes": dict(c.most_common())}
                for name, c in self.outcomes.items()
            },
            "refusals": dict(refusals.most_common()),
            "unexpected": self.unexpected,
            "unexpected_samples": self.unexpected_samples,
            "facts": self.facts,
            "container_gone_s": self.container_gone_s,
            "containers_left": self.containers_left,
        }


def sandbox_containers(sandbox_id: str) -> int:
    client = docker.from_env()
    return len(client.containers.list(all=True, filters={"label": f"{LABEL_SANDBOX}={sandbox_id}"}))


async def zeros(size: int) -> AsyncIterator[bytes]:
    chunk = bytes(MiB)
    for start in range(0, size, MiB):
        yield chunk[: min(MiB, size - start)]


async def ok(action: Awaitable[Any]) -> str:
    await action
    return "ok"


async def ran(sb: Sandbox, cmd: list[str], timeout: float = 30.0, **kw: Any) -> str:
    """A command's outcome: its exit code, timed out and truncated as they were."""
    r = await sb.exec(cmd, timeout=timeout, **kw)
    return " ".join(
        [str(r.exit_code), *(["timed_out"] if r.timed_out else []),
         *(["truncated"] if r.truncated else [])]
    )  # fmt: skip


async def shell_out(sb: Sandbox, script: str, timeout: float = 30.0) -> str:
    r = await sb.exec(["sh", "-c", script], timeout=timeout)
    if r.exit_code != 0:
        raise RuntimeError(f"{script[:40]!r} answered {r.exit_code} {r.stderr[:200]!r}")
    return r.stdout


async def cpu_ns(sb: Sandbox) -> int:
    """The sandbox's CPU time so far, in ns."""
    return int((await shell_out(sb, CPU_USAGE_NS)).strip())


async def burn(t: Tenant, sb: Sandbox) -> str:
    out = await shell_out(sb, BURN, timeout=120)
    if (m := BURNED.search(out)) is None:
        raise RuntimeError(f"the fork bomb said {out[:200]!r}")
    refused, current, limit, killed = m.groups()
    t.facts |= {
        "pids_limit": limit, "forks_refused_by_pids_limit": int(refused),
        "pids_after_bomb": int(current), "spinners_killed_for_room": int(killed),
        "spinners_left": int(current) - 6,  # init, main, log flood, this exec's sh and cat...
    }  # fmt: skip
    return "ok pids limit hit" if int(refused) else "ok pids limit not hit"


async def flood(sb: Sandbox) -> str:
    r = await sb.exec(OUTPUT_FLOOD, timeout=FLOOD_S, max_output_bytes=FLOOD_CAP)
    if max(len(r.stdout_bytes), len(r.stderr_bytes)) > FLOOD_CAP:
        return f"cap exceeded {len(r.stdout_bytes)} {len(r.stderr_bytes)}"
    return " ".join(
        [str(r.exit_code), *(["timed_out"] if r.timed_out else []),
         *(["truncated"] if r.truncated else [])]
    )  # fmt: skip


async def second_lease(client: Client, **kw: Any) -> str:
    """An acquire the quota must refuse; a sandbox it yields anyway is given back."""
    sb = await client.acquire(timeout=2, **kw)
    await sb.release()
    return "ok granted (released)"


async def foreign_exec(client: Client, own: Sandbox, other: Sandbox) -> str:
    """A command in the neighbour's sandbox, with our own lease token."""
    forged = other.lease.model_copy(update={"lease_token": own.lease.lease_token})
    return "ok ran " + await ran(Sandbox(client, forged), ["id"])


async def sees(client: Client) -> str:
    n = len(await client.list())
    return "ok sees only its own" if n == 1 else f"sees {n} sandboxes"


async def probes(t: Tenant, client: Client, sb: Sandbox, others: list[Tenant]) -> None:
    """Quota, neighbour and (execs role) path-escape attempts, one per PROBE_EVERY_S."""
    escapes: list[Callable[[], Awaitable[Any]]] = [
        lambda: sb.files.write("/etc/passwd", b"root::0:0::/:/bin/sh\n"),
        lambda: sb.files.read("/etc/passwd"),
        lambda: sb.files.read("/work/../etc/shadow"),
        lambda: sb.files.read("/work/etc-link/passwd"),  # a symlink out, resolved inside
        lambda: sb.files.write("/work/etc-link/evil", b"x"),
        lambda: sb.files.list("/proc/1"),
    ]
    Try = tuple[str, Callable[[], Awaitable[str]], tuple[str, ...]]
    tries: list[Try] = [
        ("acquire_past_quota",
         lambda: second_lease(client, pool=HOSTILE_POOL), ("429 lease_quota",)),
        ("acquire_other_pool",
         lambda: second_lease(client, pool="soak"), ("403 pool_not_allowed",)),
        ("acquire_high_priority",
         lambda: second_lease(client, pool=HOSTILE_POOL, priority=1000),
         ("403 priority_not_allowed",)),
        ("list_sandboxes", lambda: sees(client), ("ok sees only its own",)),
    ]  # fmt: skip
    neighbour = next((o for o in others[others.index(t) + 1 :] + others if o is not t), None)
    if neighbour is not None:

        def other() -> Sandbox:
            if neighbour.sandbox is None:
                raise RuntimeError(f"{neighbour.name} holds no sandbox yet")
            return neighbour.sandbox

        tries += [
            ("lease_neighbours", lambda: ok(client.lease(other().id)), ("404 unknown_sandbox",)),
            ("release_neighbours",
             lambda: ok(client.release(other().id, sb.lease.lease_token)), ("403 forbidden",)),
            ("exec_in_neighbours", lambda: foreign_exec(client, sb, other()), ("401 ", "403 ")),
        ]  # fmt: skip
    if t.role == "execs":
        tries += [
            ("path_escape", lambda: ok(escapes[i // len(tries) % len(escapes)]()),
             ("400 ", "429 too_many_execs")),
        ]  # fmt: skip
    i = 0
    while True:
        name, action, expect = tries[i % len(tries)]
        await t.attack(name, action(), *expect)
        i += 1
        await asyncio.sleep(PROBE_EVERY_S)


async def cpu_attacks(t: Tenant, sb: Sandbox) -> None:
    await t.attack("log_flood_start", ran(sb, ["sh", "-c", LOG_FLOOD]), "0")
    await t.attack("fork_bomb_to_pids_limit", burn(t, sb), "ok pids limit hit")
    t.facts["cpu_ns_armed"] = await cpu_ns(sb)
    t.facts["armed_at"] = time.perf_counter()

    async def floods() -> None:
        while True:
            await t.attack("output_flood", flood(sb), "124 timed_out")

    t.tasks.append(asyncio.create_task(floods()))


async def exec_attacks(t: Tenant, sb: Sandbox) -> None:
    await shell_out(sb, "ln -sfn /etc /work/etc-link")
    await t.attack("fill_work_dir", ok(sb.files.write("/work/ballast", zeros(BALLAST_BYTES))), "ok")
    t.facts["ballast_mb"] = BALLAST_BYTES // MiB

    async def hold_long() -> None:
        while True:  # until cancelled; one that ends (600 s) or is refused starts again
            t.facts["long_execs_started"] = t.facts.get("long_execs_started", 0) + 1
            outcome = await t.attack(
                "long_exec", ran(sb, ["sleep", "600"], 900), "0", "429 too_many_execs"
            )
            if outcome != "0":
                await asyncio.sleep(1)

    t.tasks += [asyncio.create_task(hold_long()) for _ in range(LONG_EXECS)]
    started = time.perf_counter()
    while (running := int(await shell_out(sb, COUNT_LONG))) < LONG_EXECS:
        if time.perf_counter() - started > ARM_TIMEOUT_S:
            break
        await asyncio.sleep(0.25)
    t.facts["long_execs_running_armed"] = running

    async def enospc() -> None:
        i = 0
        while True:
            whole = i % 10 == 0
            name = "write_bigger_than_work_dir" if whole else "write_into_full_work_dir"
            size = WHOLE_BYTES if whole else OVERFLOW_BYTES
            path = f"/work/over-{i % 3}"
            await t.attack(
                name, ok(sb.files.write(path, zeros(size))), "413 file_too_large",
                "429 too_many_execs",
            )  # fmt: skip
            i += 1
            await asyncio.sleep(0.1)

    async def exec_bursts() -> None:
        while True:
            burst = [
                t.attack("exec_past_limit", ran(sb, ["sleep", "1"]), "0", "429 too_many_execs")
                for _ in range(EXEC_BURST)
            ]
            await asyncio.gather(*burst)
            await asyncio.sleep(EXEC_BURST_EVERY_S)

    t.tasks += [asyncio.create_task(enospc()), asyncio.create_task(exec_bursts())]


async def admitted(sb: Sandbox, script: str) -> tuple[str, float]:
    """`script`'s output, retried while the agent refuses it for the commands it still
    counts in the sandbox (429); and how long it refused."""
    started = time.perf_counter()
    while True:
        try:
            return await shell_out(sb, script), time.perf_counter() - started
        except DsecError as e:
            if e.code != "too_many_execs" or time.perf_counter() - started > SETTLE_TIMEOUT_S:
                raise
            await asyncio.sleep(0.25)


async def measure_after(t: Tenant, sb: Sandbox) -> str:
    """What the attacks came to, measured in the sandbox once their clients hung up."""
    started = time.perf_counter()
    if t.role == "cpu":
        cores = (await cpu_ns(sb) - t.facts.pop("cpu_ns_armed")) / 1e9
        seconds = time.perf_counter() - t.facts.pop("armed_at")
        t.facts["cpu_cores_used"] = round(cores / seconds, 3)
        t.facts["template_cpus"] = TEMPLATE.cpus
        # a timed-out flood's processes are killed with it; the log flood's `yes` stays
        left, _ = await admitted(sb, COUNT_FLOODS)
        t.facts["flood_processes_left"] = int(left)
        return "ok"
    # the agent kills the commands whose clients hung up, and counts them until it has
    running, waited = await admitted(sb, COUNT_LONG)
    t.facts["execs_refused_after_cancel_s"] = round(waited, 1)
    t.facts["long_execs_running_when_admitted"] = int(running)
    while int(running) and time.perf_counter() - started < SETTLE_TIMEOUT_S:
        await asyncio.sleep(0.5)
        running, _ = await admitted(sb, COUNT_LONG)
    t.facts["long_execs_left"] = int(running)
    t.facts["long_execs_gone_after_cancel_s"] = round(time.perf_counter() - started, 1)
    return "ok"


async def tenant_life(t: Tenant, url: str, others: list[Tenant], stop: asyncio.Event) -> None:
    """Acquire, arm, attack until `stop`, measure, release, see the container go."""
    async with Client(url, token=t.token) as client:
        async with client.sandbox(pool=HOSTILE_POOL, timeout=ACQUIRE_TIMEOUT_S) as sb:
            t.sandbox = sb
            t.pending = repeated(t.role, len(others))
            try:
                await (cpu_attacks if t.role == "cpu" else exec_attacks)(t, sb)
                t.tasks.append(asyncio.create_task(probes(t, client, sb, others)))
                await stop.wait()
            finally:
                t.primed.set()  # (also when it failed: the caller then sees why)
                for task in t.tasks:
                    task.cancel()
                await asyncio.gather(*t.tasks, return_exceptions=True)
            await t.attack("measure_after", measure_after(t, sb), "ok")
            await t.attack("release", ok(sb.release()), "ok")
    started = time.perf_counter()
    while (left := await asyncio.to_thread(sandbox_containers, sb.id)) and (
        time.perf_counter() - started < GONE_TIMEOUT_S
    ):
        await asyncio.sleep(0.5)
    t.containers_left = left
    t.container_gone_s = None if left else round(time.perf_counter() - started, 1)


@asynccontextmanager
async def hostile_tenants(pool: LocalPool, tokens: list[str]) -> AsyncIterator[list[Tenant]]:
    """The tenants, attacking, for the body of the block, which starts once each has made
    every attack it repeats (or PRIME_TIMEOUT_S passed: `facts["primed"]` says so);
    stopped, released and their containers checked on the way out."""
    tenants = [
        Tenant(f"hostile-{i + 1}", "cpu" if i % 2 == 0 else "execs", token)
        for i, token in enumerate(tokens)
    ]
    stop = asyncio.Event()
    lives = [asyncio.create_task(tenant_life(t, pool.url, tenants, stop)) for t in tenants]
    try:
        started = time.perf_counter()
        for t, life in zip(tenants, lives, strict=True):
            primed = asyncio.create_task(t.primed.wait())
            left = max(0.0, PRIME_TIMEOUT_S - (time.perf_counter() - started))
            await asyncio.wait([primed, life], timeout=left, return_when=asyncio.FIRST_COMPLETED)
            primed.cancel()
            if life.done():
                life.result()  # raises why it could not start
            t.facts["primed"] = not t.pending or sorted(t.pending)  # else: what it had not made
        yield tenants
    finally:
        stop.set()
        await asyncio.gather(*lives)


async def leases_held(operator: Client) -> int:
    """Sandboxes the control plane knows with a lease, every client's."""
    return sum(1 for s in await operator.list() if s.lease_id is not None)


# --- the run and its verdict ------------------------------------------------------


@dataclass
class Leases:
    after_run: int = -1  # held once every cycle and tenant released, before the drain
    after_drain: int = -1


async def soak(cycles: int, concurrency: int, nodes: int, warmup: int, hostile: int) -> dict:
    spec = bench_spec("soak", nodes, slots=4 * concurrency)
    tokens = [new_token() for _ in range(hostile)]  # a client token each, with its quota
    spec.clients = [ClientSpec(token=token, quota=HOSTILE_QUOTA) for token in tokens]
    serving = PoolParams(min_warm=concurrency, max_warm=2 * concurrency, templates=["base"])
    teardown = Teardown()
    leases = Leases()
    async with local_pool(spec, teardown) as pool:
        async with Client(pool.url, token=pool.tokens.admin) as operator:
            initial = await snapshot(pool)
            await operator.set_pool("soak", serving)
            warm = await run_cycles(pool, "soak", warmup, concurrency)
            await drain(operator, "soak")
            start = await snapshot(pool)

            await operator.set_pool(HOSTILE_POOL, HOSTILE_PARAMS)
            await operator.set_pool("soak", serving)
            async with hostile_tenants(pool, tokens) as tenants:
                # the RSS baseline once the tenants made each of their attacks: what the
                # first round makes a process allocate (buffers, arenas), it keeps.
                # Measured, one agent under the exec-holding tenant alone for 6 min: RSS
                # +4.1 MB in the first 15 s, +1.2 MB over the next 3.5 min, then flat;
                # fds 12 before, ~127 while it attacked, 14 after. fds are judged from
                # `start`, before the tenants came.
                primed = await snapshot(pool) if tenants else start
                peaks, done = Peaks(), asyncio.Event()
                sampler = asyncio.create_task(sample_until(pool, peaks, done))
                started = time.perf_counter()
                try:
                    stats = await run_cycles(pool, "soak", cycles, concurrency)
                finally:
                    done.set()
                    await sampler
                run_s = time.perf_counter() - started
            leases.after_run = await leases_held(operator)
            drain_s = await drain(operator, "soak")
            await drain(operator, HOSTILE_POOL)
            leases.after_drain = await leases_held(operator)
            end = await snapshot(pool)
            images = await asyncio.to_thread(hibernated_images, pool.node_ids)
    return report(
        cycles, concurrency, nodes, warm, stats, initial, start, primed, peaks, end, teardown,
        images, run_s, drain_s, [t.result() for t in tenants], leases,
    )  # fmt: skip


def report(
    cycles: int,
    concurrency: int,
    nodes: int,
    warm: CycleStats,
    stats: CycleStats,
    initial: Snapshot,
    start: Snapshot,
    primed: Snapshot,
    peaks: Peaks,
    end: Snapshot,
    teardown: Teardown,
    images: int,
    run_s: float,
    drain_s: float,
    tenants: list[dict],
    leases: Leases,
) -> dict:
    processes = {}
    leaks = []
    for name, s in start.processes.items():
        e, p, i = end.processes[name], peaks.processes.get(name, s), initial.processes[name]
        b = primed.processes[name]  # the RSS baseline: `start` without hostile tenants
        growth_mb = (e.rss_kb - b.rss_kb) / 1024
        served = stats.completed if name == "controlplane" else stats.by_node[name]
        per_1000 = growth_mb * 1000 / max(1, served)
        allowed_mb = RSS_FLOOR_MB + RSS_SLACK_MB * served / 1000
        processes[name] = {
            "cycles_served": served,
            "fds": {"start": s.fds, "peak": p.fds, "end": e.fds},
            "threads": {"start": s.threads, "peak": p.threads, "end": e.threads},
            "rss_mb": {
                "before_warmup": round(i.rss_kb / 1024, 1),
                "start": round(s.rss_kb / 1024, 1),
                "hostile_primed": round(b.rss_kb / 1024, 1),
                "peak": round(p.rss_kb / 1024, 1),
                "end": round(e.rss_kb / 1024, 1),
                "growth": round(growth_mb, 2),  # from hostile_primed (start without them)
                "growth_since_start": round((e.rss_kb - s.rss_kb) / 1024, 2),
                "growth_per_1000_served": round(per_1000, 2),
                "allowed_growth": round(allowed_mb, 2),
            },
        }
        if e.fds - s.fds > FD_SLACK:
            leaks.append(f"{name}: fds {s.fds} -> {e.fds} (more than +{FD_SLACK})")
        if growth_mb > allowed_mb:
            leaks.append(f"{name}: RSS +{growth_mb:.1f} MB (over {allowed_mb:.1f} allowed)")
    if stats.errors or warm.errors:
        leaks.append(f"{len(stats.errors) + len(warm.errors)} cycles failed")
    if end.containers:
        leaks.append(f"{end.containers} containers left after the drain")
    if teardown.swept or teardown.left:
        leaks.append(
            f"at stop: {teardown.swept} containers swept (not removed by their agent), "
            f"{teardown.left} left"
        )
    if images:
        leaks.append(f"{images} hibernated images left")
    if leases.after_run:
        leaks.append(f"{leases.after_run} sandboxes still leased after the run")
    if leases.after_drain:
        leaks.append(f"{leases.after_drain} sandboxes still leased after the drain")
    for t in tenants:
        if t["containers_left"]:
            leaks.append(
                f"{t['tenant']}: its container still there {GONE_TIMEOUT_S:.0f} s after its release"
            )
    unexpected = sum(t["unexpected"] for t in tenants)
    return {
        "cycles": cycles,
        "concurrency": concurrency,
        "nodes": nodes,
        "warmup_cycles": warm.completed,
        "completed": stats.completed,
        "errors": len(stats.errors) + len(warm.errors),
        "error_samples": (warm.errors + stats.errors)[:10],
        "run_s": round(run_s, 1),
        "cycles_per_s": round(stats.completed / run_s, 2) if run_s else None,
        "containers": {
            "start": start.containers,
            "peak": peaks.containers,
            "end_after_drain": end.containers,
            "drain_s": round(drain_s, 1),
            "swept_at_stop": teardown.swept,
            "left_after_stop": teardown.left,
            "hibernated_images_left": images,
        },
        "processes": processes,
        "latency_ms": {
            "acquire": summary_ms(stats.acquire_s),
            "exec": summary_ms(stats.exec_s),
            "release": summary_ms(stats.release_s),
        },
        "thresholds": {
            "fd_slack": FD_SLACK,
            "rss_floor_mb": RSS_FLOOR_MB,
            "rss_slack_mb_per_1000_served": RSS_SLACK_MB,
        },
        "hostile": {
            "tenants": len(tenants),
            "pool": HOSTILE_POOL,
            "quota": HOSTILE_QUOTA.model_dump(),
            "by_tenant": tenants,
            "unexpected_answers": unexpected,
        },
        "leases": {"after_run": leases.after_run, "after_drain": leases.after_drain},
        "leaks": leaks,
        "passed": not leaks and not unexpected,
    }


def render(r: dict) -> str:
    c = r["containers"]
    lines = [
        f"soak: {r['completed']}/{r['cycles']} cycles ({r['warmup_cycles']} warm-up before), "
        f"concurrency {r['concurrency']}, {r['nodes']} nodes, {r['run_s']} s "
        f"({r['cycles_per_s']} cycles/s), errors {r['errors']}",
        f"containers: start {c['start']}, peak {c['peak']}, after drain {c['end_after_drain']} "
        f"(drain {c['drain_s']} s), swept at stop {c['swept_at_stop']}, "
        f"left after stop {c['left_after_stop']}, hibernated images {c['hibernated_images_left']}",
        "",
    ]
    rows = []
    for name, p in r["processes"].items():
        fds, th, rss = p["fds"], p["threads"], p["rss_mb"]
        rows.append([
            name, f"{fds['start']}/{fds['peak']}/{fds['end']}",
            f"{th['start']}/{th['peak']}/{th['end']}",
            rss["before_warmup"], rss["start"], rss["hostile_primed"], rss["peak"], rss["end"],
            f"{rss['growth']:+.2f}", rss["allowed_growth"], p["cycles_served"],
            f"{rss['growth_per_1000_served']:+.2f}",
        ])  # fmt: skip
    headers = ["process", "fds s/pk/e", "threads s/pk/e", "RSS MB: pre-warm", "start",
               "primed", "peak", "end", "growth", "allowed", "served", "per 1000"]  # fmt: skip
    lines += [format_table(headers, rows), ""]
    rows = [
        [op, s["n"], s["p50"], s["p95"], s["p99"], s["max"]] for op, s in r["latency_ms"].items()
    ]
    lines += [format_table(["latency ms", "n", "p50", "p95", "p99", "max"], rows), ""]
    t = r["thresholds"]
    lines.append(
        f"leak thresholds: fds end-start > {t['fd_slack']}; RSS growth (end-primed: the "
        f"hostile tenants' first round made) > {t['rss_floor_mb']} MB "
        f"+ {t['rss_slack_mb_per_1000_served']} MB per 1000 cycles served; any container left "
        "or failed cycle"
    )
    lines += render_hostile(r)
    lines += [f"LEAK: {x}" for x in r["leaks"]] or ["no leak found"]
    lines += [f"  {e}" for e in r["error_samples"]]
    if r["hostile"]["unexpected_answers"]:
        lines.append(f"FAIL: {r['hostile']['unexpected_answers']} unexpected answers to attacks")
    lines.append("PASS" if r["passed"] else "FAIL")
    return "\n".join(lines)


def render_hostile(r: dict) -> list[str]:
    h, leases = r["hostile"], r["leases"]
    lines = [
        f"leased sandboxes (every client's): after the run {leases['after_run']}, "
        f"after the drain {leases['after_drain']}"
    ]
    if not h["tenants"]:
        return lines
    rows = []
    for t in h["by_tenant"]:
        rows.append([
            t["tenant"], t["role"], t["node"],
            sum(a["n"] for a in t["attacks"].values()), sum(t["refusals"].values()),
            t["unexpected"], t["container_gone_s"], t["containers_left"],
        ])  # fmt: skip
    headers = ["hostile tenant", "role", "node", "attempts", "refused",
               "unexpected", "gone after s", "left"]  # fmt: skip
    lines += ["", format_table(headers, rows), ""]
    for t in h["by_tenant"]:
        lines.append(f"{t['tenant']} ({t['role']}):")
        for name, a in t["attacks"].items():
            outcomes = ", ".join(f"{o}: {n}" for o, n in a["outcomes"].items())
            lines.append(f"  {name} x{a['n']}: {outcomes}")
        lines.append("  " + ", ".join(f"{k} {v}" for k, v in t["facts"].items()))
        lines += [f"  UNEXPECTED {u}" for u in t["unexpected_samples"]]
    return [*lines, ""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=100, help="cycles before the judged run")
    parser.add_argument(
        "--hostile", type=int, default=0, help="hostile tenants attacking throughout (0-16)"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if (
        args.cycles < 1 or args.concurrency < 1 or not 1 <= args.nodes <= 200 or args.warmup < 0
        or not 0 <= args.hostile <= 16
    ):  # fmt: skip
        print("soak: --cycles, --concurrency and --nodes (<= 200) must be >= 1, "
              "--warmup >= 0, --hostile 0..16", file=sys.stderr)  # fmt: skip
        return 2
    bench = soak(args.cycles, args.concurrency, args.nodes, args.warmup, args.hostile)
    result = run_to_report("soak", bench, render, args.json)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    interrupt_on_termination()  # the pool it starts is stopped on SIGTERM, SIGHUP
    sys.exit(main())
