"""The edges of issue 14: credentials before bodies on every route, /metrics and service
discovery behind a token, a private state directory, a quoted env file, each child
process with its own credentials only, the audit log's rotation and its record of
refused credentials, and the alert rules in deploy/.

In this process where that is enough (tests/inprocess.py: a control plane without
agents, an agent without Docker); the child processes' environments need a live pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import logging
import os
import re
import shutil
import stat
import subprocess
import sys
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path

import aiohttp
import pytest
import yaml
from conftest import eventually, make_spec, started_pool
from inprocess import IdleEngine, inprocess_agent, inprocess_controlplane
from pydantic import ValidationError
from test_observability import PROMETHEUS, free_port, prometheus_config

from agent.app import agent_api
from agent.audit import AuditLog, AuditRecord
from agent.config import AgentConfig
from agent.node import Agent
from agent.sandboxes import Sandbox
from agent.store import SandboxRecord
from controlplane.app import controlplane_api
from controlplane.cloud import LocalCloudProvider
from controlplane.config import CloudConfig
from controlplane.identities import Identities
from controlplane.spent import KeyLog
from dsec.cli import build_parser, main
from dsec.client import Client
from dsec.httpkit import form_body
from dsec.image import BASE_IMAGE
from dsec.launch.local import LocalPool, Tokens, write_env_file
from dsec.models import LeaseGrant, PoolParams, TemplateSpec
from dsec.processes import is_credential
from dsec.states import SandboxState
from dsec.tokens import NO_EXPIRY, lease_token, new_token

REPO = Path(__file__).resolve().parent.parent
ALERTS = REPO / "deploy" / "alerts.yml"
PROMETHEUS_CONFIG = REPO / "deploy" / "prometheus.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "dsec.json"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"

SID = "n1.0123456789abcdef"
LEASE = "a" * 32
# nested past Python's recursion limit, and far under the 1 MiB body limit
DEEP_BODY = b"[" * 100_000 + b"]" * 100_000
PATH_PARAMS = {
    "sandbox_id": SID,
    "name": "default",
    "node_id": "n1",
    "lease_id": "0" * 32,
    "snapshot": "0" * 32,
    "index": "0",
}
JSON = {"Content-Type": "application/json"}


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def loosened(path: Path, directory: bool = False) -> Path:
    """`path` (made, empty, if missing) readable by all, as an older version left it."""
    if directory:
        path.mkdir(exist_ok=True)
    elif not path.exists():
        path.touch()
    os.chmod(path, 0o755 if directory else 0o644)
    return path


def private_mode(p: Path) -> int:
    """What `p` must be: 0700 for a directory, 0600 for a file. Except a sandbox's
    resident-loop directory (agent/resident.py), which the sandbox mounts read-only and
    its user passes through: 0711, its files and pipes 0600 (the loop's alone, as root
    in the container). The host reaches it only through the 0700 `<node>-resident`
    directory above it. The loop's shell, the node's copy of the host's busybox and its
    links in those directories, is 0111: run, never read, by anyone but root."""
    if p.name == "sh" and p.parent.parent.name.endswith("-resident"):
        return 0o111
    if p.name.endswith("-resident-sh"):
        return 0o111
    if p.parent.name.endswith("-resident"):
        return 0o711
    return 0o700 if p.is_dir() else 0o600


def assert_private(root: Path) -> None:
    """`root` and everything under it as `private_mode` says, and the agent's own."""
    wrong = [
        f"{p} {oct(mode(p))} uid {p.lstat().st_uid}"
        for p in [root, *root.rglob("*")]
        if mode(p) != private_mode(p) or p.lstat().st_uid != os.getuid()
    ]
    assert not wrong, wrong


def lease_a_sandbox(agent: Agent, state: SandboxState = SandboxState.LEASED) -> str:
    """A sandbox on `agent` with no container (nothing here reaches the engine); the
    token of its lease."""
    spec = TemplateSpec(name="base", image=BASE_IMAGE)
    record = SandboxRecord(
        id=SID,
        container_id="c1",
        pool="default",
        template=spec.model_dump(),
        created_at=0.0,
        lease_id=LEASE if state == SandboxState.LEASED else None,
        owner="0123456789abcdef",
    )
    agent.sandboxes[SID] = Sandbox(record, spec, state, 0.0)
    assert agent.identity is not None
    return lease_token(agent.identity.lease_key, SID, LEASE, record.owner, NO_EXPIRY)


