"""A fork's copy on its node (agent/snapshots.py), without Docker: only the holder of its
token reads it, only while it is kept, and it is gone from disk once dropped or past its
time. The copy's making and reading on real sandboxes: tests/test_fork_live.py."""

from __future__ import annotations

import asyncio

import pytest

from agent.snapshots import SNAPSHOT_TTL_S, Snapshot, Snapshots
from dsec.httpkit import ApiError


class StepClock:
    def __init__(self) -> None:
        self.t = 100.0

    def now(self) -> float:
        return self.t


def kept(tmp_path) -> tuple[Snapshots, Snapshot, StepClock]:
    clock = StepClock()
    snapshots = Snapshots(tmp_path / "snaps", "n1", files=None, clock=clock, verify=True)
    snapshots.clear()
    files = []
    for i in range(2):
        path = snapshots.directory / f"{'a' * 32}.{i}.tar"
        path.write_bytes(b"tar %d" % i)
        files.append(path)
    snapshot = Snapshot("a" * 32, "b" * 64, files, clock.now())
    snapshots.made[snapshot.id] = snapshot
    return snapshots, snapshot, clock


def refusal(call) -> tuple[int, str]:
    with pytest.raises(ApiError) as refused:
        call()
    return refused.value.status, refused.value.code


def test_only_the_token_reads_a_copy_and_only_its_parts(tmp_path):
    snapshots, snapshot, _ = kept(tmp_path)
    assert snapshots.path_of(snapshot.id, snapshot.token, 1).read_bytes() == b"tar 1"
    assert refusal(lambda: snapshots.path_of(snapshot.id, "c" * 64, 0)) == (403, "forbidden")
    assert refusal(lambda: snapshots.path_of(snapshot.id, None, 0)) == (401, "unauthorized")
    # another copy's id with this token: as any wrong token, nothing said of what is kept
    assert refusal(lambda: snapshots.path_of("d" * 32, snapshot.token, 0)) == (403, "forbidden")
    assert refusal(lambda: snapshots.path_of(snapshot.id, snapshot.token, 2))[0] == 404


def test_a_copy_dropped_or_past_its_time_is_gone_from_disk(tmp_path):
    snapshots, snapshot, clock = kept(tmp_path)
    assert asyncio.run(snapshots.drop(snapshot.id)) is True
    assert not any(snapshots.directory.iterdir())
    assert refusal(lambda: snapshots.path_of(snapshot.id, snapshot.token, 0))[0] == 403
    assert asyncio.run(snapshots.drop(snapshot.id)) is False

    snapshots, snapshot, clock = kept(tmp_path)
    clock.t += SNAPSHOT_TTL_S + 1
    assert refusal(lambda: snapshots.path_of(snapshot.id, snapshot.token, 0))[0] == 403
    asyncio.run(snapshots._expire())  # what the next copy's making does first
    assert snapshot.id not in snapshots.made and not any(snapshots.directory.iterdir())
