"""The agent's life on its node: adopting containers after a restart, watching the
Docker engine and reconciling after an outage, keeping the image list, joining the
control plane (the node's credentials: controlplane/identities.py), and the heartbeat
that carries the node's report to it."""

from __future__ import annotations

import asyncio
import gzip
import logging

import aiohttp
from pydantic import ValidationError

from agent.docker_driver import LABEL_SANDBOX, DockerOpError
from agent.engine import Work
from agent.node import Agent, LostSandbox
from agent.report import ReportSequence, node_report
from agent.sandboxes import Sandbox
from dsec.models import NodeIdentity, NodeLostCause, ReportAck, TemplateSpec
from dsec.states import SandboxState
from dsec.tls import client_ssl

log = logging.getLogger(__name__)


async def adopt(agent: Agent) -> None:
    """Take back this node's containers after a restart; remove what is unaccounted for."""
    records = {r.id: r for r in await agent.store.all()}
    containers = await agent.docker.list_labelled(agent.config.node_id)
    for c in containers:
        sandbox_id = c.labels.get(LABEL_SANDBOX, "")
        record = records.pop(sandbox_id, None)
        if record is None or not c.alive:
            # no record, or its processes died with the engine: nothing to hand back
            log.info("removing unaccounted container %s (%s)", c.container_id[:12], c.status)
            await agent.docker.remove(c.container_id)
            if record is not None:
                await agent.store.delete(record.id)
            continue
        state = SandboxState.LEASED if record.lease_id else SandboxState.WARM
        if c.status == "paused":
            state = SandboxState.LEASED_PAUSED if record.lease_id else SandboxState.PAUSED
        spec = TemplateSpec.model_validate(record.template)
        agent.sandboxes[record.id] = Sandbox(record, spec, state, agent.clock.now())
        log.info("adopted %s as %s", record.id, state)
    images = set(await agent.docker.image_tags())
    for record in records.values():
        if record.hibernated_image in images and record.archive_path:
            spec = TemplateSpec.model_validate(record.template)
            sandbox = Sandbox(record, spec, SandboxState.HIBERNATED, agent.clock.now())
            sandbox.frozen_at = agent.clock.now()
            agent.sandboxes[record.id] = sandbox
            continue
        await agent.store.delete(record.id)  # recorded, but its container is gone
    agent.resident.remove_all_but(set(agent.sandboxes))


async def watch_engine_forever(agent: Agent) -> None:
    while True:
        await agent.clock.sleep(agent.config.engine_check_s)
        await check_engine(agent)


async def check_engine(agent: Agent) -> None:
    """Ping the engine. When it answers again after an outage, reconcile first: an
    engine that restarted has stopped every container (there is no live restore)."""
    try:
        # asyncio.timeout, not wait_for: Python 3.11's wait_for returns the result of a
        # ping that ended as a cancellation came, and this loop would then go on (a
        # shutdown that awaited it would wait for the supervisor's SIGKILL)
        async with asyncio.timeout(agent.config.engine_check_timeout_s):
            await agent.docker.ping()
        if not agent.engine_ok:
            await reconcile(agent)
            log.info("the Docker engine is back; node %s takes work again", agent.config.node_id)
        agent.engine_ok = True
    except TimeoutError:
        agent.engine_away()
    except DockerOpError as e:
        agent.docker_failed(e)
        agent.engine_away()


async def reconcile(agent: Agent) -> None:
    """Drop the sandboxes whose containers are no longer running (a paused one still
    counts as running): an engine that restarted has stopped them all."""
    for sandbox in list(agent.sandboxes.values()):
        await drop_if_dead(agent, sandbox, "engine_lost")


async def watch_containers_forever(agent: Agent) -> None:
    """Find the containers that died while their sandboxes were held (killed or removed
    from outside, or killed for their memory use): one list of the node's stopped
    containers per look, whatever the node holds.

    A container is dropped when a second look still finds it dead: an engine shutting
    down stops its containers while it still answers, and if it went away between the
    two looks, they died with it (engine_lost), not of their own."""
    seen: dict[str, int] = {}  # container id -> the engine's outages when first seen dead
    while True:
        await agent.clock.sleep(agent.config.container_check_s)
        if not agent.engine_ok:
            continue  # its return reconciles every sandbox
        try:
            stopped = await agent.docker.list_labelled(agent.config.node_id, stopped=True)
        except DockerOpError as e:
            agent.docker_failed(e)
            continue
        dead = {}
        for c in stopped:
            sandbox = agent.sandboxes.get(c.labels.get(LABEL_SANDBOX, ""))
            if sandbox is not None and sandbox.record.container_id == c.container_id:
                dead[c.container_id] = sandbox
        for container_id, sandbox in dead.items():
            if (outages := seen.get(container_id)) is not None:
                went_away = outages != agent.engine_outages
                await drop_if_dead(agent, sandbox, "engine_lost" if went_away else None)
        seen = {cid: seen.get(cid, agent.engine_outages) for cid in dead}


