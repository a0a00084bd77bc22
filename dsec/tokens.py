"""Credentials: bearer tokens, the keys derived per node, and the per-lease exec token.

Every node credential is derived from the control plane's key (controlplane/identities.py
says which and why) with `derive`, HKDF-SHA256 (RFC 5869) with the purpose and the node
id as its `info`: a different key per node and per use, so one node's credentials tell
nothing about another's, and none of them leads back to the key.

A lease token is `<expires_at>.<lease_id>.<owner>.<mac>`: the mac is an HMAC, under the
lease key of the node that holds the sandbox, of the sandbox id, the lease id, the
client that holds the lease (empty for none) and the instant (Unix seconds) the token
stops working. The agent checks it against the lease and owner it holds for that
sandbox, with its own lease key, so it needs no call to the control plane; a token is
useless on any other sandbox, lease, client or node (another node's lease key cannot
make one), after its expiry, and once the lease ends.

The lease id and owner are in the token in the clear (neither is a secret) so that the
token alone proves the lease: a control plane answers a warm acquire without waiting
for the agent to hear of the lease, and the agent takes up the lease from the first
command's token if that command comes first (`lease_token_claim`). Tokens made before
they were added (`<expires_at>.<mac>`) are still checked against the lease held.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

# The expiry of a lease whose pool sets no max_lease_s: the year 2286, never in practice.
NO_EXPIRY = 9_999_999_999
_EXPIRY = re.compile(r"[0-9]{1,12}")
# expiry, lease id, owner (a client id, or empty) and mac of a token that names its lease
_CLAIM = re.compile(r"([0-9]{1,12})\.([0-9a-f]{32})\.([0-9a-f]{16})?\.([0-9a-f]{64})")
_HKDF_SALT = b"dsec identities v1"  # fixed: the key is random; the salt only separates uses


def new_token() -> str:
    return secrets.token_urlsafe(32)


LEASE_ID_PATTERN = r"[0-9a-f]{32}"  # what new_lease_id makes


def new_lease_id() -> str:
    return secrets.token_hex(16)


def derive(key: str, purpose: str, node_id: str) -> str:
    """A 256-bit key for `purpose` and `node_id`, hex: HKDF-SHA256 extract and expand
    (one block) of the control plane's `key`."""
    prk = hmac.new(_HKDF_SALT, key.encode(), hashlib.sha256).digest()
    info = f"{purpose}\x00{node_id}".encode()
    return hmac.new(prk, info + b"\x01", hashlib.sha256).hexdigest()


def _lease_mac(
    lease_key: str, sandbox_id: str, lease_id: str, owner: str | None, expires_at: int
) -> str:
    # none of the fields can hold "|": ids and owners are hex or names, the expiry digits
    message = f"{sandbox_id}|{lease_id}|{owner or ''}|{expires_at}"
    return hmac.new(lease_key.encode(), message.encode(), hashlib.sha256).hexdigest()


def lease_token(
    lease_key: str, sandbox_id: str, lease_id: str, owner: str | None, expires_at: int
) -> str:
    """The exec token of a lease; `lease_key` is its node's (Identities.lease_key)."""
    mac = _lease_mac(lease_key, sandbox_id, lease_id, owner, expires_at)
    return f"{expires_at}.{lease_id}.{owner or ''}.{mac}"


def lease_token_expiry(
    lease_key: str, token: str, sandbox_id: str, lease_id: str, owner: str | None
) -> int | None:
    """When `token` stops working, if it is a token of this lease made with this lease
    key; None for any other token (forged, another sandbox's, lease's, client's or
    node's). Whether that instant has passed is the caller's to judge."""
    expires, _, mac = token.partition(".")
    _, _, mac = mac.rpartition(".")  # the lease id and owner named between are not trusted
    if not _EXPIRY.fullmatch(expires):
        return None
    expected = _lease_mac(lease_key, sandbox_id, lease_id, owner, int(expires))
    return int(expires) if hmac.compare_digest(mac.encode(), expected.encode()) else None


@dataclass(frozen=True)
class LeaseClaim:
    """A lease a token proves by itself: made by the control plane for this sandbox."""

    lease_id: str
    owner: str | None
    expires_at: int


def lease_token_claim(lease_key: str, token: str, sandbox_id: str) -> LeaseClaim | None:
    """The lease `token` names on `sandbox_id`, if this lease key made it; None for any
    other token. For an agent that has not heard of a lease yet: whether that lease has
    ended, or its expiry passed, is the caller's to judge."""
    match = _CLAIM.fullmatch(token)
    if match is None:
        return None
    expires, lease_id, owner, mac = match.groups()
    expected = _lease_mac(lease_key, sandbox_id, lease_id, owner, int(expires))
    if not hmac.compare_digest(mac.encode(), expected.encode()):
        return None
    return LeaseClaim(lease_id, owner, int(expires))


def client_id(token: str) -> str:
    """Who a bearer token speaks for, without keeping the token: leases and idempotency
    keys belong to it, so one client never sees or reaches another's."""
    return hashlib.sha256(token.encode()).hexdigest()[:16]


LEASE_TOKEN_HEADER = "X-Dsec-Lease-Token"  # proves a release comes from the lease holder
