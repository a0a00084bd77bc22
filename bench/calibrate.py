"""Measure this machine's Docker and agent timings into a simulator profile.

    dsec bench calibrate [--samples 30] [--nodes 3] [--out profile.json]

Docker operations are timed through the agent's own driver (the same hardened
create, the same remove, pause, unpause, commit); exec and lease through a live
local pool (an exec of `true` via the agent; a warm acquire's server-side schedule
time, which is the lease call). Restore is a create plus unpacking a work dir.

The machine's cores are shared by everything its engine runs, so durations depend on
load. Creates and removes are also timed CONCURRENCY at a time, and warm acquires
while LOAD_LEVELS engine operations are under way beside the pool (threads creating
and removing containers with the agent's own calls: load as the simulator counts it).
Acquires take sandboxes from a warm pool that does not refill, so that not even their
own refill runs meanwhile. Levels are measured in turns, a few acquires each, so that
a change in the machine's other load touches all of them. The pool has as many nodes
as a replay's (`--nodes`). The most creates, removes and execs of `true` (the agent's
driver, on the engine directly) the engine completes a second, at any of CONCURRENCY at
once, are its throughput, which the simulator's engine shares out among all three; an
exec start's weight as load, against a create's, is the ratio of their engine work (the
create rate over the exec rate). A command in flight loads the machine too, through the
agent and the client that carry it: bursts of BURST cold acquires (a create each,
through the agents, as a replay's queue of creates goes) are timed while LOAD_LEVELS
engine operations are under way beside the pool, and beside COMMAND_SANDBOXES
sandboxes running `sleep` again and again; the operations' worth of load that slows a
burst as much as the commands do (at most the highest of LOAD_LEVELS, the load
measured), shared out among the commands, is a command's weight. The bursts measured
alone also set the create rate the simulator is given: a pool's creates come slower
than the driver's (the agents' and the control plane's own work for each, on the same
cores, which the simulated agents do not take), so the rate is the one at which the
simulator's own play of the burst takes as long a create (`pool_create_rate`), never
above the driver's.

Warm acquires were the probe for that weight once: since a running warm sandbox is
served in the tick that claims it, its schedule time no longer slows with the machine's
load (0.38 ms alone, 0.39-0.41 beside 1-4 operations, measured), and the weight read
from it was 0. A burst's creates go through the agents, whose event loops the commands
share: 64 commands slowed one as much as one engine operation did (16.3 cold acquires
a second alone, 13.1 beside them, 13.0-14.6 beside an operation), where by the cores
they take (`bench.command_cpu`) they weigh a quarter of that.

Both weights were once ratios of two small slowdowns, each a median of a few dozen
samples: on this shared machine they came out at 0.3 one run and 6.9 the next, and a
weight of 8 (the load's bound at the time, 256 operations, over 32 commands) made the
simulator's Poisson run 1,500 times slower than live. The throughput is measured over
hundreds of operations, and a load is not read past what was measured.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import docker
import requests

# a node gives its engine as many lifecycle calls at once as LIFECYCLE_SLOTS; the measured
# loads say how much slower each gets
from agent.docker_driver import LABEL_NODE, LIFECYCLE_SLOTS, DockerOpError
from bench.blocking_docker import BlockingDocker
from bench.live_latency import _wait_warm
from bench.replay_live import DEFAULT_NODES
from bench.sim.engine import simulate
from bench.sim.profile import OPS, Profile
from bench.soak import pool_containers
from dsec.client import Client, DsecError, Sandbox
from dsec.image import BASE_IMAGE, ensure_base_image
from dsec.launch.local import LocalPool, LocalPoolError, LocalPoolSpec
from dsec.models import Capacity, PoolParams, TemplateSpec
from dsec.trace import Episode, Step

CONCURRENCY = (2, 4, 8)  # creates and removes timed this many at a time, besides one at a time
LOAD_LEVELS = (0, 1, 2, 4)  # engine operations under way while warm acquires are timed
COMMAND_SANDBOXES = 64  # sandboxes running commands while a burst is timed
COMMAND_S = 1.0  # how long each of their commands runs
BURST = 36  # cold acquires at once, a burst
BURST_SETTLE_S = 60.0  # at most this long for a burst's sandboxes to be removed
# the calibration's burst as the simulator plays it: BURST acquires at once on a pool
# with no warm sandbox, each holding its sandbox past the burst
BURST_TRACE = [
    Episode(episode=f"burst-{i}", arrival_s=0.0, steps=[Step(think_s=0.0, exec_s=BURST_SETTLE_S)])
    for i in range(BURST)
]
BURST_POOL = PoolParams(min_warm=0, max_warm=0, templates=[])
RATE_FIT_STEPS = 12  # halvings of the create rate: to 1/4096 of the engine's
BATCH = 10  # warm sandboxes per turn of acquires
# a warm acquire's tail is the schedule latency's: leases get this many times the samples
LEASE_SAMPLES_FACTOR = 3
ACQUIRE_GAP_S = 0.02  # between acquires of a turn: each meets the load, not the last one
LOAD_SETTLE_S = 0.3  # background loops run this long before a turn starts

# what a calibration that cannot reach or drive Docker, or its pool, fails with
CALIBRATE_ERRORS = (
    docker.errors.DockerException,
    DockerOpError,
    requests.RequestException,
    LocalPoolError,
    DsecError,
    aiohttp.ClientError,
    TimeoutError,
    RuntimeError,  # the pool never warmed up
)

Samples = dict[str, list[float]]
LoadedSamples = dict[str, dict[int, list[float]]]


def _timed(fn: Callable, *args) -> float:
    started = time.perf_counter()
    fn(*args)
    return time.perf_counter() - started


class Engine:
    """The agent's Docker driver, creating containers labelled with a node of its own."""

    def __init__(self) -> None:
        client = docker.from_env()
        ensure_base_image(client)
        self.driver = BlockingDocker()
        self.spec = TemplateSpec(name="base", image=BASE_IMAGE)
        self.node = f"calibrate-{uuid.uuid4().hex[:6]}"
        self._names = iter(range(1 << 62))
        self._lock = threading.Lock()

    def create(self) -> str:
        with self._lock:
            name = f"{self.node}-{next(self._names)}"
        return self.driver.create(name, self.spec, {LABEL_NODE: self.node})

    def sweep(self) -> None:
        """Remove every container of this node: what a failed calibration left."""
        try:
            for container in self.driver.list_labelled(self.node):
                self.driver.remove(container.container_id)
        except DockerOpError as e:
            print(f"calibrate: could not remove containers labelled {LABEL_NODE}={self.node}: "
                  f"{e}", file=sys.stderr)  # fmt: skip


