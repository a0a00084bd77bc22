"""Commands through the sandbox's resident loop (agent/resident.py), against real
sandboxes: they run without an engine exec, answer as an engine exec would, fall back
to the engine when a tenant kills the loop, and the loop's directory is read-only to the
sandbox and gone with it.

A command the loop started has a copy of the loop for its parent (which waits for it,
to write its exit code); one the engine started has its parent outside the sandbox
(PID 0)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import signal
import stat
import uuid
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from conftest import (
    STARTED_POOLS,
    TEST_POOL_PREFIX,
    eventually,
    make_spec,
    pool_containers,
    started_pool,
    take_last_pid,
    take_pids,
)
from inprocess import inprocess_agent

from agent.config import AgentConfig
from agent.docker_driver import LOOP_USER, AsyncDocker
from agent.node import Agent
from agent.resident import Resident
from agent.sandboxes import Sandbox as LiveSandbox
from controlplane.config import default_templates
from dsec import statedir
from dsec.client import Client, DsecError, Sandbox
from dsec.clock import SystemClock
from dsec.image import BASE_IMAGE
from dsec.launch.local import LocalPool
from dsec.models import CreateSandbox, LeaseGrant, TemplateSpec

pytestmark = pytest.mark.asyncio(loop_scope="module")

PARENT = ["sh", "-c", "[ $PPID = 0 ] && echo engine || tr '\\0' ' ' </proc/$PPID/cmdline"]
# the loop runs in the node's execute-only busybox (agent/resident.py)
THROUGH_LOOP, THROUGH_ENGINE = "/.dsec/sh /.dsec/serve", "engine"


def kill_loop(container) -> None:
    """Kill the sandbox's loop from the host: nothing in the sandbox may (it runs as
    LOOP_USER, out of the tenant's reach), but a loop may end (a fork at the sandbox's
    pids limit ends it)."""
    loops = [int(pid) for pid, args in top(container) if args == THROUGH_LOOP]
    assert len(loops) == 1, loops  # no command runs: the loop alone, no copy of it
    os.kill(loops[0], signal.SIGKILL)


def top(container) -> list[tuple[str, str]]:
    return [tuple(row) for row in container.top(ps_args="-o pid,args")["Processes"] or []]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pool(docker_client, tmp_path_factory) -> AsyncIterator[LocalPool]:
    spec = make_spec(tmp_path_factory.mktemp("resident"), nodes=1)
    async with started_pool(spec, docker_client) as p:
        yield p


@pytest_asyncio.fixture(loop_scope="module")
async def sb(pool: LocalPool) -> AsyncIterator[Sandbox]:
    async with Client(pool.url, token=pool.tokens.client) as c:
        async with c.sandbox() as sandbox:
            await loop_serving(sandbox)
            yield sandbox


async def parent_of_command(sb: Sandbox) -> str:
    return (await sb.exec(PARENT)).stdout.strip()


async def loop_serving(sb: Sandbox) -> None:
    # the loop starts after the sandbox, when the engine has nothing more urgent to do
    async def through_loop() -> bool:
        return await parent_of_command(sb) == THROUGH_LOOP

    await eventually(through_loop, timeout=30)


async def test_commands_run_through_the_loop_and_answer_as_an_engine_exec_would(sb):
    out = await sb.exec(
        ["sh", "-c", r'printf "%s|%s|" "$A" "$(pwd)"; printf "\377\000" ; echo err >&2; exit 3'],
        env={"A": "it's $HOME"},
        workdir="/tmp",
    )
    assert out.exit_code == 3
    assert out.stdout_bytes == b"it's $HOME|/tmp|\xff\x00"
    assert out.stderr == "err\n"
    assert (await sb.exec(["pwd"])).stdout == "/work\n"  # the template's work dir by default
    missing = await sb.exec(["no-such-program"])
    assert missing.exit_code == 126 and "not found" in missing.stderr
    no_dir = await sb.exec(["true"], workdir="/no/such/dir")
    assert no_dir.exit_code == 126 and "/no/such/dir" in no_dir.stderr
    # each command is a session of its own (a timeout kills its process group)
    ids = (await sb.exec(["sh", "-c", "echo $$; cut -d' ' -f6 /proc/$$/stat"])).stdout.split()
    assert ids[0] == ids[1]
    assert await parent_of_command(sb) == THROUGH_LOOP


async def test_many_commands_at_once_each_get_their_own_output(sb):
    outs = await asyncio.gather(*(sb.exec(["echo", str(i)]) for i in range(40)))
    assert [o.stdout for o in outs] == [f"{i}\n" for i in range(40)]
    zombies = await sb.exec(["sh", "-c", "grep -l '^State:.Z' /proc/[0-9]*/status | wc -l"])
    assert zombies.stdout.strip() == "0"  # the sandbox's init reaps what the loop started


async def test_a_timeout_through_the_loop_kills_the_command(sb):
    out = await sb.exec(["sh", "-c", "sleep 300 & sleep 301"], timeout=1)
    assert (out.exit_code, out.timed_out) == (124, True)
    left = await sb.exec(["sh", "-c", "cat /proc/[0-9]*/cmdline | tr '\\0' ' '"])
    assert "sleep 30" not in left.stdout


async def test_the_loops_directory_is_read_only_to_the_sandbox(sb):
    for attempt in (
        "touch /.dsec/x",
        "ln -s / /.dsec/escape",
        "rm -f /.dsec/ctl",
        "mv /.dsec/serve /.dsec/s",
        "dd if=/dev/zero of=/.dsec/big bs=1M count=1",
    ):
        out = await sb.exec(["sh", "-c", attempt])
        assert out.exit_code != 0 and "Read-only" in out.stderr, (attempt, out)
    # junk in ctl (ids of commands that do not exist, not ids at all) is skipped
    await sb.exec(["sh", "-c", "printf '../../x\\n\\nffff\\n%0100d\\n' 0 > /.dsec/ctl"])
    assert (await sb.exec(["echo", "still"])).stdout == "still\n"
    assert await parent_of_command(sb) == THROUGH_LOOP


# What a command tries on the loop, a process of its own user: read its shell's file,
# read or write its memory, read its environment. Each line says what worked.
REACH_LOOP = """
loop=$(for p in $(ls /proc | sort -n); do
  case "$(tr '\\0' ' ' < /proc/$p/cmdline 2>/dev/null)" in
    *"sh /.dsec/serve ") echo $p; break ;;
  esac
