"""Released idempotency keys survive a control-plane restart through their file."""

from __future__ import annotations

import asyncio

import pytest

from controlplane.spent import KeyLog


@pytest.mark.asyncio
async def test_spent_keys_are_read_back_and_a_torn_last_line_is_skipped(tmp_path):
    path = tmp_path / "spent-keys.jsonl"
    keys = KeyLog(path, limit=10)
    await keys.add("k1", "n1.aa")
    await keys.add("k2", "n1.bb")
    with path.open("a") as f:
        f.write('["k3", "n1.c')  # the control plane died mid-write
    again = KeyLog(path, limit=10)
    assert "k1" in again and again.sandbox_of("k2") == "n1.bb"
    assert "k3" not in again


@pytest.mark.asyncio
async def test_the_file_is_rewritten_to_the_newest_keys_once_it_doubles_the_limit(tmp_path):
    path = tmp_path / "spent-keys.jsonl"
    keys = KeyLog(path, limit=3)
    for i in range(7):
        await keys.add(f"k{i}", f"n1.{i:02x}")
    assert len(path.read_text().splitlines()) == 3  # rewritten at the 7th line
    again = KeyLog(path, limit=3)
    assert [k for k in ("k3", "k4", "k5", "k6") if k in again] == ["k4", "k5", "k6"]


@pytest.mark.asyncio
async def test_without_a_state_dir_keys_live_in_memory_only(tmp_path):
    keys = KeyLog(None, limit=2)
    for i in range(3):
        await keys.add(f"k{i}", f"n1.{i:02x}")
    assert "k0" not in keys and "k2" in keys
    assert not list(tmp_path.iterdir())


@pytest.mark.asyncio
async def test_a_dropped_key_stays_dropped_after_a_restart_and_the_file_compacts(tmp_path):
    path = tmp_path / "held-keys.jsonl"
    keys = KeyLog(path, limit=1_000_000)
    for i in range(1500):  # a lease made and let go, again and again
        await keys.add(f"k{i}", f"n1.{i:016x}")
        if i != 700:
            await keys.drop(f"k{i}")
    again = KeyLog(path, limit=1_000_000)
    assert [k for k in (f"k{i}" for i in range(1500)) if k in again] == ["k700"]
    assert again.sandbox_of("k700") == f"n1.{700:016x}"
    assert len(path.read_text().splitlines()) < 2000  # rewritten, not grown for ever


@pytest.mark.asyncio
async def test_a_key_held_and_let_go_at_once_is_read_back_let_go(tmp_path):
    """A lease's key is written as held, and dropped by another task when the lease
    fails: the lines reach the file in the order asked, whatever the load."""
    path = tmp_path / "held-keys.jsonl"
    keys = KeyLog(path, limit=1_000_000)
    await asyncio.gather(
        *(op for i in range(300) for op in (keys.add(f"k{i}", f"n1.{i:04x}"), keys.drop(f"k{i}")))
    )
    again = KeyLog(path, limit=1_000_000)
    assert [f"k{i}" for i in range(300) if f"k{i}" in again] == []


@pytest.mark.asyncio
async def test_a_key_added_now_is_on_disk_at_once_and_never_while_the_file_is_rewritten(tmp_path):
    path = tmp_path / "held-keys.jsonl"
    keys = KeyLog(path, limit=3)
    for i in range(6):
        assert keys.add_now(f"k{i}", f"n1.{i:02x}")  # no wait: in the file when it returns
        assert KeyLog(path, limit=3).sandbox_of(f"k{i}") == f"n1.{i:02x}"
    # the 7th line would make the file mostly stale lines: only `add` rewrites it
    assert not keys.add_now("k6", "n1.06") and "k6" not in keys
    rewriting = asyncio.ensure_future(keys.add("k6", "n1.06"))
    await asyncio.sleep(0)  # the rewrite is under way, in a thread
    assert not keys.add_now("k7", "n1.07"), "a line now would land in the file being replaced"
    await rewriting
    assert keys.add_now("k7", "n1.07")
    again = KeyLog(path, limit=3)
    assert [k for k in ("k5", "k6", "k7") if k in again] == ["k5", "k6", "k7"]
