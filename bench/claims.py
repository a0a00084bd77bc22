"""Personalised warm claims against plain warm claims and against cold creates with the
same claim, in the same run, rounds alternating.

    python -m bench.claims [--claims 200] [--cold 20] [--concurrency 4] [--rounds 2]
                           [--template base|python] [--json]

A local 3-node pool (`bench.burst`'s) with two pools: `default` (recycled, 8 warm per
acquire at once) and `cold` (nothing kept warm: every acquire creates its sandbox).
Four kinds of acquire, each then released:
- plain: a warm claim with nothing of its own;
- personal: a warm claim with 20 environment variables and 1 MiB of files (16 files of
  64 KiB), the claim the target names;
- personal + setup: the same with a setup command too, that checks the last file is
  there (a process started in the sandbox before the answer);
- cold personal: the personal claim on the `cold` pool.
The latency of each is from the acquire's send to its answer (a usable sandbox, its
claim applied). Each personal claim's sandbox is checked (an env var, a file's bytes)
after its latency is taken. The rounds split each kind's acquires and rotate which goes
first, so the engine's drift over the run falls on all alike.

Targets (ratios within the run, issue 32): personal p99 <= 3x plain p99, personal p99
<= 0.2x cold personal p99, no error, no container left; personal + setup's ratio to the
plain claim is reported beside them, not judged. Exits 1 on a miss.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from bench.burst import (
    NODE_CAPACITY,
    NODES,
    exit_status,
    issue_spec,
    render_targets,
    target,
    wait_warm,
)
from bench.soak import Teardown, local_pool, run_to_report
from bench.stats import summary_ms
from dsec.client import Client, Sandbox
from dsec.models import PoolParams
from dsec.processes import interrupt_on_termination
from dsec.tables import format_table

PLAIN_RATIO = 3.0  # personal p99 <= this x plain p99
COLD_RATIO = 0.2  # personal p99 <= this x cold personal p99
ENV_VARS = 20
FILES, FILE_BYTES = 16, 64 * 1024  # 1 MiB in all
ACQUIRE_TIMEOUT_S = 120.0
KINDS = ("plain", "personal", "personal + setup", "cold personal")


def claim(i: int) -> dict:
    """Acquire i's env and files: distinct per acquire, so a check sees its own."""
    env = {f"TASK_VAR_{k}": f"{i}-{k}" for k in range(ENV_VARS)}
    files = {
        f"task/f{k:02}.bin": hashlib.sha256(f"{i}/{k}".encode()).digest() * (FILE_BYTES // 32)
        for k in range(FILES)
    }
    return {"env": env, "files": files}


def claim_with_setup(i: int) -> dict:
    """Acquire i's claim and a setup command that fails unless its last file is there."""
    return {**claim(i), "setup": ["test", "-s", f"/work/task/f{FILES - 1:02}.bin"]}


async def check(sb: Sandbox, i: int) -> str | None:
    """What is wrong with acquire i's sandbox, if anything."""
    asked = claim(i)
    seen = await sb.exec(["sh", "-c", f"echo $TASK_VAR_{ENV_VARS - 1}"], timeout=30)
    if seen.stdout != f"{asked['env'][f'TASK_VAR_{ENV_VARS - 1}']}\n":
        return f"env: {seen.stdout!r}"
    name = f"task/f{FILES - 1:02}.bin"
    if await sb.files.read(f"/work/{name}") != asked["files"][name]:
        return f"{name}: other bytes"
    return None


@dataclass
class Kind:
    latencies_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    paths: dict[str, int] = field(default_factory=dict)
    setup_ms: list[float] = field(default_factory=list)

    def figures(self) -> dict:
        return {
            "acquires": len(self.latencies_s),
            "errors": len(self.errors),
            "first_errors": self.errors[:5],
            "paths": self.paths,
            "latency_ms": summary_ms(self.latencies_s),
            "setup_ms": summary_ms([ms / 1000 for ms in self.setup_ms]),
        }


async def phase(
    into: Kind, first: int, count: int, concurrency: int, acquire: Callable[[int], Awaitable]
) -> None:
    slots = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with slots:
            sent = time.perf_counter()
            try:
                sb = await acquire(i)
            except Exception as e:  # noqa: BLE001 - every failure is a figure of the run
                into.errors.append(f"{i}: {type(e).__name__}: {e}"[:300])
                return
            into.latencies_s.append(time.perf_counter() - sent)
            lease = sb.lease
            into.paths[lease.path] = into.paths.get(lease.path, 0) + 1
            try:
                if lease.setup_ms is not None:
                    into.setup_ms.append(lease.setup_ms)
                    if wrong := await check(sb, i):
                        into.errors.append(f"{i}: {wrong}")
            finally:
                await sb.release()

    await asyncio.gather(*(one(i) for i in range(first, first + count)))


async def run(args: argparse.Namespace) -> dict:
    spec = issue_spec("claims")
    # the python template (dsec up --with-python's, built once then a cache hit): a real
    # image, whose cold create costs what an RL team's does
    spec.python_template = args.template == "python"
    # past what recycling gives back meanwhile: a plain claim's acquire and release take a
    # few ms, a reset ~100 ms, and a drained pool would measure the refill, not the claim
    warm = 8 * args.concurrency
    spec.pool = PoolParams(
        recycle=True, min_warm=warm, max_warm=2 * warm, templates=[args.template]
    )
    spec.more_pools = {"cold": PoolParams(min_warm=0, max_warm=0, warm_fraction=0)}
    teardown = Teardown()
    kinds = {kind: Kind() for kind in KINDS}
    async with local_pool(spec, teardown) as pool:
        async with Client(pool.url, token=pool.tokens.client) as client:
            await wait_warm(client, "default", warm)
            template, timeout = args.template, ACQUIRE_TIMEOUT_S
            how: dict[str, tuple[Callable[[int], Awaitable], int]] = {
                "plain": (lambda i: client.acquire("default", template, timeout=timeout),
                          args.claims),
                "personal": (
                    lambda i: client.acquire("default", template, timeout=timeout, **claim(i)),
                    args.claims,
                ),
                "personal + setup": (
                    lambda i: client.acquire(
                        "default", template, timeout=timeout, **claim_with_setup(i)
                    ),
                    args.claims,
                ),
                "cold personal": (
                    lambda i: client.acquire("cold", template, timeout=timeout, **claim(i)),
                    args.cold,
                ),
            }  # fmt: skip
            for r in range(args.rounds):
                order = KINDS[r % len(KINDS) :] + KINDS[: r % len(KINDS)]
                for kind in order:
                    acquire, total = how[kind]
                    share = total // args.rounds + (r < total % args.rounds)
                    await wait_warm(client, "default", warm)  # each kind starts on a full pool
                    await phase(kinds[kind], r * total, share, args.concurrency, acquire)
    report: dict = {
        "template": args.template,
        "concurrency": args.concurrency, "rounds": args.rounds, "nodes": NODES,
        "node_capacity": NODE_CAPACITY.model_dump(),
        "claim": {"env_vars": ENV_VARS, "files": FILES, "file_bytes": FILE_BYTES},
        "kinds": {kind: k.figures() for kind, k in kinds.items()},
        "containers_left": teardown.left,
    }  # fmt: skip
    report["targets"] = targets(report)
    if (setup_ratio := p99_ratio(report["kinds"], "personal + setup", "plain")) is not None:
        report["setup_vs_plain_p99"] = setup_ratio
    return report


def p99_ratio(kinds: dict, a: str, b: str) -> float | None:
    """Kind `a`'s p99 over kind `b`'s; None without both."""
    p99_a, p99_b = kinds[a]["latency_ms"]["p99"], kinds[b]["latency_ms"]["p99"]
    return round(p99_a / p99_b, 3) if p99_a is not None and p99_b else None


def targets(r: dict) -> list[dict]:
    kinds = r["kinds"]
    errors = sum(f["errors"] for f in kinds.values())
    note = f"{errors} errors" if errors else ""
    return [
        target("personal p99 vs plain warm p99", p99_ratio(kinds, "personal", "plain"), PLAIN_RATIO,
               note, not errors),
        target("personal p99 vs cold personal p99", p99_ratio(kinds, "personal", "cold personal"),
               COLD_RATIO, note, not errors),
        target("containers left", r["containers_left"], 0),
    ]  # fmt: skip


def render(r: dict) -> str:
    rows = []
    for kind, f in r["kinds"].items():
        ms, setup = f["latency_ms"], f["setup_ms"]
        paths = ", ".join(f"{p} {n}" for p, n in sorted(f["paths"].items()))
        rows.append([kind, f["acquires"], f["errors"], paths, ms["p50"], ms["p95"], ms["p99"],
                     setup["p50"], setup["p99"]])  # fmt: skip
    c = r["claim"]
    lines = [
        f"template {r['template']}: acquires, {r['concurrency']} at a time, {r['rounds']} "
        "rounds rotating; a personal "
        f"claim: {c['env_vars']} env vars, {c['files']} files of {c['file_bytes']} bytes, "
        "(and a setup command, for personal + setup)",
        format_table(
            [
                "kind",
                "acquires",
                "errors",
                "paths",
                "p50 ms",
                "p95 ms",
                "p99 ms",
                "setup p50",
                "setup p99",
            ],
            rows,
        ),  # fmt: skip
    ]
    for kind, f in r["kinds"].items():
        lines += [f"{kind} error: {e}" for e in f["first_errors"]]
    if "setup_vs_plain_p99" in r:
        lines.append(f"personal + setup p99 / plain p99: {r['setup_vs_plain_p99']} (not judged)")
    return "\n".join([*lines, "", *render_targets(r["targets"])])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--claims", type=int, default=200, help="of each warm kind")
    parser.add_argument("--cold", type=int, default=20, help="cold personal claims")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--template",
        choices=("base", "python"),
        default="base",
        help="base (busybox, created in ~0.25 s here) or python (dsec up --with-python's)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    room = NODES * NODE_CAPACITY.slots // 16  # the warm pool is at most 16x the concurrency
    if min(args.claims, args.cold, args.rounds) < 1 or not 1 <= args.concurrency <= room:
        print(
            f"claims: --claims, --cold and --rounds must be >= 1, --concurrency 1..{room}",
            file=sys.stderr,
        )
        return 2
    return exit_status(run_to_report("claims", run(args), render, args.json))


if __name__ == "__main__":
    interrupt_on_termination()  # the pool it starts is stopped on SIGTERM, SIGHUP
    sys.exit(main())
