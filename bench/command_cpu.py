"""What a command in flight costs the machine, in cores, against an engine operation.

    python -m bench.command_cpu [--seconds 4] [--rounds 3] [--json]

The simulator loads its engine with the commands in flight at the profile's
`command_weight`, in engine operations' worth each (bench/sim/agents.py, `Engine`).
`dsec bench calibrate` reads that weight from how much warm acquires slow down beside
COMMAND_SANDBOXES sandboxes running `sleep` again and again; this measures it from
what it stands for: the machine's busy cores (/proc/stat, every process: the engine,
the agents, this client, the sandboxes) while nothing runs, while those commands run,
and while one and two engine operations are under way (bench.calibrate's `EngineLoad`:
the agent's own create and remove, again and again). The phases alternate, `--rounds`
times, each `--seconds` long, and each figure is the median of its rounds.

A command's weight is its cores over an operation's: (commands - idle) /
COMMAND_SANDBOXES over (one operation - idle). The pool is three local nodes; every
container it or the engine load makes is removed on the way out.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

from bench.calibrate import COMMAND_S, COMMAND_SANDBOXES, CommandLoad, Engine, EngineLoad
from bench.host_cpu import host_jiffies
from bench.replay_live import DEFAULT_NODES
from bench.soak import run_to_report
from dsec.client import Client
from dsec.launch.local import LocalPool, LocalPoolSpec
from dsec.models import Capacity, PoolParams
from dsec.processes import interrupt_on_termination
from dsec.tables import format_table

PHASES = ("idle", "commands", "1 operation", "2 operations")
SETTLE_S = 0.5  # a phase's load runs this long before its cores are counted


def cores_busy(before: tuple[int, int], after: tuple[int, int], cores: int) -> float:
    """How many of the machine's `cores` were busy on average between two readings."""
    busy, total = after[0] - before[0], after[1] - before[1]
    return cores * busy / total if total else 0.0


def command_weight(cores: dict[str, float], commands: int) -> float | None:
    """A command in flight's cores over one engine operation's (None: no operation's
    cores to compare with)."""
    operation = cores["1 operation"] - cores["idle"]
    if operation <= 0:
        return None
    return max(0.0, cores["commands"] - cores["idle"]) / commands / operation


async def _cores_while(
    start: Callable[[], None], stop: Callable[[], Awaitable[None]], seconds: float
) -> float:
    start()
    try:
        await asyncio.sleep(SETTLE_S)
        before = host_jiffies()
        await asyncio.sleep(seconds)
        after = host_jiffies()
    finally:
        await stop()
    return cores_busy(before, after, os.cpu_count() or 1)


async def run(seconds: float, rounds: int) -> dict:
    engine = Engine()
    spec = LocalPoolSpec(
        name=f"command-cpu-{uuid.uuid4().hex[:6]}", nodes=DEFAULT_NODES, port=0,
        capacity=Capacity(cpus=64, memory_mb=65536, slots=64),
        pool=PoolParams(min_warm=0, templates=[]), state_dir=Path(tempfile.mkdtemp()),
    )  # fmt: skip
    by_phase: dict[str, list[float]] = {phase: [] for phase in PHASES}
    started = time.perf_counter()
    try:
        async with (
            LocalPool(spec) as pool,
            Client(pool.url, token=pool.tokens.admin) as operator,
            Client(pool.url, token=pool.tokens.client) as client,
        ):
            await operator.set_pool("load", PoolParams(min_warm=0, max_warm=0, templates=[]))
            commands, operations = CommandLoad(client, "load"), EngineLoad(engine)
            await commands.open()

            async def nothing() -> None:
                return None

            loads: dict[str, tuple[Callable[[], None], Callable[[], Awaitable[None]]]] = {
                "idle": (lambda: None, nothing),
                "commands": (commands.start, commands.stop),
                "1 operation": (lambda: operations.start(1), operations.stop),
                "2 operations": (lambda: operations.start(2), operations.stop),
            }
            try:
                for _ in range(rounds):
                    for phase in PHASES:
                        by_phase[phase].append(await _cores_while(*loads[phase], seconds))
            finally:
                await commands.close()
    finally:
        await asyncio.to_thread(engine.sweep)
        engine.driver.close()
    cores = {phase: round(statistics.median(v), 3) for phase, v in by_phase.items()}
    weight = command_weight(cores, COMMAND_SANDBOXES)
    return {
        "seconds": seconds, "rounds": rounds, "commands": COMMAND_SANDBOXES,
        "command_s": COMMAND_S, "cores": cores, "cores_by_round": by_phase,
        "command_weight": None if weight is None else round(weight, 4),
        "wall_s": round(time.perf_counter() - started, 1),
    }  # fmt: skip


def render(r: dict) -> str:
    rows = [[phase, r["cores"][phase], " ".join(f"{c:.3f}" for c in r["cores_by_round"][phase])]
            for phase in PHASES]  # fmt: skip
    return "\n".join(
        [
            f"{r['commands']} sandboxes running `sleep {r['command_s']:g}` again and again "
            f"against engine operations under way, {r['rounds']} rounds of {r['seconds']:g} s",
            format_table(["phase", "busy cores (median)", "each round"], rows),
            f"a command in flight weighs {r['command_weight']} of an engine operation",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="each phase")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if not 1 <= args.seconds <= 600 or not 1 <= args.rounds <= 50:
        print("command_cpu: --seconds 1..600, --rounds 1..50", file=sys.stderr)
        return 2
    run_to_report("command_cpu", run(args.seconds, args.rounds), render, args.json)
    return 0


if __name__ == "__main__":
    interrupt_on_termination()  # the pool it starts is stopped on SIGTERM, SIGHUP
    sys.exit(main())
