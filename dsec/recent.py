"""A mapping that remembers the most recent entries only: released ids, spent keys.

Services remember what is gone (a released sandbox, a spent idempotency key) so a late
call learns what happened instead of "unknown"; remembering everything forever would
grow without bound, so the oldest entries are dropped past a limit.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
D = TypeVar("D")

# How many entries a table of gone things keeps by default: ids released, keys spent.
TOMBSTONES = 100_000


class RecentMap(Generic[K, V]):
    """An insertion-ordered mapping of at most `limit` entries. `add` makes its key the
    most recent (adding a key already there moves it to the end, with the new value);
    once past the limit, the oldest entries are dropped."""

    def __init__(self, limit: int = TOMBSTONES) -> None:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        self.limit = limit
        self._entries: OrderedDict[K, V] = OrderedDict()

    def add(self, key: K, value: V = None) -> None:  # type: ignore[assignment]
        """Remember `key` (with `value`, None for a set of keys) as the most recent."""
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self.limit:
            self._entries.popitem(last=False)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __getitem__(self, key: K) -> V:
        return self._entries[key]

    def get(self, key: K, default: D = None) -> V | D:  # type: ignore[assignment]
        return self._entries.get(key, default)

    def pop(self, key: K, default: D = None) -> V | D:  # type: ignore[assignment]
        """Forget `key`; its value, or `default` when it is not there."""
        return self._entries.pop(key, default)

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[K]:
        """Keys from the oldest to the most recent."""
        return iter(self._entries)

    def items(self) -> list[tuple[K, V]]:
        """(key, value) from the oldest to the most recent."""
        return list(self._entries.items())

    def __repr__(self) -> str:
        return f"RecentMap(limit={self.limit}, entries={len(self._entries)})"
