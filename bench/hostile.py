"""Hostile tenants' output and connections against one node, in one run (issue 28's
targets for attacks 7 and 8, and the neighbour's latency under attacks 7 to 9).

    python -m bench.hostile [--floods 64] [--samples 500] [--rounds 3] [--connections 300] [--json]

One node, so every sandbox and every flood share its agent. In that order:
- relay: one sandbox streams `cat /dev/zero` for RELAY_S; the agent's CPU meanwhile
  (its process's, from /proc) against the template's `cpus`, and the bytes relayed a
  second against the sandbox's relay rate (its cpus times relay_bytes_per_cpu_s).
  Target: the agent's cores < the template's cpus;
- memory: the agent's RSS idle, then its peak while `--floods` commands flood their
  output at once, spread over FLOOD_TENANTS tenants (a client token and a sandbox
  each): one-shot NULs as base64 (the SDK), one-shot NULs and text asked as utf-8 (raw
  HTTP), and streams of NULs read as fast as they come, each ended by its timeout.
  Target: peak past idle <= RSS_PAST_IDLE_MAX_MB, the bound docs/benchmarks.md documents
  (the output budget, 128 MiB by default, and what each command reads ahead of it);
- neighbour: a quiet client runs `true` in its own sandbox one exec after another:
  quiet, then while one tenant floods output (streams and one-shots, in a process of
  its own) and another floods connections (`--connections` raw TCP connections each to
  the agent and to the control plane from 127.0.0.9, held and opened again when cut,
  in a process of its own; both at FLOODER_NICE), `--rounds` times in turn, then quiet
  once more. Target: its p99 under the floods <= 1.5x its p99 quiet (every quiet
  phase's samples together).
Exits 1 on a miss, or when a container is left behind. Every loop is bounded: floods
by their commands' timeouts and FLOOD_MAX_S, the neighbour by `--samples`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from agent.config import AgentConfig
from bench.soak import Teardown, bench_spec, local_pool, run_to_report, sample_process
from bench.stats import SUMMARY_COLUMNS, summary_ms, summary_rows
from controlplane.config import ClientSpec, default_templates
from dsec.client import Client, Sandbox
from dsec.models import MAX_OUTPUT_BYTES, PoolParams
from dsec.processes import interrupt_on_termination
from dsec.tables import format_table
from dsec.tokens import new_token

MiB = 1 << 20
POOL = "hostile"
TEMPLATE = default_templates()["base"]
FLOOD_TENANTS = 4  # the memory phase's floods are theirs, spread evenly
RSS_PAST_IDLE_MAX_MB = 256
NEIGHBOUR_P99_MAX_RATIO = 1.5
RELAY_S = 5.0
FLOOD_TIMEOUT_S = 8.0  # each flooding command runs this long, then times out
FLOOD_MAX_S = 120.0  # a flooding process stops by itself after this, whatever happens
SAMPLE_EVERY_S = 0.1
NULS = "head -c 67108864 /dev/zero"  # 64 MiB, past any one-shot cap
TEXT = "yes 'plain text, escaped \"a little\"' | head -c 67108864"
STREAMED = ["cat", "/dev/zero"]
FLOODER_SOURCE = "127.0.0.9"  # the connection flood's own loopback address
CONNECT_AGAIN_S = 0.05  # after a connection is cut, before the next
STREAMS_PER_FLOODER, ONE_SHOTS_PER_FLOODER = 4, 2  # the neighbour phase's output flood
FLOODER_NICE = 10  # the flooding clients' own processes (see `niced`)


def cpu_s(pid: int) -> float:
    """A process's CPU time so far (user and system), in seconds."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# --- floods --------------------------------------------------------------------------


async def stream_flood(sb: Sandbox, timeout: float) -> int:
    """Bytes a stream of NULs relayed before its timeout ended it."""
    got = 0
    async for chunk in sb.exec_stream(STREAMED, timeout=timeout):
        got += len(chunk.data)
    return got


async def raw_flood(http: aiohttp.ClientSession, sb: Sandbox, cmd: str) -> int:
    """A one-shot flood asked as utf-8 text (the SDK asks base64): its answer's bytes."""
    body = {
        "cmd": ["sh", "-c", cmd],
        "timeout_s": FLOOD_TIMEOUT_S,
        "max_output_bytes": MAX_OUTPUT_BYTES,
    }
    headers = {"Authorization": f"Bearer {sb.lease.lease_token}"}
    url = f"{sb.lease.agent_url}/v1/sandboxes/{sb.id}/exec"
    async with http.post(url, json=body, headers=headers) as resp:
        return len(await resp.read())


