"""A node at DSec's density (issue 13): compact delta heartbeats, bounded whatever the
clients put in their leases.

The attack that made every node's heartbeat too large (a client holding sandboxes with
the largest legal labels) runs live against a pool; the rest runs without Docker: the
agent's report builder (agent/report.py) against the control plane's view
(controlplane/view.py), and the control plane's routes in this process.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import random
import secrets

import aiohttp
import pytest
import pytest_asyncio
from conftest import make_spec, started_pool
from inprocess import inprocess_controlplane
from pydantic import ValidationError

from agent.report import ReportSequence, sandbox_report, sandbox_row
from bench.report_scale import NODE, fleet, largest_row, node_report
from controlplane.view import ClusterView, SandboxEntry
from dsec.client import Client
from dsec.httpkit import MAX_BODY_BYTES
from dsec.models import (
    MAX_NODE_SANDBOXES,
    MAX_REPORT_BYTES,
    MAX_SANDBOX_ROW_BYTES,
    Capacity,
    LeaseGrant,
    NodeReport,
    PoolParams,
    ReportAck,
    SandboxRow,
    SandboxTable,
    Usage,
)
from dsec.states import SandboxState

LARGEST_LABELS = {f"{k:02d}" + "k" * 61: "\U0001f600" * 256 for k in range(32)}
CONTROL_CHARACTERS = ("\x01" * 256, "a\nb", "\x7f", "\u202e", "\u2028", "\x9b")


# --- the wire: what a client may put in a lease, and what a report may be -------------


@pytest.mark.parametrize("value", CONTROL_CHARACTERS)
async def test_an_acquire_with_a_label_of_control_characters_answers_422(value):
    async with inprocess_controlplane() as cp:
        headers = {"Authorization": f"Bearer {cp.tokens.client}"}
        body = {"labels": {"run": value}, "timeout_s": 0.1}
        resp = await cp.http.post("/v1/sandboxes", json=body, headers=headers)
        answer = await resp.json()
        assert resp.status == 422, answer
        assert answer["error"]["code"] == "validation_error"
        assert answer["error"]["details"][0]["loc"] == "labels.run"
        # printable text of any script passes, and waits for a sandbox as usual
        body["labels"]["run"] = 'épisode 7 \U0001f600 "quoted" back\\slash'
        resp = await cp.http.post("/v1/sandboxes", json=body, headers=headers)
        assert resp.status == 503, await resp.text()


@pytest.mark.parametrize("value", CONTROL_CHARACTERS)
def test_a_lease_grant_with_a_label_of_control_characters_is_refused(value):
    grant = {"lease_id": "0" * 32, "pool": "default", "request_id": "r"}
    assert LeaseGrant.model_validate({**grant, "labels": LARGEST_LABELS}).labels
    with pytest.raises(ValidationError, match="printable"):
        LeaseGrant.model_validate({**grant, "labels": {"run": value}})


def test_the_largest_legal_row_and_report_fit_their_bounds():
    rows = [largest_row(f"{'n' * 32}.{i:016x}") for i in range(MAX_NODE_SANDBOXES)]
    one, two = (len(SandboxTable.of(rows[:n]).model_dump_json()) for n in (1, 2))
    assert two - one <= MAX_SANDBOX_ROW_BYTES  # what one more sandbox adds
    report = NodeReport(
        node_id="n" * 32,
        kind="local",
        url="http://127.0.0.2:9",
        capacity=Capacity(cpus=1, memory_mb=1, slots=MAX_NODE_SANDBOXES),
        usage=Usage(),
        images=["i" * 512] * 10_000,
        incarnation="i" * 64,
        clock=1.0,
        seq=1,
        sandboxes=SandboxTable.of(rows),
    )
    assert MAX_BODY_BYTES < len(report.model_dump_json().encode()) <= MAX_REPORT_BYTES


def report_body(held: list, **fields) -> dict:
    """A first report of `held` as JSON data, with `fields` instead of its own."""
    body = node_report(ReportSequence(), held, 4_000.0).model_dump(mode="json")
    body.update(fields)
    return body


@pytest.mark.parametrize(
    "change",
    [
        lambda b: b["sandboxes"]["busy_s"].pop(),  # columns of different lengths
        lambda b: b["sandboxes"]["id"].__setitem__(0, "other-node.0123456789abcdef"),
        lambda b: b["sandboxes"]["busy_s"].__setitem__(0, -1.0),
        lambda b: b["sandboxes"]["active_at"].__setitem__(0, float("nan")),
        lambda b: b["sandboxes"]["idempotency_key"].__setitem__(0, "k" * 129),
        lambda b: b.update(removed=[b["sandboxes"]["id"][0]]),  # a full report removes none
        lambda b: b.update(base=b["seq"]),
    ],
    ids=["ragged", "other-node", "negative-busy", "nan", "long-key", "full-removes", "base"],
)
async def test_a_malformed_report_answers_422(change):
    body = report_body(fleet(3, random.Random(1)))
    change(body)
    async with inprocess_controlplane() as cp:
        headers = {"Authorization": f"Bearer {cp.identities.node_token(NODE)}"}
        resp = await cp.http.put(f"/v1/agents/{NODE}", data=json.dumps(body), headers=headers)
        assert resp.status == 422, await resp.text()


async def test_the_heartbeat_has_its_own_body_limit_and_takes_gzip():
    async with inprocess_controlplane() as cp:
        agent = {"Authorization": f"Bearer {cp.identities.node_token(NODE)}"}
        rows = [largest_row(f"{NODE}.{i:016x}") for i in range(5000)]
        body = report_body([], sandboxes=SandboxTable.of(rows).model_dump(mode="json"))
        raw = json.dumps(body).encode()
        assert len(raw) > MAX_BODY_BYTES
        resp = await cp.http.put(
            f"/v1/agents/{NODE}",
            data=gzip.compress(raw),
            headers={**agent, "Content-Encoding": "gzip", "Content-Type": "application/json"},
        )
        assert resp.status == 200, await resp.text()
        assert await resp.json() == {"seq": 1, "full_report": False}
        # what it counts is the unzipped body
        too_large = gzip.compress(b" " * (MAX_REPORT_BYTES + 1))
        resp = await cp.http.put(
            f"/v1/agents/{NODE}", data=too_large, headers={**agent, "Content-Encoding": "gzip"}
        )
        assert resp.status == 413 and (await resp.json())["error"]["code"] == "body_too_large"
        # a client route keeps the 1 MiB limit (an acquire's has room for its claim's files)
        client = {"Authorization": f"Bearer {cp.tokens.client}"}
        resp = await cp.http.post("/v1/pools/default/prewarm", data=raw, headers=client)
        assert resp.status == 413 and (await resp.json())["error"]["code"] == "body_too_large"


async def test_after_a_restart_a_lease_learnt_from_a_heartbeat_has_unknown_labels():
    sandboxes = fleet(10, random.Random(2))
    async with inprocess_controlplane() as cp:
        agent = {"Authorization": f"Bearer {cp.identities.node_token(NODE)}"}
        admin = {"Authorization": f"Bearer {cp.tokens.admin}"}
        sequence = ReportSequence()
        delta = report_body(sandboxes, seq=7, base=6)  # from before this control plane
        resp = await cp.http.put(f"/v1/agents/{NODE}", json=delta, headers=agent)
        assert await resp.json() == {"seq": 0, "full_report": True}
        full = node_report(sequence, sandboxes, 4_000.0).model_dump(mode="json")
        resp = await cp.http.put(f"/v1/agents/{NODE}", json=full, headers=agent)
        assert await resp.json() == {"seq": 1, "full_report": False}
        leased = next(s for s in sandboxes if s.record.lease_id)
        unleased = next(s for s in sandboxes if not s.record.lease_id)
        for sandbox, labels in ((leased, None), (unleased, {})):
            resp = await cp.http.get(f"/v1/sandboxes/{sandbox.id}", headers=admin)
            assert (await resp.json())["labels"] == labels


# --- the agent's reports applied by the view ----------------------------------------


def entries(view: ClusterView) -> dict[str, tuple]:
    """What the view believes of each sandbox, as the policy and the API read it."""

    def seen(e: SandboxEntry) -> tuple:
        return (e.node, e.pool, e.template, e.state, e.lease_id, e.idempotency_key, e.owner,
                e.labels, e.busy_s, e.idle_since, e.frozen_at, e.created_at, e.cpus,
                e.memory_mb)  # fmt: skip

    return {i: seen(e) for i, e in view.sandboxes.items()}


def assert_view_has(view: ClusterView, sandboxes, now: float, agent_clock: float) -> None:
    """The view holds `sandboxes` as each says of itself (GET on its agent), at `now`."""
    assert set(view.sandboxes) == {s.id for s in sandboxes}
    for sandbox in sandboxes:
        said = sandbox_report(sandbox, agent_clock)  # what GET on the agent answers
        entry = view.sandboxes[sandbox.id]
        assert (entry.state, entry.pool, entry.template) == (said.state, said.pool, said.template)
        assert (entry.lease_id, entry.idempotency_key, entry.owner) == (
            said.lease_id,
            said.idempotency_key,
            said.owner,
        )
        assert entry.labels == (None if said.lease_id else {})
        assert (entry.cpus, entry.memory_mb) == (said.cpus, said.memory_mb)
        assert entry.busy_s == pytest.approx(said.busy_s, abs=1e-3)
        assert entry.created_at == pytest.approx(said.created_at, abs=1e-3)
        if sandbox.running_execs:
            assert entry.idle_since is None  # not idle: running a command
        else:
            assert entry.idle_since == pytest.approx(now - said.idle_s, abs=1e-3)
        if said.frozen_s is None:
            assert entry.frozen_at is None
        else:
            assert entry.frozen_at == pytest.approx(now - said.frozen_s, abs=1e-3)


def test_a_report_of_5000_from_the_agent_gives_what_each_sandbox_says_of_itself():
    sandboxes = fleet(5000, random.Random(3))
    sandboxes[0].running_execs = 1
    view = ClusterView(confirm_grace_s=0)
    now, agent_clock = 50_000.0, 4_000.0  # the agent's clock is its own
    report = node_report(ReportSequence(), sandboxes, agent_clock)
    wire = NodeReport.model_validate_json(report.model_dump_json())
    assert view.apply_report(wire, now).ack.seq == 1
    assert_view_has(view, sandboxes, now, agent_clock)


class Node:
    """An agent's sandboxes that change step by step, and its report sequence."""

    def __init__(self, seed: int, count: int) -> None:
        self.rng = random.Random(seed)
        self.sandboxes = {s.id: s for s in fleet(count, self.rng)}
        self.clock = 4_000.0  # the agent's clock: past every instant fleet() gives

    def step(self) -> None:
        """Some of what happens on a node in a second; every composition of these moves
        is an edge of the state machine, as heartbeats may be lost between them."""
        self.clock += 1.0
        rng, by_state = self.rng, {}
        for s in self.sandboxes.values():
            by_state.setdefault(s.state, []).append(s)
        *ended, started = rng.sample(by_state[SandboxState.LEASED], 4)
        for s in ended:  # a command ends
            s.busy_s += rng.uniform(0.01, 2)
            s.last_active, s.running_execs = self.clock, 0
        started.running_execs = 1
        frozen, claimed = rng.sample(by_state[SandboxState.WARM], 2)
        frozen.state, frozen.frozen_at = SandboxState.PAUSED, self.clock
        claimed.state, claimed.record.lease_id = SandboxState.LEASED, secrets.token_hex(16)
        claimed.record.owner = secrets.token_hex(8)
        claimed.record.idempotency_key = f"k-{self.clock}"
        thawed = rng.choice(by_state[SandboxState.PAUSED])
        thawed.state, thawed.frozen_at, thawed.last_active = SandboxState.WARM, None, self.clock
        del self.sandboxes[rng.choice(list(self.sandboxes))]  # released, or the pool shrinks
        for s in fleet(2, rng, leased_share=0):  # made for the warm pool
            self.sandboxes[s.id] = s

    def report(self, sequence: ReportSequence) -> NodeReport:
        sent = node_report(sequence, list(self.sandboxes.values()), self.clock)
        return NodeReport.model_validate_json(sent.model_dump_json())


