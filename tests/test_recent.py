"""RecentMap: the bounded table of gone things (released ids, spent keys)."""

from __future__ import annotations

import pytest

from dsec.recent import TOMBSTONES, RecentMap


def test_it_keeps_what_was_added_with_its_value():
    recent: RecentMap[str, str] = RecentMap(3)
    recent.add("a", "one")
    recent.add("b")
    assert "a" in recent and "b" in recent and "c" not in recent
    assert recent["a"] == "one" and recent["b"] is None
    assert recent.get("a") == "one" and recent.get("c") is None and recent.get("c", 7) == 7
    with pytest.raises(KeyError):
        recent["c"]
    assert len(recent) == 2 and list(recent) == ["a", "b"]


def test_past_the_limit_the_oldest_are_dropped():
    recent: RecentMap[int, None] = RecentMap(3)
    for i in range(5):
        recent.add(i)
    assert list(recent) == [2, 3, 4] and len(recent) == 3
    assert 0 not in recent and 1 not in recent


def test_adding_a_key_again_makes_it_the_most_recent_with_the_new_value():
    recent: RecentMap[str, int] = RecentMap(3)
    for i, key in enumerate("abc"):
        recent.add(key, i)
    recent.add("a", 10)
    assert list(recent) == ["b", "c", "a"] and recent["a"] == 10
    recent.add("d", 3)  # the oldest is now "b", not "a"
    assert list(recent) == ["c", "a", "d"]
    assert recent.items() == [("c", 2), ("a", 10), ("d", 3)]


def test_pop_forgets_a_key_and_answers_its_value_or_the_default():
    recent: RecentMap[str, str] = RecentMap(3)
    recent.add("a", "one")
    assert recent.pop("a") == "one"
    assert "a" not in recent and len(recent) == 0
    assert recent.pop("a") is None and recent.pop("a", "gone") == "gone"


def test_the_limit_is_tombstones_unless_given_and_at_least_one():
    assert RecentMap().limit == TOMBSTONES == 100_000
    with pytest.raises(ValueError):
        RecentMap(0)
    one: RecentMap[str, None] = RecentMap(1)
    one.add("a")
    one.add("b")
    assert list(one) == ["b"]
