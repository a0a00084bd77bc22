"""The pure policy, table-driven: a snapshot in, actions out, no Docker, no clock."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from dsec.models import PoolParams
from dsec.policies import make_policy
from dsec.policy import (
    Claim,
    CloudSnap,
    Create,
    Destroy,
    Hibernate,
    NodeSnap,
    Pause,
    ProvisionCloud,
    ReleaseCloud,
    RequestSnap,
    Resources,
    SandboxSnap,
    Snapshot,
    TemplateSnap,
    Thaw,
    decide,
    flow_target,
    scale_up_step,
    warm_target,
)
from dsec.states import SandboxState as S

NOW = 1000.0
TEMPLATES = {
    "t": TemplateSnap("t", "img:t", cpus=1.0, memory_mb=100, may_overflow=True),
    "pinned": TemplateSnap("pinned", "img:p", cpus=1.0, memory_mb=100, may_overflow=False),
}


def node(id="n1", kind="local", slots=1000, used=0, images=("img:t",), **kw) -> NodeSnap:
    return NodeSnap(
        id, kind, kw.pop("healthy", True), Resources(1000.0, 10**6, slots),
        Resources(float(used), used * 100, used), frozenset(images), **kw,
    )  # fmt: skip


def sandbox(id, state, pool="p", template="t", node="n1", since=NOW - 1, **kw) -> SandboxSnap:
    return SandboxSnap(id, node, pool, template, state, since, **kw)


def request(id, pool="p", template="t", priority=0, arrived_at=NOW - 0.1, **kw) -> RequestSnap:
    return RequestSnap(id, pool, template, priority, arrived_at, **kw)


def params(**kw) -> PoolParams:
    base = dict(min_warm=0, max_warm=1000, warm_fraction=0.0, templates=["t"])
    return PoolParams(**(base | kw))


def snap(nodes=(), sandboxes=(), requests=(), **kw) -> Snapshot:
    return Snapshot(tuple(nodes or [node()]), tuple(sandboxes), tuple(requests), TEMPLATES, **kw)


def of(actions, kind, reason_prefix: str | None = None) -> list:
    return [
        a for a in actions
        if isinstance(a, kind) and (reason_prefix is None or a.reason.startswith(reason_prefix))
    ]  # fmt: skip


def cold(actions) -> list[Create]:
    """The creates made for a waiting request (not warm-pool or scale-up ones)."""
    return [a for a in of(actions, Create) if a.for_request]


# --- the scale-up rule ------------------------------------------------------------


@pytest.mark.parametrize(
    ("pending", "idle", "k", "step", "expected"),
    [
        (200, 50, 2.0, 0.5, 25),  # the seed's worked example
        (100, 50, 2.0, 0.5, 0),  # not above k x idle
        (101, 50, 2.0, 0.5, 25),
        (3, 1, 2.0, 0.5, 1),  # rounds up: never a step of zero once triggered
        (0, 0, 2.0, 0.5, 0),  # nothing waiting
        (1, 0, 2.0, 0.5, 1),  # idle 0: a share of the queue instead of 50% of nothing
        (10, 0, 2.0, 0.5, 5),
        (10, 4, 3.0, 0.25, 0),  # 10 <= 3 x 4
        (13, 4, 3.0, 0.25, 1),
    ],
)
def test_scale_up_step(pending, idle, k, step, expected):
    assert scale_up_step(params(scale_up_k=k, scale_up_step=step), pending, idle) == expected


@pytest.mark.parametrize(
    ("min_warm", "max_warm", "fraction", "peak", "expected"),
    [
        (2, 64, 0.15, 0, 2),  # the floor
        (2, 64, 0.15, 100, 15),
        (2, 64, 0.15, 1000, 64),  # the ceiling
        (0, 64, 0.10, 5, 1),  # rounds up
    ],
)
def test_warm_target(min_warm, max_warm, fraction, peak, expected):
    p = params(min_warm=min_warm, max_warm=max_warm, warm_fraction=fraction)
    assert warm_target(p, peak) == expected


@pytest.mark.parametrize(
    ("in_flight", "expected"),
    [(0.0, 0), (1.0, 3), (4.0, 8), (100.0, 120)],  # mean + 2 sqrt(mean), rounded up
)
def test_flow_target(in_flight, expected):
    assert flow_target(in_flight) == expected


def test_the_warm_target_follows_the_acquire_rate_times_the_create_time():
    pool = {"p": params(min_warm=2, max_warm=20)}
    key = ("p", "t")

    def creates(**kw) -> int:
        actions = decide(snap(nodes=[node(slots=100)], **kw), pool, NOW)
        return len(of(actions, Create, "warm pool below target"))

    assert creates() == 2  # min_warm alone
    # 10 a second, 0.4 s a create: 4 taken while one is made, a target of 8 to be safe,
    # made 4 at a time: as many in flight as the stream needs, past refill_concurrency (2)
    flow = {"acquire_rates": {key: 10.0}, "create_s": {"t": 0.4}}
    assert creates(**flow) == 4
    making = [sandbox(f"c{i}", S.CREATING) for i in range(4)]
    assert creates(sandboxes=making, **flow) == 0
    ready = [sandbox(f"w{i}", S.WARM, since=NOW - 0.5) for i in range(4)]
    assert creates(sandboxes=ready, **flow) == 4  # the rest of the 8
    assert creates(sandboxes=ready + making, **flow) == 0
    assert creates(acquire_rates={key: 100.0}, create_s={"t": 1.0}) == 20  # max_warm
    assert creates(acquire_rates={("q", "t"): 10.0}, create_s={"t": 0.4}) == 2  # not its pool


def test_a_pool_that_recycles_is_replaced_by_resets_and_its_creates_stay_paced():
    recycled = TemplateSnap("t", "img:t", cpus=1.0, memory_mb=100, may_overflow=True,
                            recyclable=True)  # fmt: skip
    key = ("p", "t")
    flow = {"acquire_rates": {key: 40.0}, "create_s": {"t": 0.5}, "reset_s": {"t": 0.1}}

    def creates(pool: PoolParams) -> int:
        s = Snapshot((node(slots=100),), (), (), {"t": recycled}, **flow)
        return len(of(decide(s, {"p": pool}, NOW), Create, "warm pool below target"))

    # released sandboxes come back in 0.1 s: 4 in reset on average, a target of 8, and
    # the creates that fill it at refill_concurrency (2), not the 20 creates would need
    assert creates(params(recycle=True, min_warm=0)) == 2
    assert creates(params(recycle=True, min_warm=0, refill_concurrency=16)) == 8
    # the same stream in a pool that does not recycle: creates replace what it takes
    assert creates(params(recycle=False, min_warm=0, max_warm=40)) == 20  # of a target of 29


def test_the_seeds_worked_example():
    # 100 running, 50 idle, 200 pending: 200 > 2 x 50, so scale up by 25
    running = [sandbox(f"r{i}", S.LEASED) for i in range(100)]
    idle = [sandbox(f"i{i}", S.WARM) for i in range(50)]
    pending = [request(f"q{i:03}", arrived_at=NOW - 1 + i / 1000) for i in range(200)]
    actions = decide(snap(sandboxes=running + idle, requests=pending), {"p": params()}, NOW)
    claims = of(actions, Claim)
    assert len(claims) == 50 and {c.path for c in claims} == {"warm"}
    assert {c.request_id for c in claims} == {f"q{i:03}" for i in range(50)}  # first come
    assert len(of(actions, Create, "scale-up")) == 25
    assert len(cold(actions)) == 150  # each request left waiting gets a create of its own


def test_idle_zero_and_bounded_by_max_warm():
    pending = [request(f"q{i}") for i in range(10)]
    actions = decide(snap(requests=pending), {"p": params(max_warm=3)}, NOW)
    assert len(cold(actions)) == 10
    assert len(of(actions, Create, "scale-up")) == 3  # 50% of 10, capped by max_warm


def test_capacity_full_creates_nothing_but_serves_what_is_warm():
    full = node(slots=4, used=4)
    warm = sandbox("w", S.WARM)
    actions = decide(
        snap([full], [warm], [request("a"), request("b", arrived_at=NOW)]),
        {"p": params(min_warm=5)}, NOW,
    )  # fmt: skip
    assert of(actions, Claim) == [Claim("a", "w", "warm", of(actions, Claim)[0].reason)]
    assert of(actions, Create) == []


def test_claims_prefer_warm_then_paused_then_hibernated_then_cold():
    tiers = [
        sandbox("h", S.HIBERNATED, since=NOW - 50),
        sandbox("p", S.PAUSED, since=NOW - 50),
        sandbox("w", S.WARM, since=NOW - 50),
    ]
    reqs = [request(f"q{i}", arrived_at=NOW - 5 + i) for i in range(4)]
    actions = decide(snap(sandboxes=tiers, requests=reqs), {"p": params()}, NOW)
    got = [(c.request_id, c.sandbox_id, c.path) for c in of(actions, Claim)]
    assert got == [("q0", "w", "warm"), ("q1", "p", "thaw"), ("q2", "h", "thaw")]
    assert [a.for_request for a in cold(actions)] == ["q3"]


def test_a_fork_s_requests_are_spread_over_the_nodes_holding_warm_sandboxes():
    nodes = [node("n1"), node("n2"), node("n3")]
    # the oldest warm sandboxes are all on n1: plain requests take those
    warm = [sandbox(f"a{i}", S.WARM, node="n1", since=NOW - 90 + i) for i in range(4)]
    warm += [sandbox(f"b{i}", S.WARM, node="n2", since=NOW - 50 + i) for i in range(2)]
    warm += [sandbox("c0", S.WARM, node="n3", since=NOW - 40)]
    by_id = {sb.id: sb.node for sb in warm}

    def nodes_of(reqs) -> list[str]:
        actions = decide(snap(nodes, warm, reqs), {"p": params()}, NOW)
        claimed = {c.request_id: by_id[c.sandbox_id] for c in of(actions, Claim)}
        return [claimed[r.id] for r in reqs]

    plain = [request(f"q{i}", arrived_at=NOW - 1 + i / 10) for i in range(3)]
    assert nodes_of(plain) == ["n1", "n1", "n1"]
    fork = [request(f"f{i}", arrived_at=NOW - 1, spread="g") for i in range(5)]
    assert sorted(nodes_of(fork)) == ["n1", "n1", "n2", "n2", "n3"]
    # two groups are spread each on its own
    two = fork[:3] + [request(f"h{i}", arrived_at=NOW - 1, spread="h") for i in range(3)]
    got = nodes_of(two)
    assert sorted(got[:3]) == ["n1", "n2", "n3"] and len(set(got[3:])) >= 2


def test_a_personalised_claim_goes_to_the_node_applying_the_fewest():
    # n1 holds the oldest warm sandboxes but applies two claims already; n3 one
    nodes = [node("n1", applying=2), node("n2"), node("n3", applying=1)]
    warm = [sandbox(f"a{i}", S.WARM, node="n1", since=NOW - 90 + i) for i in range(4)]
    warm += [sandbox(f"b{i}", S.WARM, node="n2", since=NOW - 50 + i) for i in range(2)]
    warm += [sandbox(f"c{i}", S.WARM, node="n3", since=NOW - 40 + i) for i in range(2)]

    def claimed(reqs) -> list[tuple[str, str]]:
        actions = decide(snap(nodes, warm, reqs), {"p": params()}, NOW)
        return [(c.request_id, c.sandbox_id) for c in of(actions, Claim)]

    personal = [request(f"q{i}", arrived_at=NOW - 1 + i / 10, personal=True) for i in range(5)]
    # each on the node applying the fewest, this decision's claims counted (n2 at 0; then
    # n2 and n3 at 1: the older sandbox; n2 has none left; n1 and n3 at 2: the older),
    # the oldest sandbox of that node
    assert claimed(personal) == [("q0", "b0"), ("q1", "b1"), ("q2", "c0"), ("q3", "a0"),
                                 ("q4", "c1")]  # fmt: skip
    # a plain claim takes the oldest, whatever its node does
    assert claimed([request("plain", arrived_at=NOW - 1)]) == [("plain", "a0")]


def test_a_sandbox_made_after_the_request_arrived_counts_as_cold():
    fresh = sandbox("w", S.WARM, since=NOW - 0.05)  # a scale-up create, ready just now
    actions = decide(snap(sandboxes=[fresh], requests=[request("a", arrived_at=NOW - 1)]),
                     {"p": params()}, NOW)  # fmt: skip
    assert [(c.sandbox_id, c.path) for c in of(actions, Claim)] == [("w", "cold")]


def test_everything_frozen_is_thawed_for_requests():
    frozen = [sandbox(f"p{i}", S.PAUSED, since=NOW - 10) for i in range(3)]
    actions = decide(snap(sandboxes=frozen, requests=[request("a")]), {"p": params()}, NOW)
    assert [(c.sandbox_id, c.path) for c in of(actions, Claim)] == [("p0", "thaw")]


def test_a_create_for_a_request_is_claimed_when_ready_and_not_duplicated():
    mine = sandbox("c", S.CREATING, reserved_for="a")
    actions = decide(snap(sandboxes=[mine], requests=[request("a")]), {"p": params()}, NOW)
    assert of(actions, Claim) == [] and cold(actions) == []
    ready = sandbox("c", S.WARM, reserved_for="a")
    actions = decide(snap(sandboxes=[ready], requests=[request("a")]), {"p": params()}, NOW)
    assert [(c.sandbox_id, c.path) for c in of(actions, Claim)] == [("c", "cold")]


def test_whatever_is_ready_first_goes_to_the_oldest_waiter():
    # the younger request's create finished first: the older one gets it, and the younger
    # waits for the older one's create, which is still under way; nothing new is created
    older, younger = request("old", arrived_at=NOW - 2), request("young", arrived_at=NOW - 1)
    sandboxes = [
        sandbox("for-old", S.CREATING, reserved_for="old"),
        sandbox("for-young", S.WARM, reserved_for="young", since=NOW - 0.5),
    ]
    actions = decide(snap(sandboxes=sandboxes, requests=[younger, older]), {"p": params()}, NOW)
    assert [(c.request_id, c.sandbox_id, c.path) for c in of(actions, Claim)] == [
        ("old", "for-young", "cold")
    ]
    assert of(actions, Create) == []


def test_a_refill_goes_only_where_the_engine_has_a_create_to_spare():
    nodes = [node("busy", creating=4, create_limit=4), node("spare", creating=1, create_limit=2)]
    actions = decide(snap(nodes), {"p": params(min_warm=5, refill_concurrency=5)}, NOW)
    assert [a.node for a in of(actions, Create)] == ["spare"]  # then "spare" is at 2 of 2 too


def test_a_create_for_a_request_goes_to_the_shortest_create_queue_even_past_its_limit():
    nodes = [node("long", creating=8, create_limit=4), node("short", creating=5, create_limit=4)]
    actions = decide(snap(nodes, requests=[request("a")]), {"p": params()}, NOW)
    assert [a.node for a in cold(actions)] == ["short"]


# --- placement and overflow ---------------------------------------------------------


def test_placement_prefers_the_image_then_free_capacity_and_skips_what_cannot_take_it():
    nodes = [
        node("cold-cache", images=(), used=0),
        node("busy", used=900),
        node("roomy", used=100),
        node("sick", healthy=False),
        node("refusing", accepting=False),
        node("refused-it", used=0),
    ]
    reqs = [request("a", refused_by=frozenset({"refused-it"}))]
    actions = decide(snap(nodes, requests=reqs), {"p": params()}, NOW)
    assert [a.node for a in cold(actions)] == ["roomy"]


def test_one_decision_never_overbooks_a_node():
    reqs = [request(f"q{i}") for i in range(5)]
    actions = decide(snap([node("a", slots=2), node("b", slots=2)], requests=reqs),
                     {"p": params()}, NOW)  # fmt: skip
    creates = [a.node for a in of(actions, Create)]  # cold and scale-up share the 4 slots
    assert sorted(creates) == ["a", "a", "b", "b"]


def test_sampling_at_thousands_of_nodes_is_deterministic_and_feasible():
    nodes = [node(f"n{i:04}", slots=10, used=10 if i % 2 else 3) for i in range(2000)]
    reqs = [request(f"q{i}") for i in range(50)]
    first = decide(snap(nodes, requests=reqs, seed=7), {"p": params()}, NOW)
    again = decide(snap(nodes, requests=reqs, seed=7), {"p": params()}, NOW)
    assert first == again
    placed = [a.node for a in cold(first)]
    assert len(placed) == 50 and all(int(n[1:]) % 2 == 0 for n in placed)  # only feasible
    assert len(set(placed)) > 25  # spread, not piled on one node


@pytest.mark.parametrize(
    ("local_used", "threshold", "template", "expected_kind"),
    [
        (85, 0.8, "t", "cloud"),  # past the threshold: overflow
        (70, 0.8, "t", "local"),  # below it
        (85, 0.9, "t", "local"),  # a higher threshold keeps it local
        (85, 0.8, "pinned", "local"),  # a template that may not leave stays local
        (100, 0.8, "pinned", None),  # ... and waits when local is full
    ],
)
def test_cloud_overflow(local_used, threshold, template, expected_kind):
    nodes = [node("l", slots=100, used=local_used, images=("img:t", "img:p")),
             node("c", kind="cloud", slots=100, images=("img:t", "img:p"))]  # fmt: skip
    pools = {"p": params(overflow_threshold=threshold, templates=[])}
    actions = decide(snap(nodes, requests=[request("a", template=template)]), pools, NOW)
    creates = cold(actions)
    kinds = {"l": "local", "c": "cloud"}
    assert [kinds[a.node] for a in creates] == ([expected_kind] if expected_kind else [])


def test_a_ready_sandbox_on_a_cloud_node_reports_overflow():
    nodes = [node("l", used=900), node("c", kind="cloud")]
    mine = sandbox("c1", S.WARM, node="c", reserved_for="a")
    actions = decide(snap(nodes, [mine], [request("a")]), {"p": params()}, NOW)
    assert [c.path for c in of(actions, Claim)] == ["overflow"]


@pytest.mark.parametrize(
    ("cloud_nodes", "booting", "max_nodes", "provisions"),
    [(0, 0, 2, 1), (0, 1, 2, 0), (2, 0, 2, 0)],
)
def test_cloud_nodes_are_provisioned_when_overflow_finds_no_room(
    cloud_nodes, booting, max_nodes, provisions
):
    nodes = [node("l", slots=10, used=9)] + [
        node(f"c{i}", kind="cloud", slots=1, used=1) for i in range(cloud_nodes)
    ]
    cloud = CloudSnap(max_nodes=max_nodes, booting=booting, idle_release_s=60)
    actions = decide(snap(nodes, requests=[request("a")], cloud=cloud),
                     {"p": params(templates=[])}, NOW)  # fmt: skip
    assert len(of(actions, ProvisionCloud)) == provisions


def test_an_empty_cloud_node_is_released_after_a_while():
    nodes = [
        node("l"),
        node("c-old", kind="cloud", empty_since=NOW - 61),
        node("c-new", kind="cloud", empty_since=NOW - 5),
        node("c-used", kind="cloud", used=1),
    ]
    cloud = CloudSnap(max_nodes=3, booting=0, idle_release_s=60)
    actions = decide(snap(nodes, cloud=cloud), {"p": params(templates=[])}, NOW)
    assert [a.node for a in of(actions, ReleaseCloud)] == ["c-old"]


# --- pools and priorities ---------------------------------------------------------


def test_a_higher_priority_pool_is_served_first():
    pools = {"train": params(priority=0), "eval": params(priority=10)}
    warm = [sandbox("w", S.WARM, pool="train")]
    reqs = [request("t1", pool="train", arrived_at=NOW - 5), request("e1", pool="eval")]
    actions = decide(snap(sandboxes=warm, requests=reqs), pools, NOW)
    # eval takes train's only idle sandbox; train's request gets a cold create instead
    assert [(c.request_id, c.sandbox_id) for c in of(actions, Claim)] == [("e1", "w")]
    assert "lower-priority" in of(actions, Claim)[0].reason
    assert [a.for_request for a in cold(actions)] == ["t1"]


def test_priority_takes_idle_or_frozen_never_busy_and_never_upwards():
    pools = {"train": params(priority=0), "eval": params(priority=10)}
    busy = sandbox("busy", S.LEASED, pool="train")
    frozen = sandbox("frozen", S.PAUSED, pool="train", since=NOW - 100)
    eval_warm = sandbox("ew", S.WARM, pool="eval")
    actions = decide(
        snap(sandboxes=[busy, frozen, eval_warm],
             requests=[request("e1", pool="eval", arrived_at=NOW - 1),
                       request("e2", pool="eval", arrived_at=NOW - 0.5),
                       request("t1", pool="train", arrived_at=NOW - 2)]),
        pools, NOW,
    )  # fmt: skip
    claims = {c.request_id: (c.sandbox_id, c.path) for c in of(actions, Claim)}
    assert claims == {"e1": ("ew", "warm"), "e2": ("frozen", "thaw")}
    assert "busy" not in {c.sandbox_id for c in of(actions, Claim)}


def test_request_priority_orders_a_pool_queue():
    actions = decide(
        snap(sandboxes=[sandbox("w", S.WARM)],
             requests=[request("low", arrived_at=NOW - 9), request("high", priority=5)]),
        {"p": params()}, NOW,
    )  # fmt: skip
    assert [c.request_id for c in of(actions, Claim)] == ["high"]


# --- warm pool, freezing, ageing --------------------------------------------------


def test_the_warm_target_follows_the_recent_peak_thaws_first_and_is_paced():
    pools = {"p": params(min_warm=1, max_warm=50, warm_fraction=0.2, refill_concurrency=2)}
    paused = [sandbox(f"p{i}", S.PAUSED, since=NOW - 5) for i in range(3)]
    actions = decide(snap(sandboxes=paused, peaks={("p", "t"): 50}), pools, NOW)
    assert len(of(actions, Thaw)) == 3  # target 10: thaw the 3 paused first...
    assert len(of(actions, Create, "warm pool")) == 2  # ...then create, 2 at a time
    in_flight = [sandbox(f"c{i}", S.CREATING) for i in range(2)]
    actions = decide(snap(sandboxes=in_flight, peaks={("p", "t"): 50}), pools, NOW)
    assert of(actions, Create) == []


def test_scale_down_freezes_excess_idle_warm_a_step_at_a_time_once_the_queue_is_safe():
    pools = {"p": params(min_warm=2, freeze_after_s=30, scale_down_step=0.2)}
    warm = [sandbox(f"w{i}", S.WARM, since=NOW - 60 + i) for i in range(10)]
    actions = decide(snap(sandboxes=warm), pools, NOW)
    assert [a.sandbox_id for a in of(actions, Pause)] == ["w0", "w1"]  # 20% of 10, oldest
    fresh = [sandbox(f"w{i}", S.WARM, since=NOW - 10) for i in range(10)]
    assert of(decide(snap(sandboxes=fresh), pools, NOW), Pause) == []  # not idle long enough
    creating = [sandbox("c", S.CREATING, reserved_for="q")]
    busy_queue = decide(snap(sandboxes=warm + creating, requests=[request("q")]), pools, NOW)
    assert of(busy_queue, Pause) == []  # the queue is not at a safe level


@pytest.mark.parametrize(
    ("state", "since", "frozen_at", "expected"),
    [
        (S.PAUSED, NOW - 10, NOW - 10, None),
        (S.PAUSED, NOW - 130, NOW - 130, Hibernate),  # past hibernate_after (120 s)
        (S.PAUSED, NOW - 301, NOW - 301, Destroy),  # past frozen_ttl (300 s)
        (S.HIBERNATED, NOW - 100, NOW - 250, None),
        (S.HIBERNATED, NOW - 100, NOW - 301, Destroy),  # the TTL counts from the freeze
    ],
)
def test_frozen_sandboxes_age_into_hibernation_then_out(state, since, frozen_at, expected):
    pools = {"p": params(hibernate_after_s=120, frozen_ttl_s=300)}
    actions = decide(snap(sandboxes=[sandbox("s", state, since=since, frozen_at=frozen_at)]),
                     pools, NOW)  # fmt: skip
    kinds = [type(a) for a in actions if isinstance(a, Hibernate | Destroy)]
    assert kinds == ([expected] if expected else [])


def test_an_idle_lease_is_frozen():
    pools = {"p": params(lease_idle_freeze_s=60)}
    leases = [sandbox("idle", S.LEASED, idle_since=NOW - 61),
              sandbox("active", S.LEASED, idle_since=NOW - 5)]  # fmt: skip
    actions = decide(snap(sandboxes=leases), pools, NOW)
    assert [a.sandbox_id for a in of(actions, Pause)] == ["idle"]


def test_decide_is_pure():
    source = Path(__file__).parents[1].joinpath("dsec", "policy.py").read_text()
    tree = ast.parse(source)
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                for a in n.names} | {
        n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
    }  # fmt: skip
    assert not imported & {"time", "asyncio", "aiohttp", "docker", "prometheus_client", "os"}


# --- the baselines ------------------------------------------------------------------


def replicas(policy, t, warm=0, leased=0, requests=0, creating=0, tag="") -> list:
    """One decision of a replica-counting baseline: `warm` idle replicas, `creating`
    under way, `leased` busy ones, `requests` waiting."""
    sandboxes = [sandbox(f"w{tag}{i}", S.WARM, since=t - 1) for i in range(warm)]
    sandboxes += [sandbox(f"c{tag}{i}", S.CREATING, since=t) for i in range(creating)]
    waiting = [request(f"r{tag}{i}", arrived_at=t - 0.1) for i in range(requests)]
    busy = {("p", "t"): leased} if leased else {}
    return policy.decide(snap(sandboxes=sandboxes, requests=waiting, leased=busy),
                         {"p": policy.params}, t)  # fmt: skip


def baseline(name: str, **kw):
    policy = make_policy(name)
    policy.params = params(**kw)
    return policy


def test_cold_creates_per_request_and_keeps_nothing():
    policy = make_policy("cold")
    pools = {"p": params(min_warm=5)}  # a pool size means nothing without a pool
    mine = sandbox("mine", S.WARM, reserved_for="r1")
    left = sandbox("left", S.WARM, reserved_for="gone")
    actions = policy.decide(snap(sandboxes=[mine, left], requests=[request("r1"), request("r2")]),
                            pools, NOW)  # fmt: skip
    assert [(a.request_id, a.sandbox_id, a.path) for a in of(actions, Claim)] == [
        ("r1", "mine", "cold")
    ]
    assert [a.for_request for a in of(actions, Create)] == ["r2"]
    assert [a.sandbox_id for a in of(actions, Destroy)] == ["left"]


def test_static_holds_its_size_and_a_claimed_replica_still_counts():
    policy = baseline("static", min_warm=3, max_warm=3)
    assert len(of(replicas(policy, NOW), Create)) == 3
    actions = replicas(policy, NOW, warm=3, requests=1)
    # the replica claimed in this decision is busy, not gone: nothing to replace
    assert len(of(actions, Claim)) == 1 and not of(actions, Create) and not of(actions, Destroy)
    assert len(of(replicas(policy, NOW, warm=2), Create)) == 1  # one released: replaced


def test_hpa_syncs_every_15_s_doubles_at_most_and_scales_down_after_the_window():
    policy = baseline("hpa", min_warm=1)
    # 1 replica, 3 busy (1 claimed + 2 waiting): 3 / 1 / 0.7 asks for 5, within max(2x, +4)
    actions = replicas(policy, NOW, warm=1, requests=3)
    assert len(of(actions, Claim)) == 1 and len(of(actions, Create)) == 4
    assert not of(replicas(policy, NOW + 10, leased=5, requests=20), Create)  # between syncs
    grown = replicas(policy, NOW + 15, leased=5, requests=20)  # 25 / 5 / 0.7 -> 36, cut to 10
    assert len(of(grown, Create)) == 5
    # idle again: the 300 s window keeps the highest recommendation
    assert not of(replicas(policy, NOW + 30, warm=10), Destroy)
    assert len(of(replicas(policy, NOW + 331, warm=10), Destroy)) == 9  # down to minReplicas


def test_keda_starts_jobs_for_pending_work_on_each_poll_only():
    policy = baseline("keda", max_warm=4)
    actions = replicas(policy, NOW, requests=6)
    assert len(of(actions, Create)) == 4  # min(max, pending) - running
    assert not of(replicas(policy, NOW + 10, leased=4, requests=5, tag="b"), Create)
    # the next poll: jobs still starting count as running
    assert len(of(replicas(policy, NOW + 30, leased=4, creating=1, requests=5), Create)) == 3
    assert not of(replicas(policy, NOW + 31, leased=2), Create)  # no work, no jobs


def test_kpa_panics_on_a_burst_and_does_not_scale_down_in_panic():
    policy = baseline("kpa", min_warm=1)
    for t in range(0, 60, 5):  # a quiet minute: one replica (min-scale)
        replicas(policy, NOW + t, warm=1)
    # a burst: the 6 s window averages (0 + 5) / 2 = 2.5 -> 4 replicas, 4x the current one;
    # the 60 s window alone would ask for 1
    burst = replicas(policy, NOW + 60, warm=1, requests=5)
    assert len(of(burst, Claim)) == 1 and len(of(burst, Create)) == 3
    assert not of(replicas(policy, NOW + 70, warm=4), Destroy)  # quiet, but in panic
    assert len(of(replicas(policy, NOW + 125, warm=4), Destroy)) == 3  # panic over: stable


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("nope")


# --- rule 9: drain ------------------------------------------------------------------


def test_a_draining_node_gets_no_placements_and_its_idle_sandboxes_go():
    nodes = [node("n1", draining=True), node("n2")]
    idle = [
        sandbox("w", S.WARM, since=NOW - 100),
        sandbox("pz", S.PAUSED, since=NOW - 5),
        sandbox("h", S.HIBERNATED, since=NOW - 5),
    ]
    busy = [sandbox("l", S.LEASED, idle_since=NOW), sandbox("lp", S.LEASED_PAUSED)]
    making = [sandbox("c", S.CREATING)]  # placed before the drain began
    actions = decide(
        snap(nodes, idle + busy + making, [request("r1"), request("r2")]),
        {"p": params(min_warm=3)},
        NOW,
    )
    # its idle sandboxes are removed, not claimed; the leases run on
    assert {a.sandbox_id for a in of(actions, Destroy)} == {"w", "pz", "h"}
    assert all(a.reason == "its node is draining" for a in of(actions, Destroy))
    assert of(actions, Claim) == []
    # every create goes elsewhere: both requests' (its create under way is not waited
    # for) and the warm pool's, which it no longer holds
    assert {a.node for a in of(actions, Create)} == {"n2"}
    assert len(cold(actions)) == 2
    assert of(actions, Create, "warm pool below target")


def test_a_request_no_other_node_can_take_waits_rather_than_going_to_a_draining_node():
    actions = decide(snap([node("n1", draining=True)], [], [request("r")]), {"p": params()}, NOW)
    assert of(actions, Create) == []
    (unplaced,) = actions
    assert unplaced.code == "no_room" and not unplaced.final


def test_a_draining_nodes_room_does_not_count_against_overflow():
    """Local utilisation is that of the nodes that take work: a full node left alone
    beside a draining empty one overflows to the cloud."""
    nodes = [
        node("n1", slots=10, used=9),
        node("n2", slots=1000, draining=True),
        node("c", "cloud"),
    ]
    actions = decide(snap(nodes, [], [request("r")]), {"p": params()}, NOW)
    assert [a.node for a in cold(actions)] == ["c"]


def test_a_drained_node_is_left_alone():
    actions = decide(snap([node("n1", draining=True)], []), {"p": params()}, NOW)
    assert actions == []


def test_one_decisions_placements_use_up_room_as_a_look_at_every_node_would():
    """A decision keeps the nodes with room from one placement to the next: every one is
    where a fresh look at the nodes would put it, and no node is overbooked."""
    from dsec.policy import Placement

    nodes = [node(f"n{i:02}", slots=3, used=i % 3) for i in range(40)]  # 81 slots free
    kept, fresh = Placement(nodes, seed=3), Placement(nodes, seed=3)
    placed = []
    for i in range(85):
        fresh._room.clear()  # a look at every node, each time
        at = kept.place(TEMPLATES["t"], 0.8, ("k", i))
        assert at == fresh.place(TEMPLATES["t"], 0.8, ("k", i))
        placed.append(at and at.id)
    assert None not in placed[:81] and placed[81:] == [None] * 4
    by_node = {n.id: placed.count(n.id) for n in nodes}
    assert all(by_node[n.id] == 3 - n.used.slots for n in nodes)
