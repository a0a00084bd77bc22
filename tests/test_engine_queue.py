"""The order of a node's engine work and its measured create limit (agent/engine.py), in
virtual time: no engine, no waiting."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from agent.engine import (
    REMOVE_WAITS_AT_MOST_S,
    CreateLimit,
    EngineQueue,
    EngineWideCreates,
    SharedCreates,
    Work,
)
from bench.sim.loop import VirtualTimeLoop


def run(coro_fn):
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(coro_fn())
    finally:
        loop.close()


def fixed(limit: int) -> CreateLimit:
    return CreateLimit(limit, limit, limit)


async def job(queue: EngineQueue, work: Work, name: str, started: list, took: float = 1.0):
    async with queue.turn(work):
        started.append((name, asyncio.get_running_loop().time()))
        await asyncio.sleep(took)


def test_waiting_work_starts_most_urgent_first_whatever_its_arrival():
    async def scenario():
        loop = asyncio.get_running_loop()
        queue = EngineQueue(1, fixed(4), loop.time)
        started: list = []
        blocker = asyncio.ensure_future(job(queue, Work.FREEZE, "running", started))
        await asyncio.sleep(0.1)
        arrivals = [
            (Work.REMOVE, "remove"),
            (Work.RESIDENT, "loop"),
            (Work.FREEZE, "pause"),
            (Work.CREATE_WARM, "warm"),
            (Work.CREATE_FOR_REQUEST, "request"),
            (Work.THAW, "thaw"),
        ]
        jobs = [asyncio.ensure_future(job(queue, w, n, started)) for w, n in arrivals]
        await asyncio.gather(blocker, *jobs)
        return [name for name, _ in started]

    assert run(scenario) == ["running", "thaw", "request", "warm", "pause", "loop", "remove"]


def test_a_command_loop_starts_only_when_no_create_waits():
    async def scenario():
        loop = asyncio.get_running_loop()
        queue = EngineQueue(4, fixed(1), loop.time)  # slots to spare, one create at a time
        started: list = []
        creates = [
            asyncio.ensure_future(job(queue, Work.CREATE_FOR_REQUEST, f"create{i}", started, 0.1))
            for i in range(3)
        ]
        await asyncio.sleep(0.01)
        loop_start = asyncio.ensure_future(job(queue, Work.RESIDENT, "loop", started))
        pause = asyncio.ensure_future(job(queue, Work.FREEZE, "pause", started))
        await asyncio.gather(*creates, loop_start, pause)
        return [name for name, _ in started]

    # a pause takes a spare slot beside the create; the loop waits for the last create
    # to have started (none waits any more)
    assert run(scenario) == ["create0", "pause", "create1", "create2", "loop"]


def test_a_loop_start_promoted_to_a_clients_work_starts_at_once_and_gives_its_slot_back():
    """A sandbox leased while its loop's start waits behind creates: the start becomes a
    client's work (agent/resident.py hurry) and goes, while the creates keep their turn."""

    async def scenario():
        loop = asyncio.get_running_loop()
        queue = EngineQueue(4, fixed(1), loop.time)
        started: list = []
        creates = [
            asyncio.ensure_future(job(queue, Work.CREATE_FOR_REQUEST, f"create{i}", started, 1))
            for i in range(3)
        ]
        await asyncio.sleep(0.01)

        async def loop_start() -> None:
            async with queue.turn(Work.RESIDENT, key="sandbox-1"):
                started.append(("loop", loop.time()))
                await asyncio.sleep(0.1)

        starting = asyncio.ensure_future(loop_start())
        await asyncio.sleep(0.5)
        assert started == [("create0", 0.0)]  # it waits for every create to have started
        assert not queue.promote("sandbox-2", Work.CLIENT)  # nothing waits under that key
        assert not queue.promote("sandbox-1", Work.RESIDENT)  # as urgent already
        assert queue.promote("sandbox-1", Work.CLIENT)
        await asyncio.gather(*creates, starting)
        assert not queue.promote("sandbox-1", Work.CLIENT) and not queue.keyed
        return started, dict(queue.running)

    started, running = run(scenario)
    assert [name for name, _ in started] == ["create0", "loop", "create1", "create2"]
    assert started[1][1] == pytest.approx(0.51)
    assert all(n == 0 for n in running.values())  # each took its slot back as what it ran as


def test_a_clients_work_never_waits_for_a_slot():
    async def scenario():
        loop = asyncio.get_running_loop()
        queue = EngineQueue(1, fixed(1), loop.time)
        started: list = []
        busy = asyncio.ensure_future(job(queue, Work.CREATE_FOR_REQUEST, "create", started, 5))
        await asyncio.sleep(0.1)
        await job(queue, Work.CLIENT, "exec start", started, 0.01)
        await busy
        return started

    started = run(scenario)
    assert started[1][0] == "exec start" and started[1][1] < 0.2


