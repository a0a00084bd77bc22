"""`dsec node drain ID` and `dsec node undrain ID`: take a node out of service before it
goes (no new sandboxes, its idle ones removed, its leases run to their end), or put it
back."""

from __future__ import annotations

import argparse
import asyncio
import time

from dsec.cli.common import UsageError
from dsec.cli.remote import ADMIN_TOKENS, add_connection_args, run_remote
from dsec.client import Client, DsecError
from dsec.models import NodeInfo
from dsec.tables import format_table

WAIT_POLL_S = 0.5


def _show(info: NodeInfo, as_json: bool) -> None:
    if as_json:
        print(info.model_dump_json(), flush=True)
        return
    print(
        format_table(
            ["node", "drain", "placeable", "sandboxes", "url"],
            [[info.node_id, info.drain, info.placeable, info.sandboxes, info.url]],
        ),
        flush=True,
    )


async def _wait_drained(client: Client, info: NodeInfo, timeout_s: float) -> NodeInfo:
    """The node's info once it is drained (holds no sandbox), polled."""
    deadline = time.monotonic() + timeout_s
    while info.drain != "drained":
        if info.drain == "none":
            raise DsecError(409, "drain_called_off", f"the drain of {info.node_id} was called off")
        if time.monotonic() >= deadline:
            raise DsecError(
                408,
                "drain_timeout",
                f"{info.node_id} still holds {info.sandboxes} sandboxes after {timeout_s:g} s "
                "(leases run to their end; release them, or wait longer)",
            )
        await asyncio.sleep(WAIT_POLL_S)
        found = [n for n in (await client.nodes()).nodes if n.node_id == info.node_id]
        if not found:
            raise DsecError(404, "unknown_node", f"{info.node_id} left before it was drained")
        info = found[0]
    return info


def cmd_node_drain(args: argparse.Namespace) -> int:
    if args.timeout is not None and not args.wait:
        raise UsageError("--timeout goes with --wait")

    async def drain(client: Client) -> int:
        info = await client.drain_node(args.node_id)
        if args.wait:
            info = await _wait_drained(client, info, args.timeout or 3600.0)
        _show(info, args.json)
        return 0

    return run_remote(args, drain, token_vars=ADMIN_TOKENS)


def cmd_node_undrain(args: argparse.Namespace) -> int:
    async def undrain(client: Client) -> int:
        _show(await client.undrain_node(args.node_id), args.json)
        return 0

    return run_remote(args, undrain, token_vars=ADMIN_TOKENS)


def register(sub: argparse._SubParsersAction) -> None:
    """Add `dsec node drain` and `dsec node undrain`."""
    node = sub.add_parser("node", help="take a node out of service, or put it back")
    verbs = node.add_subparsers(dest="verb", required=True)
    drain = verbs.add_parser(
        "drain",
        help="no new sandboxes on the node, its idle ones removed, its leases run to their "
        "end (admin); then it may be stopped",
        description="Drain a node: the control plane places nothing more there, removes its "
        "idle sandboxes, and lets its leases run to their end. Once it holds no sandbox its "
        "drain reads `drained` (GET /v1/nodes, dsec_node_drained) and its agent may be "
        "stopped: a drained node that stops is forgotten, not reported down.",
    )
    drain.add_argument(
        "--wait", action="store_true", help="return once the node is drained, not at once"
    )
    drain.add_argument(
        "--timeout", type=float, help="with --wait: give up after this many seconds (exit 1)"
    )
    drain.set_defaults(run=cmd_node_drain)
    undrain = verbs.add_parser(
        "undrain", help="call a node's drain off: it takes new sandboxes again (admin)"
    )
    undrain.set_defaults(run=cmd_node_undrain)
    for parser in (drain, undrain):
        parser.add_argument("node_id", metavar="ID")
        parser.add_argument("--json", action="store_true")
        add_connection_args(parser)
        parser.set_defaults(prog=parser.prog)
