"""The order in which a node's Docker engine does its work, and how many creates at once.

An engine serialises much of what it is asked (20 concurrent creates took 2.8 s in
all here), so what it does first decides who waits. `EngineQueue` admits operations
by `Work` class, most urgent first: what a client waits on now, then creates a
request waits for, then warm-pool creates, then freezing, then starting sandboxes'
command loops, and last the removal of containers already stopped, when nothing else
waits. Creates are also bounded by
`CreateLimit`, which measures the concurrency past which creates only get slower;
the agent reports it, and the control plane places no more refills on a node than
that. The simulator runs the same queue (`bench.sim.agents`).
"""

from __future__ import annotations

import asyncio
import fcntl
import os
from collections import deque
from collections.abc import AsyncIterator, Hashable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from enum import IntEnum
from pathlib import Path
from typing import Protocol


class Work(IntEnum):
    """What the engine is asked to do, most urgent first."""

    CLIENT = 0  # a lease's thaw or restore, an exec's start, a kill: a client waits now
    THAW = 1  # unpause a warm-pool sandbox
    CREATE_FOR_REQUEST = 2  # an acquire waits for it
    CREATE_WARM = 3  # the warm pool refills or scales up: nobody waits yet
    FREEZE = 4  # pause, hibernate
    # start a sandbox's command loop (agent/resident.py): it saves later execs, never
    # delays a sandbox, so only when nothing more urgent waits (but the first start of a
    # leased sandbox's container is CLIENT work: Resident.hurry)
    RESIDENT = 5
    REMOVE = 6  # remove a container already stopped: only when nothing else waits


CREATES = (Work.CREATE_FOR_REQUEST, Work.CREATE_WARM)
# every class, most urgent first: a tuple, as iterating the enum itself costs several
# times more, and the queue goes through the classes on every admission
WORK_ORDER = tuple(Work)
# A removal waits for a quiet engine, but not for ever: a stopped container still holds
# its disk, and a restart removes what it finds stopped anyway.
REMOVE_WAITS_AT_MOST_S = 30.0


class CreateLimit:
    """The concurrency past which creates only get slower, measured as TCP Vegas measures
    a path: with `best` the shortest create seen (no queue in the engine), a create that
    took `took` with `limit` running means about limit * (1 - best / took) creates' worth
    of queue inside the engine. Under ALPHA, the engine has room for one more at once;
    over BETA, one fewer. `best` drifts up slowly, so an engine that got slower for good
    is not held to what it once did."""

    ALPHA, BETA = 1.0, 2.0
    DRIFT = 0.01  # per create, the share by which `best` may rise towards what is seen

    def __init__(self, initial: int = 2, lowest: int = 1, highest: int = 32) -> None:
        self.limit, self.lowest, self.highest = initial, lowest, highest
        self.best: float | None = None

    def observe(self, took: float, running: int) -> None:
        """A create took `took` seconds while `running` creates (itself included) ran."""
        if self.best is None or took < self.best:
            self.best = took
        else:
            self.best += (took - self.best) * self.DRIFT
        if took <= 0:
            return
        queued = self.limit * (1.0 - self.best / took)
        if queued < self.ALPHA and running >= self.limit:
            self.limit = min(self.highest, self.limit + 1)  # saturated, and no queue yet
        elif queued > self.BETA:
            self.limit = max(self.lowest, self.limit - 1)


