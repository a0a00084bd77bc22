"""Hostile workloads in real sandboxes: each is contained, and the neighbours keep working.

One node, so the hostile sandbox and its neighbour share the agent, the Docker engine
and the host. Every test ends by checking that the neighbour still runs a command
promptly; the commands that probe the sandbox after an attack use shell builtins where
they can, since an attack may have left it unable to fork.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import aiohttp
import docker
import pytest
import pytest_asyncio
from conftest import commands_running, make_spec, started_pool, take_last_pid, take_pids

from agent.docker_driver import LABEL_SANDBOX, LOOP_CAPS
from agent.users import FIRST_UID
from controlplane.config import default_templates
from dsec.client import Client, Sandbox, SandboxLost
from dsec.image import PASSWD
from dsec.launch.local import LocalPool

pytestmark = pytest.mark.asyncio(loop_scope="module")

BASE = default_templates()["base"]  # the template every sandbox here runs
NEIGHBOUR_EXEC_MAX_S = 2.0  # an exec of `echo` takes ~50 ms on an idle node
# While a sandbox floods its output, Docker's engine copies every byte of it (~40% of a
# core here), and every exec goes through the engine: measured p50 75-230 ms, max 2.4 s
# on a busy 2-core machine. The agent's own answers stay in milliseconds.
FLOODED_EXEC_MAX_S = 5.0
AGENT_ANSWER_MAX_S = 0.5
MiB = 1 << 20
CAP_SETGID, CAP_SETUID = 6, 7  # capability numbers (linux/capability.h)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pool(docker_client, tmp_path_factory) -> AsyncIterator[LocalPool]:
    spec = make_spec(tmp_path_factory.mktemp("hostile"), nodes=1)
    async with started_pool(spec, docker_client) as p:
        yield p


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def neighbour(pool: LocalPool) -> AsyncIterator[Sandbox]:
    async with Client(pool.url, token=pool.tokens.client) as c:
        async with c.sandbox() as sb:
            yield sb


async def assert_responsive(neighbour: Sandbox, within_s: float = NEIGHBOUR_EXEC_MAX_S) -> None:
    """The neighbour writes and reads a file promptly."""
    started = time.monotonic()
    result = await neighbour.exec(["sh", "-c", "echo ok > /work/probe && cat /work/probe"])
    elapsed = time.monotonic() - started
    assert (result.exit_code, result.stdout) == (0, "ok\n"), result
    assert elapsed < within_s, f"the neighbour's exec took {elapsed:.2f} s"


def container_of(docker_client: docker.DockerClient, sandbox_id: str):
    [container] = docker_client.containers.list(filters={"label": f"{LABEL_SANDBOX}={sandbox_id}"})
    return container


async def test_a_sandbox_runs_with_every_limit_of_its_template(client, docker_client, neighbour):
    async with client.sandbox() as sb:

        async def inside(*cmd: str) -> str:
            return (await sb.exec(["sh", "-c", " ".join(cmd)])).stdout.strip()

        async def cgroup(name: str) -> int:
            return int(await inside("cat", f"/sys/fs/cgroup/{name}"))

        # a uid of its own, from its node's range (agent/users.py), not the host's 1000
        assert int(await inside("id -u")) >= FIRST_UID
        status = dict(re.findall(r"(\w+):\s+(\S+)", await inside("cat /proc/self/status")))
        assert status["CapEff"] == status["CapPrm"] == "0000000000000000"
        # the bounding set holds the command loop's two (LOOP_CAPS), which no process of
        # the tenant's user has, nor can get (no-new-privileges)
        assert int(status["CapBnd"], 16) == 1 << CAP_SETGID | 1 << CAP_SETUID
        assert status["NoNewPrivs"] == "1"
        assert int(await inside("ulimit -n")) == BASE.nofile_limit
        assert await cgroup("pids/pids.max") == BASE.pids_limit
        cpus = await cgroup("cpu/cpu.cfs_quota_us") / await cgroup("cpu/cpu.cfs_period_us")
        assert cpus == pytest.approx(BASE.cpus)
        ram_limit = (BASE.memory_mb + BASE.workdir_mb + BASE.tmp_mb) * MiB
        assert await cgroup("memory/memory.limit_in_bytes") == ram_limit
        socket = await sb.exec(["ls", "/var/run/docker.sock", "/run/docker.sock"])
        assert socket.stderr.count("No such file or directory") == 2, socket

        host = container_of(docker_client, sb.id).attrs["HostConfig"]
        assert host["CapDrop"] == ["ALL"] and host["CapAdd"] == LOOP_CAPS
        assert host["SecurityOpt"] == ["no-new-privileges"]
        assert host["ReadonlyRootfs"] and not host["Privileged"]
        assert host["NetworkMode"] == "none"
        for shared in ("VolumesFrom", "Devices"):
            assert not host.get(shared), (shared, host.get(shared))  # nothing of the host
        # of the host, only the agent's own directory for the sandbox's command loop
        # (agent/resident.py), read-only
        (bind,) = host["Binds"]
        assert bind.endswith(f"-resident/{sb.id}:/.dsec:ro"), bind
        assert not host.get("Mounts"), host.get("Mounts")
        mounts = container_of(docker_client, sb.id).attrs["Mounts"]
        assert [(m["Destination"], m["RW"]) for m in mounts] == [("/.dsec", False)], mounts
        assert f"size={BASE.workdir_mb}m" in host["Tmpfs"][BASE.workdir]
    await assert_responsive(neighbour)


async def test_a_fork_bomb_hits_the_pids_limit(client, docker_client, neighbour):
    async with client.sandbox() as sb:
        # sleepers that stay: the bomb holds every pid it got until the sandbox goes
        bomb = await sb.exec(["sh", "-c", "while :; do sleep 1000 & done"], timeout=20)
        assert bomb.exit_code != 0
        assert "can't fork" in bomb.stderr or bomb.timed_out, bomb
        # `read` is a builtin: it needs no pid, of which the sandbox may have none left
        read_events = "read line < /sys/fs/cgroup/pids/pids.events; echo $line"
        events = await sb.exec(["sh", "-c", read_events])
        assert events.stdout.startswith("max ") and int(events.stdout.split()[1]) > 0, events
        assert len(container_of(docker_client, sb.id).top()["Processes"]) <= BASE.pids_limit
        await assert_responsive(neighbour)
    await assert_responsive(neighbour)


async def test_a_command_past_its_deadline_dies_though_the_sandbox_has_no_pid_left(
    client, docker_client, neighbour
):
    """The kill needs no fork in the sandbox (before, the kill script's own forks failed
    there, and the command ran on after its timeout)."""
    async with client.sandbox() as sb:
        container = container_of(docker_client, sb.id)
        await take_pids(container)
        await take_last_pid(container)
        out = await sb.exec(["sleep", "300"], timeout=1)  # the engine's exec: no fork here
        assert out.timed_out, out
        running = await commands_running(container)
        assert "sleep 300" not in running and "sleep 1001" in running, running
        await assert_responsive(neighbour)


async def test_a_memory_hog_is_oom_killed_within_its_limit(client, neighbour):
    async with client.sandbox() as sb:
        hog = await sb.exec(["tail", "/dev/zero"], timeout=30)  # keeps one endless line
        assert hog.exit_code == 137 and not hog.timed_out, hog  # SIGKILL from the OOM killer
        after = await sb.exec(["cat", "/sys/fs/cgroup/memory/memory.oom_control"])
        assert int(re.search(r"oom_kill (\d+)", after.stdout)[1]) >= 1
        # the sandbox itself lives on
        assert (await sb.exec(["echo", "alive"])).stdout == "alive\n"
        await assert_responsive(neighbour)


async def test_filling_the_work_dir_stops_at_its_size(client, neighbour):
    async with client.sandbox() as sb:
        script = "for d in /work /tmp; do dd if=/dev/zero of=$d/fill bs=1M; echo $?; done"
        fill = await sb.exec(["sh", "-c", script], timeout=60)
        assert fill.stdout.split() == ["1", "1"], fill
        assert fill.stderr.count("No space left on device") == 2, fill
        sizes = await sb.exec(["stat", "-c", "%s", "/work/fill", "/tmp/fill"])
        assert [int(s) for s in sizes.stdout.split()] == [BASE.workdir_mb * MiB, BASE.tmp_mb * MiB]
        # full disks, but processes still have their memory: the sandbox keeps working
        again = await sb.exec(["sh", "-c", "rm /work/fill && echo ok > /work/f && cat /work/f"])
        assert again.stdout == "ok\n", again
        await assert_responsive(neighbour)


async def test_writing_outside_the_work_dir_fails(client, neighbour):
    async with client.sandbox() as sb:
        for path in ("/etc/passwd", "/bin/sh", "/new-file", "/proc/sys/kernel/hostname"):
            result = await sb.exec(["sh", "-c", f"echo x > {path}"])
            assert result.exit_code != 0, path
            assert "Read-only file system" in result.stderr, (path, result.stderr)
        assert (await sb.exec(["cat", "/etc/passwd"])).stdout == PASSWD  # as built
        await assert_responsive(neighbour)


async def test_the_network_is_unreachable(client, pool, neighbour):
    targets = [urlsplit(pool.url), urlsplit(pool.agents[0].url)]
    async with client.sandbox() as sb:
        interfaces = await sb.exec(["cat", "/proc/net/dev"])
        names = [line.split(":")[0].strip() for line in interfaces.stdout.splitlines()[2:]]
        assert names == ["lo"]
        for target in targets:
            get = "printf 'GET /healthz HTTP/1.0\\r\\n\\r\\n'"
            nc = f"nc -w 2 {target.hostname} {target.port}"
            result = await sb.exec(["sh", "-c", f"{get} | {nc}"], timeout=10)
            assert result.exit_code != 0 and "HTTP/" not in result.stdout, (target, result)
            assert "Connection refused" in result.stderr, (target, result)
        await assert_responsive(neighbour)


async def test_signalling_pid_1(client, docker_client, neighbour):
    async with client.sandbox() as sb:
        # PID 1 and the template's command run as a user of their own (the base
        # template may be recycled: agent/docker_driver.py KEEPER_USER), so no signal
        # of the sandbox's user reaches them, and the sandbox lives on
        for sig in ("KILL", "TERM"):
            tried = await sb.exec(["sh", "-c", f"kill -{sig} 1; sleep 0.2; echo survived"])
            assert tried.stdout == "survived\n" and "not permitted" in tried.stderr, tried
        assert (await sb.exec(["true"])).exit_code == 0
        # its init ended from outside (the host): its client is told so, plainly, as
        # the infrastructure's fault, instead of getting a Docker error (409
        # sandbox_exited while its node still holds it, 410 sandbox_lost once dropped)
        os.kill(container_of(docker_client, sb.id).attrs["State"]["Pid"], signal.SIGKILL)
        await asyncio.sleep(1)
        with pytest.raises(SandboxLost) as e:
            await sb.exec(["true"])
        assert (e.value.cause, e.value.infra_fault) == ("container_died", True), e.value
    await assert_responsive(neighbour)


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+) kB", f.read())[1])


async def test_an_output_flood_is_cut_and_the_agent_stays_responsive(client, pool, neighbour):
    agent = pool.agents[0]
    rss_before = rss_kib(agent.proc.pid)
    cap = 64 * 1024
    async with client.sandbox() as sb:
        flood = ["sh", "-c", "yes out & yes err >&2"]
        floods = [
            asyncio.create_task(sb.exec(flood, timeout=4, max_output_bytes=cap)) for _ in range(3)
        ]
        await asyncio.sleep(1)  # the floods are running
        probes = 0
        async with aiohttp.ClientSession() as http:
            while not all(f.done() for f in floods):
                started = time.monotonic()
                async with http.get(f"{agent.url}/healthz") as resp:
                    assert resp.status == 200
                assert time.monotonic() - started < AGENT_ANSWER_MAX_S
                await assert_responsive(neighbour, within_s=FLOODED_EXEC_MAX_S)
                probes += 1
        assert probes > 0, "the floods ended before the agent could be probed under load"
        for done in floods:
            result = done.result()
            assert result.timed_out and result.exit_code == 124 and result.truncated
            assert len(result.stdout) == len(result.stderr) == cap
            assert result.stdout.startswith("out\n") and result.stderr.startswith("err\n")
        left = await sb.exec(["ps", "-o", "args"])
        assert "yes" not in left.stdout  # killed with the command that started them
        await assert_responsive(neighbour)
    # the agent dropped what it did not keep rather than buffering it
    assert rss_kib(agent.proc.pid) - rss_before < 64 * 1024
