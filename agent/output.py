"""What commands' output may cost the node: memory, and the agent's CPU to relay it.

- `OutputBudget`: the node's output bytes held in memory at once (a one-shot command's
  output gathered for its answer, a stream's chunk on its way to the client), shared
  between tenants: one holds at most `total / (tenants holding or waiting + 1)`, which
  leaves room for the next to come. A command with no room waits before it reads more:
  its pipe fills and its writes block (backpressure), nothing is buffered or dropped.
- `RelayRate`: a sandbox's output read per second, in proportion to its template's CPUs,
  so that relaying a flood costs the agent less CPU than the sandbox's own quota.
- `Gathered`: a one-shot command's output and its JSON answer, written piece by piece, as base64
  when its text would escape to more than `TEXT_GROWTH_MAX` times its bytes (a NUL is
  `\\u0000` in JSON: 6 bytes), so an answer costs no more memory than the output it
  holds, and is at most 4/3 of it (plus a little) on the wire.
"""

from __future__ import annotations

import asyncio
import base64
import codecs
import contextlib
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import pydantic_core

from agent.docker_driver import STDOUT
from dsec.models import ExecResult, OutputEncoding

# Text that escapes to more than this many times its bytes goes as base64 (4/3) instead;
# small output stays text whatever it is (the answer's size is then no matter).
TEXT_GROWTH_MAX = 2.0
SMALL_TEXT_BYTES = 64 << 10
ENCODE_PIECE = 48 << 10  # a multiple of 3: base64 of each piece joins into base64 of all
RELAY_BURST_S = 0.25  # a sandbox's relay may run this far ahead of its rate


@dataclass
class _Waiter:
    tenant: str
    size: int
    granted: asyncio.Future[None]


@dataclass
class OutputBudget:
    total: int
    used: int = 0
    peak: int = 0  # the most ever held at once
    held: dict[str, int] = field(default_factory=dict)  # by tenant
    queue: deque[_Waiter] = field(default_factory=deque)

    def share(self) -> int:
        """What one tenant may hold: a fair part, with room left for one more tenant."""
        tenants = set(self.held) | {w.tenant for w in self.queue}
        return self.total // (len(tenants) + 1)

    def _fits(self, tenant: str, size: int) -> bool:
        # a tenant holding nothing may always take one piece: a share smaller than a
        # chunk must not stop it for good
        held = self.held.get(tenant, 0)
        return self.used + size <= self.total and (held == 0 or held + size <= self.share())

    def _grant(self, tenant: str, size: int) -> None:
        self.used += size
        self.peak = max(self.peak, self.used)
        self.held[tenant] = self.held.get(tenant, 0) + size

    async def take(self, tenant: str, size: int) -> None:
        """Count `size` bytes against `tenant`, once they fit: in the order asked, but
        one at its tenant's share lets those behind it go first."""
        waiter = _Waiter(tenant, size, asyncio.get_running_loop().create_future())
        self.queue.append(waiter)
        self._wake()
        if waiter.granted.done():
            return
        try:
            await waiter.granted
        except asyncio.CancelledError:
            if waiter.granted.done() and not waiter.granted.cancelled():
                self.give_back(tenant, size)  # granted as it was cancelled
            else:
                with contextlib.suppress(ValueError):  # (a wake may have dropped it)
                    self.queue.remove(waiter)
                self._wake()  # its place may have held back others
            raise

    def give_back(self, tenant: str, size: int) -> None:
        if size <= 0:
            return
        self.used -= size
        left = self.held[tenant] - size
        if left:
            self.held[tenant] = left
        else:
            del self.held[tenant]
        self._wake()

    def _wake(self) -> None:
        for waiter in list(self.queue):
            if waiter.granted.done():  # cancelled, its task not yet resumed to say so
                self.queue.remove(waiter)
            elif self.used >= self.total:
                return
            elif self._fits(waiter.tenant, waiter.size):
                self.queue.remove(waiter)
                self._grant(waiter.tenant, waiter.size)
                waiter.granted.set_result(None)