done)
[ -n "$loop" ] || { echo "no loop"; exit 1; }
cat /.dsec/sh >/dev/null 2>&1 && echo "read its shell"
head -1 /proc/$loop/maps 2>/dev/null | grep -q . && echo "maps"
dd if=/proc/$loop/mem bs=1 count=1 skip=$((0x400000)) of=/dev/null 2>/dev/null && echo "read"
printf x | dd of=/proc/$loop/mem bs=1 seek=$((0x400000)) conv=notrunc 2>/dev/null && echo "wrote"
cat /proc/$loop/environ >/dev/null 2>&1 && echo "environ"
echo tried
"""


async def test_no_command_can_reach_into_the_loop(sb):
    """The loop runs as another user than the tenant's (LOOP_USER), in a program no one
    in the sandbox may read: its memory and environment are out of a tenant's reach."""
    reached = await sb.exec(["sh", "-c", REACH_LOOP])
    assert reached.stdout == "tried\n", reached


async def test_a_killed_loop_leaves_commands_to_the_engine_and_comes_back(sb, docker_client):
    kill_loop(docker_client.containers.get(f"dsec-{sb.id}"))
    assert await parent_of_command(sb) == THROUGH_ENGINE
    assert (await sb.exec(["echo", "ok"])).stdout == "ok\n"
    await loop_serving(sb)  # started again, at most every agent.resident.RESTART_AFTER_S


async def test_an_engine_exec_that_ran_is_not_started_again_whatever_it_says(sb, docker_client):
    """The agent starts an engine exec again when runc's init died before the command
    ran (a sandbox at its pids limit); a command that ran and printed runc's words, with
    runc's exit code, ran once all the same."""
    runc_says = "OCI runtime exec failed: unable to start container process: read init-p: x"
    mimic = ["sh", "-c", f"echo $PPID >> /tmp/ran; echo '{runc_says}'; exit 126"]
    kill_loop(docker_client.containers.get(f"dsec-{sb.id}"))
    out = await sb.exec(mimic, timeout=10)
    assert (out.exit_code, out.stdout) == (126, runc_says + "\n"), out
    assert (await sb.exec(["cat", "/tmp/ran"])).stdout == "0\n"  # once, by the engine
    await loop_serving(sb)


