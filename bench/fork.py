"""Fork against what a client does without it, in the same run, rounds alternating.

    python -m bench.fork [--mib 50] [--count 8] [--rounds 4] [--json]

A local 3-node pool whose warm pool is on every node. One leased source sandbox holds a
work dir of `--mib` MiB (files of 1 MiB and of 4 KiB, as a repository with its data has)
and a little in /tmp. Two ways to get `--count` sandboxes holding copies of it:
- fork: `sb.fork(count)`; the time is the call's, to every copy usable;
- by hand: the client reads the source's work dir and /tmp as tars, acquires `count`
  sandboxes at once and writes both tars into each (what it would do without fork).
After each, every copy's tree is checked against the source's (`sha256sum` of every
file, run in the sandbox; links and modes too), then all the copies are released. The
rounds alternate which goes first, so the engine's drift falls on both alike.

Targets (issue 32): fork of 50 MiB into 8 on 3 nodes all usable in <= 1.5 s (the
slowest round), every copy equal to the source, no container left. The by-hand way is
reported beside it as the ratio fork / by hand.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
import uuid
from pathlib import Path

from bench.burst import exit_status, render_targets, target, wait_warm
from bench.soak import Teardown, local_pool, run_to_report
from dsec.client import Client, Sandbox
from dsec.image import BASE_IMAGE
from dsec.launch.local import LocalPoolSpec
from dsec.models import Capacity, PoolParams, TemplateSpec
from dsec.processes import interrupt_on_termination
from dsec.tables import format_table

FORK_LIMIT_S = 1.5
NODES = 3
SMALL_FILES = 256  # of 4 KiB, beside the 1 MiB ones
TMP_KIB = 512
ACQUIRE_TIMEOUT_S = 120.0
# a tree's digest, taken in the sandbox: every file's sha256, then links and modes
TREE_DIGEST = (
    "cd {root} && find . -type f | sort | xargs -r sha256sum; "
    'find . -type l | sort | while read -r l; do echo "$l -> $(readlink "$l")"; done; '
    "find . | sort | xargs -r stat -c '%n %a %s'"
)


def pool_spec(count: int, mib: int) -> LocalPoolSpec:
    """Nodes with room for a little more than the copies: the warm pool, which holds two
    rounds' copies, is then on all three nodes, and the copies spread over them."""
    slots = (2 * count + 2) // (NODES - 1)
    workdir_mb = 2 * mib + 64
    return LocalPoolSpec(
        name=f"bench-fork-{uuid.uuid4().hex[:6]}",
        nodes=NODES,
        port=0,
        capacity=Capacity(cpus=64, memory_mb=slots * (512 + workdir_mb + 64), slots=slots),
        pool=PoolParams(min_warm=count + 1, max_warm=2 * count + 2),
        templates={"base": TemplateSpec(name="base", image=BASE_IMAGE, workdir_mb=workdir_mb)},
        state_dir=Path(tempfile.mkdtemp()),
    )


async def out(sb: Sandbox, script: str) -> str:
    result = await sb.exec(["sh", "-c", script], timeout=300, max_output_bytes=16 << 20)
    if result.exit_code != 0:
        raise RuntimeError(f"{script[:60]}: exit {result.exit_code}: {result.stderr[:300]}")
    return result.stdout


async def fill(sb: Sandbox, mib: int) -> None:
    big = mib - SMALL_FILES * 4 // 1024
    await out(
        sb,
        f"mkdir -p /work/repo/src /work/repo/data /tmp/cache && cd /work/repo && "
        f"for i in $(seq 1 {big}); do head -c 1048576 /dev/urandom > data/blob$i.bin; done && "
        f"for i in $(seq 1 {SMALL_FILES}); do head -c 4096 /dev/urandom > src/m$i.py; done && "
        "ln -s data/blob1.bin first && chmod 600 src/m1.py && "
        f"head -c {TMP_KIB * 1024} /dev/urandom > /tmp/cache/blob",
    )


async def tree(sb: Sandbox) -> tuple[str, str]:
    return (
        await out(sb, TREE_DIGEST.format(root="/work")),
        await out(sb, TREE_DIGEST.format(root="/tmp")),
    )


async def by_fork(source: Sandbox, count: int, snapshot_s: list[float]) -> list[Sandbox]:
    """`source.fork(count)`, with the time its node took to copy it noted."""
    forked = await source.client.fork(
        source.id, source.lease.lease_token, count, timeout=ACQUIRE_TIMEOUT_S
    )
    snapshot_s.append(forked.snapshot_ms / 1000)
    return [Sandbox(source.client, lease) for lease in forked.leases]


