"""Replay a trace against a live pool: a running one, or one started for the replay.

Every episode is an asyncio task on one shared `Client`. It sleeps until its arrival, acquires
a sandbox, then for every step sleeps the think time (holding the sandbox idle) and runs a
command that takes the exec time (``sleep``), then releases. All trace times are multiplied
by ``time_scale`` first: 0.1 plays a trace ten times faster. Meanwhile the pools are sampled
about once a second (GET /v1/pools), and the control plane's counters (/metrics) are read
before and after, so the run's sandbox-seconds, busy seconds and scale events are the pool's
own accounting of exactly the replay.

The pool's warm-up is not part of the run: the replay starts once no sandbox is being
created and the counts held still between two looks.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from bench.records import EpisodeRecord, RunResult, TimelineSample
from dsec.client import Client, DsecError, Sandbox
from dsec.launch.local import LocalPool, LocalPoolSpec, Tokens
from dsec.models import MAX_TIMEOUT_S, Capacity, PoolList, PoolParams
from dsec.progress import progress_bar
from dsec.states import ASSIGNED, OCCUPYING, SandboxState
from dsec.trace import Episode

logger = logging.getLogger(__name__)

REPLAY_POOL_PREFIX = "replay-"
DEFAULT_NODES = 3
DEFAULT_SLOTS_PER_NODE = 64
TIMELINE_INTERVAL_S = 1.0
SETTLE_POLL_S = 0.5
SETTLE_TIMEOUT_S = 60.0
# An exec is given its own duration plus this before the agent kills it: a loaded engine
# can take seconds to start an exec, and that is latency to measure, not a failure.
EXEC_TIMEOUT_MARGIN_S = 60.0
ENGINE_EVENTS_LAG_S = 1.0
# Errors of one call: the episode records them and goes on to release what it holds.
CALL_ERRORS = (DsecError, aiohttp.ClientError, TimeoutError)


class ReplayError(RuntimeError):
    """The replay cannot run against this pool (said in one line)."""


class ExecFailed(Exception):
    """An exec answered, but with a non-zero exit code."""


@dataclass
class MetricTotals:
    """The control plane's run-wide counters at one scrape (or between two)."""

    sandbox_seconds: dict[str, float] = field(default_factory=dict)  # by node kind
    busy_seconds: float = 0.0
    scale_events: dict[str, float] = field(default_factory=dict)  # by action

    def minus(self, earlier: MetricTotals) -> MetricTotals:
        return MetricTotals(
            sandbox_seconds={
                kind: seconds - earlier.sandbox_seconds.get(kind, 0.0)
                for kind, seconds in self.sandbox_seconds.items()
            },
            busy_seconds=self.busy_seconds - earlier.busy_seconds,
            scale_events={
                action: count - earlier.scale_events.get(action, 0.0)
                for action, count in self.scale_events.items()
            },
        )


def parse_metric_totals(text: str) -> MetricTotals:
    """Sum the counters a report needs over pools: sandbox-seconds by node kind
    (dsec_sandbox_node_seconds_total), busy seconds and scale events by action."""
    totals = MetricTotals(sandbox_seconds={"local": 0.0, "cloud": 0.0})
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "dsec_sandbox_node_seconds_total":
                kind = sample.labels["kind"]
                totals.sandbox_seconds[kind] = totals.sandbox_seconds.get(kind, 0.0) + sample.value
            elif sample.name == "dsec_sandbox_busy_seconds_total":
                totals.busy_seconds += sample.value
            elif sample.name == "dsec_scale_events_total":
                action = sample.labels["action"]
                totals.scale_events[action] = totals.scale_events.get(action, 0.0) + sample.value
    return totals


def timeline_sample(t_s: float, pools: PoolList) -> TimelineSample:
    """The pools at one instant, summed: queue depth, sandboxes by state, leased, alive."""
    by_state: Counter[str] = Counter()
    for pool in pools.pools:
        by_state.update(pool.sandboxes)
    by_state.pop(SandboxState.GONE, None)  # tombstones of released sandboxes, not sandboxes
    return TimelineSample(
        t_s=t_s,
        queue_depth=sum(pool.queue_depth for pool in pools.pools),
        sandboxes=dict(by_state),
        leased=sum(by_state[state] for state in ASSIGNED),
        alive=sum(by_state[state] for state in OCCUPYING),
    )


