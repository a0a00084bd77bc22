"""`dsec up`: the local pool (dsec/launch/local.py) from the command line.

It starts the pool, prints where things are and runs until Ctrl-C, SIGTERM or SIGHUP,
which stop the agents (removing their sandboxes), then the control plane, then sweep
Docker for any container still labelled with one of its nodes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from controlplane.config import ClientQuota, ClientSpec
from dsec.cli.common import DASHBOARD_HINT, DEFAULT_STATE_DIR, UsageError, describe
from dsec.launch.local import LocalPool, LocalPoolError, LocalPoolSpec
from dsec.models import Capacity, Name, PoolParams, TemplateSpec
from dsec.tables import format_table

MAX_CLOUD_NODES = 200  # as the control plane's config allows

Spec = TypeVar("Spec", bound=LocalPoolSpec)


class UpConfig(BaseModel):
    """`dsec up --config FILE` (JSON): pools, templates and client quotas, as the control
    plane's config has them; the rest `dsec up` sets itself."""

    model_config = ConfigDict(extra="forbid")

    pools: dict[Name, PoolParams] = Field(default_factory=dict)
    templates: dict[Name, TemplateSpec] = Field(default_factory=dict)
    clients: list[ClientSpec] = Field(default_factory=list)
    default_quota: ClientQuota = Field(default_factory=ClientQuota)


def up_spec(args: argparse.Namespace) -> LocalPoolSpec:
    if not 1 <= args.nodes <= 250:
        raise UsageError(f"--nodes must be between 1 and 250, got {args.nodes}")
    return pool_spec(LocalPoolSpec, args, nodes=args.nodes, tls=args.tls)


def pool_spec(spec_type: type[Spec], args: argparse.Namespace, **fields: Any) -> Spec:
    """A pool's spec from the flags `dsec up` and `dsec ray up` share (pool_flags), its
    config file (--config) and `fields`."""
    spec = spec_type(**pool_fields(args), **fields)
    if args.config is not None:
        _apply_config_file(spec, args.config)
    return spec


def pool_fields(args: argparse.Namespace) -> dict:
    """The spec's fields from the flags `dsec up` and `dsec ray up` share (pool_flags)."""
    if not 0 <= args.cloud_nodes <= MAX_CLOUD_NODES:
        raise UsageError(
            f"--cloud-nodes must be between 0 and {MAX_CLOUD_NODES}, got {args.cloud_nodes}"
        )
    try:
        capacity = Capacity(
            cpus=args.cpus_per_node, memory_mb=args.memory_mb_per_node, slots=args.slots_per_node
        )
        params = PoolParams(min_warm=args.min_warm, max_warm=max(args.min_warm, 64))
    except ValidationError as e:
        raise UsageError(describe(e)) from e
    return dict(
        name=args.name,
        port=args.port,
        capacity=capacity,
        pool=params,
        state_dir=args.state_dir,
        metrics_token=not args.open_metrics,
        cloud_nodes=args.cloud_nodes,
        python_template=args.with_python,
    )


def cmd_up(args: argparse.Namespace) -> int:
    return run_pool(LocalPool(up_spec(args)), args.json, "dsec up")


def run_pool(pool: LocalPool, as_json: bool, prog: str) -> int:
    """Start `pool`, print where things are, and run it until a signal or a child's exit."""
    from dsec.httpkit import stop_on_signals

    async def main() -> int:
        stop = stop_on_signals()
        if pool.spec.python_template:
            print(f"{prog}: the python template: a build the first time (about a minute), "
                  "a cache hit after", file=sys.stderr)  # fmt: skip
        try:
            async with pool:
                summary = pool.summary()
                if as_json:
                    print(json.dumps(summary), flush=True)
                else:
                    _print_summary(summary)
                why = await pool.wait(stop)
        except LocalPoolError as e:  # raised by the start only
            print(f"{prog}: {e}", file=sys.stderr)
            return 1
        print(f"{prog}: {why}; stopped (swept {pool.swept} leftover containers)", file=sys.stderr)
        for failure in pool.sweep_failures:
            print(f"{prog}: {failure}", file=sys.stderr)
        return 0 if why == "stopped" and not pool.sweep_failures else 1

    return asyncio.run(main())


