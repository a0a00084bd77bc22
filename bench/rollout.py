"""A GRPO-like rollout step on a real Python template: dsec against a container per
rollout (the Docker SDK) and against llm-sandbox, in the same run, rounds alternating.

    python -m bench.rollout [--groups 8] [--k 8] [--concurrency 16] [--rounds 3]
                            [--calls 20] [--churn-episodes 60] [--churn-concurrency 20]
                            [--image IMAGE] [--json]

The template is Debian bookworm with python3, pytest, git and build-essential
(`dsec.template_build.build_python_template()`, or `--image`), 1 CPU and 512 MB per
sandbox, no network, the same limits on all three sides. A step is `--groups` x `--k`
rollouts, `--concurrency` at a time; each rollout: open (acquire, or create and start),
upload its group's synthetic repository as a tar (`bench.rollout_repo`, ~5 MB; the K
rollouts of a group share it), `--calls` tool calls (python scripts, pytest on the repo's
suite, which must pass, grep -rn, cat, a write through a shell, ls), read back
`result.json` (checked against what it must say), close. The sides:
- dsec: a local 3-node pool (`bench.burst`'s), the template `recyclable` and the pool's
  `recycle` on, its warm target (min_warm) the larger of the two concurrencies; files
  through the agent, commands through the sandbox's command loop where it has one;
- sdk: a container per rollout with the Docker SDK (create and start, put_archive,
  a bare `docker exec` per call: exec create, start, inspect; get_archive, remove);
- llm-sandbox: its Docker backend, a session per rollout (`SandboxDockerSession` on the
  local image with a Docker client that refuses to pull; `copy_to_runtime` of the repo's
  directory, `execute_command`, `copy_from_runtime`, `close`).
Each round runs the three in turn, the order rotating, so the engine's drift over the
run falls on every side alike. Reported per side: episodes/hour, open, upload, read,
close and tool-call latencies (each kind's p50 against the bare docker exec of the same
command), and the CPU the episodes' containers used (the engine's parent cgroup, which
counts removed containers too) against the machine's bound, cpu_s / (wall_s x cores).

Then churn on the same template, `--rounds` rounds of dsec and llm-sandbox in turn:
`--churn-episodes` x (open, 3 x `sh -c 'echo hi'`, close), `--churn-concurrency` at a
time. For each dsec phase the agents' engine calls are counted (their
`dsec_agent_docker_op_seconds` by op): an `exec_start` is a command, or a reset, that
took the engine's exec instead of the command loop; an `exec_detached`, a loop started.

Targets (ratios within the run): episodes/hour >= 2 x sdk's and >= 3 x llm-sandbox's;
tool-call p50 <= 0.5 x the bare docker exec's (the same calls); acquire p99 <= 50 ms;
churn exec p50 <= 0.5 x llm-sandbox's and episodes/s >= 3 x. A failed episode on the
dsec side, or any container left behind, is a miss. Exits 1 on a miss.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import secrets
import shlex
import shutil
import sys
import tarfile
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import docker
from docker.errors import ImageNotFound
from docker.models.images import ImageCollection

from agent.docker_driver import LABEL_NODE, LABEL_POOL, LABEL_SANDBOX, LABEL_TEMPLATE
from bench.burst import (
    CALL_ERRORS,
    NODE_CAPACITY,
    NODES,
    exit_status,
    issue_spec,
    leftovers,
    render_leftovers_and_targets,
    target,
    wait_warm,
)
from bench.churn import pool_churn
from bench.engine_floor import ENGINE_ERRORS, EngineFloor
from bench.host_cpu import host_jiffies
from bench.rollout_repo import (
    RESULT,
    ROOT,
    Repo,
    ToolCall,
    check_output,
    check_result,
    make_repo,
    tool_calls,
)
from bench.soak import Teardown, local_pool, run_to_report
from bench.stats import summary_ms
from dsec.client import Client, SandboxLost
from dsec.launch.local import LocalPool
from dsec.models import PoolParams, TemplateSpec
from dsec.processes import interrupt_on_termination
from dsec.tables import format_table
from dsec.template_build import PYTHON_TEMPLATE_ENV, build_python_template

TEMPLATE = "python"
WORKDIR = "/work"
REPO_DIR = f"{WORKDIR}/{ROOT}"
USER = "1000:1000"  # the image's sandbox user, for the two baselines
CPUS, MEMORY_MB = 1.0, 512
# byte-compiled files would be written into the repo by the first rollout's imports
CALL_TIMEOUT_S = 120.0
ACQUIRE_TIMEOUT_S = 120.0
CORES = os.cpu_count() or 1
SIDES = ("dsec", "sdk", "llm-sandbox")
CHURN_CMD = ["sh", "-c", "echo hi"]
CHURN_EXECS = 3

SDK_RATIO = 2.0  # dsec episodes/hour >= this x the container-per-rollout's
LLM_RATIO = 3.0  # and >= this x llm-sandbox's
TOOL_P50_RATIO = 0.5  # dsec tool-call p50 <= this x the bare docker exec's
ACQUIRE_P99_MS = 50.0
CHURN_EXEC_RATIO = 0.5  # churn: dsec exec p50 <= this x llm-sandbox's
CHURN_RATE_RATIO = 3.0  # churn: dsec episodes/s >= this x llm-sandbox's

# what a baseline's session fails with (llm-sandbox wraps the engine's errors in its own)
BASELINE_ERRORS = (*ENGINE_ERRORS, RuntimeError, OSError)


def python_image(given: str | None) -> str:
    """The template's image: `given`, else the project's built one (a cache hit once built)."""
    return given or build_python_template(progress=True).image


def python_template(image: str) -> TemplateSpec:
    return TemplateSpec(name=TEMPLATE, image=image, cpus=CPUS, memory_mb=MEMORY_MB,
                        recyclable=True, env=PYTHON_TEMPLATE_ENV)  # fmt: skip


# --- the three sides ---------------------------------------------------------------


class Session(Protocol):
    """One rollout's sandbox, however it is made."""

    # how its open got a sandbox: the pool's schedule path (warm, thaw, cold, overflow),
    # or "create" for a side that makes a container per rollout
    opened_by: str
    # the control plane's own time to answer the open (Lease.schedule_ms), where there is one
    schedule_s: float | None

    async def open(self) -> None: ...
    async def upload(self, repo: Repo) -> None: ...
    async def run(self, call: ToolCall) -> tuple[int | None, bytes]: ...
    async def read_result(self) -> bytes: ...
    async def close(self) -> None: ...


