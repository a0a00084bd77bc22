"""The workload in a sandbox against its own sandbox's plumbing (issue 28, attacks 1 and
10): it can neither take the command loop's place nor read what the loop is given, and
what the kernel counts per user is counted per sandbox.

The workload is whatever the tenant's commands leave running: in RL, the model's own
actions, which want a reward rather than a result. Here it does all its user may do
with busybox: kill every process it can, open the loop's pipes and scripts, read /proc.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from conftest import eventually, make_spec, started_pool

from agent.users import FIRST_UID
from controlplane.config import default_templates
from dsec.client import Client, Sandbox
from dsec.image import BASE_IMAGE
from dsec.launch.local import LocalPool
from dsec.models import TemplateSpec

pytestmark = pytest.mark.asyncio(loop_scope="module")

LOOP = "/.dsec/sh /.dsec/serve"
# The command's parent: the loop's copy when the loop started it, none in its PID
# namespace (0) when the engine's exec did.
PARENT = "[ $PPID = 0 ] && echo engine || tr '\\0' ' ' </proc/$PPID/cmdline"

# 1. Kill every process it may (the loop too, where it could: the old loop ran as the
# tenant's user) but the template's command (a template that may not be recycled runs
# it as the sandbox's user: killing it ends the sandbox, which forges nothing), then
# stand in for the loop: read command ids from ctl and answer each on its pipes as
# "FORGED", exit 0, keeping its script (workdir, environment, argv). Beside it, a
# watcher copies every script and every environment it can read.
KILL_ALL = """for p in /proc/[0-9]*; do
  [ ${p#/proc/} = $$ ] || [ "$(tr '\\0' ' ' < $p/cmdline)" = "sleep 2147483647 " ] ||
    kill -9 ${p#/proc/}
done 2>/dev/null; true"""
FAKE_LOOP = """
exec </dev/null >>/tmp/attack.log 2>&1
( while :; do
    if read -r id < /.dsec/ctl; then
      echo "took $id"
      cat /.dsec/$id.cmd >> /tmp/stolen
      echo FORGED > /.dsec/$id.out
      printf 'opened\\nstarted\\n0\\n' > /.dsec/$id.rc
    fi
    sleep 0.02
  done ) &
( while :; do
    cat /.dsec/*.cmd /.dsec/serve /.dsec/boot >> /tmp/stolen 2>/dev/null
    for p in /proc/[0-9]*; do
      [ "$(tr '\\0' ' ' < $p/cmdline 2>/dev/null)" = "/.dsec/sh /.dsec/serve " ] &&
        cat $p/environ >> /tmp/stolen 2>/dev/null
    done
    sleep 0.01
  done ) &
for f in ctl serve boot; do
  [ -r /.dsec/$f ] && echo "may read $f"; [ -w /.dsec/$f ] && echo "may write $f"
done
echo started
"""


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pool(docker_client, tmp_path_factory) -> AsyncIterator[LocalPool]:
    templates = {
        **default_templates(),  # base: may be recycled, its loop started by an engine exec
        "plain": TemplateSpec(name="plain", image=BASE_IMAGE),  # its loop started by its boot
    }
    spec = make_spec(tmp_path_factory.mktemp("hostile-loop"), nodes=1, templates=templates)
    async with started_pool(spec, docker_client) as p:
        yield p


@pytest_asyncio.fixture(loop_scope="module")
async def client(pool) -> AsyncIterator[Client]:
    async with Client(pool.url, token=pool.tokens.client) as c:
        yield c


async def through_loop(sb: Sandbox) -> None:
    async def served() -> bool:
        return (await sb.exec(["sh", "-c", PARENT])).stdout.strip() == LOOP

    await eventually(served, "a command runs through the loop", timeout=30)


@pytest.mark.parametrize("template", ["base", "plain"])
async def test_attack_1_a_workload_cannot_answer_for_the_loop_nor_read_its_commands(
    client, template
):
    """The old loop ran as the tenant's user with its pipes 0666: the workload killed it,
    read ctl itself, and the tenant's next `echo REAL; exit 7` came back as FORGED, exit
    0, its environment (secrets included) in the workload's hands."""
    async with client.sandbox(template=template) as sb:
        await through_loop(sb)
        await sb.exec(["sh", "-c", KILL_ALL], timeout=10)
        started = await sb.exec(["sh", "-c", FAKE_LOOP], timeout=10)
        assert started.stdout == "", started  # nothing of the loop's it may read or write
        log = (await sb.exec(["cat", "/tmp/attack.log"])).stdout
        assert "started" in log and "may " not in log, log
        assert "can't open /.dsec/ctl: Permission denied" in log, log
        for _ in range(5):
            secret = secrets.token_hex(8)
            verdict = await sb.exec(
                ["sh", "-c", f"echo REAL; {PARENT}; exit 7"], env={"VERIFIER_SECRET": secret}
            )
            assert (verdict.exit_code, verdict.stdout) == (7, f"REAL\n{LOOP} "), verdict
        # the watcher has had every script and the loop's environment in reach meanwhile
        stolen = (await sb.exec(["sh", "-c", "cat /tmp/stolen 2>/dev/null"])).stdout
        assert stolen == "", stolen[:500]
        log = (await sb.exec(["cat", "/tmp/attack.log"])).stdout
        assert "took" not in log, log


async def test_attack_10_each_sandbox_has_a_uid_of_its_own_so_per_user_limits_are_its_own(
    client,
):
    """The kernel counts processes per user across the whole host (RLIMIT_NPROC, as it
    counts inotify instances and watches): with one uid for every sandbox, a neighbour's
    processes counted against this sandbox's limit, and one sandbox could use up what
    all the others needed. Now the neighbour's 40 processes leave this sandbox's count
    at its own."""
    async with client.sandbox() as neighbour, client.sandbox() as sb:
        uids = [int((await s.exec(["id", "-u"])).stdout) for s in (neighbour, sb)]
        assert uids[0] != uids[1] and min(uids) >= FIRST_UID, uids
        spawned = await neighbour.exec(
            ["sh", "-c", "for i in $(seq 40); do sleep 600 & done; echo spawned"]
        )
        assert spawned.stdout == "spawned\n", spawned
        # a limit of 20 processes for its user: met at once if the neighbour's count
        forked = await sb.exec(["sh", "-c", "ulimit -u 20 && sh -c 'echo forked'"])
        assert (forked.exit_code, forked.stdout) == (0, "forked\n"), forked