def test_deltas_after_lost_heartbeats_and_lost_answers_amount_to_full_reports():
    node = Node(seed=4, count=300)
    full_view, delta_view = ClusterView(confirm_grace_s=0), ClusterView(confirm_grace_s=0)
    fulls, deltas = ReportSequence(full_every=1), ReportSequence()
    fates = random.Random(5)
    kinds = set()
    for _ in range(300):
        node.step()
        now = 1_000 + node.clock
        fate = fates.choice(["delivered"] * 3 + ["lost", "answer lost"])
        full, delta = node.report(fulls), node.report(deltas)
        if fate == "lost":
            continue
        kinds.add("delta" if delta.base is not None else "full")
        fulls.acknowledged(full_view.apply_report(full, now).ack)
        ack = delta_view.apply_report(delta, now).ack
        assert not ack.full_report
        if fate == "delivered":
            deltas.acknowledged(ack)
        assert entries(delta_view) == entries(full_view)
        assert set(delta_view.nodes[NODE].rows) == set(node.sandboxes)
    assert kinds == {"delta", "full"}  # full: the first, and every FULL_REPORT_EVERY


def test_a_delta_is_much_shorter_than_a_full_report_and_carries_what_changed():
    node = Node(seed=6, count=5000)
    sequence = ReportSequence()
    view = ClusterView(confirm_grace_s=0)
    sequence.acknowledged(view.apply_report(node.report(sequence), 1.0).ack)
    node.step()
    delta = node.report(sequence)
    assert delta.base == 1 and delta.seq == 2
    # 3 commands ended, 1 started, 1 frozen, 1 thawed, 1 claimed, 2 made, 1 gone
    assert len(delta.sandboxes.id) <= 9 and len(delta.removed) == 1
    assert view.apply_report(delta, 2.0).ack.seq == view.nodes[NODE].seq == 2


