"""The `dsec` command line: up, ray up, controlplane, agent, status, plan, bench.

This package is the command-line layer, the only part of dsec/ that may import the
services above the library (controlplane/, agent/, bench/); the rest of dsec/ imports
none of them. One module per topic: `up` (a local pool, LocalPool), `ray` (the pool
on a Ray cluster, RayPool), `services`
(controlplane, agent, status), `sandbox` (acquire, exec, shell, cp, release), `pool`
(pool get, pool set), `node` (node drain, undrain), `plan`, `bench`; `common` holds what
they share, `remote` what the commands that call a running pool share.

The topic modules are imported when the parser is built, not with the package: bench/
starts pools with dsec.cli.up, and a package that imported bench/ on its way in would
make that a circular import.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from dsec.cli.common import UsageError, format_table

__all__ = ["UsageError", "build_parser", "format_table", "main"]


def build_parser() -> argparse.ArgumentParser:
    from dsec.cli import bench, node, plan, pool, ray, sandbox, services, up

    parser = argparse.ArgumentParser(prog="dsec", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default=os.environ.get("DSEC_LOG_LEVEL", "WARNING"))
    sub = parser.add_subparsers(dest="command", required=True)
    for topic in (up, ray, services, sandbox, pool, node, plan, bench):
        topic.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    try:
        return args.run(args)
    except UsageError as e:
        print(f"dsec {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