async def sdk_flood(sb: Sandbox) -> int:
    result = await sb.shell(NULS, timeout=FLOOD_TIMEOUT_S, max_output_bytes=MAX_OUTPUT_BYTES)
    return len(result.stdout_bytes)


def tenant_floods(http: aiohttp.ClientSession, sb: Sandbox, count: int) -> list:
    """`count` floods of one tenant's sandbox, of each kind in turn."""
    kinds = [
        lambda: sdk_flood(sb),
        lambda: raw_flood(http, sb, NULS),
        lambda: raw_flood(http, sb, TEXT),
        lambda: stream_flood(sb, FLOOD_TIMEOUT_S),
    ]
    return [kinds[i % len(kinds)]() for i in range(count)]


def flood_output(url: str, token: str, ready, stop) -> None:
    """Another process's tenant: streams and one-shot floods in its own sandbox, again
    and again, until `stop` (or FLOOD_MAX_S)."""

    async def main() -> None:
        deadline = time.monotonic() + FLOOD_MAX_S
        async with Client(url, token=token) as client, aiohttp.ClientSession() as http:
            async with client.sandbox(pool=POOL, timeout=120) as sb:
                ready.set()
                while not stop.is_set() and time.monotonic() < deadline:
                    floods = [stream_flood(sb, 2.0) for _ in range(STREAMS_PER_FLOODER)]
                    floods += [raw_flood(http, sb, NULS) for _ in range(ONE_SHOTS_PER_FLOODER)]
                    await asyncio.gather(*floods, return_exceptions=True)

    asyncio.run(main())


def flood_connections(targets: list[tuple[str, int]], count: int, ready, stop) -> None:
    """Another process's peer, from FLOODER_SOURCE: `count` raw TCP connections to each
    target, held (each sends half a request line) and opened again once cut, until
    `stop` (or FLOOD_MAX_S)."""

    async def hold(host: str, port: int, opened: list[int]) -> None:
        deadline = time.monotonic() + FLOOD_MAX_S
        while not stop.is_set() and time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                reader, writer = await asyncio.open_connection(
                    host, port, local_addr=(FLOODER_SOURCE, 0)
                )
                opened[0] += 1
                writer.write(b"GET /v1/sandboxes HTTP/1.1\r\n")
                with contextlib.suppress(OSError, TimeoutError):
                    await asyncio.wait_for(reader.read(1), deadline - time.monotonic())
                writer.close()
            await asyncio.sleep(CONNECT_AGAIN_S)

    async def main() -> None:
        opened = [0]
        holders = [
            asyncio.create_task(hold(host, port, opened))
            for host, port in targets
            for _ in range(count)
        ]
        while opened[0] < count * len(targets) // 2 and not stop.is_set():
            await asyncio.sleep(0.05)
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.05)
        for task in holders:
            task.cancel()
        await asyncio.gather(*holders, return_exceptions=True)

    asyncio.run(main())


def niced(target, *args) -> None:
    """`target(*args)` at FLOODER_NICE. The attackers' clients are other machines in
    production; here they share the node's two cores, and what the neighbour's latency
    is to show is what the attack costs the node (its agent, the engine), not what the
    attackers' own processes take of this machine's CPU."""
    os.nice(FLOODER_NICE)
    target(*args)


@contextlib.asynccontextmanager
async def in_processes(*roles: tuple):
    """Run each (target, args) in a spawned process; yield once each says it is ready;
    stop them on the way out."""
    spawn = multiprocessing.get_context("spawn")
    stop = spawn.Event()
    started = []
    for target, args in roles:
        ready = spawn.Event()
        proc = spawn.Process(target=niced, args=(target, *args, ready, stop), daemon=True)
        proc.start()
        started.append((proc, ready))
    try:
        for proc, ready in started:
            if not await asyncio.to_thread(ready.wait, 120):
                raise RuntimeError(f"a flooding process ({proc.pid}) never got going")
        yield
    finally:
        stop.set()
        for proc, _ in started:
            await asyncio.to_thread(proc.join, 30)
            if proc.is_alive():
                proc.kill()  # by its own pid: ours


# --- the phases ----------------------------------------------------------------------


@dataclass
class Peak:
    rss_kb: int = 0
    buffered: float = 0.0  # dsec_agent_output_buffered_bytes, as scraped


async def scrape_buffered(http: aiohttp.ClientSession, agent_url: str) -> float:
    async with http.get(f"{agent_url}/metrics") as resp:
        text = await resp.text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "dsec_agent_output_buffered_bytes":
                return sample.value
    return 0.0


