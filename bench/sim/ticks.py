"""When the simulated control plane decides.

Live, the control plane ticks on every event (an acquire, an agent's answer, a
heartbeat; `Scheduler.run_forever`) and every `tick_s` without one. A tick reads the
view and runs the policy; at DSec's scale (160 nodes, 20,000 sandboxes) that is a
fraction of a millisecond, three ticks an episode, and most of what a simulated hour
costs. `Ticks` runs the same `Scheduler.tick` only as often as the results need:

- an acquire is decided at once when none of its pool waits (it may find a warm
  sandbox: milliseconds, which any delay would show in);
- a sandbox made ready (a create, a thaw, a reset) is decided on within SHARE of the
  time it took to make, so the warm pool refills as fast as within SHARE;
- while requests wait, every event is decided on within SHARE of how long the oldest
  has waited, so no request's wait grows by more than SHARE of itself;
- anything else (a release, a removal done, a heartbeat) frees room or moves idle
  times, which the policy acts on over seconds: it is decided on at the next tick,
  within `tick_s`, the control plane's own period.

Events due together share one tick. With `share` 0 every event is decided at once,
as live (`bench.sim_scale --tick-on-every-event` compares the two).
"""

from __future__ import annotations

import asyncio
import logging
import math

from controlplane.queue import PendingRequest
from controlplane.scheduler import Scheduler

log = logging.getLogger(__name__)

SHARE = 0.05  # of a wait or a make, the most a decision about it is put off


class Ticks:
    """The control plane's loop in the simulator. It stands in for the scheduler's
    wake-up event: every wake the control plane makes itself is one event, due within
    `tick_s`; the simulated clients and agents say of theirs how soon they are due."""

    def __init__(self, scheduler: Scheduler, share: float = SHARE) -> None:
        self.scheduler = scheduler
        self.share = share
        self.period_s = scheduler.config.tick_s
        self.gap_s = scheduler.config.min_tick_gap_s
        self.due_at = math.inf  # the next tick, as the events so far want it
        # while the loop waits for the next tick: done when due_at moves earlier, or by
        # the timer at the time it waits for (a future and a timer, not an Event under
        # asyncio.timeout: that costs an exception at every tick the period brings)
        self._sooner: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        scheduler.wakeup = self  # type: ignore[assignment]  # Scheduler.wake sets it

    # --- what the control plane calls on its wake-up event ----------------------------

    def set(self) -> None:
        self.within(self.period_s if self.share else 0.0)

    def clear(self) -> None:
        """Each tick starts a new round of events (see run_forever)."""

    # --- what the simulated clients and agents say ------------------------------------

    def arrival(self, pool: str) -> None:
        """An acquire in `pool`: at once unless some of its pool wait before it."""
        oldest = self._oldest_waiting(self.scheduler.queues.pending.get(pool, {}).values())
        self.within(0.0 if oldest is None else self._waited_share(oldest))

    def ready(self, took_s: float) -> None:
        """A sandbox made ready, which took `took_s`."""
        self.within(self.share * took_s)

    def within(self, seconds: float) -> None:
        """An event to decide on within `seconds`, and sooner while requests wait."""
        loop = asyncio.get_running_loop()
        if self.share:
            pending = self.scheduler.queues.pending.values()
            oldest = self._oldest_waiting(r for q in pending for r in q.values())
            if oldest is not None:
                seconds = min(seconds, self._waited_share(oldest))
        at = loop.time() + seconds
        if at < self.due_at:
            self.due_at = at
            self._wake()

    def _wake(self) -> None:
        if self._sooner is not None and not self._sooner.done():
            self._sooner.set_result(None)

    def _on_timer(self) -> None:
        self._timer = None  # it ran: nothing to cancel
        self._wake()

    def _waited_share(self, request: PendingRequest) -> float:
        return self.share * (asyncio.get_running_loop().time() - request.arrived_at)

    @staticmethod
    def _oldest_waiting(requests) -> PendingRequest | None:
        """The first request not yet handed a sandbox (queues keep arrival order)."""
        return next((r for r in requests if not r.claimed), None)

    # --- the loop ---------------------------------------------------------------------

    async def run_forever(self) -> None:
        """Tick when an event is due, or `tick_s` after the last tick, as the live loop
        does; never sooner than `min_tick_gap_s` after the last one."""
        loop = asyncio.get_running_loop()
        while True:
            self.due_at = math.inf  # what the tick's own actions wake is due anew
            ticked_at = loop.time()
            try:
                self.scheduler.tick()
            except Exception:  # as live: a bug must not stop the pool
                log.exception("tick failed")
            while True:
                at = max(min(self.due_at, ticked_at + self.period_s), ticked_at + self.gap_s)
                if loop.time() >= at:
                    break
                self._sooner = loop.create_future()
                self._timer = loop.call_at(at, self._on_timer)
                try:
                    await self._sooner
                finally:
                    if self._timer is not None:
                        self._timer.cancel()
                        self._timer = None