class NodeKinds:
    """Node id to kind (local or cloud), refreshed when a lease names a node not seen yet
    (cloud nodes join while the run overflows)."""

    def __init__(self, client: Client, kinds: dict[str, str]) -> None:
        self.client = client
        self.kinds = kinds
        self.refreshing = asyncio.Lock()

    async def kind_of(self, node_id: str) -> str | None:
        if node_id not in self.kinds:
            async with self.refreshing:  # one GET /v1/nodes for a crowd of new leases
                if node_id not in self.kinds:
                    nodes = (await self.client.nodes()).nodes
                    self.kinds.update({node.node_id: node.kind for node in nodes})
        return self.kinds.get(node_id)


async def _sleep_until(clock: Callable[[], float], at_s: float) -> None:
    delay = at_s - clock()
    if delay > 0:
        await asyncio.sleep(delay)


def _command_for(exec_s: float) -> list[str]:
    # busybox sleep takes fractions of a second; `true` is the cheapest command that is one
    return ["sleep", f"{exec_s:.3f}"] if exec_s > 0 else ["true"]


async def _release(sandbox: Sandbox, record: EpisodeRecord, clock: Callable[[], float]) -> None:
    released_at_s = clock()  # the hold ends here; removing the container is the pool's time
    try:
        await sandbox.release()
    except CALL_ERRORS as error:
        if not (isinstance(error, DsecError) and error.code == "already_released"):
            record.error = record.error or f"release: {error}"
            return
    record.released_at_s = released_at_s


async def play_episode(
    client: Client,
    episode: Episode,
    *,
    time_scale: float,
    clock: Callable[[], float],
    node_kinds: NodeKinds,
    acquire_timeout_s: float = MAX_TIMEOUT_S,
) -> EpisodeRecord:
    """Acquire at the (scaled) arrival, think and exec every step, release; record it all.

    ``clock`` gives seconds since the replay's start. An error ends the episode early, is
    recorded, and whatever it holds is still released.
    """
    await _sleep_until(clock, episode.arrival_s * time_scale)
    record = EpisodeRecord(
        episode=episode.episode,
        pool=episode.pool,
        template=episode.template,
        arrival_s=episode.arrival_s * time_scale,
        requested_at_s=clock(),
    )
    try:
        sandbox = await client.acquire(
            episode.pool,
            episode.template,
            priority=episode.priority,
            timeout=acquire_timeout_s,
        )
    except CALL_ERRORS as error:
        record.error = f"acquire: {error}"
        return record
    record.acquired_at_s = clock()
    record.schedule_ms = sandbox.lease.schedule_ms
    record.path = sandbox.lease.path
    record.node = sandbox.node
    try:
        record.node_kind = await node_kinds.kind_of(sandbox.node)
        for step in episode.steps:
            thinking_since = clock()
            await asyncio.sleep(step.think_s * time_scale)
            record.idle_s += clock() - thinking_since
            exec_s = step.exec_s * time_scale
            exec_since = clock()
            result = await sandbox.exec(
                _command_for(exec_s), timeout=min(MAX_TIMEOUT_S, exec_s + EXEC_TIMEOUT_MARGIN_S)
            )
            took_s = clock() - exec_since
            record.exec_s.append(took_s)
            record.busy_s += took_s
            if result.exit_code != 0:
                raise ExecFailed(f"exit code {result.exit_code}: {result.stderr.strip()[:200]}")
    except (*CALL_ERRORS, ExecFailed) as error:
        record.error = f"exec: {error}"
    finally:
        releasing = asyncio.ensure_future(_release(sandbox, record, clock))
        try:
            await asyncio.shield(releasing)
        except asyncio.CancelledError:
            await releasing  # a cancelled replay still gives the sandbox back, then stops
            raise
    return record


