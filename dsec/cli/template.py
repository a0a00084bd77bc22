"""`dsec template list | show NAME | add NAME --image REF [key=value...] | rm NAME`: the
pool's templates, changed live (`/v1/templates`, admin for add and rm), and `dsec
template build` (dsec/cli/template_build.py), which makes a template's image."""

from __future__ import annotations

import argparse
import json

from dsec.cli.common import format_table
from dsec.cli.pool import parse_assignment
from dsec.cli.remote import ADMIN_TOKENS, add_connection_args, run_remote
from dsec.client import Client
from dsec.models import TemplateFields, TemplateInfo


def _counts(info: TemplateInfo) -> str:
    return ", ".join(f"{n} {state}" for state, n in sorted(info.sandboxes.items())) or "none"


def _show(info: TemplateInfo, as_json: bool) -> None:
    if as_json:
        print(info.model_dump_json())
        return
    rows = [[key, json.dumps(value)] for key, value in info.spec.model_dump().items()]
    print(format_table(["setting", "value"], rows))
    nodes = ", ".join(info.nodes_with_image) or "none"
    sent = "; the control plane sends it to the others" if info.distributable else ""
    print(
        f"\ntemplate {info.name}: kept warm by {', '.join(info.pools) or 'no pool'}; "
        f"image on {nodes}{sent}; sandboxes: {_counts(info)}"
    )


def cmd_template_list(args: argparse.Namespace) -> int:
    async def listed(client: Client) -> int:
        infos = await client.templates()
        if args.json:
            print(json.dumps([i.model_dump(mode="json") for i in infos]))
            return 0
        rows = [
            [i.name, i.spec.image, ",".join(i.pools) or "-", len(i.nodes_with_image), _counts(i)]
            for i in infos
        ]
        print(format_table(["template", "image", "pools", "nodes with image", "sandboxes"], rows))
        return 0

    return run_remote(args, listed)


def cmd_template_show(args: argparse.Namespace) -> int:
    async def show(client: Client) -> int:
        _show(await client.template(args.name), args.json)
        return 0

    return run_remote(args, show)


def cmd_template_add(args: argparse.Namespace) -> int:
    fields = {"image": args.image}
    fields |= dict(parse_assignment(a, TemplateFields, "template setting") for a in args.settings)

    async def put(client: Client) -> int:
        _show(await client.put_template(args.name, fields), args.json)
        return 0

    return run_remote(args, put, token_vars=ADMIN_TOKENS)


def cmd_template_rm(args: argparse.Namespace) -> int:
    async def remove(client: Client) -> int:
        removed = await client.delete_template(args.name)
        if args.json:
            print(removed.model_dump_json())
        else:
            print(
                f"template {removed.name} removed: {removed.sandboxes_removed} idle sandboxes "
                f"go, {removed.leases_left} leases run to their end"
            )
        return 0

    return run_remote(args, remove, token_vars=ADMIN_TOKENS)


def register(sub: argparse._SubParsersAction) -> None:
    """Add `dsec template` and its verbs."""
    template = sub.add_parser("template", help="build, list, add, change and remove templates")
    verbs = template.add_subparsers(dest="verb", required=True)
    listed = verbs.add_parser("list", help="every template, its image and where it is")
    listed.set_defaults(run=cmd_template_list)
    show = verbs.add_parser("show", help="one template's settings, pools, nodes and sandboxes")
    show.add_argument("name")
    show.set_defaults(run=cmd_template_show)
    add = verbs.add_parser(
        "add",
        help="add or replace a template live (admin): dsec template add py --image py:latest "
        'recyclable=true \'env={"PYTHONDONTWRITEBYTECODE": "1"}\'',
        description="Settings are TemplateSpec's fields; values are JSON where they parse as "
        "JSON, strings otherwise; those not given take their defaults. Replacing a template "
        "retires its old sandboxes: idle ones go, leases run to their end.",
    )
    add.add_argument("name")
    add.add_argument("--image", required=True, help="an image a node's engine holds")
    add.add_argument("settings", nargs="*", metavar="key=value")
    add.set_defaults(run=cmd_template_add)
    rm = verbs.add_parser(
        "rm", help="remove a template (admin): its idle sandboxes go, its leases run to their end"
    )
    rm.add_argument("name")
    rm.set_defaults(run=cmd_template_rm)
    for parser in (listed, show, add, rm):
        parser.add_argument("--json", action="store_true")
        add_connection_args(parser)
        parser.set_defaults(prog=parser.prog)