def _apply_config_file(spec: LocalPoolSpec, path: Path) -> None:
    try:
        config = UpConfig.model_validate_json(path.read_bytes())
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror}") from e
    except ValidationError as e:
        raise UsageError(f"{path}: {describe(e)}") from e
    spec.pool = config.pools.pop("default", spec.pool)
    spec.more_pools = config.pools
    spec.templates = {**spec.templates, **config.templates}
    spec.clients, spec.default_quota = config.clients, config.default_quota


def _print_summary(summary: dict) -> None:
    print(f"control plane  {summary['url']}")
    if summary.get("ray"):
        print(f"ray cluster    {summary['ray']}")
    print(format_table(["node", "url"], [[n["node_id"], n["url"]] for n in summary["nodes"]]))
    if summary["cloud_nodes"]:
        print(f"cloud nodes    up to {summary['cloud_nodes']}, started when local passes 80%")
    templates = ", ".join(f"{name} ({image})" for name, image in summary["templates"].items())
    print(f"templates      {templates}")
    print(f"metrics        {summary['metrics']}")
    print(f"prometheus sd  {summary['service_discovery']}")
    if summary["metrics_token_file"]:
        print(f"metrics token  {summary['metrics_token_file']} (Prometheus: credentials_file)")
    if summary["prometheus_config"]:
        print(f"prometheus     prometheus --config.file={summary['prometheus_config']}")
    print(f"dashboard      {DASHBOARD_HINT}")
    if summary["ca"]:
        print(f"CA             {summary['ca']} (DSEC_CA; in the env file)")
    print(f"credentials    source {summary['env_file']}")
    print("Ctrl-C stops the pool and removes every sandbox it made.", flush=True)


def register(sub: argparse._SubParsersAction) -> None:
    """Add `dsec up`."""
    up = sub.add_parser("up", help="run a local multi-node pool until Ctrl-C")
    up.add_argument("--nodes", type=int, default=3)
    pool_flags(
        up,
        name="dsec",
        cloud_help="cloud nodes (agents on 127.0.1.x) the pool may start when local nodes "
        "pass 80%% utilisation",
    )
    up.add_argument(
        "--tls",
        action="store_true",
        help="every service on HTTPS, with a CA made for this pool (DSEC_CA in the env file)",
    )
    up.set_defaults(run=cmd_up)


def pool_flags(parser: argparse.ArgumentParser, name: str, cloud_help: str) -> None:
    """The flags of a pool's control plane and nodes: `dsec up`'s and `dsec ray up`'s."""
    parser.add_argument("--name", default=name, help="prefix of the node ids; one per pool")
    parser.add_argument("--port", type=int, default=8700, help="control plane port (0: any)")
    parser.add_argument("--slots-per-node", type=int, default=64)
    parser.add_argument("--cpus-per-node", type=float, default=16)
    parser.add_argument("--memory-mb-per-node", type=int, default=65536)
    parser.add_argument("--min-warm", type=int, default=4, help="warm sandboxes in pool 'default'")
    parser.add_argument("--cloud-nodes", type=int, default=0, help=cloud_help)
    parser.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR)
    parser.add_argument(
        "--config",
        type=Path,
        help="a JSON file of pools, templates and client quotas (docs/operations.md)",
    )
    metrics = parser.add_mutually_exclusive_group()
    metrics.add_argument(
        "--metrics-token",
        action="store_true",
        help="the default: /metrics and discovery need a metrics token, $DSEC_METRICS_TOKEN "
        "or a new one (then in the env file and <state-dir>/<name>/metrics-token)",
    )
    metrics.add_argument(
        "--open-metrics",
        action="store_true",
        help="/metrics and discovery open to anyone who can connect, unless "
        "$DSEC_METRICS_TOKEN is set",
    )
    parser.add_argument(
        "--with-python",
        action="store_true",
        help="build (about a minute the first time, then a cache hit) and add a template "
        "'python': python3, pytest, pip, venv, git, build-essential, from Debian's packages",
    )
    parser.add_argument("--json", action="store_true", help="print where things are as JSON")