def bearer(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def routes(api) -> list[tuple[str, str]]:
    """Every route of an API with its path parameters filled in, but /healthz: each
    needs a credential (the metrics routes once a metrics token is set)."""
    return [
        (method, path.format(**PATH_PARAMS))
        for method, path, *_ in api.routes
        if path != "/healthz"
    ]


# --- credentials before bodies --------------------------------------------------------


@pytest.mark.parametrize(("method", "path"), routes(controlplane_api()))
async def test_the_control_plane_checks_credentials_before_it_reads_a_body(method, path):
    async with inprocess_controlplane(metrics_token=new_token()) as cp:
        for token, status in ((None, 401), (new_token(), 403), (cp.tokens.agent, 403)):
            if path.endswith("/join") and token == cp.tokens.agent:
                continue  # a node joins with it (and sends no body)
            resp = await cp.http.request(method, path, data=DEEP_BODY, headers=bearer(token) | JSON)
            assert resp.status == status, (method, path, await resp.text())


@pytest.mark.parametrize(("method", "path"), routes(agent_api()))
async def test_the_agent_checks_credentials_before_it_reads_a_body(method, path, tmp_path):
    async with inprocess_agent(tmp_path, metrics_token=new_token()) as a:
        lease = lease_a_sandbox(a.agent)
        lease_route = "/files" in path or "/exec" in path
        # a client's lease token on the control plane's routes, a stranger's on its own
        wrong = new_token() if lease_route else lease
        for token, status in ((None, 401), (wrong, 403)):
            resp = await a.http.request(method, path, data=DEEP_BODY, headers=bearer(token) | JSON)
            assert resp.status == status, (method, path, await resp.text())


# --- /metrics and service discovery ---------------------------------------------------


async def status_of(http, path: str, token: str | None) -> int:
    resp = await http.get(path, headers=bearer(token))
    return resp.status


async def test_control_plane_metrics_and_discovery_need_the_metrics_token_once_it_is_set():
    metrics = new_token()
    async with inprocess_controlplane(metrics_token=metrics) as cp:
        for path in ("/metrics", "/v1/sd/prometheus"):
            assert await status_of(cp.http, path, None) == 401, path
            assert await status_of(cp.http, path, cp.tokens.client) == 403, path
            assert await status_of(cp.http, path, cp.tokens.agent) == 403, path
            assert await status_of(cp.http, path, metrics) == 200, path
            assert await status_of(cp.http, path, cp.tokens.admin) == 200, path


async def test_without_a_metrics_token_metrics_are_open_unless_a_token_is_required():
    async with inprocess_controlplane() as cp:  # what a Prometheus set up before expects
        assert await status_of(cp.http, "/metrics", None) == 200
    async with inprocess_controlplane(require_metrics_token=True) as cp:
        assert await status_of(cp.http, "/v1/sd/prometheus", None) == 401
        assert await status_of(cp.http, "/v1/sd/prometheus", cp.tokens.admin) == 200
    async with inprocess_controlplane(metrics_token=new_token(), require_metrics_token=False) as cp:
        assert await status_of(cp.http, "/metrics", None) == 200


async def test_agent_metrics_need_the_metrics_token_once_it_is_set(tmp_path):
    metrics = new_token()
    async with inprocess_agent(tmp_path, metrics_token=metrics) as a:
        lease = lease_a_sandbox(a.agent)
        assert await status_of(a.http, "/metrics", None) == 401
        for not_for_metrics in (a.agent.identity.call_token, lease):
            assert await status_of(a.http, "/metrics", not_for_metrics) == 403
        assert await status_of(a.http, "/metrics", metrics) == 200
    # an agent has no operator token to fall back on
    with pytest.raises(ValidationError, match="needs a metrics_token"):
        AgentConfig(
            node_id="n1", agent_token=new_token(), state_dir=tmp_path, require_metrics_token=True
        )


def test_the_commands_take_the_metrics_options(monkeypatch):
    parser = build_parser()
    for command in (["controlplane"], ["agent", "--node-id", "n1"]):
        assert parser.parse_args(command).require_metrics_token is None
        required = parser.parse_args([*command, "--metrics-token-required"])
        assert required.require_metrics_token is True
        assert parser.parse_args([*command, "--open-metrics"]).require_metrics_token is False
    assert parser.parse_args(["up", "--metrics-token"]).metrics_token is True
    monkeypatch.setenv("DSEC_AGENT_TOKEN", new_token())
    monkeypatch.delenv("DSEC_METRICS_TOKEN", raising=False)
    assert main(["agent", "--node-id", "n1", "--metrics-token-required"]) == 2


def test_dsec_version_prints_the_installed_version(capsys):
    with pytest.raises(SystemExit) as ended:
        main(["--version"])
    assert ended.value.code == 0
    assert capsys.readouterr().out == f"dsec {importlib.metadata.version('dsec')}\n"


async def test_a_pool_whose_engine_has_gone_stops_with_a_line_not_a_traceback(
    tmp_path, monkeypatch
):
    """Ctrl-C that also stopped the engine (as `./run` once let it): the stop's sweep says
    in one line what it could not do, and raises nothing."""
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-engine.sock")
    pool = LocalPool(make_spec(tmp_path))
    assert await pool.stop() == 0
    [failure] = pool.sweep_failures
    assert failure.startswith("the Docker engine did not answer") and "not removed" in failure


# --- the state directory --------------------------------------------------------------


async def test_an_agent_makes_its_state_dir_private_also_when_it_was_not(tmp_path):
    state = loosened(tmp_path / "state", directory=True)
    hibernated = loosened(state / "n1-hibernated", directory=True)
    loosened(hibernated / f"{SID}.tar")
    for name in ("n1.sqlite", "n1.sqlite-wal", "n1.sqlite-shm", "n1-audit.jsonl"):
        loosened(state / name)
    loosened(state / "n1-audit.jsonl.1")
    async with inprocess_agent(state) as a:
        assert_private(state)  # at start, before any write
        lease_a_sandbox(a.agent)
        await a.agent.store.put(a.agent.sandboxes[SID].record)  # a fresh -wal and -shm
        resp = await a.http.post(f"/v1/sandboxes/{SID}/exec", json={"cmd": ["true"]})
        assert resp.status == 401  # its audit record: a write to the log
        assert (state / "n1.sqlite-wal").exists()
        assert_private(state)


async def test_a_new_agent_creates_its_files_private(tmp_path):
    state = tmp_path / "fresh"
    async with inprocess_agent(state) as a:
        lease_a_sandbox(a.agent)
        await a.agent.store.put(a.agent.sandboxes[SID].record)
        resp = await a.http.post(f"/v1/sandboxes/{SID}/exec", json={"cmd": ["true"]})
        assert resp.status == 401
        names = {p.name for p in state.iterdir()}
        assert {"n1.sqlite", "n1.sqlite-wal", "n1-audit.jsonl"} <= names, names
        assert_private(state)


class SnapshotEngine(IdleEngine):
    """What a hibernation asks of the engine: an archive of the work dir, an image."""

    async def unpause(self, container_id, work) -> None:
        return None

    async def archive_dir(self, container_id, path, cap, user) -> bytes:
        return b"the work dir, as a tar"

    async def commit(self, container_id, repository, tag) -> str:
        return f"{repository}:{tag}"

    async def remove(self, container_id, work=None) -> None:
        return None


async def test_a_hibernation_archive_is_private(tmp_path):
    async with inprocess_agent(tmp_path, SnapshotEngine()) as a:
        lease_a_sandbox(a.agent, SandboxState.PAUSED)
        sandbox = await a.agent.hibernate(SID)
        archive = Path(sandbox.record.archive_path)
        assert archive.read_bytes() == b"the work dir, as a tar"
        assert mode(archive) == 0o600 and mode(archive.parent) == 0o700


async def test_spent_keys_are_private_also_when_the_file_was_not(tmp_path):
    state = loosened(tmp_path / "controlplane", directory=True)
    path = loosened(state / "spent-keys.jsonl")
    path.write_text(json.dumps(["k0", SID]) + "\n")
    keys = KeyLog(path, limit=2)
    assert "k0" in keys
    assert_private(state)
    for n in range(1, 6):  # appended, then past twice the limit rewritten
        await keys.add(f"k{n}", SID)
    assert_private(state)
    fresh = tmp_path / "fresh" / "spent-keys.jsonl"
    await KeyLog(fresh, limit=2).add("k", SID)
    assert_private(fresh.parent)


def test_the_env_file_is_private_and_sh_takes_every_value_as_it_is(tmp_path):
    hostile = "a b'c\"d $(touch ran-1) `touch ran-2`; touch ran-3\nexport X=1"
    tokens = Tokens(client=hostile, admin="plain-token", agent="x" * 43, metrics="m&m|m")
    env = {"DSEC_URL": "http://127.0.0.1:8700", **tokens.env()}
    env_file = loosened(tmp_path / "env")
    write_env_file(env_file, env)
    assert mode(env_file) == 0o600
    show = "import json, os; print(json.dumps({k: v for k, v in os.environ.items()}))"
    sourced = subprocess.run(
        ["sh", "-c", '. "$1" && exec "$2" -c "$3"', "sh", str(env_file), sys.executable, show],
        cwd=tmp_path,
        env={"PATH": os.environ["PATH"]},
        capture_output=True,
        text=True,
        check=True,
    )
    seen = json.loads(sourced.stdout)
    assert {k: seen.get(k) for k in env} == env
    assert "X" not in seen and not list(tmp_path.glob("ran-*")), "the env file ran something"


# --- the audit log ----------------------------------------------------------------------


def command_record(n: int) -> AuditRecord:
    return AuditRecord(
        time=float(n),
        node="n1",
        sandbox=SID,
        lease_id=LEASE,
        pool="default",
        peer="127.0.0.1",
        cmd=f"echo {n}",
        cmd_truncated=False,
        exit_code=0,
        duration_ms=1.0,
    )


def numbers(records) -> list[int]:
    return [int(r.time) for r in records]


async def test_the_audit_log_rotates_by_size_and_keeps_its_last_files(tmp_path):
    path = tmp_path / "n1-audit.jsonl"
    log = AuditLog(path, max_bytes=4096, files=3)
    line = len(command_record(100).model_dump_json()) + 1
    for n in range(200):
        await log.append(command_record(n))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "n1-audit.jsonl",
        "n1-audit.jsonl.1",
        "n1-audit.jsonl.2",
    ]
    for kept in tmp_path.iterdir():
        assert kept.stat().st_size < 4096 + line and mode(kept) == 0o600
    found = numbers(await log.read(None, 10_000))
    # the newest records, in order, each once, read across the three files
    assert found == list(range(found[0], 200)) and found[0] > 0
    assert len(found) > 2 * (4096 // line)
    assert numbers(await log.read(SID, 5)) == found[-5:]
    await log.close()


async def test_reads_see_each_kept_record_once_while_the_log_rotates(tmp_path):
    log = AuditLog(tmp_path / "n1-audit.jsonl", max_bytes=2048, files=2)
    snapshots: list[list[int]] = []
    writing = asyncio.Event()

    async def write() -> None:
        for n in range(400):
            await log.append(command_record(n))
            writing.set()
        writing.clear()

    async def read() -> None:
        await writing.wait()
        while writing.is_set():
            snapshots.append(numbers(await log.read(None, 10_000)))

    await asyncio.gather(write(), read())
    await log.close()
    assert len(snapshots) > 10
    for found in snapshots:
        assert found == list(range(found[0], found[0] + len(found))), found


async def test_refused_credentials_leave_an_audit_record_with_the_callers_address(tmp_path):
    async with inprocess_agent(tmp_path) as a:
        lease = lease_a_sandbox(a.agent)
        stranger = new_token()
        tries = [
            # the control plane's routes: no credential, then a client's lease token
            ("POST", "/v1/sandboxes", "/v1/sandboxes", None, 401),
            ("POST", f"/v1/sandboxes/{SID}/lease", "/v1/sandboxes/{sandbox_id}/lease", lease, 403),
            ("GET", "/v1/audit", "/v1/audit", stranger, 403),
            # the lease token's routes
            ("POST", f"/v1/sandboxes/{SID}/exec", "/v1/sandboxes/{sandbox_id}/exec", stranger, 403),
            (
                "GET",
                f"/v1/sandboxes/{SID}/exec/stream",
                "/v1/sandboxes/{sandbox_id}/exec/stream",
                None,
                401,
            ),
            (
                "PUT",
                f"/v1/sandboxes/{SID}/files?path=/work/x",
                "/v1/sandboxes/{sandbox_id}/files",
                stranger,
                403,
            ),
        ]
        for method, path, _, token, status in tries:
            resp = await a.http.request(method, path, json={"cmd": ["id"]}, headers=bearer(token))
            assert resp.status == status, (path, await resp.text())
        operator = bearer(a.agent.identity.call_token)
        records = (await (await a.http.get("/v1/audit", headers=operator)).json())["records"]
        on_sandbox = await (await a.http.get(f"/v1/audit?sandbox={SID}", headers=operator)).json()
    assert [(r["event"], r["method"], r["route"], r["status"]) for r in records] == [
        ("refused", method, route, status) for method, _, route, _, status in tries
    ]
    for r in records:
        assert r["peer"] == "127.0.0.1" and r["node"] == "n1"
        assert r["sandbox"] == (SID if "{sandbox_id}" in r["route"] else None)
        assert r["code"] == ("unauthenticated" if r["status"] == 401 else "forbidden")
    assert len(on_sandbox["records"]) == 4
    written = b"".join(p.read_bytes() for p in tmp_path.glob("n1-audit.jsonl*"))
    assert stranger.encode() not in written and lease.encode() not in written


async def test_a_grant_s_form_other_than_the_grant_then_its_files_is_refused(tmp_path):
    """The control plane sends a claim's files as a form's second part, bytes as they
    are; any other form is refused before a sandbox is touched."""
    async with inprocess_agent(tmp_path) as a:
        lease_a_sandbox(a.agent, SandboxState.WARM)
        grant = LeaseGrant(lease_id=LEASE, pool="default", request_id="r1").model_dump_json()
        operator = bearer(a.agent.identity.call_token)
        for parts, status, says in [
            ([("files", None, b"x")], 422, "not ['files']"),
            ([("grant", None, grant)], 422, "not ['grant']"),
            ([("grant", None, grant), ("files", None, b"x"), ("more", None, b"y")], 413, "2 parts"),
            ([("grant", None, "{no"), ("files", None, b"x")], 400, "not valid JSON"),
        ]:
            resp = await a.http.post(
                f"/v1/sandboxes/{SID}/lease", data=form_body(parts), headers=operator
            )
            answer = await resp.json()
            assert (resp.status, says in answer["error"]["message"]) == (status, True), answer
        assert a.agent.sandboxes[SID].state == SandboxState.WARM
        assert a.agent.sandboxes[SID].record.lease_id is None


async def test_the_agent_rotates_its_audit_log_as_configured(tmp_path):
    async with inprocess_agent(tmp_path, audit_max_bytes=4096, audit_files=2) as a:
        for _ in range(60):  # each refusal leaves a record of about 200 bytes
            assert (await a.http.get("/v1/node")).status == 401
        operator = bearer(a.agent.identity.call_token)
        records = (await (await a.http.get("/v1/audit", headers=operator)).json())["records"]
    assert sorted(p.name for p in tmp_path.glob("n1-audit.jsonl*")) == [
        "n1-audit.jsonl",
        "n1-audit.jsonl.1",
    ]
    in_current = len((tmp_path / "n1-audit.jsonl").read_text().splitlines())
    assert in_current < len(records) < 60  # both kept files read; the oldest gone


async def test_the_control_plane_logs_refused_credentials_with_the_callers_address(caplog):
    stranger = new_token()
    async with inprocess_controlplane() as cp:
        with caplog.at_level(logging.WARNING, logger="dsec.httpkit"):
            assert (await cp.http.get("/v1/nodes", headers=bearer(stranger))).status == 403
            assert (await cp.http.put("/v1/agents/n1", data=DEEP_BODY)).status == 401
    logged = [r.getMessage() for r in caplog.records if r.name == "dsec.httpkit"]
    assert "refused GET /v1/nodes from 127.0.0.1: 403 forbidden" in logged, logged
    assert "refused PUT /v1/agents/{node_id} from 127.0.0.1: 401 unauthenticated" in logged
    assert not [m for m in logged if stranger in m]


# --- each child process's credentials (a live pool) --------------------------------------


def credentials_of(pid: int) -> dict[str, str]:
    """The dsec credentials in a process's environment, as the kernel holds it."""
    entries = Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
    return dict(e.split("=", 1) for e in entries if "=" in e and is_credential(e.split("=")[0]))


STRAY = "DSEC_STRAY_TOKEN"  # a credential of ours that no child has any use for


@pytest.fixture
def own_credentials(monkeypatch) -> None:
    """Our environment as an operator's shell after `source env`: the pool makes its own
    tokens, and our STRAY credential must reach no child."""
    for name in [n for n in os.environ if is_credential(n)]:
        monkeypatch.delenv(name)
    monkeypatch.setenv(STRAY, new_token())


async def test_each_child_gets_its_own_credentials_and_the_pool_dir_stays_private(
    docker_client, tmp_path, own_credentials
):
    spec = make_spec(tmp_path, nodes=2, metrics_token=True, pool=PoolParams(min_warm=1))
    pool_dir = loosened(tmp_path / spec.name, directory=True)
    loosened(pool_dir / "env")
    async with started_pool(spec, docker_client) as pool:
        tokens = pool.tokens
        operators = {tokens.client, tokens.admin}  # what speaks for clients and operators
        controlplane = credentials_of(pool.controlplane.proc.pid)
        assert controlplane == pool.controlplane.credentials  # nothing inherited
        assert operators <= set(controlplane.values())  # the tokens it checks
        for agent in pool.agents:
            held = credentials_of(agent.proc.pid)
            assert held == agent.credentials and STRAY not in held
            assert held["DSEC_METRICS_TOKEN"] == tokens.metrics
            assert not operators & set(held.values()), f"{agent.name} holds {held}"
        async with aiohttp.ClientSession() as http:
            for url in (
                f"{pool.url}/metrics",
                f"{pool.url}/v1/sd/prometheus",
                *(f"{agent.url}/metrics" for agent in pool.agents),
            ):
                async with http.get(url) as resp:
                    assert resp.status == 401, url
                async with http.get(url, headers=bearer(tokens.metrics)) as resp:
                    assert resp.status == 200, url
        assert pool.metrics_token_file.read_text() == tokens.metrics
        async with Client(pool.url, token=tokens.client) as client:
            sb = await client.acquire(idempotency_key="edges")  # released: a spent key
            assert (await sb.exec(["true"])).exit_code == 0  # an audit record
            await sb.release()
        names = {p.name for p in pool_dir.iterdir()}
        expected = {"env", "controlplane.json", "metrics-token", "spent-keys.jsonl"}
        expected |= {f"{n}.sqlite" for n in pool.node_ids} | {f"{sb.node}-audit.jsonl"}
        assert expected <= names, names
        assert_private(pool_dir)


async def test_a_cloud_agent_holds_none_of_the_control_planes_tokens(
    docker_client, tmp_path, monkeypatch
):
    # the control plane's environment holds the tokens it checks: its cloud agents must not
    theirs = {name: new_token() for name in ("DSEC_TOKEN", "DSEC_ADMIN_TOKEN", "DSEC_AGENT_TOKEN")}
    for name, value in theirs.items():
        monkeypatch.setenv(name, value)
    metrics_token = new_token()
    cloud = LocalCloudProvider(
        CloudConfig(
            max_nodes=1, node_prefix="test-edges-cloud", boot_delay_s=0, state_dir=tmp_path
        ),
        Identities(new_token(), theirs["DSEC_AGENT_TOKEN"]),
        metrics_token,
    )
    cloud.controlplane_url = "http://127.0.0.1:9"  # nothing there: it never joins
    try:
        node_id = await cloud.start_node()
        held = credentials_of(cloud.procs[node_id].pid)
        assert held["DSEC_METRICS_TOKEN"] == metrics_token
        assert not set(held.values()) & set(theirs.values()), held
    finally:
        await cloud.close()


# --- deploy/: alert rules and their panels -----------------------------------------------


def promtool(*args: str) -> subprocess.CompletedProcess:
    if not Path(PROMTOOL).exists():
        pytest.fail("these tests need Debian's promtool (./run installs prometheus with apt)")
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)