@pytest.mark.parametrize("template", ["base", "plain"], ids=["exec", "boot"])
async def test_a_sandbox_with_no_pid_left_runs_commands_through_the_engine(
    pool, booting, docker_client, template
):
    """A fork inside the sandbox fails at its pids limit, so the loop cannot start a
    command: it says so, or its own failed fork ends it, and the command takes the
    engine's exec, which joins the sandbox from outside (before, the command waited out
    its whole timeout: always where the container's boot started the loop, and where an
    engine exec did, when the engine answered before the loop's program ran)."""
    events = ["sh", "-c", "read l < /sys/fs/cgroup/pids/pids.events; echo $PPID $l"]
    pool = booting if template == "plain" else pool  # "plain" may not be recycled: booted
    async with Client(pool.url, token=pool.tokens.client) as c:
        async with c.sandbox(template=template) as sandbox:
            await loop_serving(sandbox)
            container = docker_client.containers.get(f"dsec-{sandbox.id}")
            await take_pids(container)
            # the loop forks a subshell with the last pid, whose fork of the copy fails
            out = await sandbox.exec(events, timeout=20)
            assert not out.timed_out and out.exit_code == 0, out
            assert out.stdout.split()[:2] == ["0", "max"], out  # parent outside: the engine
            await take_last_pid(container)  # the loop's own fork fails, which ends it
            out = await sandbox.exec(events, timeout=20)
            assert not out.timed_out and out.stdout.split()[:2] == ["0", "max"], out
            assert (await sandbox.exec(["echo", "still"])).stdout == "still\n"


async def test_stdin_takes_the_engine_and_works(sb):
    chunks = []
    async with sb.exec_stream(["sh", "-c", "cat; echo $PPID"], stdin=True) as stream:
        await stream.write(b"in\n")
        await stream.close_stdin()
        async for chunk in stream:
            chunks.append(chunk.data)
    assert b"".join(chunks) == b"in\n0\n"  # started by the engine


MAIN_PROCESS = [
    "sh",
    "-c",
    """for p in /proc/[0-9]*; do
      [ "$(tr '\\0' ' ' < $p/cmdline)" = "sleep 2147483647 " ] || continue
      echo "$(readlink $p/exe) $(cut -d' ' -f4 $p/stat)"
    done 2>/dev/null""",
]
ENTRY_RECIPE = (
    f"FROM {BASE_IMAGE}\n"
    'ENTRYPOINT ["/bin/sh", "-c", "echo \\"$0\\" > /tmp/entry; exec \\"$@\\"", "entered"]\n'
)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def booting(docker_client, tmp_path_factory) -> AsyncIterator[LocalPool]:
    """A pool with templates that may not be recycled: the base image as it is, one
    with an entrypoint of its own, and one whose command the image lacks."""
    tag = f"dsec-test-entry-{uuid.uuid4().hex[:8]}:latest"
    docker_client.images.build(
        fileobj=io.BytesIO(ENTRY_RECIPE.encode()), tag=tag, rm=True, network_mode="none"
    )
    templates = {
        **default_templates(),
        "plain": TemplateSpec(name="plain", image=BASE_IMAGE),
        "entry": TemplateSpec(name="entry", image=tag),
        "nocmd": TemplateSpec(name="nocmd", image=BASE_IMAGE, command=["no-such-program"]),
    }
    spec = make_spec(tmp_path_factory.mktemp("booting"), nodes=1, templates=templates)
    try:
        async with started_pool(spec, docker_client) as p:
            yield p
    finally:
        docker_client.images.remove(tag, force=True)


async def test_a_sandbox_starts_its_loop_itself_whether_or_not_it_may_be_recycled(
    booting, docker_client
):
    """Its container starts the command loop (boot_script): the first command already
    runs through the loop, and the engine made no exec in it. The template's command is
    the container's main process (its init's child), the image's own program under the
    name the template gives, not the loop's busybox applet. So does a template that may
    be recycled (its boot runs the template's command as KEEPER_USER): on the old code
    its loop was started by an engine exec, which the engine did beside a burst's
    creates; the agent now finds the booted loop from the host, and a reset keeps it
    (test_recycle_live, attack 15)."""
    async with Client(booting.url, token=booting.tokens.client) as c:
        for template in ("plain", "base"):
            async with c.sandbox(template=template) as sandbox:
                assert await parent_of_command(sandbox) == THROUGH_LOOP, template
                container = docker_client.containers.get(f"dsec-{sandbox.id}")
                assert container.attrs["Config"]["User"] == LOOP_USER
                assert not container.attrs["ExecIDs"], (template, container.attrs["ExecIDs"])
        async with c.sandbox(template="plain") as sandbox:
            assert (await sandbox.exec(MAIN_PROCESS)).stdout == "/bin/busybox 1\n"


