"""Measure this machine's Docker and agent timings into a simulator profile.

    dsec bench calibrate [--samples 30] [--out profile.json]

Docker operations are timed through the agent's own driver (the same hardened
create, the same remove, pause, unpause, commit); exec and lease through a live
local pool (an exec of `true` via the agent; a warm acquire's server-side schedule
time, which is the lease call). Restore is a create plus unpacking a work dir.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
import uuid
from pathlib import Path

import docker

from agent.docker_driver import LABEL_NODE, DockerDriver
from bench.live_latency import _wait_warm
from bench.sim.profile import OPS, Profile
from dsec.client import Client
from dsec.image import BASE_IMAGE, ensure_base_image
from dsec.localpool import LocalPool, LocalPoolSpec
from dsec.models import Capacity, PoolParams, TemplateSpec


def _timed(fn, *args) -> float:
    started = time.perf_counter()
    fn(*args)
    return time.perf_counter() - started


def docker_samples(n: int) -> dict[str, list[float]]:
    client = docker.from_env()
    ensure_base_image(client)
    driver = DockerDriver(client)
    spec = TemplateSpec(name="base", image=BASE_IMAGE)
    node = f"calibrate-{uuid.uuid4().hex[:6]}"
    samples: dict[str, list[float]] = {op: [] for op in ("create", "remove", "pause", "unpause",
                                                         "commit")}  # fmt: skip
    ids: list[str] = []
    try:
        for i in range(n):
            started = time.perf_counter()
            ids.append(driver.create(f"{node}-{i}", spec, {LABEL_NODE: node}))
            samples["create"].append(time.perf_counter() - started)
        for cid in ids:
            samples["pause"].append(_timed(driver.pause, cid))
            samples["unpause"].append(_timed(driver.unpause, cid))
        for i, cid in enumerate(ids[: max(3, n // 3)]):
            started = time.perf_counter()
            ref = driver.commit(cid, "dsec-calibrate", f"{node}-{i}")
            samples["commit"].append(time.perf_counter() - started)
            driver.remove_image(ref)
    finally:
        for cid in ids:
            samples["remove"].append(_timed(driver.remove, cid))
    return samples


async def pool_samples(n: int) -> dict[str, list[float]]:
    spec = LocalPoolSpec(
        name=f"calibrate-{uuid.uuid4().hex[:6]}", nodes=1, port=0,
        capacity=Capacity(cpus=64, memory_mb=65536, slots=64),
        pool=PoolParams(min_warm=0, templates=[]), state_dir=Path(tempfile.mkdtemp()),
    )  # fmt: skip
    pool = LocalPool(spec)
    await pool.start()
    samples: dict[str, list[float]] = {"exec": [], "lease": []}
    try:
        async with (
            Client(pool.url, token=pool.tokens.admin) as operator,
            Client(pool.url, token=pool.tokens.client) as client,
        ):
            await operator.set_pool("calibrate", PoolParams(min_warm=10, templates=["base"]))
            while len(samples["lease"]) < n:
                await _wait_warm(client, "calibrate", 10)
                held = [await client.acquire(pool="calibrate") for _ in range(10)]
                samples["lease"] += [sb.lease.schedule_ms / 1000 for sb in held]
                await asyncio.gather(*(sb.release() for sb in held))
            async with client.sandbox(pool="calibrate") as sb:
                for _ in range(n):
                    started = time.perf_counter()
                    await sb.exec(["true"])
                    samples["exec"].append(time.perf_counter() - started)
            await operator.set_pool("calibrate", PoolParams(min_warm=0, templates=[]))
    finally:
        await pool.stop()
    return samples


def calibrate(n: int) -> Profile:
    samples = docker_samples(n)
    samples.update(asyncio.run(pool_samples(n)))
    # a restore is a create plus unpacking the work dir through an exec
    samples["restore"] = [c + e for c, e in zip(samples["create"], samples["exec"], strict=False)]
    assert set(samples) == set(OPS)
    return Profile(samples, source=f"calibrated here, {n} samples per operation")


def add_calibrate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--out", type=Path, default=Path("profile.json"))


def run_calibrate(args: argparse.Namespace) -> int:
    if not 5 <= args.samples <= 1000:
        print("dsec bench calibrate: --samples must be between 5 and 1000", file=sys.stderr)
        return 2
    profile = calibrate(args.samples)
    profile.save(args.out)
    for op in OPS:
        s = sorted(profile.samples[op])
        print(f"{op:8} median {s[len(s) // 2] * 1000:8.1f} ms   max {s[-1] * 1000:8.1f} ms")
    print(f"profile written to {args.out}")
    return 0