def alert_rules() -> dict[str, dict]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return {rule["alert"]: rule for group in groups for rule in group["rules"] if "alert" in rule}


# the failure modes the issues introduced, and the control plane's own absence
FAILURE_MODES = {
    "DsecControlPlaneDown",
    "DsecNodeUnreachable",
    "DsecEngineDown",
    "DsecNodeTakenOut",
    "DsecScheduleLatencyHigh",
    "DsecQueueWaitHigh",
    "DsecLeasesExpiring",
}


def test_the_prometheus_config_loads_the_alert_rules():
    assert set(alert_rules()) == FAILURE_MODES
    checked = promtool("check", "config", str(PROMETHEUS_CONFIG))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(FAILURE_MODES)} rules found" in checked.stdout, checked.stdout


def steady(value: float) -> str:
    return f"{value}x60"  # 15 minutes of 15 s scrapes


def growing(step: float, after: int = 0) -> str:
    """A counter that stands still for `after` scrapes, then grows by `step` a scrape."""
    return f"0x{after} 0+{step}x{60 - after}" if after else f"0+{step}x60"


def pool_series(pool: str, fast: bool, expired: str) -> dict[str, str]:
    """A pool's schedule latency (fast: all under 5 ms; slow: most between 0.5 and 1 s,
    10 s of waiting for each 2 sandboxes held), leased sandboxes and expired leases."""
    labels = f'pool="{pool}",path="warm"'
    buckets = {"0.005": 10 if fast else 0, "0.5": 10 if fast else 1, "1": 10, "+Inf": 10}
    series = {
        f'dsec_schedule_latency_seconds_bucket{{{labels},le="{le}"}}': growing(n)
        for le, n in buckets.items()
    }
    series[f"dsec_schedule_latency_seconds_sum{{{labels}}}"] = growing(0.02 if fast else 10)
    series[f'dsec_sandboxes{{node="n1",pool="{pool}",state="leased"}}'] = steady(10 if fast else 2)
    series[f'dsec_leases_expired_total{{pool="{pool}"}}'] = expired
    return series


