"""Who a node is: its credentials, and the addresses it may report.

Every node has credentials of its own, bound to its node id and derived from the control
plane's key (`identity_key`; dsec.tokens.derive, HKDF-SHA256 with the purpose and the
node id), so the control plane stores none of them and a restart with the same key
issues the same ones:

- its node token, the bearer token of its heartbeats (`PUT /v1/agents/{node_id}`): a node
  cannot report as another, since it cannot compute that node's token;
- the control plane's call token for it, which its agent requires on the control
  plane's routes (create, lease, pause, ..., audit): a node cannot call another node's
  agent, since it does not know that node's call token;
- its lease key, the key of the exec tokens of its sandboxes (dsec/tokens.py), which
  only it and the control plane know: a node cannot make a token another node accepts.

One key per node is never issued: its grant key, under which the control plane seals
each lease it grants there (`grant_proof`, in the grant; the agent keeps it with the
lease and reports it). A node knows its lease key, so a lease token cannot prove to
the control plane that it made a lease; a grant proof can, also after a restart of
the control plane, which keeps no record of its grants: a lease a report names
without a valid proof was never granted, and is not taken (ClusterView).

A node learns them by joining (`POST /v1/agents/{node_id}/join`), with either its own
node token (what `dsec up` and the cloud provider give the agents they start, so that no
node holds anything that speaks for another) or the pool's join token (`agent_token`,
DSEC_AGENT_TOKEN: an enrolment secret for agents started by hand; whoever holds it may
join as any node, so it belongs with the operator, not on nodes once they have joined).

Heartbeats must also carry an address the operator allows (`agent_urls`: loopback
unless configured), or a node could draw placements and its clients' commands to any
address. A report may name only sandboxes of its own node (`NodeReport` refuses others).
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass
from ipaddress import IPv4Network, IPv6Network, ip_address, ip_network
from pathlib import Path
from typing import Annotated, Protocol
from urllib.parse import urlsplit

from pydantic import AfterValidator

from dsec.httpkit import ApiError
from dsec.models import NodeIdentity, SandboxRow
from dsec.statedir import private_dir, write_private
from dsec.tokens import derive, new_token

KEY_FILE = "controlplane.key"
SCHEMES = ("http", "https")
# where agents may be unless the operator says otherwise: this machine
LOOPBACK_AGENT_URLS = (
    "http://127.0.0.0/8",
    "https://127.0.0.0/8",
    "http://::1/128",
    "https://::1/128",
    "http://localhost",
    "https://localhost",
)
_HOST_NAME = re.compile(r"^[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?$")


class IdentitySettings(Protocol):
    """The settings every node's credentials derive from: ControlPlaneConfig's, which
    imports this module (so this one names only what it reads)."""

    identity_key: str
    agent_token: str


class Identities:
    """Every node's credentials, computed from the control plane's key when asked."""

    def __init__(self, key: str, join_token: str) -> None:
        self._key = key
        self.join_token = join_token
        # node -> its lease key, worked out once: every acquire and release asks (two
        # HMACs each time), and the key never changes for the life of this object
        self._lease_keys: dict[str, str] = {}

    @classmethod
    def of(cls, config: IdentitySettings) -> Identities:
        return cls(config.identity_key, config.agent_token)

    def node_token(self, node_id: str) -> str:
        return derive(self._key, "node token", node_id)

    def call_token(self, node_id: str) -> str:
        return derive(self._key, "call token", node_id)

    def lease_key(self, node_id: str) -> str:
        key = self._lease_keys.get(node_id)
        if key is None:
            key = self._lease_keys[node_id] = derive(self._key, "lease key", node_id)
        return key

    def grant_proof(
        self,
        node_id: str,
        sandbox_id: str,
        lease_id: str,
        owner: str | None,
        idempotency_key: str | None,
        pool: str,
    ) -> str:
        """The proof that this control plane granted that lease on that sandbox of
        `node_id`: an HMAC under the node's grant key, which no node is given."""
        key = derive(self._key, "grant key", node_id)
        # none of the fields can hold "|": ids and owners are hex, keys and pools names
        message = f"{sandbox_id}|{lease_id}|{owner or ''}|{idempotency_key or ''}|{pool}"
        return hmac.new(key.encode(), message.encode(), hashlib.sha256).hexdigest()

    def granted(self, node_id: str, row: SandboxRow) -> bool:
        """Whether the lease `row` names carries this control plane's proof of its grant."""
        if row.lease_id is None or row.grant_proof is None:
            return False
        expected = self.grant_proof(
            node_id, row.id, row.lease_id, row.owner, row.idempotency_key, row.pool
        )
        return hmac.compare_digest(row.grant_proof.encode(), expected.encode())

    def issue(self, node_id: str) -> NodeIdentity:
        return NodeIdentity(
            node_id=node_id,
            node_token=self.node_token(node_id),
            call_token=self.call_token(node_id),
            lease_key=self.lease_key(node_id),
        )

    def may_join_as(self, node_id: str) -> list[str]:
        """The tokens a join as `node_id` is accepted with: the node's own, or the pool's
        join token."""
        return [self.node_token(node_id), self.join_token]


