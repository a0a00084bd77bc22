"""Replay a trace in virtual time through the control plane's own scheduler.

The pieces are the live ones: the scheduler as `controlplane.scheduler.build_scheduler`
makes it for the HTTP app, with its view, queues and metrics, the same policy objects
(`dsec.policies.make_policy`), `Leases.acquire` / `Leases.release`, which the HTTP
handlers call live, and the heartbeat path (`Scheduler.on_report`), through which the
simulated agents report every second as live ones do. What is simulated: time (a
virtual-time event loop), the agents and Docker (durations drawn from a profile), and
the network between them (none). Deterministic for a given seed.

An episode acquires at its arrival, holds its sandbox through its steps, and
releases it. Steps are not one event each: think and exec times are added up into
one hold, except a think long enough for lease-idle freezing, which is played out so
the policy sees the lease idle and the next exec pays the thaw, as live.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
import time
from collections.abc import Callable, Iterator

from bench.records import EpisodeRecord, RunResult, TimelineSample
from bench.replay_live import SETTLE_POLL_S, SETTLE_TIMEOUT_S
from bench.sim.agents import SimAgents
from bench.sim.loop import VirtualClock, VirtualTimeLoop
from bench.sim.profile import Profile
from bench.sim.ticks import SHARE, Ticks
from controlplane.config import ControlPlaneConfig
from controlplane.metrics import ControlPlaneMetrics
from controlplane.scheduler import build_scheduler
from dsec.httpkit import ApiError
from dsec.models import AcquireRequest, PoolParams
from dsec.policies import make_policy
from dsec.policy import Resources
from dsec.progress import progress_bar
from dsec.states import ASSIGNED, OCCUPYING
from dsec.states import SandboxState as S
from dsec.trace import Episode

SIM_TOKEN = "simulated-agent-token-0000"
ACQUIRE_TIMEOUT_S = 3600.0
# allocations between two collections of the youngest objects while simulating (Python's
# default is 700): see _collector_eased
SIM_GC_THRESHOLD = 50_000


def simulate(
    episodes: list[Episode],
    *,
    policy: str = "dsec",
    nodes: int = 3,
    slots_per_node: int = 64,
    cloud_nodes: int = 0,
    seed: int = 0,
    time_scale: float = 1.0,
    params: PoolParams | None = None,
    profile: Profile | None = None,
    shared_engine: bool = False,
    tick_s: float = 0.25,
    min_tick_gap_s: float = 0.0,
    decide_within: float = SHARE,
    sample_s: float = 1.0,
    heartbeat_s: float = 1.0,
    horizon_s: float | None = None,
    trace_name: str = "",
    progress: bool | Callable[[float], None] = False,
) -> RunResult:
    """Play `episodes` against `nodes` simulated nodes (plus `cloud_nodes` cloud ones,
    present from the start) under `policy`; every pool the trace names gets `params`.
    With `horizon_s`, stop at that simulated time: episodes still running then are
    recorded unreleased. `decide_within`: how much of a wait or of a sandbox's making a
    decision about it may be put off, so that events share ticks (bench/sim/ticks.py;
    0: a tick on every event, as live)."""
    loop = VirtualTimeLoop()
    try:
        with _collector_eased():
            return loop.run_until_complete(
                _simulate(
                    loop, episodes, policy=policy, nodes=nodes, slots_per_node=slots_per_node,
                    cloud_nodes=cloud_nodes, seed=seed, time_scale=time_scale,
                    params=params or PoolParams(), profile=profile or Profile.default(seed=seed),
                    shared_engine=shared_engine, tick_s=tick_s, min_tick_gap_s=min_tick_gap_s,
                    decide_within=decide_within,
                    sample_s=sample_s, heartbeat_s=heartbeat_s,
                    horizon_s=horizon_s, trace_name=trace_name, progress=progress,
                )
            )  # fmt: skip
    finally:
        loop.close()


async def _simulate(loop: VirtualTimeLoop, episodes: list[Episode], **o) -> RunResult:
    started_wall = time.perf_counter()
    clock = VirtualClock(loop)
    rng = random.Random(o["seed"])
    params: PoolParams = o["params"]
    pool_names = sorted({e.pool for e in episodes} | {"default"})
    config = ControlPlaneConfig(
        admin_tokens=[SIM_TOKEN],
        agent_token=SIM_TOKEN,
        pools={name: params for name in pool_names},
        tick_s=o["tick_s"],
        min_tick_gap_s=o["min_tick_gap_s"],
        heartbeat_timeout_s=60,
        policy=o["policy"],
    )
    agents = SimAgents(o["profile"], rng, o["shared_engine"])
    # reports are never late here: each is the simulated agents' state at its instant
    # ids from the seed too, in a stream of their own: the policy samples nodes by them
    ids = random.Random(f"ids-{o['seed']}")
    scheduler = build_scheduler(
        config, agents, clock, policy=make_policy(o["policy"]), confirm_grace_s=0,
        ids=lambda n: f"{ids.getrandbits(8 * n):0{2 * n}x}",
    )  # fmt: skip
    view, metrics = scheduler.view, scheduler.metrics
    ticks = Ticks(scheduler, o["decide_within"])
    agents.on_ready = ticks.ready
    capacity = Resources(cpus=1e4, memory_mb=1 << 40, slots=o["slots_per_node"])
    image = config.templates["base"].image
    for i in range(o["nodes"] + o["cloud_nodes"]):
        kind = "local" if i < o["nodes"] else "cloud"
        node = agents.add_node(f"{kind}-{i + 1}", kind, capacity, {image})
        scheduler.on_report(agents.report(node.id, clock.now()))  # it registers

    records: list[EpisodeRecord] = []
    timeline: list[TimelineSample] = []
    busy = [0.0]
    scale = o["time_scale"]
    end_of_trace = max((e.arrival_s + e.lifetime_s) * scale for e in episodes) if episodes else 0
    if o["horizon_s"] is not None:
        end_of_trace = min(end_of_trace, o["horizon_s"])
    report_progress = _progress(o["progress"], end_of_trace)

    started_at = [0.0]  # when the replay starts, once the pool has settled

    def since() -> float:
        """Replay time: what a record's times count from, as live."""
        return clock.now() - started_at[0]

    async def play(episode: Episode) -> None:
        await asyncio.sleep(max(0.0, episode.arrival_s * scale - since()))
        record = EpisodeRecord(
            episode=episode.episode, pool=episode.pool, template=episode.template,
            arrival_s=episode.arrival_s * scale, requested_at_s=since(),
        )  # fmt: skip
        records.append(record)
        ticks.arrival(episode.pool)
        try:
            lease = await scheduler.leases.acquire(
                AcquireRequest(pool=episode.pool, template=episode.template,
                               priority=episode.priority, timeout_s=ACQUIRE_TIMEOUT_S)
            )  # fmt: skip
        except ApiError as e:
            record.error = f"{e.code}: {e.message}"
            return
        record.acquired_at_s = since()
        record.schedule_ms, record.path, record.node = lease.schedule_ms, lease.path, lease.node
        record.node_kind = agents.nodes[lease.node].kind
        await hold(episode, lease.id, lease.node, record, params.lease_idle_freeze_s)
        await scheduler.leases.release(lease.id, lease.lease_token)
        record.released_at_s = since()

    async def hold(episode, sandbox_id, node_id, record, freeze_after_s) -> None:
        steps = episode.steps
        thinks = [think_s * scale for think_s in steps.think_s]
        overheads = o["profile"].draws("exec", rng, len(steps))
        record.exec_s = [
            exec_s * scale + e for exec_s, e in zip(steps.exec_s, overheads, strict=True)
        ]
        record.idle_s, record.busy_s = sum(thinks), sum(record.exec_s)
        busy[0] += record.busy_s
        # played in stretches: a think long enough for the policy to freeze the lease is
        # played out (it sees the lease idle; the next exec pays the thaw); the steps
        # between are handed to the agent at once and held as one sleep
        cuts = [i for i, think in enumerate(thinks) if think >= freeze_after_s]
        bounds = [0, *cuts, len(steps)]
        pending_s = 0.0  # what is handed over and not yet played out
        for lo, hi in zip(bounds, bounds[1:], strict=False):
            if lo == hi:
                continue
            first_think = thinks[lo]
            if first_think >= freeze_after_s:
                await asyncio.sleep(pending_s + first_think)
                pending_s = first_think = 0.0
                await agents.thaw_for_exec(node_id, sandbox_id)  # its next report says so
            pending_s += agents.run_commands(
                node_id, sandbox_id, clock.now() + pending_s,
                [first_think, *thinks[lo + 1 : hi]], overheads[lo:hi], record.exec_s[lo:hi],
            )  # fmt: skip
        await asyncio.sleep(pending_s)

    def by_state() -> dict[str, int]:
        return {str(s): len(m) for s, m in view.by_state.items() if m and s != S.GONE}

    async def sample() -> None:
        while True:
            leased = sum(len(view.by_state[s]) for s in ASSIGNED)
            alive = sum(len(view.by_state[s]) for s in OCCUPYING)
            depth = sum(scheduler.queues.depth(p) for p in pool_names)
            timeline.append(TimelineSample(since(), depth, by_state(), leased, alive))
            report_progress(since())
            await asyncio.sleep(o["sample_s"])

    async def settle() -> None:
        """As a live replay starts (bench.replay_live): once the pool has made its warm
        sandboxes and its counts held still between two looks."""
        previous = None
        while clock.now() < SETTLE_TIMEOUT_S:
            await asyncio.sleep(SETTLE_POLL_S)
            counts = by_state()
            if counts == previous and not counts.get(S.CREATING):
                return
            previous = counts

    await agents.start()
    ticking = asyncio.ensure_future(ticks.run_forever())
    # a heartbeat at most every half timeout: the simulated agents are never late
    beating = asyncio.ensure_future(
        agents.heartbeat_forever(
            scheduler.on_report, o["heartbeat_s"], config.heartbeat_timeout_s / 2
        )
    )
    await settle()
    started_at[0] = clock.now()
    warm_up = _accounts(metrics)  # the pool's own accounting counts from here, as live
    engine_events_before = agents.engine_events.copy()
    sampling = asyncio.ensure_future(sample())
    playing = asyncio.gather(*(play(e) for e in episodes))
    try:
        await asyncio.wait_for(playing, o["horizon_s"])
    except TimeoutError:
        pass  # the horizon: what still runs is left as it is
    in_flight = (ticking, beating, sampling, *scheduler.actuator.tasks, *agents.background)
    for task in in_flight:
        task.cancel()  # at the horizon, what is in flight stays unfinished
    await asyncio.gather(*in_flight, return_exceptions=True)
    scheduler.sandbox_seconds.account(clock.now())  # the last stretch of sandbox-seconds
    report_progress(None)
    sandbox_seconds, scale_events = (
        {k: v - before.get(k, 0.0) for k, v in after.items()}
        for after, before in zip(_accounts(metrics), warm_up, strict=True)
    )

    return RunResult(
        records=sorted(records, key=lambda r: (r.arrival_s, r.episode)),
        timeline=timeline,
        sandbox_seconds=sandbox_seconds,
        busy_seconds=busy[0],
        scale_events={k: round(v) for k, v in scale_events.items() if v >= 0.5},
        meta={
            "trace": o["trace_name"], "policy": o["policy"],
            "params": params.model_dump(), "mode": "sim", "seed": o["seed"],
            "time_scale": scale, "nodes": o["nodes"], "cloud_nodes": o["cloud_nodes"],
            "slots_per_node": o["slots_per_node"], "profile": o["profile"].source,
            "shared_engine": o["shared_engine"],
            "min_tick_gap_s": o["min_tick_gap_s"], "decide_within": o["decide_within"],
            "heartbeat_s": o["heartbeat_s"],
            "wall_s": round(time.perf_counter() - started_wall, 3),
            "simulated_s": round(since(), 3),
            "settled_after_s": round(started_at[0], 3),
            "engine_events": dict(sorted((agents.engine_events - engine_events_before).items())),
        },
    )  # fmt: skip


