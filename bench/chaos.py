"""Chaos under running episodes: an agent killed, and separately a node's Docker engine
restarted, while 40 episodes run; every episode must end as it should.

    python -m bench.chaos [--episodes 40] [--steps 40] [--fault-after 4] [--json]

A local pool of 2 nodes on the shared engine and, per scenario, one more node (the
victim: `bench.extra_nodes`):
- agent_kill: the victim's agent, on the shared engine, is killed (SIGKILL) mid-run;
- engine_restart: the victim's agent runs on a Docker engine of its own, which is
  stopped (as `systemctl stop docker`: it stops its containers) mid-run and started
  again 3 s later.
Each episode acquires a sandbox, runs `--steps` commands (`sleep 0.2; echo <step>`,
each checked: exit 0 and its own output) and releases it. The fault comes once every
episode holds its sandbox and has run a command.

Targets (issue 32): every episode on the victim node that had not finished ends in
SandboxLost with infra_fault and the scenario's cause (node_lost, engine_lost); every
other episode finishes all its steps; none ends in a wrong exit code or output, another
error, or a hang (an episode past 180 s); no container left. Exits 1 on a miss.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import docker

from agent.docker_driver import LABEL_NODE
from bench.burst import exit_status, render_targets, target
from bench.extra_nodes import ExtraAgent, PrivateEngine, node_info, private_engine, start_agent
from bench.soak import Teardown, bench_spec, local_pool, run_to_report
from bench.stats import summary_ms
from dsec.client import Client, Sandbox, SandboxLost
from dsec.launch.local import LocalPool
from dsec.models import PoolParams
from dsec.processes import interrupt_on_termination
from dsec.tables import format_table

SCENARIOS = {"agent_kill": "node_lost", "engine_restart": "engine_lost"}
VICTIM_NAMES = {"agent_kill": "killed", "engine_restart": "engine"}  # node ids are short
VICTIM_HOST = "127.0.0.19"  # LocalPool gives its own agents 127.0.0.2 upwards
EPISODE_TIMEOUT_S = 180.0
ENGINE_DOWN_S = 3.0


@dataclass
class Episode:
    index: int
    node: str = ""
    steps_done: int = 0
    end: str = "running"  # finished, lost, wrong, error, hang
    cause: str | None = None
    infra_fault: bool | None = None
    detail: str = ""
    ended_at: float = 0.0  # perf_counter


@dataclass
class Run:
    episodes: list[Episode] = field(default_factory=list)
    holding: asyncio.Event = field(default_factory=asyncio.Event)
    started: int = 0


async def episode(client: Client, run: Run, ep: Episode, steps: int) -> None:
    sb: Sandbox | None = None
    try:
        async with asyncio.timeout(EPISODE_TIMEOUT_S):
            sb = await client.acquire(timeout=60)
            ep.node = sb.node
            for step in range(steps):
                out = await sb.exec(["sh", "-c", f"sleep 0.2; echo {step}"])
                if out.exit_code != 0 or out.stdout != f"{step}\n":
                    ep.end, ep.detail = "wrong", f"step {step}: exit {out.exit_code} {out.stdout!r}"
                    return
                ep.steps_done += 1
                if step == 0:
                    run.started += 1
                    if run.started == len(run.episodes):
                        run.holding.set()
            ep.end = "finished"
    except SandboxLost as e:
        ep.end, ep.cause, ep.infra_fault, ep.detail = "lost", e.cause, e.infra_fault, str(e)
    except TimeoutError:
        ep.end = "hang"
    except Exception as e:  # a wrong ending of any kind: reported, not raised
        ep.end, ep.detail = "error", f"{type(e).__name__}: {e}"
    finally:
        ep.ended_at = time.perf_counter()
        if sb is not None:
            with contextlib.suppress(Exception):
                await sb.release()


async def until_placeable(client: Client, node_id: str, timeout_s: float = 60.0) -> None:
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        info = await node_info(client, node_id)
        if info is not None and info.placeable:
            return
        await asyncio.sleep(0.2)
    raise RuntimeError(f"node {node_id} never took placements")


async def scenario(pool: LocalPool, name: str, args: argparse.Namespace) -> dict:
    with contextlib.ExitStack() as stack:
        env = {}
        engine = None
        if name == "engine_restart":
            engine = stack.enter_context(private_engine("dsec-chaos-"))
            env = {"DOCKER_HOST": engine.socket}
        victim_id = f"{pool.spec.name}-{VICTIM_NAMES[name]}"
        agent = await start_agent(pool, victim_id, host=VICTIM_HOST, slots=args.episodes, env=env)
        try:
            async with (
                Client(pool.url, token=pool.tokens.admin) as operator,
                Client(pool.url, token=pool.tokens.client) as client,
            ):
                await until_placeable(operator, victim_id)
                return await faulted_run(client, agent, engine, name, args)
        finally:
            await agent.stop()
            if engine is None:  # a killed agent leaves its containers: this removes them
                await asyncio.to_thread(remove_node_containers, victim_id)


async def faulted_run(
    client: Client,
    agent: ExtraAgent,
    engine: PrivateEngine | None,
    name: str,
    args: argparse.Namespace,
) -> dict:
    run = Run([Episode(i) for i in range(args.episodes)])
    tasks = [asyncio.ensure_future(episode(client, run, ep, args.steps)) for ep in run.episodes]
    await asyncio.wait_for(run.holding.wait(), 120)
    await asyncio.sleep(args.fault_after)
    fault_at = time.perf_counter()
    if engine is None:
        agent.proc.send_signal(signal.SIGKILL)
        await agent.proc.wait()
    else:
        await asyncio.to_thread(engine.stop)
        await asyncio.sleep(ENGINE_DOWN_S)
        await asyncio.to_thread(engine.start)
    await asyncio.gather(*tasks)
    victims = [ep for ep in run.episodes if ep.node == agent.node_id]
    others = [ep for ep in run.episodes if ep.node != agent.node_id]
    lost = [ep for ep in victims if ep.end == "lost"]
    return {
        "scenario": name,
        "expected_cause": SCENARIOS[name],
        "episodes": len(run.episodes),
        "on_victim": len(victims),
        "ends": dict(Counter(ep.end for ep in run.episodes)),
        "victim_ends": dict(Counter(ep.end for ep in victims)),
        "causes": dict(Counter(f"{ep.cause} (infra {ep.infra_fault})" for ep in lost)),
        "others_finished": sum(ep.end == "finished" for ep in others),
        "others": len(others),
        "lost_after_fault_ms": summary_ms([ep.ended_at - fault_at for ep in lost]),
        "wrong": [
            f"#{ep.index} on {ep.node}: {ep.end} {ep.detail}"[:300]
            for ep in run.episodes
            if ep.end not in ("finished", "lost")
        ],  # fmt: skip
        "misattributed": [
            f"#{ep.index}: {ep.cause} (infra {ep.infra_fault})"
            for ep in run.episodes
            if ep.end == "lost"
            and (ep.node != agent.node_id or (ep.cause, ep.infra_fault) != (SCENARIOS[name], True))
        ],
    }


def remove_node_containers(node_id: str) -> None:
    client = docker.from_env()
    for c in client.containers.list(all=True, filters={"label": f"{LABEL_NODE}={node_id}"}):
        c.remove(force=True)


async def run(args: argparse.Namespace) -> dict:
    spec = bench_spec("chaos", nodes=2, slots=args.episodes)
    spec.pool = PoolParams(min_warm=args.episodes // 2, max_warm=args.episodes)
    teardown = Teardown()
    scenarios = []
    async with local_pool(spec, teardown) as pool:
        for name in SCENARIOS:
            scenarios.append(await scenario(pool, name, args))
    report = {
        "steps": args.steps,
        "fault_after_s": args.fault_after,
        "scenarios": scenarios,
        "containers_left": teardown.left,
    }
    report["targets"] = targets(report)
    return report


def targets(r: dict) -> list[dict]:
    out = []
    for s in r["scenarios"]:
        name = s["scenario"]
        unlost = (
            s["on_victim"] - s["victim_ends"].get("lost", 0) - s["victim_ends"].get("finished", 0)
        )
        out.append(
            target(
                f"{name}: victim episodes not ended as SandboxLost({s['expected_cause']})",
                len(s["misattributed"]) + unlost,
                0,
                f"{s['on_victim']} on the victim; {s['causes']}",
                ok=s["on_victim"] > 0,
            )
        )
        out.append(
            target(
                f"{name}: other episodes unfinished",
                s["others"] - s["others_finished"],
                0,
                f"{s['others_finished']} of {s['others']} finished",
            )
        )
        out.append(
            target(
                f"{name}: wrong exit, error or hang", len(s["wrong"]), 0, "; ".join(s["wrong"][:3])
            )
        )
    out.append(target("containers left", r["containers_left"], 0))
    return out


def render(r: dict) -> str:
    rows = [
        [
            s["scenario"],
            s["episodes"],
            s["on_victim"],
            ", ".join(f"{k} {v}" for k, v in sorted(s["ends"].items())),
            ", ".join(f"{k}: {v}" for k, v in s["causes"].items()),
            f"{s['lost_after_fault_ms']['p50']:.0f} / {s['lost_after_fault_ms']['max']:.0f}"
            if s["lost_after_fault_ms"]["n"]
            else "-",
        ]
        for s in r["scenarios"]
    ]
    table = format_table(
        ["scenario", "episodes", "on victim", "ends", "lost as", "lost after fault p50/max ms"],
        rows,
    )
    return "\n".join([table, "", *render_targets(r["targets"])])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=40)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--fault-after", type=float, default=4.0, help="seconds")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.episodes < 2 or args.steps < 2 or args.fault_after < 0:
        print("chaos: --episodes and --steps must be >= 2, --fault-after >= 0", file=sys.stderr)
        return 2
    return exit_status(run_to_report("chaos", run(args), render, args.json))


if __name__ == "__main__":
    interrupt_on_termination()  # the pool it starts is stopped on SIGTERM, SIGHUP
    sys.exit(main())