@dataclass
class Held:
    """One command's bytes in the node's budget, given back in full when it ends."""

    budget: OutputBudget
    tenant: str
    size: int = 0

    async def take(self, size: int) -> None:
        if size <= 0:
            return
        await self.budget.take(self.tenant, size)
        self.size += size

    def give_back(self, size: int) -> None:
        self.budget.give_back(self.tenant, size)
        self.size -= size

    def close(self) -> None:
        self.give_back(self.size)


@dataclass
class RelayRate:
    """A token bucket of bytes: `delay(n, now)` is how long a reader waits after taking
    `n` bytes, so that over time it takes `rate` bytes a second, RELAY_BURST_S ahead at
    most."""

    rate: float
    level: float = 0.0
    at: float | None = None

    def delay(self, size: int, now: float) -> float:
        burst = self.rate * RELAY_BURST_S
        elapsed = 0.0 if self.at is None else now - self.at
        self.level = min(burst, (burst if self.at is None else self.level) + elapsed * self.rate)
        self.at = now
        self.level -= size
        return max(0.0, -self.level / self.rate)


def _text_pieces(data: bytes | bytearray) -> Iterator[bytes]:
    """The JSON string's inside for `data` as UTF-8 text (undecodable bytes replaced),
    a piece at a time; a character split between pieces is decoded whole."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    view = memoryview(data)
    for start in range(0, len(data), ENCODE_PIECE):
        last = start + ENCODE_PIECE >= len(data)
        yield _escaped(decoder.decode(view[start : start + ENCODE_PIECE], final=last))


def _escaped(text: str) -> bytes:
    return pydantic_core.to_json(text)[1:-1]


def _base64_pieces(data: bytes | bytearray) -> Iterator[bytes]:
    view = memoryview(data)
    for start in range(0, len(data), ENCODE_PIECE):
        yield base64.b64encode(view[start : start + ENCODE_PIECE])


@dataclass
class Gathered:
    """A one-shot command's output, kept for its answer as it comes; asked as text, also
    the size that text escapes to, measured a chunk at a time (no pass over it all at
    the end, which would hold the event loop)."""

    asked: OutputEncoding
    out: bytearray = field(default_factory=bytearray)
    err: bytearray = field(default_factory=bytearray)
    escaped: int = 0
    decoders: dict[int, codecs.IncrementalDecoder] = field(default_factory=dict)

    def add(self, stream: int, data: bytes) -> None:
        (self.out if stream == STDOUT else self.err).extend(data)
        if self.asked == "utf-8":
            decoder = self.decoders.setdefault(
                stream, codecs.getincrementaldecoder("utf-8")("replace")
            )
            self.escaped += len(_escaped(decoder.decode(data)))

    def encoding(self) -> OutputEncoding:
        """As asked, unless that is text escaping to more than TEXT_GROWTH_MAX times its
        bytes: then base64, which the answer's `encoding` says."""
        size = len(self.out) + len(self.err)
        if self.asked == "base64" or size <= SMALL_TEXT_BYTES:
            return self.asked
        # what an unended character at the end becomes: one replacement, 3 bytes at most
        ends = sum(3 for d in self.decoders.values() if d.getstate()[0])
        return "utf-8" if self.escaped + ends <= TEXT_GROWTH_MAX * size else "base64"

    def answer(self, result: ExecResult) -> Iterator[bytes]:
        """`result` as JSON with this output as its stdout and stderr, in its encoding,
        written a piece at a time: no copy of the whole output is ever made."""
        pieces = _base64_pieces if result.encoding == "base64" else _text_pieces
        head = result.model_dump_json(exclude={"stdout", "stderr"})
        yield head[:-1].encode() + b',"stdout":"'
        yield from pieces(self.out)
        yield b'","stderr":"'
        yield from pieces(self.err)
        yield b'"}'