@contextlib.contextmanager
def _collector_eased() -> Iterator[None]:
    """Cyclic garbage collection, less often and not through what is already there (the
    trace). A simulation makes millions of short-lived objects (events, snapshots) beside
    millions of long-lived ones: with Python's defaults the collector takes a sixth of a
    simulated hour at DSec's scale, going through the trace again and again."""
    threshold = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(SIM_GC_THRESHOLD, *threshold[1:])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()


def _accounts(metrics: ControlPlaneMetrics) -> tuple[dict[str, float], dict[str, float]]:
    """The pool's sandbox-seconds by node kind and scale events by action, so far."""
    return (
        _by_label(metrics, "dsec_sandbox_node_seconds_total", "kind"),
        _by_label(metrics, "dsec_scale_events_total", "action"),
    )


def _by_label(metrics: ControlPlaneMetrics, name: str, label: str) -> dict[str, float]:
    totals: dict[str, float] = {"local": 0.0, "cloud": 0.0} if label == "kind" else {}
    for family in metrics.registry.collect():
        for sample in family.samples:
            if sample.name == name:
                key = sample.labels[label]
                totals[key] = totals.get(key, 0.0) + sample.value
    return totals


def _progress(progress, total_s: float) -> Callable[[float | None], None]:
    """A progress bar over simulated time, a callback, or nothing."""
    if callable(progress):
        return lambda t: progress(t) if t is not None else None
    if not progress:
        return lambda t: None
    bar = progress_bar(round(total_s), "simulating", "sim s", leave=False)

    def update(t: float | None) -> None:
        if t is None:
            bar.close()
        else:
            bar.update(max(0, round(t) - bar.n))

    return update