def _concurrently(n: int, fn: Callable[[int], None]) -> None:
    """fn(0), ..., fn(n - 1) on n threads started together."""
    start = threading.Barrier(n)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            start.wait()
            fn(i)
        except BaseException as e:  # re-raised below, on the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def docker_samples(engine: Engine, n: int) -> tuple[Samples, LoadedSamples, dict[str, float]]:
    """Each operation one at a time; creates and removes also CONCURRENCY at a time (the
    samples of c at a time are those of load c - 1: the others under way), and execs of
    `true` too, though only counted. Also the most creates, removes and execs a second
    the engine completed at any of those concurrencies: past a few at once it completes
    no more, however many it is given."""
    driver = engine.driver
    samples: Samples = {op: [] for op in ("create", "remove", "pause", "unpause", "commit")}
    loaded: LoadedSamples = {"create": {}, "remove": {}}
    ids: list[str] = []
    for _ in range(n):
        started = time.perf_counter()
        ids.append(engine.create())
        samples["create"].append(time.perf_counter() - started)
    for cid in ids:
        samples["pause"].append(_timed(driver.pause, cid))
        samples["unpause"].append(_timed(driver.unpause, cid))
    for i, cid in enumerate(ids[: max(3, n // 3)]):
        started = time.perf_counter()
        ref = driver.commit(cid, "dsec-calibrate", f"{engine.node}-{i}")
        samples["commit"].append(time.perf_counter() - started)
        driver.remove_image(ref)
    rates = {"exec": 0.0}
    for c in CONCURRENCY:
        per_thread = -(-n // c)

        def execs(i: int, per_thread=per_thread, c=c) -> None:
            for j in range(per_thread):
                if driver.exec(ids[(i + j * c) % len(ids)], ["true"], engine.spec.user) != 0:
                    raise DockerOpError("exec", "failed", "`true` did not exit 0")

        started = time.perf_counter()
        _concurrently(c, execs)
        rates["exec"] = max(rates["exec"], c * per_thread / (time.perf_counter() - started))
    samples["remove"] = [_timed(driver.remove, cid) for cid in ids]
    rates["create"] = n / sum(samples["create"])  # one at a time
    rates["remove"] = n / sum(samples["remove"])
    for c in CONCURRENCY:
        per_thread = -(-n // c)
        made: list[list[str]] = [[] for _ in range(c)]
        took: dict[str, list[float]] = {"create": [], "remove": []}

        def create(i: int, made=made, took=took, per_thread=per_thread) -> None:
            for _ in range(per_thread):
                started = time.perf_counter()
                made[i].append(engine.create())
                took["create"].append(time.perf_counter() - started)

        def remove(i: int, made=made, took=took) -> None:
            took["remove"] += [_timed(driver.remove, cid) for cid in made[i]]

        for op, work in (("create", create), ("remove", remove)):
            started = time.perf_counter()
            _concurrently(c, work)
            rates[op] = max(rates[op], c * per_thread / (time.perf_counter() - started))
        for op in took:
            loaded[op][c - 1] = took[op]
    return samples, loaded, rates


class EngineLoad:
    """`k` threads keeping `k` operations under way on the engine, beside the pool: each
    creates a container with the agent's own create, removes it, and again. Load as the
    simulator counts it (operations its engine runs)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.stopping = threading.Event()
        self.threads: list[threading.Thread] = []
        self.errors: list[BaseException] = []

    def _loop(self) -> None:
        try:
            while not self.stopping.is_set():
                self.engine.driver.remove(self.engine.create())
        except BaseException as e:  # re-raised by stop, on the caller's thread
            self.errors.append(e)

    def start(self, k: int) -> None:
        self.stopping.clear()
        self.threads = [threading.Thread(target=self._loop) for _ in range(k)]
        for thread in self.threads:
            thread.start()

    async def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            await asyncio.to_thread(thread.join)
        self.threads = []
        if self.errors:
            raise self.errors[0]


class CommandLoad:
    """COMMAND_SANDBOXES held sandboxes, each running `sleep COMMAND_S` again and again
    while started: commands in flight, as a replay's episodes keep them, which load the
    machine through the agents and the client that carry them."""

    def __init__(self, client: Client, pool: str) -> None:
        self.client, self.pool = client, pool
        self.held: list[Sandbox] = []
        self.stopping = asyncio.Event()
        self.tasks: list[asyncio.Task] = []

    async def open(self) -> None:
        self.held = [await self.client.acquire(pool=self.pool) for _ in range(COMMAND_SANDBOXES)]

    async def _loop(self, sandbox: Sandbox) -> None:
        while not self.stopping.is_set():
            await sandbox.exec(["sleep", str(COMMAND_S)])

    def start(self) -> None:
        self.stopping.clear()
        self.tasks = [asyncio.create_task(self._loop(sb)) for sb in self.held]

    async def stop(self) -> None:
        self.stopping.set()
        await asyncio.gather(*self.tasks)
        self.tasks = []

    async def close(self) -> None:
        await asyncio.gather(*(sb.release() for sb in self.held))


async def pool_samples(
    engine: Engine, n: int, nodes: int
) -> tuple[Samples, LoadedSamples, dict[int, list[float]], list[float]]:
    """The exec and lease samples, alone and under load; and bursts' seconds per
    create, by the engine's load and beside commands in flight."""
    spec = LocalPoolSpec(
        name=f"calibrate-{uuid.uuid4().hex[:6]}", nodes=nodes, port=0,
        capacity=Capacity(cpus=64, memory_mb=65536, slots=64),
        pool=PoolParams(min_warm=0, templates=[]), state_dir=Path(tempfile.mkdtemp()),
    )  # fmt: skip
    samples: Samples = {"exec": []}
    by_level: dict[int, list[float]] = {k: [] for k in LOAD_LEVELS}
    bursts: dict[int, list[float]] = {k: [] for k in LOAD_LEVELS}
    beside_commands: list[float] = []
    async with (
        LocalPool(spec) as pool,
        Client(pool.url, token=pool.tokens.admin) as operator,
        Client(pool.url, token=pool.tokens.client) as client,
    ):
        # no warm sandboxes: every acquire there is a create on an agent
        await operator.set_pool("load", PoolParams(min_warm=0, max_warm=0, templates=[]))
        async with client.sandbox(pool="load") as sb:
            for _ in range(n):
                started = time.perf_counter()
                await sb.exec(["true"])
                samples["exec"].append(time.perf_counter() - started)
        engine_load, commands = EngineLoad(engine), CommandLoad(client, "load")
        leases = n * LEASE_SAMPLES_FACTOR
        while min(len(s) for s in by_level.values()) < leases:
            for k in LOAD_LEVELS:
                by_level[k] += await _acquire_turn(
                    operator, client, lambda k=k: engine_load.start(k), engine_load.stop
                )
        await commands.open()
        try:
            for _ in range(burst_rounds(n)):
                for k in LOAD_LEVELS:
                    bursts[k].append(
                        await _burst(client, pool, lambda k=k: engine_load.start(k),
                                     engine_load.stop, held=len(commands.held))
                    )  # fmt: skip
                beside_commands.append(
                    await _burst(client, pool, commands.start, commands.stop,
                                 held=len(commands.held))
                )  # fmt: skip
        finally:
            await commands.close()
    samples["lease"] = by_level[0][:leases]
    under_load = {"lease": {k: by_level[k][:leases] for k in LOAD_LEVELS if k}}
    return samples, under_load, bursts, beside_commands


def burst_rounds(n: int) -> int:
    """Bursts per load for `n` samples an operation: a burst is BURST samples of the
    pool's creates in one figure, and each takes seconds."""
    return max(1, n // 15)


async def _burst(
    client: Client,
    pool: LocalPool,
    start: Callable[[], None],
    stop: Callable[[], Awaitable],
    held: int,
) -> float:
    """Seconds per create of BURST cold acquires at once on the pool `load` (no warm
    sandbox), while a background load runs; once they are released, their removals are
    waited for (the pool's containers back to the `held` ones), so that they do not
    load the next burst."""
    start()
    try:
        await asyncio.sleep(LOAD_SETTLE_S)
        started = time.perf_counter()
        got = await asyncio.gather(
            *(client.acquire(pool="load", timeout=BURST_SETTLE_S) for _ in range(BURST))
        )
        took = time.perf_counter() - started
    finally:
        await stop()
    await asyncio.gather(*(sb.release() for sb in got))
    deadline = time.perf_counter() + BURST_SETTLE_S
    while await asyncio.to_thread(pool_containers, pool.node_ids) > held:
        if time.perf_counter() > deadline:
            raise RuntimeError(f"a burst's sandboxes were not removed in {BURST_SETTLE_S:g} s")
        await asyncio.sleep(0.2)
    return took / BURST


def simulated_burst(profile: Profile, create_rate: float, nodes: int) -> float:
    """Seconds per create of the calibration's burst (BURST cold acquires at once) as the
    simulator plays it on `nodes` nodes sharing one engine, with `profile` at
    `create_rate` creates a second: the last acquire's time over BURST."""
    trial = dataclasses.replace(
        profile, engine_rates_per_s={**profile.engine_rates_per_s, "create": create_rate}
    )
    result = simulate(
        BURST_TRACE,
        nodes=nodes,
        slots_per_node=BURST,
        profile=trial,
        shared_engine=True,
        params=BURST_POOL,
        horizon_s=BURST_SETTLE_S,
    )
    acquired = [r.acquired_at_s for r in result.records]
    return (math.inf if None in acquired else max(acquired)) / BURST


def pool_create_rate(
    profile: Profile, seconds_per_create: float, nodes: int, engine_rate: float
) -> float:
    """The engine's create rate as a pool's own creates get it: the rate at which the
    simulator's burst (`simulated_burst`) takes `seconds_per_create` a create (the
    bursts measured alone, `_burst`), found by halving; never above `engine_rate`, the
    agent's driver's on the engine directly. What the pool pays that the driver does
    not, the agents' and the control plane's own work for each create on the same
    cores, is the simulated agents' to pay too: they take no processor time of their
    own."""
    if simulated_burst(profile, engine_rate, nodes) >= seconds_per_create:
        return engine_rate
    _, fast_enough = halved(
        lambda rate: simulated_burst(profile, rate, nodes) > seconds_per_create,
        0.0,
        engine_rate,
        RATE_FIT_STEPS,
    )
    return fast_enough


def halved(
    below: Callable[[float], bool], low: float, high: float, steps: int
) -> tuple[float, float]:
    """The interval from `low` to `high` halved `steps` times towards the edge where
    `below` (true at `low`, false at `high`) turns false."""
    for _ in range(steps):
        middle = (low + high) / 2
        low, high = (middle, high) if below(middle) else (low, middle)
    return low, high


def exec_weight(rates_per_s: dict[str, float]) -> float:
    """How many creates' worth of load one exec start is: its engine work against a
    create's, from the rates at which the engine completes each."""
    return rates_per_s["create"] / rates_per_s["exec"]


async def _acquire_turn(
    operator: Client, client: Client, start: Callable[[], None], stop: Callable[[], Awaitable]
) -> list[float]:
    """BATCH warm acquires' schedule times while a background load runs (`start`ed
    once the sandboxes are warm, `stop`ped after); the warm pool does not refill
    meanwhile."""
    await operator.set_pool("calibrate", PoolParams(min_warm=BATCH, templates=["base"]))
    await _wait_warm(client, "calibrate", BATCH)
    await operator.set_pool("calibrate", PoolParams(min_warm=0, max_warm=0, templates=["base"]))
    start()
    got: list[Sandbox] = []
    try:
        await asyncio.sleep(LOAD_SETTLE_S)
        for _ in range(BATCH):
            got.append(await client.acquire(pool="calibrate"))
            await asyncio.sleep(ACQUIRE_GAP_S)
    finally:
        await stop()
        await asyncio.gather(*(sb.release() for sb in got))
    return [sb.lease.schedule_ms / 1000 for sb in got if sb.lease.path == "warm"]


def equivalent_load(slowdown: Callable[[float], float], ratio: float) -> float:
    """The load (operations under way, up to the highest of LOAD_LEVELS) at which
    `slowdown` reaches `ratio`: it grows with the load, so halving the interval finds
    it; 0 if `ratio` is not above 1. A ratio past the slowdown at the highest load
    measured is read as that load: past it, `slowdown` is a trend carried on, whose
    slope (a difference of two noisy medians) may be near 0."""
    if ratio <= 1.0:
        return 0.0
    highest = float(max(LOAD_LEVELS))
    if slowdown(highest) <= ratio:
        return highest
    low, high = halved(lambda load: slowdown(load) < ratio, 0.0, highest, 50)
    return (low + high) / 2


def command_weight(slowdown: Callable[[float], float], alone: list[float],
                   beside_commands: list[float]) -> float:  # fmt: skip
    """How many operations' worth of load one command in flight is: the load at which
    the probe (`slowdown`, its durations `alone`) slows down as much as it did beside
    COMMAND_SANDBOXES commands, shared out among them."""
    ratio = statistics.median(beside_commands) / statistics.median(alone)
    return equivalent_load(slowdown, ratio) / COMMAND_SANDBOXES


def calibrate(n: int, nodes: int = DEFAULT_NODES) -> Profile:
    """`n` samples per operation and load; the lease calls on a pool of `nodes` nodes.
    Raises one of CALIBRATE_ERRORS if Docker or the pool fails; leaves no container."""
    engine = Engine()
    try:
        samples, under_load, rates = docker_samples(engine, n)
        pooled, pooled_loaded, bursts, beside_commands = asyncio.run(pool_samples(engine, n, nodes))
    finally:
        engine.sweep()
        engine.driver.close()
    samples.update(pooled)
    under_load.update(pooled_loaded)
    # a restore is a create plus unpacking the work dir through an exec
    samples["restore"] = [c + e for c, e in zip(samples["create"], samples["exec"], strict=False)]
    assert set(samples) == set(OPS)
    profile = Profile(samples, engine_concurrency=LIFECYCLE_SLOTS,
                      under_load=under_load,
                      engine_rates_per_s={op: round(r, 2) for op, r in rates.items()})  # fmt: skip
    profile.engine_rates_per_s["create"] = round(
        pool_create_rate(profile, statistics.median(bursts[0]), nodes, rates["create"]), 2
    )
    profile.exec_weight = round(exec_weight(profile.engine_rates_per_s), 3)
    # a burst's seconds per create, by load, as a profile of its own for its slowdowns
    burst = Profile(
        {"create": bursts[0]}, under_load={"create": {k: v for k, v in bursts.items() if k}}
    )
    profile.command_weight = round(
        command_weight(lambda k: burst.slowdown("create", k), bursts[0], beside_commands), 4
    )
    profile.source = (
        f"calibrated here, {n} samples per operation and load; create median "
        f"{statistics.median(samples['create']) * 1000:.0f} ms alone"
    )
    return profile


def add_calibrate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--nodes", type=int, default=DEFAULT_NODES)
    parser.add_argument("--out", type=Path, default=Path("profile.json"))


def describe(profile: Profile) -> str:
    def med_max(s: list[float]) -> str:
        s = sorted(s)
        return f"median {s[len(s) // 2] * 1000:8.1f} ms   max {s[-1] * 1000:8.1f} ms"

    lines = [
        profile.source,
        f"exec weight {profile.exec_weight} (creates' worth of load)",
        f"command weight {profile.command_weight} (operations' worth of load in flight)",
    ]
    lines += [f"engine {op} rate {rate} a second at most, "
              + ("as the pool's own creates get it" if op == "create" else "alone")
              for op, rate in profile.engine_rates_per_s.items()]  # fmt: skip
    lines += [f"{op:8} {med_max(profile.samples[op])}" for op in OPS]
    for op, by_k in profile.under_load.items():
        lines += [f"{op:8} {med_max(s)}   with {k} others" for k, s in sorted(by_k.items())]
    return "\n".join(lines)


def run_calibrate(args: argparse.Namespace) -> int:
    if not 5 <= args.samples <= 1000 or not 1 <= args.nodes <= 64:
        print("dsec bench calibrate: --samples must be between 5 and 1000, --nodes between "
              "1 and 64", file=sys.stderr)  # fmt: skip
        return 2
    try:
        profile = calibrate(args.samples, args.nodes)
    except CALIBRATE_ERRORS as e:
        print(f"dsec bench calibrate: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    profile.save(args.out)
    print(describe(profile))
    print(f"profile written to {args.out}")
    return 0
