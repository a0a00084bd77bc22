"""The agent's store (agent/store.py) commits writes in groups: a burst of writes takes a
few transactions, not one apiece, in the order they were asked, each caller answered
once its write is on disk."""

from __future__ import annotations

import asyncio
import json

from agent.store import SandboxRecord, SandboxStore


def record(i: int, lease: str | None = None) -> SandboxRecord:
    return SandboxRecord(
        id=f"n1.{i:016x}", container_id=f"c{i}", pool="default", template={}, created_at=0.0,
        lease_id=lease,
    )  # fmt: skip


async def test_a_burst_of_writes_is_committed_in_a_few_groups_in_order(tmp_path):
    store = SandboxStore(tmp_path / "n1.sqlite")
    commits: list[str] = []

    def trace(sql: str) -> None:
        if sql.strip().upper() == "COMMIT":
            commits.append(sql)

    await store.all()  # connected, on its own thread
    await store._run(lambda: store._connect().set_trace_callback(trace))
    # 100 creates' records, then for each: a removal's delete or a lease's update
    writes = [store.put(record(i)) for i in range(100)]
    writes += [store.delete(record(i).id) if i % 2 else store.put(record(i, f"lease-{i}"))
               for i in range(100)]  # fmt: skip
    await asyncio.gather(*writes)
    assert len(commits) <= 3, len(commits)  # one apiece would be 200
    kept = {r.id: r.lease_id for r in await store.all()}
    assert kept == {record(i).id: f"lease-{i}" for i in range(0, 100, 2)}
    await store.close()
    reopened = SandboxStore(tmp_path / "n1.sqlite")  # on disk, not only in memory
    assert {r.id for r in await reopened.all()} == set(kept)
    await reopened.close()


async def test_a_failed_group_tells_each_of_its_callers(tmp_path):
    store = SandboxStore(tmp_path / "n1.sqlite")
    await store.put(record(1))
    await store._run(lambda: store._connect().execute("DROP TABLE sandboxes"))
    results = await asyncio.gather(
        store.put(record(2)), store.delete(record(1).id), return_exceptions=True
    )
    assert all(isinstance(r, Exception) for r in results), results
    await store.close()


async def test_ended_leases_are_rows_of_their_own_and_go_with_their_sandbox(tmp_path):
    store = SandboxStore(tmp_path / "n1.sqlite")
    recycled, other = record(1), record(2)
    for i in range(200):  # a sandbox recycled 200 times
        await store.put(recycled, ended=f"lease-{i}")
    await store.put(other)
    # the record's own row does not grow with its leases: a recycle adds a row instead
    [row] = await store._run(
        lambda: (
            store._connect()
            .execute("SELECT record FROM sandboxes WHERE id = ?", (recycled.id,))
            .fetchall()
        )
    )
    assert "lease-" not in row[0]
    await store.close()
    reopened = SandboxStore(tmp_path / "n1.sqlite")
    kept = {r.id: r.ended_leases for r in await reopened.all()}
    assert kept == {recycled.id: {f"lease-{i}" for i in range(200)}, other.id: set()}
    await reopened.delete(recycled.id)
    count = await reopened._run(
        lambda: reopened._connect().execute("SELECT COUNT(*) FROM ended_leases").fetchone()[0]
    )
    assert count == 0
    await reopened.close()


async def test_a_record_an_older_agent_wrote_keeps_its_ended_leases(tmp_path):
    store = SandboxStore(tmp_path / "n1.sqlite")
    old = record(1)
    await store.put(old)
    fields = {**json.loads(json.dumps(vars(old), default=list)), "ended_leases": ["lease-a"]}
    await store._run(
        lambda: (
            store._connect()
            .execute("UPDATE sandboxes SET record = ? WHERE id = ?", (json.dumps(fields), old.id))
            .connection.commit()
        )
    )
    [loaded] = await store.all()
    assert loaded.ended_leases == {"lease-a"}
    await store.put(loaded, ended="lease-b")  # its list is gone from the record's row
    await store.close()
    reopened = SandboxStore(tmp_path / "n1.sqlite")
    [again] = await reopened.all()
    assert again.ended_leases == {"lease-a", "lease-b"}
    await reopened.close()
