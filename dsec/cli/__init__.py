"""The `dsec` command line: up, ray up, controlplane, agent, status, plan, bench, serve.

This package is the top layer: it may import everything below it (the library, the
services in controlplane/ and agent/, the launchers in dsec/launch/, bench/), and
nothing imports it (tests/test_layers.py). One module per topic: `up` (a local pool),
`ray` (the pool on a Ray cluster), `services` (controlplane, agent, status), `sandbox`
(acquire, exec, shell, cp, release), `pool` (pool get, pool set), `template` (build,
list, show, add, rm), `node` (node drain, undrain), `plan`, `bench`, `serve` (serve
fusion); `common` holds what they share, `remote` what the commands that call a running
pool share.

The topic modules are imported when the parser is built, not with the package, and a
command line that names its command imports that command's topic alone: all of them
(the Docker SDK, agent/, controlplane/, bench/) took about a third of a `dsec exec`'s
start, paid on every call of a worker that runs its commands through the CLI.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import logging
import os
import sys

from dsec.cli.common import UsageError
from dsec.processes import interrupt_on_termination

__all__ = ["UsageError", "build_parser", "main"]

# Each command's topic module, in the order help lists them (tests/test_cli_sandbox.py checks
# this against what each topic registers).
TOPIC_OF = {
    "up": "up",
    "ray": "ray",
    "controlplane": "services",
    "agent": "services",
    "status": "services",
    "acquire": "sandbox",
    "exec": "sandbox",
    "shell": "sandbox",
    "cp": "sandbox",
    "release": "sandbox",
    "fork": "sandbox",
    "pool": "pool",
    "template": "template",
    "node": "node",
    "plan": "plan",
    "bench": "bench",
    "serve": "serve",
}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser of every command; of `argv`'s command alone where it names one."""
    parser = argparse.ArgumentParser(prog="dsec", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"dsec {_version()}")
    _add_own_options(parser)
    command = _command_in(argv) if argv is not None else None
    topics = [TOPIC_OF[command]] if command in TOPIC_OF else list(dict.fromkeys(TOPIC_OF.values()))
    sub = parser.add_subparsers(dest="command", required=True)
    for topic in topics:
        importlib.import_module(f"dsec.cli.{topic}").register(sub)
    return parser


def _version() -> str:
    """The installed distribution's version; a source tree that was never installed has none."""
    try:
        return importlib.metadata.version("dsec")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def _add_own_options(parser: argparse.ArgumentParser) -> None:
    """dsec's options before its command."""
    parser.add_argument("--log-level", default=os.environ.get("DSEC_LOG_LEVEL", "WARNING"))


def _command_in(argv: list[str]) -> str | None:
    """The command `argv` names: its first word past dsec's own options, read as the
    full parser reads them (help, and the error of a line it cannot read, are left to
    that parser)."""
    own = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    _add_own_options(own)
    try:
        _, rest = own.parse_known_args(argv)
    except argparse.ArgumentError:
        return None
    return rest[0] if rest and not rest[0].startswith("-") else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args, rest = parser.parse_known_args(argv)
    if rest:
        # argparse hands a positional that may be empty nothing once an option follows
        # the one before it (`template add NAME --image REF key=value`): a command that
        # takes key=value settings (`settings` in its defaults) gets them from the rest
        if not hasattr(args, "settings") or any(a.startswith("-") or "=" not in a for a in rest):
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        args.settings += rest
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    interrupt_on_termination()  # a pool this command starts is stopped on SIGTERM, SIGHUP
    try:
        return args.run(args)
    except UsageError as e:
        print(f"dsec {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
