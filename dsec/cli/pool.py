"""`dsec pool get NAME` and `dsec pool set NAME key=value...`: one pool's parameters,
read, or changed one by one (`PATCH /v1/pools/{name}`: the others keep their values)."""

from __future__ import annotations

import argparse
import json

from pydantic import BaseModel

from dsec.cli.common import UsageError, settings_table, state_counts
from dsec.cli.remote import ADMIN_TOKENS, add_connection_args, run_remote
from dsec.client import Client
from dsec.models import PoolInfo, PoolParams


def parse_assignment(
    text: str, fields: type[BaseModel] = PoolParams, what: str = "pool parameter"
) -> tuple[str, object]:
    """`key=value` naming one of `fields`' fields, the value read as JSON when it is JSON
    (8, 0.5, true, ["base"]) and as a string otherwise."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise UsageError(f"expected key=value, got {text!r}")
    if key not in fields.model_fields:
        known = ", ".join(fields.model_fields)
        raise UsageError(f"unknown {what} {key!r}; known: {known}")
    try:
        return key, json.loads(raw)
    except ValueError:
        return key, raw


def _show(info: PoolInfo, as_json: bool) -> None:
    if as_json:
        print(info.model_dump_json())
        return
    print(settings_table(info.params, "parameter"))
    counts = state_counts(info.sandboxes)
    print(f"\npool {info.name}: queue depth {info.queue_depth}; sandboxes: {counts}")


def cmd_pool_get(args: argparse.Namespace) -> int:
    async def get(client: Client) -> int:
        _show(await client.pool(args.name), args.json)
        return 0

    return run_remote(args, get)


def cmd_pool_set(args: argparse.Namespace) -> int:
    fields = dict(parse_assignment(a) for a in args.assignments)

    async def patch(client: Client) -> int:
        _show(await client.patch_pool(args.name, **fields), args.json)
        return 0

    return run_remote(args, patch, token_vars=ADMIN_TOKENS)


def register(sub: argparse._SubParsersAction) -> None:
    """Add `dsec pool get` and `dsec pool set`."""
    pool = sub.add_parser("pool", help="read or change a pool's parameters")
    verbs = pool.add_subparsers(dest="verb", required=True)
    get = verbs.add_parser("get", help="a pool's parameters, queue and sandboxes")
    get.add_argument("name")
    get.set_defaults(run=cmd_pool_get)
    put = verbs.add_parser(
        "set",
        help="change some parameters (admin): dsec pool set train min_warm=8 recycle=true",
        description="Only the parameters named change. Values are JSON where they parse "
        "as JSON (8, 0.5, true, '[\"base\"]'), strings otherwise. A bad value or pair "
        "changes nothing.",
    )
    put.add_argument("name")
    put.add_argument("assignments", nargs="+", metavar="key=value")
    put.set_defaults(run=cmd_pool_set)
    for parser in (get, put):
        parser.add_argument("--json", action="store_true")
        add_connection_args(parser)
        parser.set_defaults(prog=parser.prog)