async def sample_timeline(
    client: Client, clock: Callable[[], float], samples: list[TimelineSample]
) -> None:
    """Append a sample of GET /v1/pools about every second until cancelled."""
    next_at_s = clock()
    while True:
        at_s = clock()
        try:
            samples.append(timeline_sample(at_s, await client.pools()))
        except CALL_ERRORS as error:
            logger.warning("timeline sample at %.1f s failed: %s", at_s, error)
        next_at_s += TIMELINE_INTERVAL_S
        await _sleep_until(clock, next_at_s)


async def _scrape(http: aiohttp.ClientSession, url: str) -> MetricTotals:
    async with http.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=30)) as response:
        response.raise_for_status()
        return parse_metric_totals(await response.text())


async def _wait_settled(client: Client) -> None:
    previous: dict[str, int] | None = None
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while time.monotonic() < deadline:
        await asyncio.sleep(SETTLE_POLL_S)  # first: the policy's first ticks start the creates
        counts = timeline_sample(0.0, await client.pools()).sandboxes
        if counts == previous and not counts.get(SandboxState.CREATING):
            return
        previous = counts
    logger.warning("the pool still changed after %.0f s; replaying anyway", SETTLE_TIMEOUT_S)


async def _ensure_pools(url: str, admin_token: str, wanted: set[str], existing: PoolList) -> None:
    """Create the pools the trace names that the control plane lacks, with the parameters
    of its `default` pool (the ones a fresh pool has)."""
    params = {pool.name: pool.params for pool in existing.pools}
    missing = sorted(wanted - params.keys())
    if not missing:
        return
    if not admin_token:
        raise ReplayError(
            f"the trace names pools the control plane does not have ({', '.join(missing)}); "
            "set DSEC_ADMIN_TOKEN so the replay can create them"
        )
    async with Client(url, token=admin_token) as operator:
        for name in missing:
            await operator.set_pool(name, params.get("default", PoolParams()))


async def _replay(episodes: Sequence[Episode], url: str, tokens: Tokens, **run) -> RunResult:
    # every episode may hold one connection at a time (a queued acquire, or an exec)
    connection_limit = len(episodes) + 16
    try:
        async with (
            Client(url, token=tokens.client, connection_limit=connection_limit) as client,
            aiohttp.ClientSession() as http,
        ):
            return await _replay_with(episodes, url, tokens, client, http, **run)
    except CALL_ERRORS as error:  # the episodes keep theirs: this is setup or the last scrape
        raise ReplayError(f"the pool at {url} cannot be replayed against: {error}") from error


async def _replay_with(
    episodes: Sequence[Episode],
    url: str,
    tokens: Tokens,
    client: Client,
    http: aiohttp.ClientSession,
    *,
    time_scale: float,
    progress: bool,
    acquire_timeout_s: float,
    meta: dict,
) -> RunResult:
    wanted = {episode.pool for episode in episodes}
    await _ensure_pools(url, tokens.admin, wanted, await client.pools())
    await _wait_settled(client)
    nodes = (await client.nodes()).nodes
    node_kinds = NodeKinds(client, {node.node_id: node.kind for node in nodes})
    local_nodes = [node for node in nodes if node.kind == "local"]
    pools = (await client.pools()).pools
    meta = {
        **meta,
        "params": {p.name: p.params.model_dump(mode="json") for p in pools if p.name in wanted},
        "nodes": len(local_nodes),
        "slots_per_node": local_nodes[0].capacity.slots if local_nodes else None,
    }

    before = await _scrape(http, url)
    started = time.perf_counter()
    started_at_unix = time.time()  # the engine's own events are dated so (bench.engine_events)

    def clock() -> float:
        return time.perf_counter() - started

    timeline: list[TimelineSample] = []
    sampler = asyncio.create_task(sample_timeline(client, clock, timeline))
    plays = [
        asyncio.create_task(
            play_episode(
                client,
                episode,
                time_scale=time_scale,
                clock=clock,
                node_kinds=node_kinds,
                acquire_timeout_s=acquire_timeout_s,
            )
        )
        for episode in episodes
    ]
    with progress_bar(len(plays), "episodes", "ep", shown=progress) as bar:
        try:
            for finished in asyncio.as_completed(plays):
                await finished
                bar.update(1)
        finally:
            for play in plays:
                play.cancel()
            sampler.cancel()
            await asyncio.gather(*plays, sampler, return_exceptions=True)
    timeline.append(timeline_sample(clock(), await client.pools()))
    wall_s = clock()
    spent = (await _scrape(http, url)).minus(before)
    # the engine dates a container's end when it sees it, a little after the agent's kill
    # answered the last release: its events are counted up to a moment later
    await asyncio.sleep(ENGINE_EVENTS_LAG_S)
    ended_at_unix = time.time()

    return RunResult(
        records=[play.result() for play in plays],
        timeline=timeline,
        sandbox_seconds=spent.sandbox_seconds,
        busy_seconds=spent.busy_seconds,
        scale_events={action: round(n) for action, n in spent.scale_events.items() if n >= 0.5},
        meta={
            **meta,
            "wall_s": round(wall_s, 3),
            "started_at_unix": started_at_unix,
            "ended_at_unix": ended_at_unix,
        },
    )