def test_creates_run_no_more_at_once_than_the_limit():
    async def scenario():
        loop = asyncio.get_running_loop()
        queue = EngineQueue(8, fixed(2), loop.time)
        started: list = []
        jobs = [
            asyncio.ensure_future(job(queue, Work.CREATE_FOR_REQUEST, f"c{i}", started))
            for i in range(5)
        ]
        pause = asyncio.ensure_future(job(queue, Work.FREEZE, "pause", started))
        await asyncio.gather(*jobs, pause)
        return started

    started = dict(run(scenario))
    assert [started[f"c{i}"] for i in range(5)] == [0.0, 0.0, 1.0, 1.0, 2.0]
    assert started["pause"] == 0.0  # a free slot is not kept for a blocked create


def test_a_removal_waits_for_a_quiet_engine_but_not_for_ever():
    async def scenario():
        loop = asyncio.get_running_loop()
        queue = EngineQueue(4, fixed(1), loop.time)
        started: list = []
        creates = [
            asyncio.ensure_future(job(queue, Work.CREATE_WARM, f"c{i}", started)) for i in range(3)
        ]
        await asyncio.sleep(0.1)
        removal = asyncio.ensure_future(job(queue, Work.REMOVE, "remove", started, 0.1))
        await asyncio.gather(*creates, removal)
        # a long run of creates: the removal goes once it has waited long enough
        later: list = []
        creates = [
            asyncio.ensure_future(job(queue, Work.CREATE_WARM, f"c{i}", later, 10))
            for i in range(10)
        ]
        await asyncio.sleep(0.1)
        removal = asyncio.ensure_future(job(queue, Work.REMOVE, "late", later, 0.1))
        await asyncio.gather(*creates, removal)
        return started, later

    started, later = (dict(s) for s in run(scenario))
    assert 3.0 <= started["remove"] < 3.2  # after the last create, not beside them
    late = later["late"] - later["c0"]
    assert REMOVE_WAITS_AT_MOST_S <= late <= REMOVE_WAITS_AT_MOST_S + 10.1


def test_a_cancelled_wait_gives_its_place_up():
    async def scenario():
        loop = asyncio.get_running_loop()
        queue = EngineQueue(1, fixed(4), loop.time)
        started: list = []
        busy = asyncio.ensure_future(job(queue, Work.FREEZE, "busy", started))
        await asyncio.sleep(0.1)
        gone = asyncio.ensure_future(job(queue, Work.THAW, "gone", started))
        after = asyncio.ensure_future(job(queue, Work.FREEZE, "after", started))
        await asyncio.sleep(0.1)
        gone.cancel()
        await asyncio.gather(busy, after, gone, return_exceptions=True)
        return started, queue

    started, queue = run(scenario)
    assert [n for n, _ in started] == ["busy", "after"]
    assert sum(queue.running.values()) == 0 and not any(queue.waiting.values())


def test_the_create_limit_grows_while_creates_do_not_queue_and_shrinks_when_they_do():
    limit = CreateLimit(initial=2, lowest=1, highest=8)
    for _ in range(10):  # saturated, and each create as fast as the best
        limit.observe(0.2, running=limit.limit)
    assert limit.limit == 8
    for _ in range(20):  # every create 4 x the best: the engine queues them
        limit.observe(0.8, running=limit.limit)
    assert limit.limit < 8
    assert limit.best is not None and limit.best < 0.8


def test_the_create_limit_does_not_grow_while_it_is_not_used():
    limit = CreateLimit(initial=2, lowest=1, highest=8)
    for _ in range(10):
        limit.observe(0.2, running=1)
    assert limit.limit == 2


@pytest.mark.parametrize("shared", ["files", "memory"])
def test_agents_on_one_engine_share_its_bound_on_creates(tmp_path, shared):
    """Three agents' creates on one engine: at most the highest of their limits at once
    (EngineWideCreates across processes by flock, SharedCreates in the simulator)."""

    async def scenario() -> None:
        if shared == "files":  # one per agent, as each agent opens the same directory
            slots = [EngineWideCreates(tmp_path / "engine-x-creates") for _ in range(3)]
        else:
            slots = [SharedCreates()] * 3
        running, most = 0, 0
        release = asyncio.Event()

        async def create(agent: int, limit: int) -> None:
            nonlocal running, most
            async with slots[agent].slot(limit):
                running += 1
                most = max(most, running)
                await release.wait()
                running -= 1

        tasks = [asyncio.ensure_future(create(i % 3, 2 + i % 2)) for i in range(9)]
        await asyncio.sleep(0.1)
        assert running == 3  # limits 2, 3 and 2: the highest, 3, engine-wide
        release.set()
        await asyncio.gather(*tasks)
        assert (most, running) == (3, 0)

    asyncio.run(scenario())


def test_a_killed_agent_s_slot_comes_back(tmp_path):
    """A slot is a lock the kernel lets go of with its holder: an agent killed while it
    creates leaves nothing to clean up."""
    directory = tmp_path / "engine-x-creates"
    mine = EngineWideCreates(directory)  # makes the directory
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_SLOT_0, str(directory / "slot-0")], stdout=subprocess.PIPE
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"

        async def scenario() -> None:
            waiting = asyncio.ensure_future(mine.slot(1).__aenter__())
            await asyncio.sleep(0.1)
            assert not waiting.done()  # the other agent's create holds the only slot
            holder.kill()
            await asyncio.wait_for(waiting, 5)

        asyncio.run(scenario())
    finally:
        holder.kill()
        holder.wait()


HOLD_SLOT_0 = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(60)
"""