def test_a_restarted_control_plane_asks_for_a_full_report_and_learns_everything():
    node = Node(seed=7, count=200)
    sequence, before = ReportSequence(), ClusterView(confirm_grace_s=0)
    for step in range(5):
        node.step()
        sequence.acknowledged(before.apply_report(node.report(sequence), step).ack)
    after = ClusterView(confirm_grace_s=0)  # the restarted control plane
    node.step()
    delta = node.report(sequence)
    ack = after.apply_report(delta, 10.0).ack
    assert delta.base is not None and ack.full_report and not after.sandboxes
    sequence.acknowledged(ack)
    full = node.report(sequence)
    assert full.base is None and not after.apply_report(full, 10.0).ack.full_report
    assert_view_has(after, list(node.sandboxes.values()), 10.0, node.clock)


def test_a_late_report_changes_nothing():
    node = Node(seed=8, count=50)
    sequence, view = ReportSequence(), ClusterView(confirm_grace_s=0)
    sequence.acknowledged(view.apply_report(node.report(sequence), 1.0).ack)
    node.step()
    older = node.report(sequence)
    node.step()
    newer = node.report(sequence)  # both based on report 1: the answer to `older` is lost
    assert view.apply_report(newer, 3.0).ack.seq == 3
    seen = entries(view)
    assert view.apply_report(older, 4.0).ack.seq == 3  # arrives late
    assert entries(view) == seen