def node_series(node: str, healthy: int = 1, engine_ok: int = 1, taken_out: str = "") -> dict:
    labels = f'node="{node}",kind="local"'
    return {
        f"dsec_node_healthy{{{labels}}}": steady(healthy),
        f"dsec_node_engine_ok{{{labels}}}": steady(engine_ok),
        f'dsec_nodes_taken_out_total{{node="{node}"}}': taken_out or steady(0),
    }


def test_each_alert_fires_on_its_failure_and_none_on_a_healthy_pool(tmp_path):
    healthy = {
        'up{job="dsec-controlplane",instance="cp:8700"}': steady(1),
        **node_series("n1"),
        **pool_series("fast", fast=True, expired=steady(0)),
    }
    failing = {
        **healthy,
        'up{job="dsec-controlplane",instance="standby:8700"}': steady(0),
        **node_series("n2", healthy=0),
        **node_series("n3", engine_ok=0),
        **node_series("n4", taken_out=growing(1, after=40)),
        **pool_series("slow", fast=False, expired=growing(1, after=40)),
    }
    subjects = {
        "DsecControlPlaneDown": 'instance="standby:8700",job="dsec-controlplane"',
        "DsecNodeUnreachable": 'kind="local",node="n2"',
        "DsecEngineDown": 'kind="local",node="n3"',
        "DsecNodeTakenOut": 'node="n4"',
        "DsecScheduleLatencyHigh": 'pool="slow"',
        "DsecQueueWaitHigh": 'pool="slow"',
        "DsecLeasesExpiring": 'pool="slow"',
    }
    assert set(subjects) == FAILURE_MODES
    rules = alert_rules()
    firing = [
        {
            "labels": f'ALERTS{{alertname="{name}",alertstate="firing",{labels},'
            f'severity="{rules[name]["labels"]["severity"]}"}}',
            "value": 1,
        }
        for name, labels in subjects.items()
    ]

    def case(series: dict[str, str], expected: list[dict], query: str) -> dict:
        return {
            "interval": "15s",
            "input_series": [{"series": s, "values": v} for s, v in series.items()],
            "promql_expr_test": [{"expr": query, "eval_time": "15m", "exp_samples": expected}],
        }

    unit_tests = {
        "rule_files": [str(ALERTS)],
        "evaluation_interval": "15s",
        "tests": [
            case(healthy, [], "ALERTS"),  # not even pending
            case(failing, firing, 'ALERTS{alertstate="firing"}'),
        ],
    }
    spec = tmp_path / "alerts_test.yml"
    spec.write_text(json.dumps(unit_tests))  # JSON is YAML
    tested = promtool("test", "rules", str(spec))
    assert tested.returncode == 0, tested.stdout + tested.stderr