async def sample_peak(pid: int, agent_url: str, http: aiohttp.ClientSession, done) -> Peak:
    peak = Peak()
    while not done.is_set():
        peak.rss_kb = max(peak.rss_kb, sample_process(pid).rss_kb)
        peak.buffered = max(peak.buffered, await scrape_buffered(http, agent_url))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), SAMPLE_EVERY_S)
    return peak


async def relay_phase(sb: Sandbox, pid: int) -> dict:
    cpu0, started = cpu_s(pid), time.monotonic()
    relayed = await stream_flood(sb, RELAY_S)
    took = time.monotonic() - started
    cores = (cpu_s(pid) - cpu0) / took
    rate = TEMPLATE.cpus * AgentConfig.model_fields["relay_bytes_per_cpu_s"].default
    return {
        "relayed_mib_s": round(relayed / took / MiB, 1),
        "relay_rate_mib_s": round(rate / MiB, 1),
        "agent_cores": round(cores, 3),
        "template_cpus": TEMPLATE.cpus,
    }


async def memory_phase(sandboxes: list[Sandbox], pid: int, agent_url: str, floods: int) -> dict:
    async with aiohttp.ClientSession() as http:
        await asyncio.sleep(1.0)  # what the relay phase let go
        idle_kb = sample_process(pid).rss_kb
        done = asyncio.Event()
        sampler = asyncio.create_task(sample_peak(pid, agent_url, http, done))
        work = [
            flood
            for i, sb in enumerate(sandboxes)
            for flood in tenant_floods(http, sb, len(range(i, floods, len(sandboxes))))
        ]
        try:
            results = await asyncio.gather(*work, return_exceptions=True)
        finally:
            done.set()
            peak = await sampler
    failed = [repr(r)[:200] for r in results if isinstance(r, BaseException)]
    past_idle_mb = (peak.rss_kb - idle_kb) / 1024
    return {
        "floods": floods,
        "tenants": len(sandboxes),
        "failed": failed,
        "answered_mib": round(sum(r for r in results if isinstance(r, int)) / MiB, 1),
        "idle_rss_mb": round(idle_kb / 1024, 1),
        "peak_rss_mb": round(peak.rss_kb / 1024, 1),
        "peak_past_idle_mb": round(past_idle_mb, 1),
        "bound_past_idle_mb": RSS_PAST_IDLE_MAX_MB,
        "peak_buffered_mib": round(peak.buffered / MiB, 1),
        "budget_mib": AgentConfig.model_fields["output_budget_bytes"].default / MiB,
    }


async def neighbour_execs(sb: Sandbox, samples: int) -> list[float]:
    seconds = []
    for _ in range(samples):
        started = time.perf_counter()
        result = await sb.exec(["true"], timeout=30)
        seconds.append(time.perf_counter() - started)
        if result.exit_code != 0:
            raise RuntimeError(f"the neighbour's `true` answered {result.exit_code}")
    return seconds


async def neighbour_phase(pool, neighbour: Sandbox, flooder: str, args) -> dict:
    """Quiet and flooded in turn, `args.rounds` times, then quiet once more: the
    machine's own drift (the engine's speed, other work) falls on both sides alike."""
    agent, cp = urlsplit(pool.agents[0].url), urlsplit(pool.url)
    targets = [(agent.hostname, agent.port), (cp.hostname, cp.port)]
    await neighbour_execs(neighbour, 20)  # connections, page cache
    quiet, flooded = [], []
    for _ in range(args.rounds):
        quiet += await neighbour_execs(neighbour, args.samples)
        async with in_processes(
            (flood_output, (pool.url, flooder)),
            (flood_connections, (targets, args.connections)),
        ):
            flooded += await neighbour_execs(neighbour, args.samples)
    quiet += await neighbour_execs(neighbour, args.samples)
    quiet_ms, hot = summary_ms(quiet), summary_ms(flooded)
    return {
        "quiet_ms": quiet_ms,
        "flooded_ms": hot,
        "p99_flooded_over_quiet": round(hot["p99"] / quiet_ms["p99"], 3),
        "rounds": args.rounds,
        "connections_per_target": args.connections,
    }


