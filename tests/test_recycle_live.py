"""Recycling on the real engine: a recycled sandbox keeps no file, process, environment
variable or memory of its previous lease, and a reset that fails removes the sandbox.

One node with room for one sandbox, in a pool with `recycle` on: the next acquire after
a release can only get the recycled sandbox (or, after a failed reset, a new one)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import aiohttp
import pytest
import pytest_asyncio
from conftest import make_spec, started_pool, still_runs

from agent.docker_driver import LABEL_SANDBOX
from dsec.client import Client, DsecError
from dsec.models import Capacity, PoolParams

pytestmark = pytest.mark.asyncio(loop_scope="module")

MARKER = "dsec-recycle-marker-7f3a"  # what lease 1 leaves everywhere it can
MB = 1 << 20

# Lease 1's mess: files with dotfiles and an unreadable directory in all three places, a
# POSIX message queue, 48 MB on the tmpfs file systems, and processes of every kind, all
# holding MARKER in their environment: a plain background one, one in a session of its
# own, one deaf to SIGHUP (as nohup makes it; busybox here has no nohup), a shell holding
# 24 MB of memory in a variable, and a command still running at the release.
MESS = f"""
set -e
echo {MARKER} > /work/file; echo {MARKER} > /work/.dotfile
mkdir -p /work/d/e; echo {MARKER} > /work/d/e/f; chmod 000 /work/d
echo {MARKER} > /tmp/t; echo {MARKER} > /tmp/.t; echo {MARKER} > /dev/shm/.s
: > /dev/mqueue/lease-one
dd if=/dev/zero of=/dev/shm/.blob bs=1M count=32 2>/dev/null
dd if=/dev/zero of=/tmp/big bs=1M count=16 2>/dev/null
sleep 1000 >/dev/null 2>&1 &
setsid sleep 999 >/dev/null 2>&1 &
(trap '' HUP; exec sleep 998) >/dev/null 2>&1 &
sh -c 'x=$(head -c 25000000 /dev/zero | tr "\\0" a); : > /tmp/.x; sleep 997; echo $x' \\
  >/dev/null 2>&1 &