def load_or_make_key(state_dir: Path) -> str:
    """The control plane's key, kept in `state_dir` (0600) and made there on first use:
    after a restart every node's credentials and every lease token still hold."""
    path = private_dir(state_dir) / KEY_FILE
    if path.exists():
        key = path.read_text().strip()
        if key:
            write_private(path, key.encode())  # the same key, the file 0600 whatever it was
            return key
    key = new_token()
    write_private(path, key.encode())
    return key


# --- the addresses agents may report ---------------------------------------------------


@dataclass(frozen=True)
class _Rule:
    scheme: str
    network: IPv4Network | IPv6Network | None  # an address rule
    host: str | None  # a host-name rule


def _parse_rule(rule: str) -> _Rule:
    scheme, sep, place = rule.partition("://")
    place = place.replace("[", "").replace("]", "").lower()
    if sep and scheme in SCHEMES and place:
        try:
            return _Rule(scheme, ip_network(place, strict=False), None)
        except ValueError:
            if _HOST_NAME.match(place):
                return _Rule(scheme, None, place)
    raise ValueError(
        f"{rule!r} is not an agent URL rule: http:// or https:// and a network "
        "(http://10.0.0.0/8, https://::1/128) or a host name (https://node-1.example.org)"
    )


def _valid_rule(rule: str) -> str:
    _parse_rule(rule)
    return rule


AgentUrlRule = Annotated[str, AfterValidator(_valid_rule)]


def check_agent_url(url: str, rules: list[str]) -> None:
    """Refuse (422 url_not_allowed) an agent URL that no rule allows: a scheme and a
    host the rules name (any port), and nothing else (no path, user or query)."""
    if not _allowed(url, [_parse_rule(r) for r in rules]):
        raise ApiError(
            422,
            "url_not_allowed",
            f"agent URL {url!r} is not allowed: the control plane's agent_urls allow "
            f"{', '.join(rules) or 'none'} (scheme://network or host, any port, no path)",
            [{"loc": "url", "msg": f"allowed: {rules}"}],
        )


def _allowed(url: str, rules: list[_Rule]) -> bool:
    parts = urlsplit(url)
    try:
        parts.port  # noqa: B018 (a bad port raises)
    except ValueError:
        return False
    host = parts.hostname
    if (
        not host
        or parts.path
        or parts.query
        or parts.fragment
        or parts.username is not None
        or parts.password is not None
    ):
        return False
    try:
        address = ip_address(host)
    except ValueError:
        return any(r.scheme == parts.scheme and r.host == host for r in rules)
    return any(
        r.scheme == parts.scheme and r.network is not None and address in r.network for r in rules
    )