class EngineQueue:
    """Admits engine operations by priority. A client's work starts at once; the rest at
    most `slots` at once (lifecycle calls the engine is given together), at most
    `creates.limit` of them creates, and a removal only when no other work waits and no
    create runs (or once it has waited REMOVE_WAITS_AT_MOST_S)."""

    def __init__(self, slots: int, creates: CreateLimit, now) -> None:
        self.slots = slots
        self.creates = creates
        self.now = now  # the injected clock's now()
        self.waiting: dict[Work, deque[tuple[float, asyncio.Future]]] = {w: deque() for w in Work}
        self.running: dict[Work, int] = {w: 0 for w in Work}
        # work that waits under a key, for `promote`: the key's [class, ticket]
        self.keyed: dict[Hashable, list] = {}

    def queued(self, work: Work) -> int:
        return len(self.waiting[work])

    @asynccontextmanager
    async def turn(self, work: Work, key: Hashable | None = None) -> AsyncIterator[None]:
        """Hold one of the engine's slots for `work`, once its turn comes; while it waits,
        `promote(key, ...)` may make it more urgent work."""
        ticket = asyncio.get_running_loop().create_future()
        self.waiting[work].append((self.now(), ticket))
        waiting_as = [work, ticket]  # its class, which a promotion changes
        if key is not None:
            self.keyed[key] = waiting_as
        self._admit()
        try:
            await ticket
        except BaseException:
            work = waiting_as[0]
            if ticket.done() and not ticket.cancelled():
                self._leave(work)  # admitted just as it was cancelled: give the slot back
            else:
                self.waiting[work] = deque(t for t in self.waiting[work] if t[1] is not ticket)
                self._admit()
            raise
        finally:
            if key is not None and self.keyed.get(key) is waiting_as:
                del self.keyed[key]
        try:
            yield
        finally:
            self._leave(waiting_as[0])

    def promote(self, key: Hashable, to: Work) -> bool:
        """Make the work waiting under `key` `to` (more urgent) from now; False if none
        waits, or it is as urgent already."""
        waiting_as = self.keyed.get(key)
        if waiting_as is None or to >= waiting_as[0]:
            return False
        work, ticket = waiting_as
        queue = self.waiting[work]
        for i, (since, queued) in enumerate(queue):
            if queued is ticket:
                del queue[i]
                self.waiting[to].append((since, ticket))
                waiting_as[0] = to
                self._admit()
                return True
        return False

    def _leave(self, work: Work) -> None:
        self.running[work] -= 1
        self._admit()

    def creating(self) -> int:
        return sum(self.running[w] for w in CREATES)

    def _admit(self) -> None:
        for work in WORK_ORDER:
            queue = self.waiting[work]
            while queue and self._may_start(work, queue[0][0]):
                _, ticket = queue.popleft()
                self.running[work] += 1
                ticket.set_result(None)

    def _may_start(self, work: Work, since: float) -> bool:
        if work == Work.CLIENT:
            return True
        if sum(self.running.values()) - self.running[Work.CLIENT] >= self.slots:
            return False
        if work in CREATES:
            return self.creating() < self.creates.limit
        if work == Work.RESIDENT:
            return not any(self.waiting[w] for w in WORK_ORDER if w < Work.RESIDENT)
        if work == Work.REMOVE:
            quiet = not self.creating() and not any(
                self.waiting[w] for w in WORK_ORDER if w != Work.REMOVE
            )
            return quiet or self.now() - since >= REMOVE_WAITS_AT_MOST_S
        return True


class CreateSlots(Protocol):
    """The creates one engine runs at once, whichever agent asks."""

    def slot(self, limit: int) -> AbstractAsyncContextManager[None]: ...


class EngineWideCreates:
    """Creates in flight on one engine, for every agent that drives it: `dsec up`'s agents
    share one engine, and each one's CreateLimit alone let three times its limit run at
    once (about 95 creating at once in a burst on 2 cores, each slower for the others).

    A create holds one of `limit` slots, a lock file each under `directory` (one per
    engine, by its id, in the state dir its agents share) locked with flock(2): an agent
    tries the first `limit` (its own measured limit), so the engine-wide bound is the
    highest of its agents' limits, and the kernel lets go of a dead agent's slots. A
    create that finds none free looks again every POLL_S. An agent on an engine of its
    own holds slots no other asks for: its bound is its own, as before."""

    POLL_S = 0.01

    def __init__(self, directory: Path) -> None:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.directory = directory

    def _try(self, index: int) -> int | None:
        fd = os.open(self.directory / f"slot-{index}", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return fd

    def _first_free(self, limit: int) -> int | None:
        for index in range(limit):
            if (fd := self._try(index)) is not None:
                return fd
        return None

    @asynccontextmanager
    async def slot(self, limit: int) -> AsyncIterator[None]:
        while (fd := self._first_free(limit)) is None:
            await asyncio.sleep(self.POLL_S)
        try:
            yield
        finally:
            os.close(fd)  # closing the last descriptor of the lock lets it go


class SharedCreates:
    """The same bound in one process: the simulator's nodes that share an engine."""

    def __init__(self) -> None:
        self.running = 0
        self.changed = asyncio.Condition()

    @asynccontextmanager
    async def slot(self, limit: int) -> AsyncIterator[None]:
        async with self.changed:
            await self.changed.wait_for(lambda: self.running < limit)
            self.running += 1
        try:
            yield
        finally:
            async with self.changed:
                self.running -= 1
                self.changed.notify_all()
