"""The engine's own floor: the benchmarks' work done directly on the Docker engine
with the Docker SDK, no pool in between. The baseline of `bench.burst` (a container
per request), `bench.churn` (create, execs, remove per episode) and
`bench.trace_floor` (a trace's episodes, each a container, at their arrival times).

Containers are made by the agents' own driver (`bench.blocking_docker`) from the base template
(`default_templates()["base"]`: the same image, hardening and limits as a sandbox),
on a client with one connection per thread. Each carries the labels of a sandbox
(`agent.docker_driver.LABEL_*`) under a node id of its own, `bench-floor-<hex>`, so the
label sweeps of `dsec up` and of the tests see them, and `EngineFloor` removes every
container with that label when it closes, however the run ends.
"""

from __future__ import annotations

import contextlib
import itertools
import secrets
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import docker
from docker.errors import DockerException

from agent.docker_driver import (
    LABEL_NODE,
    LABEL_POOL,
    LABEL_SANDBOX,
    LABEL_TEMPLATE,
    DockerOpError,
)
from bench.blocking_docker import BlockingDocker
from controlplane.config import default_templates
from dsec.models import TemplateSpec
from dsec.trace import Episode

BURST_THREADS = 32  # the baseline: a container per request from 32 threads
# what a floor's create (the agent's driver) or exec (the Docker SDK) fails with
ENGINE_ERRORS = (DockerException, DockerOpError)
FLOOR_POOL = "engine-floor"  # the dsec.pool label of the floor's containers


@dataclass
class BurstFloor:
    """A burst served by creating a container per request."""

    latencies_s: list[float] = field(default_factory=list)  # arrival to container started
    failures: list[str] = field(default_factory=list)
    removed: int = 0
    remove_s: float = 0.0  # removing them all afterwards (not part of the latencies)


@dataclass
class ChurnFloor:
    """Episodes of create, execs, remove."""

    completed: int = 0
    wall_s: float = 0.0
    exec_s: list[float] = field(default_factory=list)
    create_s: list[float] = field(default_factory=list)
    remove_s: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


@dataclass
class TraceFloor:
    """A trace's episodes played on the engine, each a container of its own."""

    start_s: list[float] = field(default_factory=list)  # arrival to container started
    # an exec's wall time past its command's own
    exec_overhead_s: list[float] = field(default_factory=list)
    remove_s: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    wall_s: float = 0.0  # first arrival to the last episode's end