def with_metrics_token(config: str, token_file: Path) -> str:
    """deploy/prometheus.yml with its `authorization` blocks uncommented, as its header
    says to, reading the token from `token_file`."""
    config, blocks = re.subn(r"^(\s*)# (authorization:)$", r"\1\2", config, flags=re.M)
    config = re.sub(r"^(\s*)#   (type: Bearer)", r"\1  \2", config, flags=re.M)
    config, files = re.subn(
        r"^(\s*)#   credentials_file: \S+",
        rf"\1  credentials_file: {token_file}",
        config,
        flags=re.M,
    )
    assert blocks == files == 3, "deploy/prometheus.yml lost an authorization block"
    return config


@contextlib.asynccontextmanager
async def prometheus_on(config: str, work: Path) -> AsyncIterator[str]:
    """Prometheus running `config` (with deploy/alerts.yml beside it); its URL."""
    if not Path(PROMETHEUS).exists():
        pytest.fail("this test needs Debian's prometheus (./run installs it with apt)")
    (work / "prometheus.yml").write_text(config)
    shutil.copy(ALERTS, work)
    url = f"http://127.0.0.1:{free_port()}"
    with (work / "prometheus.log").open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            PROMETHEUS,
            f"--config.file={work / 'prometheus.yml'}",
            f"--storage.tsdb.path={work / 'data'}",
            f"--web.listen-address={url.removeprefix('http://')}",
            stdout=log,
            stderr=log,
        )
    try:
        yield url
    finally:
        proc.terminate()
        await proc.wait()