# the 24 MB take a while on a busy machine: its sleep starts only once they are made
until [ -e /tmp/.x ]; do sleep 0.1; done
sleep 1
"""

# What is left, seen from a lease: every process but this shell (pid, then its command
# line), which of them hold MARKER in their environment or command line, and every
# entry in the three directories. Pids are listed with builtins first, so the commands
# that read them are not in the list.
LOOK = f"""
pids=
for d in /proc/[0-9]*; do p=${{d#/proc/}}; [ "$p" = $$ ] || pids="$pids $p"; done
for p in $pids; do
  [ -e /proc/$p ] || continue
  echo "process $p $(tr '\\0' ' ' < /proc/$p/cmdline)"
  if grep -q {MARKER} /proc/$p/environ /proc/$p/cmdline; then
    echo "marker $p"
  fi
done
ls -A /work /tmp /dev/shm /dev/mqueue | grep -v ':$' | grep . | sed 's/^/file /' || true
"""


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pool(docker_client, tmp_path_factory):
    spec = make_spec(
        tmp_path_factory.mktemp("recycle"),
        nodes=1,
        capacity=Capacity(cpus=32, memory_mb=65536, slots=1),
        pool=PoolParams(min_warm=0, max_warm=1, warm_fraction=0, recycle=True),
    )
    async with started_pool(spec, docker_client) as p:
        yield p


@pytest_asyncio.fixture(loop_scope="module")
async def client(pool):
    async with Client(pool.url, token=pool.tokens.client) as c:
        yield c


def container_of(docker_client, sandbox_id: str):
    [c] = docker_client.containers.list(filters={"label": f"{LABEL_SANDBOX}={sandbox_id}"})
    return c


def memory_used(docker_client, container) -> int:
    """The container's memory, page cache that could be dropped left out (as `docker stats`
    shows it); tmpfs pages are not droppable, so they count."""
    stats = docker_client.api.stats(container.id, stream=False, one_shot=True)
    memory = stats["memory_stats"]
    return memory["usage"] - memory.get("stats", {}).get("total_inactive_file", 0)


def lines(output: str, kind: str) -> list[str]:
    return [line.removeprefix(kind + " ") for line in output.splitlines() if line.startswith(kind)]


async def reset_seconds(agent_url: str) -> dict[str, tuple[float, int]]:
    """The agent's resets so far, by path ("host" or "engine"): their seconds, all told,
    and how many (dsec_agent_reset_seconds)."""
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{agent_url}/metrics") as resp:
            text = await resp.text()
    found: dict[str, list[float]] = {}
    for line in text.splitlines():
        for part, index in (("_sum{", 0), ("_count{", 1)):
            if line.startswith("dsec_agent_reset_seconds" + part):
                path = line.split('path="', 1)[1].split('"', 1)[0]
                found.setdefault(path, [0.0, 0])[index] = float(line.rsplit(" ", 1)[-1])
    return {path: (total, int(count)) for path, (total, count) in found.items()}


async def test_a_recycled_sandbox_keeps_nothing_of_its_previous_lease(client, docker_client):
    first = await client.acquire(timeout=60)
    container = container_of(docker_client, first.id)
    baseline = memory_used(docker_client, container)
    made = await first.exec(["sh", "-c", MESS], env={"DSEC_MARKER": MARKER}, timeout=60)
    assert made.exit_code == 0, made.stderr
    before = await first.exec(["sh", "-c", LOOK])
    assert len(lines(before.stdout, "process")) >= 2 + 5, before.stdout  # init, main, 5+ more
    assert len(lines(before.stdout, "marker")) >= 5, before.stdout
    assert {"file", ".dotfile", "t", ".t", ".s", ".blob", "big", "lease-one"} <= set(
        lines(before.stdout, "file")
    ), before.stdout
    held = memory_used(docker_client, container)
    assert held - baseline > 60 * MB, (baseline, held)  # 48 MB of files, 24 MB in a process
    # a command of the lease still runs when it is released: the reset kills it
    running = asyncio.create_task(first.exec(["sleep", "60"], env={"DSEC_MARKER": MARKER}))
    await asyncio.sleep(0.5)

    started = time.monotonic()
    await first.release()
    released_in = time.monotonic() - started
    try:
        cut = await asyncio.wait_for(running, 10)
        assert cut.exit_code != 0  # killed, not run to its end
    except DsecError:
        pass  # or answered as released: either way it is over

    second = await client.acquire(timeout=30)
    try:
        assert second.id == first.id and second.lease.path == "warm"
        assert second.lease.lease_id != first.lease.lease_id
        assert second.lease.lease_token != first.lease.lease_token
        after = await second.exec(["sh", "-c", LOOK])
        # PID 1 (docker's init), the template's command, and the agent's command loop
        # (agent/resident.py; with the copy of it that started this command), which the
        # reset killed with the rest and the agent starts again once the engine has
        # time: it may not run yet. Nothing else
        loop = "/.dsec/sh /.dsec/serve"
        listed = lines(after.stdout, "process")
        processes = [p for p in listed if p.split(" ", 1)[1].strip() != loop]
        assert len(processes) == 2, after.stdout
        assert processes[0].startswith("1 ") and "docker-init" in processes[0], processes
        assert processes[1].split(" ", 1)[1].strip() == "sleep 2147483647", processes
        assert len(listed) - len(processes) <= 2, after.stdout  # the loop (and its copy)
        assert not lines(after.stdout, "marker"), after.stdout
        assert not lines(after.stdout, "file"), after.stdout
        # the first lease's token no longer works, on the agent as on the control plane
        with pytest.raises(DsecError) as old:
            await first.exec(["true"])
        assert old.value.status in (403, 409, 410)
        with pytest.raises(DsecError) as again:
            await first.release()
        assert again.value.code == "already_released"
        # memory back near where it started (what the 72 MB were is gone)
        now = memory_used(docker_client, container)
        assert now - baseline < 8 * MB, (baseline, held, now)
        assert container_of(docker_client, second.id).id == container.id  # the same container
        # done from the host's side (agent/host.py: these tests run as root with the
        # host's PIDs), with no engine exec
        resets = await reset_seconds(second.lease.agent_url)
        assert resets["host"][1] == 1 and "engine" not in resets, resets
        total, count = resets["host"]
        print(
            f"\nrecycle: release answered in {released_in * 1000:.0f} ms; reset "
            f"{total / count * 1000:.0f} ms on the agent; memory "
            f"{baseline / MB:.1f} MB -> {held / MB:.1f} MB -> {now / MB:.1f} MB"
        )
    finally:
        await second.release()


# The loop's PID (the oldest process running it), this command's parent's command line,
# and this command's nice value and I/O priority.
LOOP_SEEN = """
for p in $(ls /proc | sort -n); do
  [ "$(tr '\\0' ' ' < /proc/$p/cmdline 2>/dev/null)" = "/.dsec/sh /.dsec/serve " ] &&
    echo "loop $p" && break
done
echo "parent $(tr '\\0' ' ' < /proc/$PPID/cmdline)"
read -r s < /proc/self/stat; set -- ${s##*') '}; echo "nice ${17}"
echo "io $(ionice -p $$)"
"""


async def loop_seen(sb) -> dict[str, str]:
    """What LOOP_SEEN says, once a command runs through the loop (after a reset that
    killed it, the loop is started again when the engine has time)."""
    deadline = time.monotonic() + 30
    while True:
        seen = dict(
            line.split(" ", 1)
            for line in (await sb.exec(["sh", "-c", LOOP_SEEN])).stdout.splitlines()
        )
        if seen["parent"].strip() == "/.dsec/sh /.dsec/serve" or time.monotonic() > deadline:
            return seen
        await asyncio.sleep(0.2)


async def test_attack_15_a_lease_cannot_change_the_loop_that_the_next_lease_inherits(client):
    """A reset from the host keeps the sandbox's command loop for the next lease (no
    engine exec to start it again). What a lease could change in the loop, that the
    next lease's commands would inherit, it may not: the loop runs as LOOP_USER, so
    lowering its I/O priority (`ionice -c3`, which on the old loop, as the tenant's
    user, left lease 2's commands at idle I/O priority) or its nice value is refused,
    and so is writing into its ctl pipe."""
    first = await client.acquire(timeout=60)
    before = await loop_seen(first)
    assert before["nice"] == "0" and before["io"] != "idle" and "loop" in before, before
    tries = await first.exec(["sh", "-c", (
        f"ionice -c3 -p {before['loop']} && echo ionice; "
        f"renice -n 15 -p {before['loop']} && echo renice; "
        "printf abc > /.dsec/ctl && echo ctl; echo tried"
    )])  # fmt: skip
    assert tries.stdout == "tried\n", tries
    await first.release()
    second = await client.acquire(timeout=30)
    try:
        assert second.id == first.id
        kept = await loop_seen(second)
        assert kept["loop"] == before["loop"], (before, kept)  # the very same process
        assert kept["parent"].strip() == "/.dsec/sh /.dsec/serve", kept
        assert (kept["nice"], kept["io"]) == (before["nice"], before["io"]), (before, kept)
    finally:
        await second.release()


async def test_attack_14_a_lease_that_locks_its_work_dir_leaves_the_next_one_a_usable_one(
    client,
):
    """Lease 1 takes every permission off its work dir (it owns it): the reset empties
    the directory and gives it back its mode, so lease 2's first command runs there (on
    the old code it failed, 126 `chdir to /work failed`)."""
    first = await client.acquire(timeout=60)
    locked = await first.exec(["sh", "-c", "chmod 0 /work && stat -c %a /work"])
    assert locked.stdout == "0\n", locked
    await first.release()
    second = await client.acquire(timeout=30)
    try:
        assert second.id == first.id
        after = await second.exec(["sh", "-c", "pwd; stat -c %a /work; echo x > f; cat f"])
        assert (after.exit_code, after.stdout) == (0, "/work\n755\nx\n"), after
    finally:
        await second.release()


async def test_a_reset_from_the_host_follows_no_symlink_the_tenant_made(client, tmp_path):
    """The host's side empties the sandbox's directories through /proc (agent/host.py):
    links that lease 1 points at the host's paths are removed, never followed."""
    outside = tmp_path / "host-only"
    outside.mkdir()
    (outside / "keep").write_text("the host's")
    first = await client.acquire(timeout=60)
    made = await first.exec(["sh", "-c", (
        f"set -e; ln -s {outside} /work/out; ln -s {outside}/keep /tmp/keep; ln -s / /work/root; "
        f"mkdir -p /work/d; ln -s {outside} /work/d/deeper; chmod 000 /work/d"
    )])  # fmt: skip
    assert made.exit_code == 0, made.stderr
    await first.release()
    second = await client.acquire(timeout=30)
    try:
        assert second.id == first.id
        after = await second.exec(["sh", "-c", LOOK])
        assert not lines(after.stdout, "file"), after.stdout
    finally:
        await second.release()
    assert (outside / "keep").read_text() == "the host's"


# What a lease tries on the processes a reset keeps (init, PID 1, and the template's
# command, the child of init that started first): read their memory, write into it (as
# a tenant would to leave code there for the next lease), read their environment, kill
# every process it can. Each line says what happened.
REACH_KEPT = """
main=$(for d in /proc/[0-9]*; do read -r s < $d/stat; set -- ${s##*') '}
  [ "$2" = 1 ] && echo "${20} ${d#/proc/}"; done | sort -n | head -1 | cut -d' ' -f2)
for p in 1 $main; do
  addr=$(( 0x$(head -1 /proc/$p/maps | cut -d- -f1) ))
  dd if=/proc/$p/mem bs=1 count=4 skip=$addr of=/dev/null 2>/dev/null && echo "read $p"
  printf x | dd of=/proc/$p/mem bs=1 seek=$addr conv=notrunc 2>/dev/null && echo "wrote $p"
  cat /proc/$p/environ >/dev/null 2>&1 && echo "environ $p"
done
kill -9 -1
"""


async def test_no_lease_can_reach_into_the_processes_a_reset_keeps(client, docker_client):
    """Init and the template's command outlive every lease of a recycled sandbox: they
    run as a user of their own (KEEPER_USER), so a tenant can neither leave anything in
    their memory for the next lease nor kill them."""
    first = await client.acquire(timeout=60)
    container = container_of(docker_client, first.id)
    with contextlib.suppress(DsecError):  # the kill may end this very command's call
        reached = await first.exec(["sh", "-c", REACH_KEPT], timeout=30)
        assert reached.stdout == "", reached.stdout
    container.reload()
    assert container.status == "running"
    await first.release()
    second = await client.acquire(timeout=30)
    try:
        assert second.id == first.id and second.lease.path == "warm"
    finally:
        await second.release()


@pytest.mark.parametrize(
    ("what", "mess"),
    [
        # a directory nested past PATH_MAX: rm -rf cannot name what is inside, so the
        # check finds the work dir not empty
        ("fails to verify", "i=0; while [ $i -lt 2100 ]; do mkdir a; cd a; i=$((i+1)); done"),
        # the template's command gone (killed from the host: no lease can): the
        # container stopped, and the reset cannot run in it
        ("main process died", None),
    ],
)
async def test_a_reset_that_fails_removes_the_sandbox(client, docker_client, what, mess):
    first = await client.acquire(timeout=60)
    if mess is None:
        container = container_of(docker_client, first.id)
        [main] = [p for p in container.top()["Processes"] if p[-1] == "sleep 2147483647"]
        os.kill(int(main[1]), signal.SIGKILL)
    else:
        await first.exec(["sh", "-c", mess], timeout=60)
    await first.release()
    found = docker_client.containers.list(
        all=True, sparse=True, filters={"label": f"{LABEL_SANDBOX}={first.id}"}
    )
    assert not [c for c in found if still_runs(docker_client, c)], f"{what}: it still runs"
    second = await client.acquire(timeout=60)
    try:
        assert second.id != first.id and second.lease.path == "cold", what
    finally:
        await second.release()


async def test_a_recycled_sandbox_keeps_no_environment_or_file_of_its_previous_claim(client):
    """A personalised claim's env is the lease's, not the sandbox's: the next lease of the
    recycled sandbox has none of it, nor the claim's files."""
    claim = {"env": {"DSEC_CLAIM_SECRET": MARKER}, "files": {"claimed.txt": MARKER.encode()}}
    first = await client.acquire(timeout=60, **claim)
    seen = await first.exec(["sh", "-c", "echo $DSEC_CLAIM_SECRET; cat /work/claimed.txt"])
    assert seen.stdout == f"{MARKER}\n{MARKER}", seen
    await first.release()
    second = await client.acquire(timeout=30)
    try:
        assert second.id == first.id
        left = await second.exec(["sh", "-c", "echo [$DSEC_CLAIM_SECRET]; ls -A /work"])
        assert left.stdout == "[]\n", left
    finally:
        await second.release()