class EngineFloor:
    """Direct Docker SDK work, labelled, cleaned up on close (use it as a context)."""

    def __init__(self, threads: int = BURST_THREADS, template: TemplateSpec | None = None) -> None:
        self.node = f"bench-floor-{uuid.uuid4().hex[:8]}"
        self.threads = threads
        self.spec = template or default_templates()["base"]
        self.client = docker.from_env(max_pool_size=max(threads, 10))
        self.driver = BlockingDocker()
        self.swept_at_close = 0  # containers the close had to remove: a run's cleanup missed them
        self.left_after_close = 0  # containers of this floor still there after that sweep

    def __enter__(self) -> EngineFloor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        try:
            self.swept_at_close = self.sweep()
            self.left_after_close = len(self.labelled())
        finally:
            self.driver.close()
            self.client.close()

    # --- one container -------------------------------------------------------------

    def create(self) -> str:
        sandbox_id = f"{self.node}.{secrets.token_hex(8)}"
        labels = {
            LABEL_NODE: self.node,
            LABEL_POOL: FLOOR_POOL,
            LABEL_TEMPLATE: self.spec.name,
            LABEL_SANDBOX: sandbox_id,
        }
        return self.driver.create(f"dsec-{sandbox_id}", self.spec, labels)

    def _create_or_note(self, label: str, failures: list[str], lock: threading.Lock) -> str | None:
        """A container made; or None, with why it was not in `failures` under `lock`."""
        try:
            return self.create()
        except ENGINE_ERRORS as e:
            with lock:
                failures.append(f"{label}: {type(e).__name__}: {e}")
            return None

    def exec(self, container_id: str, cmd: list[str]) -> tuple[int | None, bytes]:
        """What `Container.exec_run` does (create, start and read, inspect), without the
        extra inspect of looking the container up first."""
        api = self.client.api
        exec_id = api.exec_create(container_id, cmd, stdout=True, stderr=True)["Id"]
        output = api.exec_start(exec_id)
        return api.exec_inspect(exec_id).get("ExitCode"), output

    def remove(self, container_id: str) -> None:
        self.driver.remove(container_id)

    # --- labelled containers -------------------------------------------------------

    def labelled(self) -> list[str]:
        """Ids of this floor's containers still on the engine, in any state."""
        rows = self.client.api.containers(all=True, filters={"label": f"{LABEL_NODE}={self.node}"})
        return [r["Id"] for r in rows]

    def sweep(self) -> int:
        """Remove every container of this floor; returns how many there were."""
        found = self.labelled()
        for container_id in found:
            with contextlib.suppress(DockerOpError):
                self.driver.remove(container_id)
        return len(found)

    # --- the burst ---------------------------------------------------------------

    def burst(self, size: int, window_s: float, timeout_s: float) -> BurstFloor:
        """Request i arrives at i * window_s / size and is a create on one of `threads`
        threads; its latency runs from its arrival to its container started. One that
        fails, or starts more than `timeout_s` after its arrival (an acquire's timeout),
        is a failure. Every container is removed afterwards."""
        result = BurstFloor()
        made: list[str] = []
        lock = threading.Lock()

        def one(i: int, arrival: float) -> None:
            container_id = self._create_or_note(f"request {i}", result.failures, lock)
            if container_id is None:
                return
            took = time.perf_counter() - arrival
            with lock:
                made.append(container_id)
                if took > timeout_s:
                    result.failures.append(f"request {i}: started after {took:.1f} s")
                else:
                    result.latencies_s.append(took)

        with ThreadPoolExecutor(self.threads, "floor-burst") as pool:
            started = time.perf_counter()
            futures: list[Future[None]] = []
            for i in range(size):
                arrival = started + i * window_s / size
                time.sleep(max(0.0, arrival - time.perf_counter()))
                futures.append(pool.submit(one, i, arrival))
            for f in futures:
                f.result()
            removing = time.perf_counter()
            removals = [pool.submit(self.remove, c) for c in made]
            for f in removals:
                try:
                    f.result()
                    result.removed += 1
                except ENGINE_ERRORS as e:
                    result.failures.append(f"remove: {type(e).__name__}: {e}")
            result.remove_s = time.perf_counter() - removing
        return result

    # --- churn -------------------------------------------------------------------

    def churn(
        self, episodes: int, concurrency: int, cmd: list[str], execs: int, expect: bytes
    ) -> ChurnFloor:
        """`episodes` episodes, `concurrency` at a time: create, `execs` execs of `cmd`
        (each must exit 0 with output `expect`), remove."""
        result = ChurnFloor()
        lock = threading.Lock()
        todo = itertools.count()

        def episode(i: int) -> None:
            t0 = time.perf_counter()
            container_id = self.create()
            t1 = time.perf_counter()
            exec_s = []
            try:
                for _ in range(execs):
                    started = time.perf_counter()
                    code, output = self.exec(container_id, cmd)
                    exec_s.append(time.perf_counter() - started)
                    if (code, output) != (0, expect):
                        raise RuntimeError(f"exec answered {code} {output!r}")
            finally:
                t2 = time.perf_counter()
                self.remove(container_id)
                t3 = time.perf_counter()
            with lock:
                result.completed += 1
                result.create_s.append(t1 - t0)
                result.exec_s.extend(exec_s)
                result.remove_s.append(t3 - t2)

        def worker() -> None:
            while (i := next(todo)) < episodes:
                try:
                    episode(i)
                except (*ENGINE_ERRORS, RuntimeError) as e:
                    with lock:
                        result.failures.append(f"episode {i}: {type(e).__name__}: {e}")

        started = time.perf_counter()
        with ThreadPoolExecutor(concurrency, "floor-churn") as pool:
            for f in [pool.submit(worker) for _ in range(concurrency)]:
                f.result()
        result.wall_s = time.perf_counter() - started
        return result

    # --- a trace -----------------------------------------------------------------

    def trace(self, episodes: Sequence[Episode], time_scale: float = 1.0) -> TraceFloor:
        """Each episode at its arrival (times `time_scale`) on one of `threads` threads:
        a create, then each step's think and an exec of `sleep EXEC_S`, then a remove.
        An episode whose container could not be made, or that finds no free thread, is
        late from its arrival on: the floor has no queue of its own but the threads'."""
        result = TraceFloor()
        lock = threading.Lock()

        def one(episode: Episode, arrival: float) -> None:
            container_id = self._create_or_note(episode.episode, result.failures, lock)
            if container_id is None:
                return
            started = time.perf_counter()
            overheads = []
            try:
                for step in episode.steps:
                    time.sleep(step.think_s * time_scale)
                    exec_s = step.exec_s * time_scale
                    began = time.perf_counter()
                    code, _ = self.exec(container_id, ["sleep", f"{exec_s:.3f}"])
                    overheads.append(time.perf_counter() - began - exec_s)
                    if code != 0:
                        raise RuntimeError(f"exec answered {code}")
            except (*ENGINE_ERRORS, RuntimeError) as e:
                with lock:
                    result.failures.append(f"{episode.episode}: {type(e).__name__}: {e}")
            began = time.perf_counter()
            try:
                self.remove(container_id)  # what is left, the close's sweep removes
            except ENGINE_ERRORS as e:
                with lock:
                    result.failures.append(f"{episode.episode}: remove: {e}")
            removed = time.perf_counter() - began
            with lock:
                result.start_s.append(started - arrival)
                result.exec_overhead_s.extend(overheads)
                result.remove_s.append(removed)

        ordered = sorted(episodes, key=lambda e: e.arrival_s)
        with ThreadPoolExecutor(self.threads, "floor-trace") as pool:
            began = time.perf_counter()
            t0 = ordered[0].arrival_s if ordered else 0.0
            futures: list[Future[None]] = []
            for episode in ordered:
                arrival = began + (episode.arrival_s - t0) * time_scale
                time.sleep(max(0.0, arrival - time.perf_counter()))
                futures.append(pool.submit(one, episode, arrival))
            for f in futures:
                f.result()
            result.wall_s = time.perf_counter() - began
        return result