class DsecSession:
    def __init__(self, client: Client, pool: str) -> None:
        self.client, self.pool = client, pool
        self.sb: Any = None
        self.opened_by = ""
        self.schedule_s: float | None = None

    async def open(self) -> None:
        self.sb = await self.client.acquire(self.pool, TEMPLATE, timeout=ACQUIRE_TIMEOUT_S)
        self.opened_by = self.sb.lease.path
        self.schedule_s = self.sb.lease.schedule_ms / 1000

    async def upload(self, repo: Repo) -> None:
        await self.sb.files.write_tar(WORKDIR, repo.tar)

    async def run(self, call: ToolCall) -> tuple[int | None, bytes]:
        out = await self.sb.exec(call.argv, timeout=CALL_TIMEOUT_S, workdir=REPO_DIR)
        return out.exit_code, out.stdout_bytes

    async def read_result(self) -> bytes:
        return await self.sb.files.read(f"{REPO_DIR}/{RESULT}")

    async def close(self) -> None:
        await self.sb.release()


def labels(floor: EngineFloor, side: str) -> dict[str, str]:
    """A baseline container's labels: a sandbox's, under the floor's node, which the
    floor's sweep removes."""
    return {LABEL_NODE: floor.node, LABEL_POOL: f"rollout-{side}", LABEL_TEMPLATE: TEMPLATE,
            LABEL_SANDBOX: f"{floor.node}.{secrets.token_hex(8)}"}  # fmt: skip


class Threads:
    """A blocking side's calls, run on threads of its own (one per concurrent rollout);
    a container of its own per rollout."""

    opened_by = "create"
    schedule_s = None  # no control plane

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        self.pool = pool

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)


class SdkSession(Threads):
    """A plain container of the template's image and limits (no hardening of dsec's),
    driven with the Docker SDK's low-level client."""

    def __init__(self, floor: EngineFloor, image: str, pool: ThreadPoolExecutor) -> None:
        super().__init__(pool)
        self.api, self.floor, self.image = floor.client.api, floor, image
        self.id = ""

    def _create(self) -> None:
        api, ram = self.api, f"{MEMORY_MB}m"
        host = api.create_host_config(
            network_mode="none", nano_cpus=int(CPUS * 1e9), mem_limit=ram, memswap_limit=ram,
            pids_limit=256, init=True,
        )  # fmt: skip
        env = [f"{k}={v}" for k, v in {"HOME": WORKDIR, **PYTHON_TEMPLATE_ENV}.items()]
        self.id = api.create_container(
            self.image, user=USER, working_dir=WORKDIR, environment=env,
            labels=labels(self.floor, "sdk"), host_config=host, network_disabled=True,
        )["Id"]  # fmt: skip
        api.start(self.id)

    async def open(self) -> None:
        await self.call(self._create)

    async def upload(self, repo: Repo) -> None:
        await self.call(self.api.put_archive, self.id, WORKDIR, repo.tar)

    def _exec(self, argv: list[str]) -> tuple[int | None, bytes]:
        exec_id = self.api.exec_create(self.id, argv, workdir=REPO_DIR)["Id"]
        output = self.api.exec_start(exec_id)
        return self.api.exec_inspect(exec_id).get("ExitCode"), output

    async def run(self, call: ToolCall) -> tuple[int | None, bytes]:
        return await self.call(self._exec, call.argv)

    def _read(self) -> bytes:
        stream, _ = self.api.get_archive(self.id, f"{REPO_DIR}/{RESULT}")
        with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
            member = tar.extractfile(RESULT)
            assert member is not None
            return member.read()

    async def read_result(self) -> bytes:
        return await self.call(self._read)

    async def close(self) -> None:
        await self.call(lambda: self.api.remove_container(self.id, force=True))