async def drop_if_dead(agent: Agent, sandbox: Sandbox, cause: NodeLostCause | None = None) -> None:
    """Drop `sandbox` if its container no longer runs, as lost by `cause` (or, None, by
    what the engine says of its death). Its clients learn it from this agent (410
    sandbox_lost, with the cause) and from the control plane (the next report names it
    lost), and the pool refills without it. Looked at under its lock, so a create,
    restore or removal that ends meanwhile is seen as it is, not as a list taken before."""
    async with sandbox.lock:
        if agent.sandboxes.get(sandbox.record.id) is not sandbox or sandbox.state in (
            SandboxState.CREATING,  # its create call is still in Docker's hands
            SandboxState.HIBERNATED,  # no container: its image and archive survive
            SandboxState.DESTROYING,
        ):
            return
        died = await agent.docker.death_of(sandbox.record.container_id)
        if died is None:
            return
        cause = cause or died
        log.warning("sandbox %s was lost: %s", sandbox.record.id, cause)
        sandbox.move(SandboxState.DESTROYING)
        await agent.docker.remove(sandbox.record.container_id, Work.FREEZE)
        await agent.store.delete(sandbox.record.id)
        del agent.sandboxes[sandbox.record.id]
        agent.lost.add(sandbox.record.id, LostSandbox(cause, agent.clock.now()))


async def refresh_images_forever(agent: Agent) -> None:
    """The images this node holds, for placement; apart from the heartbeat, so a
    Docker engine busy with creates never delays a heartbeat."""
    while True:
        await agent.clock.sleep(agent.config.images_refresh_s)
        await refresh_images(agent)


async def refresh_images(agent: Agent) -> None:
    """The images the engine holds, and its id while not known (an engine that was
    away at the start is asked again at each refresh)."""
    try:
        agent.images = await agent.docker.image_tags()
        if not agent.engine_id:
            agent.engine_id = await agent.docker.engine_id()
            agent.share_engine_bound()
    except DockerOpError as e:
        agent.docker_failed(e)


async def join(agent: Agent, http: aiohttp.ClientSession) -> NodeIdentity:
    """This node's credentials from its control plane (controlplane/identities.py), asked
    for with what it was started with (its own node token, or the pool's join token),
    every heartbeat_s until given; they replace any it had."""
    node_id = agent.config.node_id
    url = f"{agent.config.controlplane_url}/v1/agents/{node_id}/join"
    auth = {"Authorization": f"Bearer {agent.config.agent_token}"}
    while True:
        try:
            async with http.post(url, headers=auth) as resp:
                if resp.status == 200:
                    identity = NodeIdentity.model_validate_json(await resp.read())
                    if identity.node_id == node_id:
                        agent.identity = identity
                        log.info("node %s joined %s", node_id, agent.config.controlplane_url)
                        return identity
                log.warning("join refused: %s %s", resp.status, await resp.text())
        except (aiohttp.ClientError, TimeoutError, ValidationError) as e:
            log.warning("join at %s failed: %s", url, e)
        agent.metrics.heartbeat_failures.labels(node_id).inc()
        await agent.clock.sleep(agent.config.heartbeat_s)


async def heartbeat_forever(agent: Agent) -> None:
    """Join, then report to the control plane every heartbeat_s: deltas, full reports
    when due (agent/report.py says when and why), gzipped: a full report is mostly ids
    and keys. A report refused for its credential means they no longer hold (a control
    plane with another key): the node joins again."""
    assert agent.config.controlplane_url
    url = f"{agent.config.controlplane_url}/v1/agents/{agent.config.node_id}"
    sequence = ReportSequence()
    async with aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=5),
        connector=aiohttp.TCPConnector(ssl=client_ssl(agent.config.ca)),
    ) as http:
        await join(agent, http)
        await agent.listening.wait()  # the report must carry the address clients will use
        while True:
            agent.metrics.sandboxes.labels(agent.config.node_id).set(len(agent.sandboxes))
            agent.metrics.observe_engine(agent.docker.engine)
            resend = rejoin = False
            assert agent.identity is not None  # joined
            headers = {
                "Authorization": f"Bearer {agent.identity.node_token}",
                "Content-Type": "application/json",
                "Content-Encoding": "gzip",
            }
            try:
                report = node_report(agent, sequence)
                body = gzip.compress(report.model_dump_json().encode(), compresslevel=1)
                async with http.put(url, data=body, headers=headers) as resp:
                    if resp.status >= 300:
                        sequence.refused()
                        agent.metrics.heartbeat_failures.labels(agent.config.node_id).inc()
                        log.warning("heartbeat refused: %s %s", resp.status, await resp.text())
                        rejoin = resp.status in (401, 403)
                    else:
                        ack = ReportAck.model_validate_json(await resp.read())
                        sequence.acknowledged(ack)
                        # it could not apply this delta (it restarted): a full report now
                        resend = ack.full_report and report.base is not None
            except (aiohttp.ClientError, TimeoutError, ValidationError) as e:
                agent.metrics.heartbeat_failures.labels(agent.config.node_id).inc()
                log.warning("heartbeat to %s failed: %s", url, e)
            if rejoin:
                await join(agent, http)
            if not resend:
                await agent.clock.sleep(agent.config.heartbeat_s)
