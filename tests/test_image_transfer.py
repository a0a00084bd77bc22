"""A template's image reaches a node that lacks it, streamed from the control plane's host
(controlplane/images.py pushes, agent/images.py loads), and only the control plane can
make a node load one.

The node's agent runs on a second dockerd this module starts beside the shared one (its
own data root and socket), which starts without the template's image: the control plane,
on the shared engine, saves it there and sends it over real HTTP. The images are built
into the shared engine from the base image and a file of their own (a layer the second
engine cannot already hold), and removed at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import tarfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import docker
import pytest
import pytest_asyncio
from aiohttp import web
from conftest import eventually, make_spec, metric_value, started_pool
from inprocess import served

from bench.extra_nodes import ExtraAgent, PrivateEngine, node_info, private_engine, start_agent
from controlplane.agents import HttpAgents
from controlplane.config import ControlPlaneConfig, default_templates
from controlplane.identities import Identities
from controlplane.images import BACKOFF_FIRST_S, MAX_TRANSFERS, ImageDistributor
from controlplane.scheduler import build_scheduler
from controlplane.view import NodeEntry
from dsec.client import Client
from dsec.image import BASE_IMAGE
from dsec.launch.local import LocalPool
from dsec.models import NodeInfo, PoolParams, TemplateSpec
from dsec.policy import Resources
from dsec.tokens import new_token

pytestmark = pytest.mark.docker

FAR_HOST = "127.0.0.11"  # LocalPool gives its own agents 127.0.0.2 upwards; it has none here
CARRIED = "carried"  # the template whose image the node lacks


def build_image(client: docker.DockerClient, ref: str) -> None:
    """`ref`: the base image and /marker, holding `ref` (a layer no other image has)."""
    context = io.BytesIO()
    with tarfile.open(fileobj=context, mode="w") as tar:
        for name, data in (
            ("Dockerfile", f"FROM {BASE_IMAGE}\nCOPY marker /marker\n".encode()),
            ("marker", f"{ref}\n".encode()),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    context.seek(0)
    client.images.build(fileobj=context, custom_context=True, tag=ref, rm=True)


def saved(client: docker.DockerClient, ref: str) -> bytes:
    return b"".join(client.images.get(ref).save(named=True))


def with_garbled_layer(archive: bytes) -> bytes:
    """`archive` (a docker save) with its last layer's bytes replaced by garbage of the
    same size: a tar whose manifest still names the image, which only the engine's own
    reading of the layer refuses."""
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        members = [(m, tar.extractfile(m).read() if m.isfile() else b"") for m in tar]
    manifest = next(data for m, data in members if m.name == "manifest.json")
    last_layer = json.loads(manifest)[0]["Layers"][-1]
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for member, data in members:
            if member.name == last_layer:
                data = bytes((i * 7 + 3) % 251 for i in range(len(data)))
            tar.addfile(member, io.BytesIO(data) if member.isfile() else None)
    return out.getvalue()


@pytest.fixture(scope="module")
def second_engine() -> Iterator[PrivateEngine]:
    """A dockerd of this module's own, without the base image (what it is sent is the
    test), stopped (and waited for) and its dirs removed at the end."""
    with private_engine("dsec-e2-", base_image=False) as engine:
        yield engine


@pytest.fixture(scope="module")
def refs(docker_client) -> Iterator[dict[str, str]]:
    """Image names of this run: `carried` (the template's, built in the test), `refused`
    (built now, for the archives the node must refuse); removed from the shared engine
    at the end."""
    tag = uuid.uuid4().hex[:8]
    names = {
        "carried": f"dsec-test-carried-{tag}:latest",
        "refused": f"dsec-test-refused-{tag}:latest",
    }
    build_image(docker_client, names["refused"])
    try:
        yield names
    finally:
        for ref in names.values():
            with contextlib.suppress(docker.errors.ImageNotFound):
                docker_client.images.remove(ref, force=True)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pool(docker_client, refs, tmp_path_factory) -> AsyncIterator[LocalPool]:
    """A control plane on the shared engine with no node of its own, whose template
    `carried` names an image no engine holds yet; nothing is kept warm."""
    templates = {
        **default_templates(),
        CARRIED: TemplateSpec(name=CARRIED, image=refs["carried"]),
    }
    spec = make_spec(
        tmp_path_factory.mktemp("images"),
        nodes=0,
        templates=templates,
        pool=PoolParams(min_warm=0, templates=[]),
    )
    async with started_pool(spec, docker_client) as p:
        yield p


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def far_node(pool: LocalPool, second_engine: PrivateEngine) -> AsyncIterator[ExtraAgent]:
    """`dsec agent` on the second engine (DOCKER_HOST), once it takes work."""
    agent = await start_agent(
        pool,
        f"{pool.spec.name}-far",
        host=FAR_HOST,
        slots=2,
        env={"DOCKER_HOST": second_engine.socket},
    )
    try:
        async with Client(pool.url, token=pool.tokens.admin) as operator:

            async def placeable() -> NodeInfo | None:
                info = await node_info(operator, agent.node_id)
                return info if info is not None and info.placeable else None

            await eventually(placeable, f"{agent.node_id} to register")
        yield agent
    finally:
        await agent.stop()
        left = second_engine.containers(agent.node_id)
        assert not left, "the agent left containers behind"


def engine_tags(engine: PrivateEngine) -> set[str]:
    return {t for image in engine.client().images.list() for t in image.tags}


@pytest.mark.asyncio(loop_scope="module")
async def test_a_node_lacking_a_templates_image_is_sent_it_and_runs_it(
    pool: LocalPool, far_node: ExtraAgent, second_engine: PrivateEngine, docker_client, refs
):
    carried = refs["carried"]
    node_id = far_node.node_id
    async with Client(pool.url, token=pool.tokens.admin) as operator:
        info = await node_info(operator, node_id)
        assert info is not None and carried not in info.images, info
        assert BASE_IMAGE in info.images  # `dsec agent` built it there, as on any node
        assert carried not in engine_tags(second_engine)

        # the host's engine gets it: from there it goes to the node, which then says so
        await asyncio.to_thread(build_image, docker_client, carried)

        async def reported() -> bool:
            info = await node_info(operator, node_id)
            return info is not None and carried in info.images

        await eventually(reported, f"{node_id} to report {carried}", timeout=60)
    assert carried in engine_tags(second_engine)
    transfers = {"node": node_id}
    sent = await metric_value(pool, "dsec_image_transfers_total", transfers | {"outcome": "ok"})
    assert sent == 1, sent  # once: it is not sent again while its report catches up
    for outcome in ("refused", "failed", "no_image"):
        assert not await metric_value(
            pool, "dsec_image_transfers_total", transfers | {"outcome": outcome}
        ), outcome

    async with Client(pool.url, token=pool.tokens.client) as client:
        async with client.sandbox(template=CARRIED, timeout=30) as sandbox:
            assert sandbox.node == node_id
            out = await sandbox.exec(["cat", "/marker"])
            assert (out.exit_code, out.stdout) == (0, f"{carried}\n"), out


async def put_image(agent_url: str, ref: str, body: bytes, token: str | None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with (
        aiohttp.ClientSession() as http,
        http.put(f"{agent_url}/v1/images", params={"ref": ref}, data=body, headers=headers) as resp,
    ):
        return resp.status, await resp.json()


@pytest.mark.asyncio(loop_scope="module")
async def test_only_the_control_plane_makes_a_node_load_and_a_bad_archive_leaves_nothing(
    pool: LocalPool, far_node: ExtraAgent, second_engine: PrivateEngine, docker_client, refs
):
    refused = refs["refused"]
    assert pool.identities is not None
    async with Client(pool.url, token=pool.tokens.admin) as operator:
        info = await node_info(operator, far_node.node_id)
    assert info is not None
    archive = await asyncio.to_thread(saved, docker_client, refused)
    engine = second_engine.client()
    images_before = {i.id for i in engine.images.list(all=True)}
    layers_before = set((second_engine.data_root / "overlay2").iterdir())

    # no credential, a client's, the node's own (its heartbeats'): none is the control
    # plane's call token for this node, and a good archive is refused with each
    for token, status in (
        (None, 401),
        (pool.tokens.client, 403),
        (pool.tokens.admin, 403),
        (pool.identities.node_token(far_node.node_id), 403),
        (pool.identities.call_token("another-node"), 403),
    ):
        answer = await put_image(info.url, refused, archive, token)
        assert answer[0] == status, (token == pool.tokens.client, answer)

    call_token = pool.identities.call_token(far_node.node_id)
    for body, why in (
        (b"\x00not a tar at all" * 1000, "not an image archive"),
        (archive[: len(archive) // 2], "not an image archive"),  # cut short: no manifest
        (await asyncio.to_thread(saved, docker_client, BASE_IMAGE), "does not hold image"),
        (with_garbled_layer(archive), "the engine refused it"),  # its manifest is whole
    ):
        status, answer = await put_image(info.url, refused, body, call_token)
        error = answer["error"]
        assert (status, error["code"]) == (422, "invalid_image_archive"), answer
        assert why in error["message"], answer
    status, answer = await put_image(info.url, "no tag@x", archive, call_token)
    assert status == 400 and answer["error"]["code"] == "invalid_ref", answer

    assert {i.id for i in engine.images.list(all=True)} == images_before
    # no layer the loads left: what is new is the layers of containers the node made
    # meanwhile, for its pool (and one it removed meanwhile took its layers with it)
    layers_of_containers = set()
    for c in engine.containers.list(all=True):
        upper = Path(c.attrs["GraphDriver"]["Data"]["UpperDir"]).parent
        layers_of_containers |= {upper, upper.with_name(f"{upper.name}-init")}
    layers_after = set((second_engine.data_root / "overlay2").iterdir())
    assert not layers_after - layers_before - layers_of_containers
    spool = pool.dir / f"{far_node.node_id}-images"
    assert not list(spool.iterdir()), list(spool.iterdir())


# --- the distributor's bounds and retries, against agents that hold every transfer ------


class SteppedClock:
    """Time that moves when the test says: backoffs pass without being waited for."""

    def __init__(self) -> None:
        self.t = 1000.0

    def now(self) -> float:
        return self.t

    def wall(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(0)


class HeldAgents:
    """Every node's agent, on one real server: each transfer is read to its end, then
    held until `answer` is set and answered `status`. What each node was sent, and how
    many transfers it received at once, is kept."""

    def __init__(self, identities: Identities, node_ids: list[str]) -> None:
        self.node_of = {identities.call_token(n): n for n in node_ids}
        self.receiving: list[str] = []
        self.most_at_once: dict[str, int] = {}  # for each node, and "all"
        self.whole: list[str] = []  # nodes whose transfer was read to its end
        self.sent: set[tuple[str, int]] = set()  # (ref, bytes) of every transfer
        self.answer = asyncio.Event()
        self.status = 503

    async def put_image(self, request: web.Request) -> web.Response:
        node = self.node_of[request.headers["Authorization"].removeprefix("Bearer ")]
        self.receiving.append(node)
        for who, n in ((node, self.receiving.count(node)), ("all", len(self.receiving))):
            self.most_at_once[who] = max(self.most_at_once.get(who, 0), n)
        try:
            size = 0
            async for chunk in request.content.iter_any():
                size += len(chunk)
            self.sent.add((request.query["ref"], size))
            self.whole.append(node)
            await self.answer.wait()
        finally:
            self.receiving.remove(node)
        return web.json_response({"ref": request.query["ref"], "bytes": size}, status=self.status)


@pytest.mark.asyncio(loop_scope="module")
async def test_transfers_are_bounded_and_a_failed_one_is_tried_again_later(docker_client):
    config = ControlPlaneConfig(admin_tokens=[new_token()], agent_token=new_token())
    identities = Identities.of(config)
    clock = SteppedClock()
    scheduler = build_scheduler(config, HttpAgents(identities), clock)
    lacking = [f"n{i}" for i in range(MAX_TRANSFERS + 2)]
    agents = HeldAgents(identities, lacking)
    app = web.Application()
    app.router.add_put("/v1/images", agents.put_image)
    async with served(app) as url:

        def node(node_id: str, images: frozenset[str] = frozenset(), **how) -> NodeEntry:
            capacity = Resources(8, 8192, 8)
            return NodeEntry(node_id, "local", url, capacity, images, "i", clock.t, **how)

        for node_id in lacking:
            scheduler.view.nodes[node_id] = node(node_id)
        # neither one that holds the image nor one being drained is sent it
        scheduler.view.nodes["holder"] = node("holder", images=frozenset({BASE_IMAGE}))
        scheduler.view.nodes["drained"] = node("drained", drain_requested=True)
        distributor = ImageDistributor(scheduler, identities)
        await distributor.start()
        try:

            async def pass_then_answer(status: int, expected: list[str]) -> None:
                """A pass starts transfers to `expected`, and no more; answered `status`."""
                agents.whole.clear()
                agents.answer.clear()
                agents.status = status
                await distributor.run_pass()
                await eventually(lambda: len(agents.whole) == len(expected), "the transfers")
                under_way = dict(distributor.sending)
                await distributor.run_pass()  # no slot free, or nothing else due
                assert distributor.sending == under_way  # none started beside them
                assert sorted(agents.whole) == sorted(under_way) == expected
                agents.answer.set()
                await eventually(lambda: not distributor.sending, "the answers")

            await pass_then_answer(503, lacking[:MAX_TRANSFERS])  # so many at once at most
            assert distributor.available("dsec-base") and not distributor.available("absent:1")
            # the failed ones wait out their backoff; the others go
            await pass_then_answer(200, lacking[MAX_TRANSFERS:])
            await distributor.run_pass()
            assert not distributor.sending
            clock.t += BACKOFF_FIRST_S
            await pass_then_answer(503, lacking[:MAX_TRANSFERS])  # failed twice in a row
            clock.t += BACKOFF_FIRST_S
            await distributor.run_pass()  # the backoff has doubled
            assert not distributor.sending
            clock.t += BACKOFF_FIRST_S
            await pass_then_answer(200, lacking[:MAX_TRANSFERS])
            clock.t += BACKOFF_FIRST_S
            await distributor.run_pass()  # sent: not again while the reports catch up
            assert not distributor.sending
        finally:
            await distributor.close()
    assert agents.most_at_once == {"all": MAX_TRANSFERS} | {n: 1 for n in lacking}
    archive_size = len(await asyncio.to_thread(saved, docker_client, BASE_IMAGE))
    assert agents.sent == {(BASE_IMAGE, archive_size)}  # each whole, as the engine saves it

    def counted(node_id: str, outcome: str) -> float | None:
        labels = {"node": node_id, "outcome": outcome}
        return scheduler.metrics.registry.get_sample_value("dsec_image_transfers_total", labels)

    for node_id in lacking:
        assert counted(node_id, "ok") == 1
        assert counted(node_id, "failed") == (2 if node_id in lacking[:MAX_TRANSFERS] else None)
