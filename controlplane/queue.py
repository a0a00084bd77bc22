"""Acquire requests waiting for a sandbox, one queue per pool."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from controlplane.claims import Personal
from dsec.models import Lease
from dsec.policy import RequestSnap


def scoped_key(owner: str | None, key: str | None) -> str | None:
    """An idempotency key as the control plane files it: each client's keys are its own,
    so a key another client guesses or reuses reaches none of its sandboxes."""
    return None if key is None else f"{owner}/{key}"


@dataclass
class PendingRequest:
    id: str
    pool: str
    template: str
    priority: int
    arrived_at: float
    idempotency_key: str | None
    owner: str | None  # the client asking
    labels: dict[str, str]
    personal: Personal | None = None  # the claim's own env, files and setup
    setup_ms: float | None = None  # the time its node took to apply `personal`
    spread: str | None = None  # a fork's: its copies go to different nodes where they can
    # its client made its key for this acquire (AcquireRequest.new_key): nothing but
    # this acquire's own retries, unanswered, can ask for the key's lease again
    new_key: bool = False
    # its outcome: a lease, an ApiError, or cancelled when given up; set through answer,
    # fail and give_up, which also wake its waiters
    done: asyncio.Future[Lease] = field(default_factory=asyncio.Future)
    refused_by: set[str] = field(default_factory=set)
    template_refusal: str | None = None  # the last refusal about its template, as said
    unplaced: str | None = None  # why no node could take it, while none can
    reservation: str | None = None  # the sandbox being created for it
    claimed: bool = False  # a sandbox is being leased to it
    claimed_on: str | None = None  # the node of the last sandbox claimed for it
    # a future per acquire waiting on it (a retry with its key is one more), woken
    # directly when `done` is set: each hop of a shield or a done callback is one more
    # turn of the event loop, in which the tick's grant and creates are sent first
    waiters: list[asyncio.Future[None]] = field(default_factory=list)
    # what the policy is shown of it, with the refusals it was made from (refused_by only
    # grows, so its length says whether it changed)
    _snap: tuple[int, str | None, RequestSnap] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def answer(self, lease: Lease) -> None:
        self.done.set_result(lease)
        self._wake_waiters()

    def fail(self, error: Exception) -> None:
        self.done.set_exception(error)
        self._wake_waiters()

    def give_up(self) -> None:
        self.done.cancel()
        self._wake_waiters()

    def _wake_waiters(self) -> None:
        for waiter in self.waiters:
            if not waiter.done():
                waiter.set_result(None)

    @property
    def scoped_key(self) -> str | None:
        return scoped_key(self.owner, self.idempotency_key)

    def snap(self) -> RequestSnap:
        """What the policy sees of it (the same object while its refusals are the same)."""
        made = self._snap
        if made is None or made[0] != len(self.refused_by) or made[1] != self.template_refusal:
            request = RequestSnap(
                self.id,
                self.pool,
                self.template,
                self.priority,
                self.arrived_at,
                frozenset(self.refused_by),
                self.template_refusal,
                self.spread,
                self.personal is not None,
            )
            made = self._snap = (len(self.refused_by), self.template_refusal, request)
        return made[2]


class RequestQueues:
    def __init__(self) -> None:
        self.pending: dict[str, dict[str, PendingRequest]] = {}
        self.by_id: dict[str, PendingRequest] = {}  # every queued request, claimed or not

    def add(self, req: PendingRequest) -> None:
        self.pending.setdefault(req.pool, {})[req.id] = req
        self.by_id[req.id] = req

    def remove(self, req: PendingRequest) -> None:
        self.pending.get(req.pool, {}).pop(req.id, None)
        self.by_id.pop(req.id, None)

    def get(self, request_id: str) -> PendingRequest | None:
        return self.by_id.get(request_id)

    def waiting(self) -> list[PendingRequest]:
        """Requests not yet handed a sandbox."""
        return [r for q in self.pending.values() for r in q.values() if not r.claimed]

    def depth(self, pool: str) -> int:
        return sum(1 for r in self.pending.get(pool, {}).values() if not r.claimed)