async def run(args: argparse.Namespace) -> dict:
    spec = bench_spec("hostile", nodes=1, slots=FLOOD_TENANTS + 8)
    tokens = [new_token() for _ in range(FLOOD_TENANTS + 1)]  # the last: the neighbour's flooder
    spec.clients = [ClientSpec(token=token) for token in tokens]
    teardown = Teardown()
    async with local_pool(spec, teardown) as pool:
        pid, agent_url = pool.agents[0].proc.pid, pool.agents[0].url
        async with contextlib.AsyncExitStack() as stack:
            operator = await stack.enter_async_context(Client(pool.url, token=pool.tokens.admin))
            await operator.set_pool(POOL, PoolParams(min_warm=FLOOD_TENANTS + 2, max_warm=8))
            clients = [
                await stack.enter_async_context(Client(pool.url, token=t)) for t in tokens[:-1]
            ]
            floods = [
                await stack.enter_async_context(c.sandbox(pool=POOL, timeout=120)) for c in clients
            ]
            neighbour_client = await stack.enter_async_context(
                Client(pool.url, token=pool.tokens.client)
            )
            neighbour = await stack.enter_async_context(
                neighbour_client.sandbox(pool=POOL, timeout=120)
            )
            relay = await relay_phase(floods[0], pid)
            memory = await memory_phase(floods, pid, agent_url, args.floods)
            neighbour_report = await neighbour_phase(pool, neighbour, tokens[-1], args)
    return {
        "node": "1 node (every tenant and the neighbour share its agent)",
        "relay": relay,
        "memory": memory,
        "neighbour": neighbour_report,
        "containers_swept_at_stop": teardown.swept,
        "containers_left_after_stop": teardown.left,
    }


def misses(r: dict) -> list[str]:
    found = []
    if r["relay"]["agent_cores"] >= r["relay"]["template_cpus"]:
        found.append("relaying one flood cost the agent more than the sandbox's CPU quota")
    if r["memory"]["peak_past_idle_mb"] > RSS_PAST_IDLE_MAX_MB:
        found.append(f"the agent's RSS rose past {RSS_PAST_IDLE_MAX_MB} MB above idle")
    if r["memory"]["failed"]:
        found.append("floods failed rather than waited")
    if r["neighbour"]["p99_flooded_over_quiet"] > NEIGHBOUR_P99_MAX_RATIO:
        found.append(f"the neighbour's p99 under the floods passed {NEIGHBOUR_P99_MAX_RATIO}x")
    if r["containers_swept_at_stop"] or r["containers_left_after_stop"]:
        found.append("containers were left behind")
    return found


def render(r: dict) -> str:
    relay, memory, n = r["relay"], r["memory"], r["neighbour"]
    lines = [
        f"hostile tenants, {r['node']}",
        f"relay: one stream of NULs at {relay['relayed_mib_s']} MiB/s (rate "
        f"{relay['relay_rate_mib_s']}), agent {relay['agent_cores']} cores "
        f"(template {relay['template_cpus']} cpus)",
        f"memory: {memory['floods']} floods of {memory['tenants']} tenants, "
        f"{memory['answered_mib']} MiB answered, {len(memory['failed'])} failed; agent RSS "
        f"idle {memory['idle_rss_mb']} MB, peak {memory['peak_rss_mb']} MB, past idle "
        f"{memory['peak_past_idle_mb']} MB (bound {memory['bound_past_idle_mb']}); buffered "
        f"peak {memory['peak_buffered_mib']} MiB (budget {memory['budget_mib']})",
        "",
    ]
    phases = ("quiet", "quiet_ms"), ("flooded", "flooded_ms")
    rows = summary_rows((name, n[key]) for name, key in phases)
    lines += [format_table(["neighbour `true` ms", *SUMMARY_COLUMNS], rows), ""]
    lines.append(f"p99 flooded over quiet: {n['p99_flooded_over_quiet']}")
    lines += [f"MISS: {m}" for m in misses(r)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--floods", type=int, default=64, help="output floods at once")
    parser.add_argument("--samples", type=int, default=500, help="neighbour execs per phase")
    parser.add_argument("--rounds", type=int, default=3, help="quiet and flooded phases, in turn")
    parser.add_argument(
        "--connections", type=int, default=300, help="raw connections to each service"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    limit = AgentConfig.model_fields["execs_per_sandbox"].default * FLOOD_TENANTS
    if not (1 <= args.floods <= limit and args.samples >= 100 and 1 <= args.connections <= 5000):
        print(
            f"hostile: --floods 1..{limit}, --samples >= 100, --connections 1..5000",
            file=sys.stderr,
        )
        return 2
    report = run_to_report("hostile", run(args), render, args.json)
    return 1 if misses(report) else 0


if __name__ == "__main__":
    interrupt_on_termination()  # the pool it starts is stopped on SIGTERM, SIGHUP
    sys.exit(main())
