"""The policies a control plane or the simulator may run, by name: dsec's own
(dsec/policy.py, pure) and the baselines it is compared with (dsec/baselines.py), all
behind one interface.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, Protocol, get_args

from dsec.baselines import ColdPolicy, HpaPolicy, KedaPolicy, KpaPolicy, StaticPolicy
from dsec.models import PoolParams
from dsec.policy import Action, Snapshot, decide


class Policy(Protocol):
    name: str

    def decide(
        self, snapshot: Snapshot, pools: Mapping[str, PoolParams], now: float
    ) -> list[Action]: ...


class DsecPolicy:
    name = "dsec"

    def decide(self, snapshot: Snapshot, pools: Mapping[str, PoolParams], now: float):
        return decide(snapshot, pools, now)


# The one list of policy names: the control plane's config takes one of these, and
# POLICIES maps each to its class (by the class's `name`).
PolicyName = Literal["dsec", "cold", "static", "hpa", "keda", "kpa"]

_CLASSES = {
    p.name: p for p in (DsecPolicy, ColdPolicy, StaticPolicy, HpaPolicy, KedaPolicy, KpaPolicy)
}
POLICIES = {name: _CLASSES[name] for name in get_args(PolicyName)}
assert POLICIES.keys() == _CLASSES.keys(), "a policy class without its name in PolicyName"


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {sorted(POLICIES)}") from None