async def by_hand(client: Client, source: Sandbox, count: int) -> list[Sandbox]:
    work, tmp = await asyncio.gather(source.files.read_tar("/work"), source.files.read_tar("/tmp"))
    copies = list(
        await asyncio.gather(*(client.acquire(timeout=ACQUIRE_TIMEOUT_S) for _ in range(count)))
    )

    async def copy(sb: Sandbox) -> None:
        await sb.files.write_tar("/work", work)
        await sb.files.write_tar("/tmp", tmp)

    await asyncio.gather(*(copy(sb) for sb in copies))
    return copies


async def run(args: argparse.Namespace) -> dict:
    teardown = Teardown()
    seconds: dict[str, list[float]] = {"fork": [], "by hand": [], "fork's copy on its node": []}
    nodes: list[int] = []
    wrong: list[str] = []
    size = 0
    async with local_pool(pool_spec(args.count, args.mib), teardown) as pool:
        async with Client(pool.url, token=pool.tokens.client) as client:
            await wait_warm(client, "default", args.count + 1)
            async with client.sandbox(timeout=ACQUIRE_TIMEOUT_S) as source:
                await fill(source, args.mib)
                expected = await tree(source)
                size = int(await out(source, "du -sk /work /tmp | awk '{s+=$1} END {print s}'"))
                for r in range(args.rounds):
                    order = ["fork", "by hand"] if r % 2 == 0 else ["by hand", "fork"]
                    for way in order:
                        await wait_warm(client, "default", args.count)
                        started = time.perf_counter()
                        if way == "fork":
                            copies = await by_fork(
                                source, args.count, seconds["fork's copy on its node"]
                            )
                        else:
                            copies = await by_hand(client, source, args.count)
                        seconds[way].append(time.perf_counter() - started)
                        if way == "fork":
                            nodes.append(len({sb.node for sb in copies}))
                        trees = await asyncio.gather(*(tree(sb) for sb in copies))
                        pairs = zip(copies, trees, strict=True)
                        wrong += [f"{way} round {r}: {sb.id}" for sb, t in pairs if t != expected]
                        await asyncio.gather(*(sb.release() for sb in copies))
    report: dict = {
        "mib": args.mib, "count": args.count, "rounds": args.rounds, "nodes": NODES,
        "tree_kib": size, "seconds": {k: [round(s, 3) for s in v] for k, v in seconds.items()},
        "fork_nodes": nodes, "wrong_copies": wrong, "containers_left": teardown.left,
    }  # fmt: skip
    report["targets"] = targets(report)
    return report


def targets(r: dict) -> list[dict]:
    fork, hand = r["seconds"]["fork"], r["seconds"]["by hand"]
    slowest = max(fork) if fork else None
    ratio = round(sum(fork) / sum(hand), 3) if fork and hand and sum(hand) else None
    return [
        target(f"fork of {r['mib']} MiB into {r['count']}: slowest round, s", slowest,
               FORK_LIMIT_S),
        target("copies unlike their source", len(r["wrong_copies"]), 0),
        target("fork / by hand, mean s", ratio, 1.0),
        target("containers left", r["containers_left"], 0),
    ]  # fmt: skip


def render(r: dict) -> str:
    rows = [
        [way, len(s), min(s), round(sum(s) / len(s), 3), max(s)]
        for way, s in r["seconds"].items()
        if s
    ]
    lines = [
        f"{r['count']} copies of a {r['tree_kib']} KiB work dir and /tmp, {r['rounds']} rounds "
        f"alternating; forks landed on {r['fork_nodes']} nodes of {r['nodes']}",
        format_table(["way", "rounds", "min s", "mean s", "max s"], rows),
        *[f"unlike its source: {w}" for w in r["wrong_copies"][:5]],
        "",
        *render_targets(r["targets"]),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=50, help="the work dir's size")
    parser.add_argument("--count", type=int, default=8, help="copies per fork")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if not 2 <= args.mib <= 1024 or not 1 <= args.count <= 64 or args.rounds < 1:
        print("fork: --mib 2..1024, --count 1..64, --rounds >= 1", file=sys.stderr)
        return 2
    return exit_status(run_to_report("fork", run(args), render, args.json))


if __name__ == "__main__":
    interrupt_on_termination()  # the pool it starts is stopped on SIGTERM, SIGHUP
    sys.exit(main())