def default_pool_spec(
    policy: str = "dsec",
    *,
    nodes: int = DEFAULT_NODES,
    slots_per_node: int = DEFAULT_SLOTS_PER_NODE,
    cloud_nodes: int = 0,
    state_dir: Path | None = None,
) -> LocalPoolSpec:
    """The local pool a replay starts: ``nodes`` nodes whose limit is their slots (CPUs and
    memory are sized so that they never bind first), and up to ``cloud_nodes`` cloud nodes
    started when local utilisation passes the overflow threshold."""
    spec = LocalPoolSpec(
        name=f"{REPLAY_POOL_PREFIX}{uuid.uuid4().hex[:8]}",
        nodes=nodes,
        port=0,
        capacity=Capacity(
            cpus=slots_per_node, memory_mb=slots_per_node * 1024, slots=slots_per_node
        ),
        cloud_nodes=cloud_nodes,
        policy=policy,
    )
    if state_dir is not None:
        spec.state_dir = state_dir
    return spec


async def replay_live(
    episodes: Sequence[Episode],
    *,
    url: str | None = None,
    tokens: Tokens | None = None,
    pool_spec: LocalPoolSpec | None = None,
    time_scale: float = 1.0,
    policy: str = "dsec",
    progress: bool = True,
    trace: str | None = None,
    seed: int | None = None,
    acquire_timeout_s: float = MAX_TIMEOUT_S,
) -> RunResult:
    """Replay ``episodes`` live and return what happened.

    With ``url``, against that control plane, with ``tokens`` (or DSEC_TOKEN and, to create
    pools the trace names, DSEC_ADMIN_TOKEN); ``policy`` then only labels the run. Without,
    it starts a local pool from ``pool_spec`` running ``policy`` (default: `default_pool_spec`
    in a temporary state directory) and stops it afterwards, removing every sandbox.
    ``trace`` and ``seed`` are recorded in the run's meta.
    """
    if not episodes:
        raise ValueError("nothing to replay: no episodes")
    if not time_scale > 0:
        raise ValueError(f"time scale must be > 0, got {time_scale}")
    meta = {
        "trace": trace,
        "policy": policy,
        "mode": "live",
        "seed": seed,
        "time_scale": time_scale,
    }
    run = {"time_scale": time_scale, "progress": progress, "acquire_timeout_s": acquire_timeout_s}
    if url is not None:
        if tokens is None:
            tokens = Tokens(
                client=os.environ.get("DSEC_TOKEN", ""),
                admin=os.environ.get("DSEC_ADMIN_TOKEN", ""),
                agent="",
            )
        return await _replay(episodes, url, tokens, meta=meta, **run)

    if pool_spec is None:
        with tempfile.TemporaryDirectory(prefix="dsec-replay-") as state_dir:
            spec = default_pool_spec(policy, state_dir=Path(state_dir))
            return await _replay_on_local_pool(episodes, spec, meta, run)
    return await _replay_on_local_pool(episodes, replace(pool_spec, policy=policy), meta, run)


async def _replay_on_local_pool(
    episodes: Sequence[Episode], spec: LocalPoolSpec, meta: dict, run: dict
) -> RunResult:
    async with LocalPool(spec) as pool:
        return await _replay(
            episodes, pool.url, pool.tokens, meta={**meta, "cloud_nodes": spec.cloud_nodes}, **run
        )