def test_a_node_back_from_silence_gets_its_sandboxes_back_from_a_delta():
    node = Node(seed=9, count=50)
    sequence, view = ReportSequence(), ClusterView(confirm_grace_s=0)
    sequence.acknowledged(view.apply_report(node.report(sequence), 1.0).ack)
    states = {i: e.state for i, e in view.sandboxes.items()}
    view.mark_silent_nodes(100.0, timeout_s=5.0)
    assert {e.state for e in view.sandboxes.values()} == {SandboxState.LOST}
    delta = node.report(sequence)  # nothing changed on the node meanwhile
    assert delta.base == 1 and not delta.sandboxes.id
    view.apply_report(delta, 101.0)
    assert {i: e.state for i, e in view.sandboxes.items()} == states


def test_a_sandbox_settled_late_is_settled_by_a_later_delta_that_does_not_name_it():
    node = Node(seed=10, count=50)
    sequence, view = ReportSequence(), ClusterView(confirm_grace_s=5.0)
    sequence.acknowledged(view.apply_report(node.report(sequence), 0.0).ack)
    warm = next(s for s in node.sandboxes.values() if s.state == SandboxState.WARM)
    entry = view.sandboxes[warm.id]
    entry.op_in_flight = True  # the control plane is pausing it
    warm.state, warm.frozen_at = SandboxState.PAUSED, 0.5
    delta = node.report(sequence)
    assert warm.id in delta.sandboxes.id
    sequence.acknowledged(view.apply_report(delta, 10.0).ack)
    assert entry.state == SandboxState.WARM  # its outcome will say, not the report
    entry.op_in_flight = False  # ... the call's answer was lost, say
    quiet = node.report(sequence)
    assert warm.id not in quiet.sandboxes.id
    sequence.acknowledged(view.apply_report(quiet, 11.0).ack)
    assert entry.state == SandboxState.PAUSED and entry.frozen_at is not None
    # one the view forgot while its agent still has it comes back with the next report,
    # to be removed (it was released), as a full report would have it
    view.forget(warm.id)
    view.apply_report(node.report(sequence), 12.0)
    assert view.sandboxes[warm.id].state == SandboxState.DESTROYING


def test_a_delta_as_long_as_the_full_report_is_sent_full():
    node = Node(seed=11, count=20)
    sequence, view = ReportSequence(), ClusterView(confirm_grace_s=0)
    sequence.acknowledged(view.apply_report(node.report(sequence), 0.0).ack)
    for s in node.sandboxes.values():
        s.busy_s += 1.0
    assert node.report(sequence).base is None
    sequence.refused()  # the control plane refused a report: it may have lost track
    assert node.report(sequence).base is None