async def test_the_images_entrypoint_still_runs_and_a_command_it_lacks_is_refused(booting):
    """The loop's boot runs before the image's own entrypoint, which runs the template's
    command; a command the image lacks is refused at create, as when the engine looked
    for it itself."""
    async with Client(booting.url, token=booting.tokens.client) as c:
        async with c.sandbox(template="entry") as sandbox:
            assert (await sandbox.exec(["cat", "/tmp/entry"])).stdout == "entered\n"
            assert (await sandbox.exec(MAIN_PROCESS)).stdout == "/bin/busybox 1\n"
            assert await parent_of_command(sandbox) == THROUGH_LOOP
        with pytest.raises(DsecError) as refused:
            await c.acquire(template="nocmd", timeout=60)
        assert refused.value.code == "template_unavailable", refused.value
        assert "docker_start_failed" in refused.value.message
        assert "no-such-program" in refused.value.message


async def test_the_loops_directory_goes_with_its_sandbox(pool):
    async with Client(pool.url, token=pool.tokens.client) as c:
        async with c.sandbox() as sandbox:
            # on this host's tmpfs, not in the state dir on its disk
            assert statedir.loops_dir(pool.dir).is_relative_to(statedir.SHARED_MEMORY)
            (path,) = statedir.loops_dir(pool.dir).glob(f"*-resident/{sandbox.id}")
            assert (path / "ctl").is_fifo()
            out = await sandbox.exec(["sh", "-c", r"printf '\377\001'"])
            assert out.stdout_bytes == b"\xff\x01"
            # what the loop's boot and the loop need, no command's file left
            names = sorted(p.name for p in path.iterdir())
            assert names == ["boot", "booted", "ctl", "serve", "sh"], names
            shell = (path / "sh").stat()  # the node's one copy, execute-only
            assert stat.S_IMODE(shell.st_mode) == 0o111 and shell.st_nlink >= 2

        async def gone() -> bool:
            return not path.exists()

        await eventually(gone, timeout=30)


async def test_the_loop_never_starts_while_the_sandbox_is_being_paused(docker_client, tmp_path):
    """An exec that starts while its container is being paused hangs in the engine for
    good (runc joins a frozen cgroup), and so does every later call on that container,
    its removal too. A pause holds the sandbox's lock: the loop waits for its turn."""
    async with inprocess_sandbox(docker_client, tmp_path) as (agent, sandbox):
        await _loop_waits_for_the_sandbox(agent, sandbox, docker_client)


@contextlib.asynccontextmanager
async def inprocess_sandbox(docker_client, tmp_path) -> AsyncIterator[tuple[Agent, LiveSandbox]]:
    """An agent in this process with one sandbox of the base image, as a template that
    may not be recycled; both gone on the way out."""
    node = f"{TEST_POOL_PREFIX}{uuid.uuid4().hex[:8]}"
    STARTED_POOLS.add(node)
    docker = AsyncDocker(SystemClock(), lambda op, took: None)
    async with inprocess_agent(tmp_path, docker, node_id=node) as running:
        req = CreateSandbox(
            sandbox_id=f"{node}.{uuid.uuid4().hex[:16]}",
            pool="default",
            template=TemplateSpec(name="base", image=BASE_IMAGE),
            request_id="r1",
        )
        try:
            sandbox, _ = await running.agent.create(req)
            yield running.agent, sandbox
        finally:
            await running.agent.remove_all()
    await docker.close()
    assert not pool_containers(docker_client, node)


async def _loop_waits_for_the_sandbox(agent, sandbox, docker_client) -> None:
    """The scenario of the test above, on a sandbox of an agent in this process."""
    container = docker_client.containers.get(sandbox.record.container_id)

    def loops() -> int:
        return sum(1 for _, args in top(container) if args == THROUGH_LOOP)

    def execs() -> list[str]:  # every exec the engine made in it (kept for a while)
        container.reload()
        return container.attrs["ExecIDs"] or []

    await eventually(lambda: not agent.resident.starting, "the first start is done")
    assert loops() == 1
    kill_loop(container)
    await eventually(lambda: loops() == 0, "the loop is gone")
    before = execs()
    async with sandbox.lock:  # as a pause in flight holds it
        sandbox.resident_tried_at = None
        agent.resident.ensure_loop(sandbox)
        await eventually(lambda: not agent.resident.starting, "the start gave way")
        assert execs() == before and loops() == 0
    await agent.pause(sandbox.id)  # a frozen sandbox gets no loop either
    agent.resident.ensure_loop(sandbox)
    await eventually(lambda: not agent.resident.starting, "the start gave way")
    assert execs() == before and container.status == "paused"
    await agent.unpause(sandbox.id)
    agent.resident.ensure_loop(sandbox)  # the next command's fallback asks again
    await eventually(lambda: loops() == 1, "the loop starts once the sandbox is free")


