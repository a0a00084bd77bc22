"""What the commands that talk to a running pool share: where it is, which credential
they use, and a refusal or an unreachable pool as one line on stderr, not a traceback."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import Awaitable, Callable

import aiohttp
from pydantic import ValidationError

from dsec.cli.common import UsageError, describe, env_token
from dsec.client import Client, DsecError

CLIENT_TOKENS = ("DSEC_TOKEN", "DSEC_ADMIN_TOKEN")
ADMIN_TOKENS = ("DSEC_ADMIN_TOKEN", "DSEC_TOKEN")


def add_connection_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", help="control plane URL (default $DSEC_URL)")
    parser.add_argument("--token", help="credential (default from the environment)")
    parser.add_argument("--ca", help="CA bundle of an https pool (default $DSEC_CA)")


def run_remote(
    args: argparse.Namespace,
    main: Callable[[Client], Awaitable[int]],
    *,
    token_vars: tuple[str, ...] = CLIENT_TOKENS,
    failure_status: int = 1,
) -> int:
    """Run `main` with a Client of the pool named by --url/--token or the environment.
    A refusal (DsecError) or an unreachable pool exits with `failure_status`."""
    client = Client(args.url, args.token or env_token(*token_vars), ca=args.ca)

    async def with_client() -> int:
        async with client:
            return await main(client)

    try:
        return asyncio.run(with_client())
    except DsecError as e:
        details = "".join(f"; {d.get('loc') or 'value'}: {d.get('msg')}" for d in e.details or [])
        print(f"{args.prog}: {e.message}{details} ({e.status} {e.code})", file=sys.stderr)
    except ValidationError as e:
        raise UsageError(describe(e)) from e
    except (aiohttp.ClientError, TimeoutError) as e:
        why = str(e) or type(e).__name__
        print(f"{args.prog}: no answer from {client.url}: {why}", file=sys.stderr)
    except BrokenPipeError:  # our reader left (`| head`): stop quietly, as cat does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing to flush
        return 128 + signal.SIGPIPE
    except OSError as e:  # a local file: cp's source or destination
        print(f"{args.prog}: {e}", file=sys.stderr)
    return failure_status