class NoPullImages(ImageCollection):
    def pull(self, repository: str, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"llm-sandbox asked to pull {repository}: it is given a local image")


class NoPullClient(docker.DockerClient):
    """A Docker client whose image pulls fail: llm-sandbox pulls an image it cannot find,
    and this benchmark touches no network."""

    @property
    def images(self) -> ImageCollection:
        return NoPullImages(client=self)


class LlmSandboxSession(Threads):
    """A session of llm-sandbox's Docker backend, a container of its own."""

    def __init__(
        self, client: NoPullClient, floor: EngineFloor, image: str, repo_dirs: RepoDirs,
        pool: ThreadPoolExecutor,
    ) -> None:  # fmt: skip
        from llm_sandbox.docker import SandboxDockerSession

        super().__init__(pool)
        ram = f"{MEMORY_MB}m"
        self.repo_dirs = repo_dirs
        self.session = SandboxDockerSession(
            client=client, image=image, lang="python", workdir=WORKDIR,
            skip_environment_setup=True,  # no venv or pip upgrade: the image has what it needs
            runtime_configs={
                "labels": labels(floor, "llm-sandbox"), "network_mode": "none",
                "network_disabled": True, "nano_cpus": int(CPUS * 1e9), "mem_limit": ram,
                "memswap_limit": ram, "pids_limit": 256, "user": USER, "working_dir": WORKDIR,
                "environment": {"HOME": WORKDIR, **PYTHON_TEMPLATE_ENV},
                # an init passes its stop's SIGTERM on: `sleep` as PID 1 ignores it, and
                # each close would wait out the engine's 10 s before the kill
                "init": True,
            },
        )  # fmt: skip
        self.scratch = Path(tempfile.mkdtemp(prefix="rollout-llm-"))

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        from llm_sandbox import SandboxError

        try:
            return await super().call(fn, *args)
        except SandboxError as e:  # its own, for what the engine or the container refused
            raise RuntimeError(f"llm-sandbox: {type(e).__name__}: {e}") from e

    async def open(self) -> None:
        await self.call(self.session.open)

    async def upload(self, repo: Repo) -> None:
        await self.call(self.session.copy_to_runtime, str(self.repo_dirs.of(repo)), REPO_DIR)

    def _run(self, argv: list[str], workdir: str) -> tuple[int | None, bytes]:
        out = self.session.execute_command(shlex.join(argv), workdir=workdir)
        return out.exit_code, out.stdout.encode()

    async def run(self, call: ToolCall, workdir: str = REPO_DIR) -> tuple[int | None, bytes]:
        return await self.call(self._run, call.argv, workdir)

    def _read(self) -> bytes:
        local = self.scratch / RESULT
        self.session.copy_from_runtime(f"{REPO_DIR}/{RESULT}", str(local))
        return local.read_bytes()

    async def read_result(self) -> bytes:
        return await self.call(self._read)

    async def close(self) -> None:
        try:
            await self.call(self.session.close)
        finally:
            shutil.rmtree(self.scratch, ignore_errors=True)