# --- the attack, live ----------------------------------------------------------------

HOLDERS = 40  # 40 x 32 labels of 256 four-byte characters: 1.3 MB, past the old limit
SLOTS = HOLDERS + 4


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def dense_pool(docker_client, tmp_path_factory):
    spec = make_spec(
        tmp_path_factory.mktemp("density"),
        nodes=1,
        capacity=Capacity(cpus=SLOTS, memory_mb=SLOTS * 1024, slots=SLOTS),
        pool=PoolParams(min_warm=2, max_warm=8),
    )
    async with started_pool(spec, docker_client) as p:
        yield p


@pytest.mark.asyncio(loop_scope="module")
async def test_a_client_with_the_largest_labels_cannot_take_down_a_node(dense_pool):
    pool = dense_pool
    async with (
        Client(pool.url, token=pool.tokens.client) as attacker,
        Client(pool.url, token=pool.tokens.admin) as operator,
    ):

        async def hold(i: int):
            key = f"{i:04d}" + "k" * 124  # the longest idempotency key
            return await attacker.acquire(
                "default", "base", timeout=120, labels=LARGEST_LABELS, idempotency_key=key
            )

        held = await asyncio.gather(*(hold(i) for i in range(HOLDERS)))
        try:
            await asyncio.sleep(3 * pool.spec.heartbeat_s + 5)  # past the heartbeat timeout
            [node] = (await operator.nodes()).nodes
            assert node.healthy and node.placeable, node
            assert node.sandboxes >= HOLDERS
            # the labels are the control plane's to serve, from the acquire ...
            assert (await attacker.get(held[0].id)).labels == LARGEST_LABELS
            # ... and the agent's, from its records
            url = f"{held[0].lease.agent_url}/v1/sandboxes/{held[0].id}"
            token = {"Authorization": f"Bearer {pool.identities.call_token(held[0].node)}"}
            async with aiohttp.ClientSession() as http, http.get(url, headers=token) as resp:
                assert (await resp.json())["labels"] == LARGEST_LABELS
            # and another holder (the operator's token) still gets a sandbox, and uses it
            async with operator.sandbox(timeout=30) as sb:
                assert (await sb.exec(["echo", "hi"], timeout=10)).stdout == "hi\n"
        finally:
            await asyncio.gather(*(sb.release() for sb in held))


def test_a_state_no_edge_leads_to_is_ignored_and_the_rest_of_the_report_counts():
    """A faulty or hostile node's report cannot make the view raise (a 500 on every
    heartbeat, the node unhealthy for good)."""
    node = Node(seed=10, count=20)
    sequence, view = ReportSequence(), ClusterView(confirm_grace_s=0)
    sequence.acknowledged(view.apply_report(node.report(sequence), 1.0).ack)
    leased = next(s for s in node.sandboxes.values() if s.state == SandboxState.LEASED)
    paused = next(s for s in node.sandboxes.values() if s.state == SandboxState.PAUSED)
    leased.state = SandboxState.HIBERNATED  # leased -> hibernated: no such edge
    paused.state, paused.frozen_at = SandboxState.WARM, None  # a legal thaw, same report
    node.clock += 1.0
    ack = view.apply_report(node.report(sequence), 2.0).ack
    assert ack.seq == 2
    assert view.sandboxes[leased.id].state == SandboxState.LEASED  # not taken
    assert view.sandboxes[paused.id].state == SandboxState.WARM  # taken


def test_a_report_told_only_what_changed_is_the_report_of_every_row():
    """As the simulator reports (ReportSequence.next_changes): the rows that may have
    changed, some of them unchanged, and the ids gone, give the reports that every row
    does, whatever answers are lost."""
    node = Node(seed=7, count=300)
    every, told = ReportSequence(), ReportSequence()
    previous: dict[str, SandboxRow] = {}
    fates = random.Random(8)
    for _ in range(150):
        node.step()
        rows = {s.id: sandbox_row(s) for s in node.sandboxes.values()}
        may_have_changed = [
            row for i, row in rows.items() if previous.get(i) != row or fates.random() < 0.05
        ]
        gone = [i for i in previous if i not in rows]
        full, delta = every.next(rows.values()), told.next_changes(may_have_changed, gone)
        assert (full.seq, full.base, full.sandboxes) == (delta.seq, delta.base, delta.sandboxes)
        assert sorted(full.removed) == sorted(delta.removed)
        if fates.random() < 0.8:  # else the answer is lost
            every.acknowledged(ReportAck(seq=full.seq))
            told.acknowledged(ReportAck(seq=delta.seq))
        previous = rows