async def prometheus_api(url: str, path: str) -> dict:
    async with aiohttp.ClientSession() as http, http.get(f"{url}/api/v1/{path}") as resp:
        return (await resp.json())["data"]


async def every_target_up(url: str) -> bool:
    try:
        targets = (await prometheus_api(url, "targets"))["activeTargets"]
    except aiohttp.ClientError:
        return False  # not listening yet
    return {(t["labels"]["job"], t["health"]) for t in targets} == {
        ("dsec-controlplane", "up"),
        ("dsec-agent", "up"),  # found through discovery, which needs the token too
    }


async def test_prometheus_scrapes_a_pool_with_a_metrics_token_as_deploy_says(
    docker_client, tmp_path, own_credentials
):
    spec = make_spec(tmp_path / "state", nodes=1, metrics_token=True)
    async with started_pool(spec, docker_client) as pool:
        async with aiohttp.ClientSession() as http:
            for path in ("/metrics", "/v1/sd/prometheus"):  # while anyone else is refused
                async with http.get(f"{pool.url}{path}") as resp:
                    assert resp.status == 401, path
        config = with_metrics_token(prometheus_config(pool.url), pool.metrics_token_file)
        async with prometheus_on(config, tmp_path) as url:
            await eventually(partial(every_target_up, url), "scrapes with the metrics token")
            groups = (await prometheus_api(url, "rules"))["groups"]
            assert {r["name"] for g in groups for r in g["rules"]} == FAILURE_MODES


def test_the_dashboard_shows_what_each_alert_watches():
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for row in dashboard["panels"] for p in [row, *row.get("panels", [])]]
    exprs = " ".join(t["expr"] for p in panels for t in p.get("targets", []))
    shown = set(re.findall(r"\b(dsec_\w+|up)\b", exprs))
    for name, rule in alert_rules().items():
        watched = set(re.findall(r"\b(dsec_\w+|up)\b", rule["expr"]))
        assert watched and watched <= shown, f"{name}: no panel shows {watched - shown}"
