"""`dsec template list | show NAME | add NAME --image REF [key=value...] | rm NAME`: the
pool's templates, changed live (`/v1/templates`, admin for add and rm); and `dsec
template build NAME (--debian SUITE --packages a,b [--pip x,y] | --dockerfile PATH |
--image REF)`, which makes a template's image on this machine's engine
(dsec/template_build.py)."""

from __future__ import annotations

import argparse
import json
import re
import sys

from dsec.cli.common import settings_table, state_counts
from dsec.cli.pool import parse_assignment
from dsec.cli.remote import ADMIN_TOKENS, add_connection_args, run_remote
from dsec.client import Client
from dsec.models import NAME_PATTERN, TemplateFields, TemplateInfo
from dsec.tables import format_table


def _show(info: TemplateInfo, as_json: bool) -> None:
    if as_json:
        print(info.model_dump_json())
        return
    print(settings_table(info.spec, "setting"))
    nodes = ", ".join(info.nodes_with_image) or "none"
    sent = "; the control plane sends it to the others" if info.distributable else ""
    print(
        f"\ntemplate {info.name}: kept warm by {', '.join(info.pools) or 'no pool'}; "
        f"image on {nodes}{sent}; sandboxes: {state_counts(info.sandboxes)}"
    )


def cmd_template_list(args: argparse.Namespace) -> int:
    async def listed(client: Client) -> int:
        infos = await client.templates()
        if args.json:
            print(json.dumps([i.model_dump(mode="json") for i in infos]))
            return 0
        rows = [
            [
                i.name,
                i.spec.image,
                ",".join(i.pools) or "-",
                len(i.nodes_with_image),
                state_counts(i.sandboxes),
            ]
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


def cmd_template_build(args: argparse.Namespace) -> int:
    from dsec.template_build import TemplateBuildError, build_template

    def words(text: str | None) -> list[str]:
        return [w for w in (text or "").split(",") if w]

    try:
        built = build_template(
            args.name,
            debian=args.debian,
            packages=words(args.packages),
            pip=words(args.pip),
            dockerfile=args.dockerfile,
            image=args.image,
            progress=True,
        )
    except TemplateBuildError as e:
        print(f"dsec template build: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(built.as_dict()))
    else:
        how = "cached" if built.cached else f"built in {built.seconds:.1f} s"
        print(f"{built.image} ({built.tag_latest}), {built.size_mb:.0f} MB, {how}")
        print(f"add it: dsec template add {args.name} --image {built.image}")
    return 0


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
    build = verbs.add_parser(
        "build",
        help="make a template's image on this machine's engine, tagged NAME:<content hash> "
        "and NAME:latest (the same inputs: a cache hit)",
    )
    build.add_argument("name", type=_name)
    source = build.add_mutually_exclusive_group(required=True)
    source.add_argument("--debian", metavar="SUITE", help="a root file system from Debian")
    source.add_argument("--dockerfile", metavar="PATH", help="built by the engine, no network")
    source.add_argument("--image", metavar="REF", help="an image the engine has, as it is")
    build.add_argument("--packages", metavar="a,b", help="Debian packages (with --debian)")
    build.add_argument("--pip", metavar="x,y", help="pip packages from the host's index")
    build.add_argument("--json", action="store_true")
    build.set_defaults(run=cmd_template_build)


def _name(text: str) -> str:
    if not re.match(NAME_PATTERN, text):
        raise argparse.ArgumentTypeError(f"not a template name (a-z, 0-9, -): {text!r}")
    return text