async def test_a_restored_sandbox_boots_its_loop_again_once(docker_client, tmp_path):
    """A hibernated sandbox's snapshot carries the boot in its entrypoint: its restore
    names the entrypoint afresh (boot, then the image's own), so its container starts
    one loop, and no engine exec starts another."""
    async with inprocess_sandbox(docker_client, tmp_path) as (agent, sandbox):
        await agent.pause(sandbox.id)
        await agent.hibernate(sandbox.id)
        grant = LeaseGrant(lease_id="0" * 32, pool="default", request_id="r2")
        await agent.lease(sandbox.id, grant)
        container = docker_client.containers.get(sandbox.record.container_id)
        assert container.attrs["Config"]["Entrypoint"] == ["/.dsec/sh", "/.dsec/boot"]
        assert sorted(args for _, args in top(container)) == sorted(
            ["/sbin/docker-init -- /.dsec/sh /.dsec/boot sleep 2147483647",
             "sleep 2147483647", THROUGH_LOOP]
        )  # fmt: skip
        assert not container.attrs["ExecIDs"] and not agent.resident.starting


async def test_the_loops_go_to_a_tmpfs_directory_of_the_state_dir_s_own_or_stay_in_it(
    tmp_path, monkeypatch
):
    shm, state, other = tmp_path / "shm", tmp_path / "state", tmp_path / "other"
    shm.mkdir(mode=0o1777)
    monkeypatch.setattr(statedir, "SHARED_MEMORY", shm)
    monkeypatch.setattr(statedir, "_is_tmpfs", lambda path: path == shm)
    configured = tmp_path / "loops"
    assert statedir.loops_dir(state, configured) == configured
    mine = statedir.loops_dir(state)
    assert mine.parent == shm / f"dsec-{os.geteuid()}" and mine == statedir.loops_dir(state)
    assert stat.S_IMODE(mine.parent.stat().st_mode) == 0o700
    assert statedir.loops_dir(other) not in (mine, other)  # each state dir its own
    # a directory of that name that is not this user's alone: the state dir, as without
    mine.parent.chmod(0o755)
    assert statedir.loops_dir(state) == state
    mine.parent.rmdir()
    (shm / f"dsec-{os.geteuid()}").symlink_to(tmp_path)
    assert statedir.loops_dir(state) == state
    monkeypatch.setattr(statedir, "_is_tmpfs", lambda path: False)
    assert statedir.loops_dir(other) == other


async def test_loop_directories_whose_state_dir_is_gone_are_swept(tmp_path, monkeypatch):
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setattr(statedir, "SHARED_MEMORY", shm)
    monkeypatch.setattr(statedir, "_is_tmpfs", lambda path: path == shm)
    kept, gone, unmarked = tmp_path / "kept", tmp_path / "gone", tmp_path / "unmarked"
    kept.mkdir()
    for state in (kept, gone, unmarked):
        base = statedir.loops_dir(state)
        (base / "n1-resident").mkdir(parents=True)
        if state != unmarked:  # (one being made has no mark yet: not judged)
            (base / statedir.STATE_DIR_MARK).write_text(str(state.resolve()))
    statedir.sweep_orphans()
    left = {p.name for p in (shm / f"dsec-{os.geteuid()}").iterdir()}
    assert left == {statedir.loops_dir(kept).name, statedir.loops_dir(unmarked).name}


async def test_nodes_of_one_state_dir_closing_together_leave_nothing_and_raise_nothing(
    tmp_path, monkeypatch
):
    """At a pool's stop its agents close at once: one may find the state dir's loop
    directory gone, removed by another between its own directory's removal and its look
    (it raised FileNotFoundError at shutdown)."""
    shm, state = tmp_path / "shm", tmp_path / "state"
    shm.mkdir()
    monkeypatch.setattr(statedir, "SHARED_MEMORY", shm)
    monkeypatch.setattr(statedir, "_is_tmpfs", lambda path: path == shm)

    def node(node_id: str) -> Resident:
        config = AgentConfig(node_id=node_id, agent_token="t" * 16, state_dir=state)
        return Resident(config, None, SystemClock(), lambda e: None, set())  # type: ignore[arg-type]

    first, second = node("n1"), node("n2")
    assert first.base == second.base and first.base.parent.parent == shm
    for resident in (first, second):  # as each node's start leaves them (node_shell)
        resident.root.mkdir(parents=True)
        resident.shell_path.write_text("")
    (first.base / statedir.STATE_DIR_MARK).write_text(str(state.resolve()))
    second.root.rmdir()  # n2 has removed its directory and shell copy...
    second.shell_path.unlink()
    first.close(set())  # ...when n1, closing too, sees none left and removes the state dir's
    assert not first.base.exists()
    second.close(set())  # n2 goes on to its look: nothing left to remove