class RepoDirs:
    """Each group's repository unpacked on the host, for llm-sandbox's copy_to_runtime
    (which takes a path and makes its own tar)."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="rollout-repos-"))
        self.dirs: dict[int, Path] = {}

    def of(self, repo: Repo) -> Path:
        if repo.group not in self.dirs:
            into = self.root / str(repo.group)
            with tarfile.open(fileobj=io.BytesIO(repo.tar)) as tar:
                tar.extractall(into, filter="data")
            self.dirs[repo.group] = into / ROOT
        return self.dirs[repo.group]

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


# --- CPU -----------------------------------------------------------------------------

# The engine's parent cgroup of every container: cgroup v1's cpuacct (ns), or v2's (usec).
# A parent's usage keeps what its removed children used.
CGROUP_CPU = (
    (Path("/sys/fs/cgroup/cpuacct/docker/cpuacct.usage"), 1e-9),
    (Path("/sys/fs/cgroup/cpu,cpuacct/docker/cpuacct.usage"), 1e-9),
    (Path("/sys/fs/cgroup/docker/cpu.stat"), 1e-6),
)


def containers_cpu_s() -> float | None:
    """CPU seconds used so far by every container of the engine; None where unknown."""
    for path, unit in CGROUP_CPU:
        try:
            text = path.read_text()
        except OSError:
            continue
        if path.name == "cpu.stat":
            usage = dict(line.split() for line in text.splitlines()).get("usage_usec")
            return int(usage) * unit if usage is not None else None
        return int(text) * unit
    return None


@dataclass
class CpuMeter:
    containers_s: float | None = None
    host: tuple[int, int] = (0, 0)

    @classmethod
    def now(cls) -> CpuMeter:
        return cls(containers_cpu_s(), host_jiffies())

    def since(self, before: CpuMeter) -> dict:
        used = (
            None
            if self.containers_s is None or before.containers_s is None
            else self.containers_s - before.containers_s
        )
        busy, total = (a - b for a, b in zip(self.host, before.host, strict=True))
        return {
            "containers_cpu_s": None if used is None else round(used, 2),
            "host_busy": round(busy / total, 3) if total else None,
        }


# --- a step of rollouts ----------------------------------------------------------------


@dataclass
class Step:
    """One side's figures over one or more steps."""

    episodes: int = 0
    wall_s: float = 0.0
    open_s: list[float] = field(default_factory=list)
    open_s_by_path: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    # dsec's opens as the control plane timed them (Lease.schedule_ms): the rest of
    # open_s is the way there and back, and the client's and the control plane's queues
    schedule_s: list[float] = field(default_factory=list)
    upload_s: list[float] = field(default_factory=list)
    read_s: list[float] = field(default_factory=list)
    close_s: list[float] = field(default_factory=list)
    calls: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    failures: list[str] = field(default_factory=list)
    # of the failures, dsec's SandboxLost with infra_fault: samples a trainer masks
    infra_faults: int = 0
    cpu_s: float | None = 0.0
    host_busy: list[float] = field(default_factory=list)

    def add(self, other: Step) -> None:
        self.episodes += other.episodes
        self.infra_faults += other.infra_faults
        self.wall_s += other.wall_s
        for name in (
            "open_s",
            "schedule_s",
            "upload_s",
            "read_s",
            "close_s",
            "failures",
            "host_busy",
        ):
            getattr(self, name).extend(getattr(other, name))
        for kind, values in other.calls.items():
            self.calls[kind].extend(values)
        for path, values in other.open_s_by_path.items():
            self.open_s_by_path[path].extend(values)
        self.cpu_s = None if self.cpu_s is None or other.cpu_s is None else self.cpu_s + other.cpu_s


async def timed(into: list[float], action: Awaitable[Any]) -> Any:
    started = time.perf_counter()
    try:
        return await action
    finally:
        into.append(time.perf_counter() - started)


async def rollout(
    step: Step, make: Callable[[], Session], repo: Repo, calls: list[ToolCall], i: int
) -> None:
    """One episode; its failure (an error, a wrong answer) is noted in `step`."""
    session = make()
    try:
        await timed(step.open_s, session.open())
        step.open_s_by_path[session.opened_by].append(step.open_s[-1])
        if session.schedule_s is not None:
            step.schedule_s.append(session.schedule_s)
    except (*CALL_ERRORS, *BASELINE_ERRORS) as e:
        step.failures.append(f"episode {i}: open: {type(e).__name__}: {e}")
        return
    try:
        await timed(step.upload_s, session.upload(repo))
        for call in calls:
            code, stdout = await timed(step.calls[call.kind], session.run(call))
            if (wrong := check_output(call, code, stdout)) is not None:
                raise RuntimeError(wrong)
        if len(calls) == len(tool_calls()):  # the last call writes the result
            raw = await timed(step.read_s, session.read_result())
            if (wrong := check_result(repo, raw)) is not None:
                raise RuntimeError(wrong)
        step.episodes += 1
    except (*CALL_ERRORS, *BASELINE_ERRORS) as e:
        step.failures.append(f"episode {i}: {type(e).__name__}: {e}")
        step.infra_faults += isinstance(e, SandboxLost) and e.infra_fault
    finally:
        try:
            await timed(step.close_s, session.close())
        except (*CALL_ERRORS, *BASELINE_ERRORS) as e:
            step.failures.append(f"episode {i}: close: {type(e).__name__}: {e}")


