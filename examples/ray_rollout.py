"""An RL rollout loop on Ray with sandboxes from a dsec pool.

Rollout workers are Ray actors, as in verl, OpenRLHF or SkyRL. Each episode acquires a
sandbox, runs the agent's tool calls in it one step at a time, scores the result and
releases the sandbox, also when a step fails. The "policy" here is a stand-in: each step
appends to a file the next number of a sequence, and the reward is whether the file
holds the whole sequence at the end. A trainer would send its model's tool calls and
score them its own way.

    dsec ray up &                 # or dsec up: any pool will do
    source ~/.dsec/ray/env        # DSEC_URL and DSEC_TOKEN
    python examples/ray_rollout.py --address auto --workers 4 --episodes 16

It prints one JSON line: the episodes, their mean reward, the tool calls made, and the
nodes whose sandboxes served them.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import ray

from dsec.sync_client import SyncClient


@ray.remote(num_cpus=0.25)
class RolloutWorker:
    """One rollout worker: a client of the pool, which it keeps for all its episodes."""

    def __init__(self, url: str, token: str) -> None:
        self.client = SyncClient(url, token)

    def rollout(self, episode: int, steps: int) -> dict:
        started = time.monotonic()
        with self.client.sandbox(timeout=60) as sb:
            for step in range(1, steps + 1):  # the tool calls, one at a time
                result = sb.exec(["sh", "-c", f"echo {episode * step} >> /work/answer"])
                if result.exit_code != 0:
                    break
            answer = sb.exec(["cat", "/work/answer"]).stdout.split()
            node = sb.node
        expected = [str(episode * step) for step in range(1, steps + 1)]
        return {
            "episode": episode,
            "node": node,
            "tool_calls": steps + 1,
            "reward": 1.0 if answer == expected else 0.0,
            "seconds": time.monotonic() - started,
        }

    def close(self) -> None:
        self.client.close()


def rollouts(url: str, token: str, workers: int, episodes: int, steps: int) -> dict:
    """`episodes` episodes over `workers` rollout workers; what they came to."""
    pool = [RolloutWorker.remote(url, token) for _ in range(workers)]
    try:
        results = ray.get(
            [pool[i % workers].rollout.remote(i, steps) for i in range(1, episodes + 1)]
        )
    finally:
        ray.get([w.close.remote() for w in pool])
    return {
        "episodes": len(results),
        "mean_reward": sum(r["reward"] for r in results) / len(results),
        "tool_calls": sum(r["tool_calls"] for r in results),
        "nodes": sorted({r["node"] for r in results}),
        "mean_episode_s": sum(r["seconds"] for r in results) / len(results),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default="auto", help="the Ray cluster (ray.init's)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3, help="tool calls per episode")
    args = parser.parse_args()
    url, token = os.environ.get("DSEC_URL"), os.environ.get("DSEC_TOKEN")
    if not url or not token:
        parser.error("set DSEC_URL and DSEC_TOKEN (source the env file `dsec ray up` wrote)")
    ray.init(address=args.address, log_to_driver=False)
    try:
        print(json.dumps(rollouts(url, token, args.workers, args.episodes, args.steps)))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
