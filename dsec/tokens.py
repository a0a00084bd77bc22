"""Credentials: bearer tokens and the per-lease exec token.

A lease token is an HMAC of (sandbox id, lease id) under the cluster's agent secret,
which the control plane and the agents share. The agent checks it against the lease
it holds for that sandbox, so it needs no call to the control plane, a token is
useless on any other sandbox, and it dies with the lease on release.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets


def new_token() -> str:
    return secrets.token_urlsafe(32)


def new_lease_id() -> str:
    return secrets.token_hex(16)


def lease_token(secret: str, sandbox_id: str, lease_id: str) -> str:
    mac = hmac.new(secret.encode(), f"{sandbox_id}:{lease_id}".encode(), hashlib.sha256)
    return mac.hexdigest()


def client_id(token: str) -> str:
    """Who a bearer token speaks for, without keeping the token: leases and idempotency
    keys belong to it, so one client never sees or reaches another's."""
    return hashlib.sha256(token.encode()).hexdigest()[:16]


LEASE_TOKEN_HEADER = "X-Dsec-Lease-Token"  # proves a release comes from the lease holder