async def rollout_step(
    make: Callable[[], Session], repos: list[Repo], k: int, concurrency: int, calls: list[ToolCall]
) -> Step:
    """`len(repos)` groups of `k` rollouts, `concurrency` at a time."""
    step = Step()
    todo = iter([(i, repos[i // k]) for i in range(len(repos) * k)])

    async def worker() -> None:
        while (item := next(todo, None)) is not None:
            await rollout(step, make, item[1], calls, item[0])

    cpu = CpuMeter.now()
    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    step.wall_s = time.perf_counter() - started
    used = CpuMeter.now().since(cpu)
    step.cpu_s = used["containers_cpu_s"]
    step.host_busy.append(used["host_busy"])
    return step


def step_figures(s: Step) -> dict:
    every = [v for values in s.calls.values() for v in values]
    return {
        "episodes": s.episodes,
        "failures": len(s.failures),
        "failure_samples": s.failures[:5],
        "infra_faults_per_1000": round(1000 * s.infra_faults / started, 2)
        if (started := s.episodes + len(s.failures))
        else None,
        "wall_s": round(s.wall_s, 2),
        "episodes_per_hour": round(s.episodes * 3600 / s.wall_s, 1) if s.wall_s else None,
        "open_ms": summary_ms(s.open_s),
        "open_ms_by_path": {k: summary_ms(v) for k, v in sorted(s.open_s_by_path.items())},
        "open_schedule_ms": summary_ms(s.schedule_s),
        "upload_ms": summary_ms(s.upload_s),
        "tool_call_ms": summary_ms(every),
        "tool_call_ms_by_kind": {k: summary_ms(v) for k, v in sorted(s.calls.items())},
        "read_ms": summary_ms(s.read_s),
        "close_ms": summary_ms(s.close_s),
        "containers_cpu_s": None if s.cpu_s is None else round(s.cpu_s, 2),
        "cpu_per_episode_s": round(s.cpu_s / s.episodes, 3) if s.cpu_s and s.episodes else None,
        "share_of_cores": round(s.cpu_s / (s.wall_s * CORES), 3) if s.cpu_s and s.wall_s else None,
        # the most this machine could run if every core ran these episodes' own commands
        # and nothing else (no control plane, agent, engine or client)
        "ceiling_episodes_per_hour": round(CORES * 3600 * s.episodes / s.cpu_s, 1)
        if s.cpu_s and s.episodes
        else None,
        "host_busy": round(sum(s.host_busy) / len(s.host_busy), 3) if s.host_busy else None,
    }


# --- churn ---------------------------------------------------------------------------


@dataclass
class Churn:
    completed: int = 0
    wall_s: float = 0.0
    exec_s: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def add(self, other: Churn) -> None:
        self.completed += other.completed
        self.wall_s += other.wall_s
        self.exec_s += other.exec_s
        self.failures += other.failures


async def llm_churn(
    make: Callable[[], LlmSandboxSession], episodes: int, concurrency: int
) -> Churn:
    result = Churn()
    todo = iter(range(episodes))
    call = ToolCall("churn", CHURN_CMD)

    async def episode(i: int) -> None:
        session = make()
        await session.open()
        try:
            for _ in range(CHURN_EXECS):
                started = time.perf_counter()
                code, out = await session.run(call, WORKDIR)
                result.exec_s.append(time.perf_counter() - started)
                if (code, out) != (0, b"hi\n"):
                    raise RuntimeError(f"exec answered {code} {out!r}")
        finally:
            await session.close()

    async def worker() -> None:
        while (i := next(todo, None)) is not None:
            try:
                await episode(i)
                result.completed += 1
            except BASELINE_ERRORS as e:
                result.failures.append(f"episode {i}: {type(e).__name__}: {e}")

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    result.wall_s = time.perf_counter() - started
    return result


def churn_figures(c: Churn) -> dict:
    return {
        "completed": c.completed,
        "failures": len(c.failures),
        "failure_samples": c.failures[:5],
        "wall_s": round(c.wall_s, 2),
        "episodes_per_s": round(c.completed / c.wall_s, 3) if c.wall_s else None,
        "exec_ms": summary_ms(c.exec_s),
    }


async def engine_ops(pool: LocalPool) -> Counter[str]:
    """The agents' Engine API calls so far, by op (dsec_agent_docker_op_seconds)."""
    ops: Counter[str] = Counter()
    async with aiohttp.ClientSession() as http:
        for agent in pool.agents:
            async with http.get(f"{agent.url}/metrics") as resp:
                text = await resp.text()
            for line in text.splitlines():
                if line.startswith("dsec_agent_docker_op_seconds_count{"):
                    labels_text, value = line.rsplit(" ", 1)
                    op = labels_text.split('op="', 1)[1].split('"', 1)[0]
                    ops[op] += int(float(value))
    return ops


# --- the run -------------------------------------------------------------------------


def pool_params(args: argparse.Namespace) -> PoolParams:
    warm = max(args.concurrency, args.churn_concurrency)
    return PoolParams(templates=[TEMPLATE], recycle=True, min_warm=warm,
                      max_warm=max(warm, PoolParams().max_warm))  # fmt: skip


def rotated(round_index: int) -> tuple[str, ...]:
    n = round_index % len(SIDES)
    return SIDES[n:] + SIDES[:n]


async def run(args: argparse.Namespace) -> dict:
    image = python_image(args.image)
    spec_template = python_template(image)
    try:
        docker.from_env().images.get(image)
    except ImageNotFound:
        raise RuntimeError(
            f"image {image} is not on this engine (build it with dsec template build)"
        ) from None
    calls = tool_calls()[: args.calls]
    repos = [make_repo(g, args.repo_mb) for g in range(args.groups)]
    teardown = Teardown()
    spec = issue_spec("rollout")
    spec.templates = {**spec.templates, TEMPLATE: spec_template}
    spec.pool = pool_params(args)
    report: dict = {
        "image": image, "groups": args.groups, "k": args.k, "concurrency": args.concurrency,
        "rounds": args.rounds, "calls": [c.argv for c in calls], "repo_bytes": repos[0].size_bytes,
        "nodes": NODES, "node_capacity": NODE_CAPACITY.model_dump(), "cores": CORES,
        "pool_params": spec.pool.model_dump(
            include={"templates", "recycle", "min_warm", "max_warm"}
        ),
        "template": spec_template.model_dump(include={"cpus", "memory_mb", "recyclable"}),
    }  # fmt: skip
    totals = {side: Step() for side in SIDES}
    churn_totals = {"dsec": Churn(), "llm-sandbox": Churn()}
    rounds: list[dict] = []
    churn_rounds: list[dict] = []
    ops_rollout: Counter[str] = Counter()
    ops_churn: Counter[str] = Counter()
    repo_dirs = RepoDirs()
    threads = ThreadPoolExecutor(max(args.concurrency, args.churn_concurrency), "rollout")
    no_pull = NoPullClient.from_env(max_pool_size=max(args.concurrency, args.churn_concurrency) + 4)
    try:
        with EngineFloor(args.concurrency, spec_template) as floor:
            async with local_pool(spec, teardown) as pool:
                async with Client(pool.url, token=pool.tokens.client) as client:
                    warm = spec.pool.min_warm

                    def dsec() -> DsecSession:
                        return DsecSession(client, "default")

                    def sdk() -> SdkSession:
                        return SdkSession(floor, image, threads)

                    def llm() -> LlmSandboxSession:
                        return LlmSandboxSession(no_pull, floor, image, repo_dirs, threads)

                    makers = {"dsec": dsec, "sdk": sdk, "llm-sandbox": llm}
                    await wait_warm(client, "default", warm)
                    for r in range(args.rounds):
                        this_round = {}
                        for side in rotated(r):
                            if side == "dsec":
                                await wait_warm(client, "default", warm)
                                before = await engine_ops(pool)
                            step = await rollout_step(makers[side], repos, args.k,
                                                      args.concurrency, calls)  # fmt: skip
                            if side == "dsec":
                                ops_rollout += await engine_ops(pool) - before
                            totals[side].add(step)
                            this_round[side] = step_figures(step)
                        rounds.append(this_round)
                    for r in range(args.rounds if args.churn_episodes else 0):
                        this_round = {}
                        for side in ("dsec", "llm-sandbox")[:: 1 if r % 2 == 0 else -1]:
                            if side == "dsec":
                                await wait_warm(client, "default", warm)
                                before = await engine_ops(pool)
                                c = await pool_churn(client, "default", args.churn_episodes,
                                                     args.churn_concurrency, CHURN_EXECS,
                                                     template=TEMPLATE)  # fmt: skip
                                ops_churn += await engine_ops(pool) - before
                                got = Churn(c.completed, c.wall_s, c.exec_s, c.failures)
                            else:
                                got = await llm_churn(llm, args.churn_episodes,
                                                      args.churn_concurrency)  # fmt: skip
                            churn_totals[side].add(got)
                            this_round[side] = churn_figures(got)
                        churn_rounds.append(this_round)
    finally:
        threads.shutdown(wait=False, cancel_futures=True)
        no_pull.close()
        repo_dirs.close()
    report["sides"] = {side: step_figures(s) for side, s in totals.items()}
    report["by_round"] = rounds
    report["engine_ops_dsec_rollout"] = dict(sorted(ops_rollout.items()))
    report["tool_calls_dsec"] = sum(len(v) for v in totals["dsec"].calls.values())
    if churn_rounds:
        report["churn"] = {side: churn_figures(c) for side, c in churn_totals.items()}
        report["churn"]["by_round"] = churn_rounds
        report["churn"]["engine_ops_dsec"] = dict(sorted(ops_churn.items()))
        report["churn"]["execs_dsec"] = len(churn_totals["dsec"].exec_s)
    report["leftovers"] = leftovers(teardown, floor)
    report["targets"] = targets(report)
    return report


# --- targets and the report -----------------------------------------------------------


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def p50(figures: dict, key: str) -> float | None:
    return figures[key]["p50"]


def ceiling(ours: dict, other: dict) -> str:
    """What the cores allow dsec against `other`, to note beside a ratio of episodes/hour:
    its episodes' own CPU time bounds it whatever the pool does."""
    bound = ratio(ours["ceiling_episodes_per_hour"], other["episodes_per_hour"])
    return f"all cores on dsec's episodes: {bound}x" if bound is not None else ""


def targets(r: dict) -> list[dict]:
    ours, sdk, llm = (r["sides"][s] for s in SIDES)
    failed = ours["failures"]
    fails = f"{failed} dsec episodes failed" if failed else ""
    noted = "; ".join(f"{s}: {r['sides'][s]['failures']} failed" for s in SIDES[1:]
                      if r["sides"][s]["failures"])  # fmt: skip
    rate = "episodes_per_hour"
    out = [
        target("episodes/hour / sdk's", ratio(ours[rate], sdk[rate]), SDK_RATIO,
               fails or noted, not failed, op=">="),
        target("episodes/hour / llm-sandbox's", ratio(ours[rate], llm[rate]), LLM_RATIO,
               "; ".join(n for n in (fails or noted, ceiling(ours, llm)) if n), not failed,
               op=">="),
        target("tool-call p50 / bare docker exec's",
               ratio(p50(ours, "tool_call_ms"), p50(sdk, "tool_call_ms")), TOOL_P50_RATIO,
               fails, not failed),
        target("acquire p99 ms", ours["open_ms"]["p99"], ACQUIRE_P99_MS, fails, not failed),
    ]  # fmt: skip
    if "churn" in r:
        c_ours, c_llm = r["churn"]["dsec"], r["churn"]["llm-sandbox"]
        fails = f"{c_ours['failures']} dsec churn episodes failed" if c_ours["failures"] else ""
        out += [
            target("churn: exec p50 / llm-sandbox's",
                   ratio(c_ours["exec_ms"]["p50"], c_llm["exec_ms"]["p50"]), CHURN_EXEC_RATIO,
                   fails, not c_ours["failures"]),
            target("churn: episodes/s / llm-sandbox's",
                   ratio(c_ours["episodes_per_s"], c_llm["episodes_per_s"]), CHURN_RATE_RATIO,
                   fails, not c_ours["failures"], op=">="),
        ]  # fmt: skip
    left = r["leftovers"]["pool_left"] + r["leftovers"]["floor_left"]
    out.append(target("containers left behind", left, 0))
    return out


def render(r: dict) -> str:
    lines = [
        f"rollout: {r['groups']} groups x {r['k']} rollouts, {r['concurrency']} at a time, "
        f"{r['rounds']} rounds (sides in turn); {len(r['calls'])} tool calls each, a "
        f"{r['repo_bytes'] / 1e6:.1f} MB repo; image {r['image']}; {r['nodes']} nodes, "
        f"{r['cores']} cores",
        "",
    ]
    headers = ["", "episodes", "failed", "infra/1000", "wall s", "episodes/h", "open p50",
               "open p99", "upload p50", "call p50", "call p99", "read p50", "close p50", "cpu s",
               "cpu/(wall*cores)", "host busy"]  # fmt: skip
    rows = []
    for side, s in r["sides"].items():
        rows.append([side, s["episodes"], s["failures"], s["infra_faults_per_1000"], s["wall_s"],
                     s["episodes_per_hour"],
                     s["open_ms"]["p50"], s["open_ms"]["p99"], s["upload_ms"]["p50"],
                     s["tool_call_ms"]["p50"], s["tool_call_ms"]["p99"], s["read_ms"]["p50"],
                     s["close_ms"]["p50"], s["containers_cpu_s"], s["share_of_cores"],
                     s["host_busy"]])  # fmt: skip
    lines += [format_table(headers, rows), "(latencies in ms)", ""]
    kinds = sorted({k for s in r["sides"].values() for k in s["tool_call_ms_by_kind"]})
    rows = []
    for kind in kinds:
        by = {
            side: s["tool_call_ms_by_kind"].get(kind, {}).get("p50")
            for side, s in r["sides"].items()
        }
        rows.append([kind, r["sides"]["dsec"]["tool_call_ms_by_kind"][kind]["n"], by["dsec"],
                     by["sdk"], by["llm-sandbox"], ratio(by["dsec"], by["sdk"])])  # fmt: skip
    lines += [format_table(["call p50 ms", "n (dsec)", "dsec", "bare docker exec", "llm-sandbox",
                            "dsec / docker exec"], rows), ""]  # fmt: skip
    per_round = [[i + 1, *(rd[s]["episodes_per_hour"] for s in SIDES)]
                 for i, rd in enumerate(r["by_round"])]  # fmt: skip
    lines += [format_table(["round", *(f"{s} episodes/h" for s in SIDES)], per_round), ""]
    opens = r["sides"]["dsec"]["open_ms_by_path"].items()
    lines.append("dsec opens by path: " + "; ".join(
        f"{path} {o['n']} (p50 {o['p50']}, p99 {o['p99']}, max {o['max']} ms)" for path, o in opens
    ))  # fmt: skip
    scheduled = r["sides"]["dsec"]["open_schedule_ms"]
    lines.append(
        f"dsec opens as the control plane timed them (schedule_ms): p50 {scheduled['p50']}, "
        f"p99 {scheduled['p99']}, max {scheduled['max']} ms"
    )
    lines.append(f"dsec rollouts: {r['tool_calls_dsec']} tool calls; the agents' engine calls "
                 f"meanwhile {r['engine_ops_dsec_rollout']}")  # fmt: skip
    if "churn" in r:
        c = r["churn"]
        rows = [[side, c[side]["completed"], c[side]["failures"], c[side]["wall_s"],
                 c[side]["episodes_per_s"], c[side]["exec_ms"]["p50"], c[side]["exec_ms"]["p99"]]
                for side in ("dsec", "llm-sandbox")]  # fmt: skip
        lines += ["", "churn: open, 3 x sh -c 'echo hi', close",
                  format_table(["", "episodes", "failed", "wall s", "episodes/s", "exec p50 ms",
                                "exec p99 ms"], rows),
                  f"dsec churn: {c['execs_dsec']} execs; the agents' engine calls meanwhile "
                  f"{c['engine_ops_dsec']}"]  # fmt: skip
    for side in SIDES:
        for sample in r["sides"][side]["failure_samples"]:
            lines.append(f"{side} failure: {sample[:300]}")
    lines += render_leftovers_and_targets(r)
    return "\n".join(lines)


def add_rollout_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--groups", type=int, default=8, help="G: groups of a step")
    parser.add_argument("--k", type=int, default=8, help="K: rollouts of a group")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3, help="steps of each side, in turn")
    parser.add_argument(
        "--calls", type=int, default=len(tool_calls()),
        help="tool calls per rollout: the first N (fewer: no result file)",
    )  # fmt: skip
    parser.add_argument("--repo-mb", type=float, default=5.0)
    parser.add_argument("--churn-episodes", type=int, default=60, help="0: no churn phase")
    parser.add_argument("--churn-concurrency", type=int, default=20)
    parser.add_argument("--image", help="the template's image (default: the project's build)")
    parser.add_argument("--json", action="store_true")


def run_rollout(args: argparse.Namespace) -> int:
    room = NODES * NODE_CAPACITY.slots
    if (
        min(args.groups, args.k, args.rounds) < 1
        or not 1 <= args.concurrency <= room
        or not 1 <= args.churn_concurrency <= room
        or not 1 <= args.calls <= len(tool_calls())
        or args.churn_episodes < 0
        or args.repo_mb <= 0
    ):
        print(
            f"rollout: --groups, --k and --rounds must be >= 1, --concurrency and "
            f"--churn-concurrency 1..{room}, --calls 1..{len(tool_calls())}, "
            "--churn-episodes >= 0, --repo-mb > 0",
            file=sys.stderr,
        )
        return 2
    return exit_status(run_to_report("rollout", run(args), render, args.json))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_rollout_arguments(parser)
    return run_rollout(parser.parse_args(argv))


if __name__ == "__main__":
    interrupt_on_termination()  # the pool it starts is stopped on SIGTERM, SIGHUP
    sys.exit(main())
