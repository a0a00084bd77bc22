"""`dsec serve fusion`: SandboxFusion's API (`POST /run_code`) on a running pool
(dsec/integrations/fusion.py; docs/integrations.md)."""

from __future__ import annotations

import argparse
import asyncio
import sys

import aiohttp

from dsec.cli.common import env_token
from dsec.cli.remote import CLIENT_TOKENS, add_connection_args
from dsec.client import Client, DsecError


def cmd_serve_fusion(args: argparse.Namespace) -> int:
    from dsec.clock import SystemClock
    from dsec.httpkit import serve, stop_on_signals
    from dsec.integrations.fusion import FusionSettings, create_fusion_app

    settings = FusionSettings(
        template=args.template,
        pool=args.pool,
        concurrency=args.concurrency,
        max_code_bytes=args.max_code_kb * 1024,
        max_request_bytes=args.max_request_mb << 20,
        acquire_timeout_s=args.acquire_timeout,
    )
    client = Client(args.url, args.token or env_token(*CLIENT_TOKENS), ca=args.ca)

    async def main() -> int:
        async with client:
            try:
                await client.template(settings.template)  # a name the pool has, or say so now
            except DsecError as e:
                print(f"dsec serve fusion: {e.message} ({e.status} {e.code})", file=sys.stderr)
                return 1
            except (aiohttp.ClientError, TimeoutError) as e:
                why = str(e) or type(e).__name__
                print(f"dsec serve fusion: no answer from {client.url}: {why}", file=sys.stderr)
                return 1
            app = create_fusion_app(client, settings, SystemClock())
            await serve(app, args.host, args.port, stop_on_signals())
            return 0

    return asyncio.run(main())


def _positive(kind: type) -> object:
    def parse(text: str) -> object:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
        return value

    return parse


def register(sub: argparse._SubParsersAction) -> None:
    """Add `dsec serve fusion`."""
    serve = sub.add_parser("serve", help="serve another system's API on a running pool")
    kinds = serve.add_subparsers(dest="kind", required=True)
    fusion = kinds.add_parser(
        "fusion",
        help="SandboxFusion's POST /run_code, a sandbox of TEMPLATE per request",
        description="Answers SandboxFusion's run_code API (its sandbox-fusion client, verl's "
        "and SkyRL's code rewards) from the pool at --url: each request in a warm sandbox "
        "of its own, released after. It needs no token of its callers: listen where only "
        "they reach.",
    )
    fusion.add_argument("--template", required=True, help="the template requests run in")
    fusion.add_argument("--pool", default="default")
    fusion.add_argument("--host", default="127.0.0.1")
    fusion.add_argument("--port", type=int, default=8080)
    fusion.add_argument(
        "--concurrency",
        type=_positive(int),
        default=32,
        help="requests holding a sandbox at once; the rest wait in line (default 32)",
    )
    fusion.add_argument("--max-code-kb", type=_positive(int), default=1024)
    fusion.add_argument("--max-request-mb", type=_positive(int), default=64)
    fusion.add_argument(
        "--acquire-timeout", type=_positive(float), default=60.0, help="seconds (default 60)"
    )
    add_connection_args(fusion)
    fusion.set_defaults(run=cmd_serve_fusion)
