"""TLS on every listener (issue 14), and the limits every listener keeps.

Without Docker: the local CA and its certificate (dsec/tls.py); `serve` on TLS, its
connection limit and its timeouts (dsec/httpkit.py); `dsec controlplane` started with
TLS flags, reached by the SDK, the synchronous SDK and `dsec status`. With Docker: a
whole pool on TLS (`dsec up --tls`, the `tls_pool` fixture). The fuzz tests run on a
TLS pool as well (test_fuzz.py).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
import json
import os
import shlex
import stat
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import inprocess
import pytest
import pytest_asyncio
from aiohttp import web
from conftest import eventually
from cryptography import x509
from cryptography.hazmat.primitives.serialization import load_pem_private_key
from cryptography.x509.oid import ExtendedKeyUsageOID
from pydantic import BaseModel
from rawhttp import RawConnection

from controlplane.cloud import LocalCloudProvider, cloud_node_host
from controlplane.config import CloudConfig
from controlplane.identities import Identities
from dsec import httpkit
from dsec.client import Client
from dsec.httpkit import Api, ServerLimits, body_chunks, new_app, read_model
from dsec.launch.local import LocalPool
from dsec.processes import dsec_argv
from dsec.sync_client import SyncClient
from dsec.tls import (
    CA_FILE,
    CERT_FILE,
    CLOCK_SKEW,
    KEY_FILE,
    VALIDITY,
    TlsFiles,
    client_ssl,
    make_local_pool_tls,
)
from dsec.tokens import new_token

ADDRESSES = ["127.0.0.1", "127.0.0.2", cloud_node_host(1)]


@pytest.fixture
def tls(tmp_path: Path) -> TlsFiles:
    return make_local_pool_tls(tmp_path / "tls", "test", ADDRESSES)


def load_cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


# --- the local CA --------------------------------------------------------------


def test_the_local_ca_files_are_private_and_the_ca_key_is_not_kept(tls, tmp_path):
    directory = tmp_path / "tls"
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert sorted(p.name for p in directory.iterdir()) == sorted([CA_FILE, CERT_FILE, KEY_FILE])
    for path in directory.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    # one private key on disk, the server's: nothing there can sign another certificate
    assert [p.name for p in directory.iterdir() if b"PRIVATE KEY" in p.read_bytes()] == [KEY_FILE]
    key = load_pem_private_key(tls.key.read_bytes(), password=None)
    assert key.public_key() == load_cert(tls.cert).public_key()
    again = make_local_pool_tls(tmp_path / "again", "test", ADDRESSES)
    assert load_cert(again.ca).public_key() != load_cert(tls.ca).public_key()  # a new CA


def test_the_server_certificate_names_every_address_and_only_those(tls):
    cert, ca = load_cert(tls.cert), load_cert(tls.ca)
    cert.verify_directly_issued_by(ca)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address(a) for a in ADDRESSES]
    assert sans.get_values_for_type(x509.DNSName) == ["localhost"]


def test_the_certificates_are_valid_from_now_for_their_validity(tls):
    now = dt.datetime.now(dt.UTC)
    for cert in (load_cert(tls.ca), load_cert(tls.cert)):
        assert cert.not_valid_before_utc <= now - CLOCK_SKEW + dt.timedelta(seconds=5)
        assert cert.not_valid_after_utc - cert.not_valid_before_utc == VALIDITY + CLOCK_SKEW


def test_the_ca_signs_servers_only_and_the_server_certificate_serves_only(tls):
    ca, cert = load_cert(tls.ca), load_cert(tls.cert)
    constraints = ca.extensions.get_extension_for_class(x509.BasicConstraints)
    assert constraints.critical and constraints.value.ca and constraints.value.path_length == 0
    usage = ca.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.key_cert_sign and usage.crl_sign and not usage.digital_signature

    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    usage = cert.extensions.get_extension_for_class(x509.KeyUsage)
    assert usage.critical and usage.value.digital_signature and not usage.value.key_cert_sign
    purposes = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(purposes) == [ExtendedKeyUsageOID.SERVER_AUTH]


def test_a_certificate_needs_its_key_and_a_child_gets_the_same_files(tls):
    with pytest.raises(ValueError, match="needs its key"):
        TlsFiles(cert=tls.cert)
    with pytest.raises(ValueError, match="needs its key"):
        TlsFiles(key=tls.key)
    assert tls.args() == [
        *("--tls-cert", str(tls.cert), "--tls-key", str(tls.key)),
        *("--ca", str(tls.ca)),
    ]
    assert TlsFiles(ca=tls.ca).args() == ["--ca", str(tls.ca)]
    assert TlsFiles().server_context() is None and TlsFiles().client_ssl() is True


# --- serve: TLS, limits, timeouts ----------------------------------------------


class Echo(BaseModel):
    text: str


def small_api(served: list[str]) -> Api:
    """/hello, /echo (a JSON body) and /upload (a streamed body); `served` records the
    requests that reached a handler."""

    async def hello(request: web.Request) -> web.Response:
        served.append(request.path)
        return web.json_response({"hello": True})

    async def echo(request: web.Request) -> web.Response:
        served.append(request.path)
        return web.json_response((await read_model(request, Echo)).model_dump())

    async def upload(request: web.Request) -> web.Response:
        served.append(request.path)
        size = sum([len(chunk) async for chunk in body_chunks(request, 1024)])
        return web.json_response({"bytes": size})

    api = Api(title="test")
    api.route("GET", "/hello", hello)
    api.route("POST", "/echo", echo, body=Echo)
    api.route("PUT", "/upload", upload)
    return api


@asynccontextmanager
async def served_at(
    served: list[str] | None = None,
    tls: TlsFiles | None = None,
    limits: ServerLimits | None = None,
) -> AsyncIterator[str]:
    """`serve` in this process, on loopback: its URL while the block runs."""
    app = new_app(small_api(served if served is not None else []))
    context = tls.server_context() if tls else None
    async with inprocess.served(app, ssl_context=context, limits=limits) as url:
        yield url


async def status_of(url: str, verify=True) -> int:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=verify)) as http:
        async with http.get(url, timeout=aiohttp.ClientTimeout(total=10)) as resp:
            return resp.status


async def plain_text_answer(url: str) -> int | None:
    """The status a plain-HTTP request to an https `url` gets, or None: no answer."""
    try:
        return await status_of(url.replace("https://", "http://", 1))
    except aiohttp.ClientError:
        return None


async def test_serve_speaks_tls_to_clients_with_the_ca_and_to_no_one_else(tls):
    served: list[str] = []
    async with served_at(served, tls) as url:
        assert url.startswith("https://127.0.0.1:")
        assert await status_of(f"{url}/hello", client_ssl(tls.ca)) == 200
        assert served == ["/hello"]
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            await status_of(f"{url}/hello")  # the system's roots do not know this CA
        assert await plain_text_answer(f"{url}/hello") in (None, 400)
        assert served == ["/hello"], "a plain-text request reached a handler"


async def test_a_certificate_for_other_addresses_is_refused(tmp_path):
    elsewhere = make_local_pool_tls(tmp_path / "elsewhere", "test", ["127.0.0.9"])
    async with served_at(tls=elsewhere) as url:
        with pytest.raises(aiohttp.ClientConnectorCertificateError, match="mismatch"):
            await status_of(f"{url}/hello", client_ssl(elsewhere.ca))


async def test_a_request_head_that_does_not_arrive_in_time_is_cut_off():
    async with served_at(limits=ServerLimits(idle_timeout_s=0.5)) as url:
        slow = await RawConnection.to(url)
        started = time.monotonic()
        slow.writer.write(b"GET /hello HTTP/1.1\r\nHost: test\r\n")  # and never the blank line
        assert await slow.rest(timeout=5) == b""
        assert 0.4 < time.monotonic() - started < 3
        silent = await RawConnection.to(url)  # connects, sends nothing
        assert await silent.rest(timeout=5) == b""


async def test_a_tls_handshake_that_does_not_happen_is_cut_off(tls):
    limits = ServerLimits(idle_timeout_s=60, handshake_timeout_s=0.5)
    async with served_at(tls=tls, limits=limits) as url:
        silent = await RawConnection.to(url.replace("https://", "http://"))
        started = time.monotonic()
        assert await silent.rest(timeout=5) == b""
        assert time.monotonic() - started < 3


@pytest.mark.parametrize(
    ("method", "path", "timeout"),
    [("POST", "/echo", "BODY_TIMEOUT_S"), ("PUT", "/upload", "BODY_IDLE_TIMEOUT_S")],
)
async def test_a_body_that_stops_coming_is_answered_408(monkeypatch, method, path, timeout):
    monkeypatch.setattr(httpkit, timeout, 0.3)
    served: list[str] = []
    async with served_at(served) as url:
        slow = await RawConnection.to(url)
        slow.writer.write(
            f"{method} {path} HTTP/1.1\r\nHost: test\r\nContent-Length: 100\r\n\r\n".encode()
            + b'{"text": '  # and no more
        )
        status, body = await slow.answer()
        assert status.startswith(b"HTTP/1.1 408 "), body
        assert json.loads(body)["error"]["code"] == "body_timeout"
        assert served == [path]
        await slow.close()


# --- dsec controlplane on TLS, without Docker ----------------------------------


@dataclass
class TlsControlPlane:
    url: str
    admin: str
    identities: Identities  # its nodes' credentials


@pytest_asyncio.fixture
async def tls_controlplane(tls, tmp_path) -> AsyncIterator[TlsControlPlane]:
    """`dsec controlplane` with --tls-cert, --tls-key and --ca, and no agents."""
    key = new_token()
    identities = Identities(key, join_token=new_token())
    config = tmp_path / "controlplane.json"
    config.write_text(json.dumps({"pools": {"default": {"min_warm": 0}}, "identity_key": key}))
    admin = new_token()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("DSEC_")},
        "DSEC_ADMIN_TOKEN": admin,
        "DSEC_AGENT_TOKEN": identities.join_token,
    }
    proc = await asyncio.create_subprocess_exec(
        *dsec_argv("controlplane", "--config", str(config), "--port", "0", *tls.args()),
        stdout=asyncio.subprocess.PIPE,
        env=env,
    )
    assert proc.stdout is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        yield TlsControlPlane(json.loads(line)["url"], admin, identities)
    finally:
        proc.terminate()
        await proc.wait()


async def test_the_control_plane_serves_tls_from_its_flags(tls, tls_controlplane, monkeypatch):
    url, admin = tls_controlplane.url, tls_controlplane.admin
    assert url.startswith("https://127.0.0.1:")
    monkeypatch.delenv("DSEC_CA", raising=False)
    async with Client(url, admin, ca=tls.ca) as client:
        assert (await client.nodes()).nodes == []
    async with Client(url, admin) as client:
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            await client.nodes()
    monkeypatch.setenv("DSEC_CA", str(tls.ca))
    async with Client(url, admin) as client:  # DSEC_CA
        assert (await client.nodes()).nodes == []

    def sync_nodes() -> list:
        with SyncClient(url, admin, ca=tls.ca) as client:
            return client.nodes().nodes

    assert await asyncio.to_thread(sync_nodes) == []
    assert await plain_text_answer(f"{url}/healthz") in (None, 400)


async def test_dsec_status_verifies_with_dsec_ca(tls, tls_controlplane):
    url, admin = tls_controlplane.url, tls_controlplane.admin
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSEC_")}
    env |= {"DSEC_URL": url, "DSEC_ADMIN_TOKEN": admin}
    for ca, code in ((str(tls.ca), 0), (None, 1)):
        proc = await asyncio.create_subprocess_exec(
            *dsec_argv("status", "--json"),
            env=env | ({"DSEC_CA": ca} if ca else {}),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await proc.communicate()
        assert proc.returncode == code, err.decode()
        if code == 0:
            assert json.loads(out)["url"] == url
        else:
            assert "CERTIFICATE_VERIFY_FAILED" in err.decode() and b"Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["agent", "--node-id", "n1", "--tls-cert", "{cert}"], "TLS: a TLS certificate needs"),
        (["controlplane", "--tls-cert", "/nonexistent", "--tls-key", "/nonexistent"], "TLS: "),
        (["status", "--ca", "/nonexistent"], "TLS: "),
        (
            ["agent", "--node-id", "n1", "--tls-cert", "{cert}", "--tls-key", "{key}"]
            + ["--controlplane", "http://127.0.0.1:8700"],
            "--controlplane must be https",
        ),
    ],
)
async def test_tls_flags_that_cannot_work_are_refused_at_once(tls, argv, message):
    argv = [a.format(cert=tls.cert, key=tls.key) for a in argv]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSEC_")}
    env |= {"DSEC_ADMIN_TOKEN": new_token(), "DSEC_AGENT_TOKEN": new_token()}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dsec.cli", *argv, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await proc.communicate()
    assert proc.returncode == 2, err.decode()
    assert message in err.decode() and b"Traceback" not in err


async def test_a_cloud_agent_started_by_the_control_plane_reports_over_tls(
    docker_client, tls, tls_controlplane, tmp_path
):
    """What the control plane does on overflow (controlplane/cloud.py), with its own TLS
    files: the agent serves https, joins and heartbeats over TLS."""
    cloud = LocalCloudProvider(
        CloudConfig(
            max_nodes=1,
            node_prefix="test-tls-cloud",
            boot_delay_s=0,
            state_dir=tmp_path,
            heartbeat_s=0.5,
        ),
        tls_controlplane.identities,
        tls=tls,
    )
    cloud.controlplane_url = tls_controlplane.url
    try:
        node_id = await cloud.start_node()
        async with Client(tls_controlplane.url, tls_controlplane.admin, ca=tls.ca) as operator:

            async def healthy() -> list:
                nodes = (await operator.nodes()).nodes
                return [n for n in nodes if n.node_id == node_id and n.healthy]

            (node,) = await eventually(healthy, "the cloud node's heartbeats")
        assert node.kind == "cloud" and node.url.startswith(f"https://{cloud_node_host(1)}:")
        assert await plain_text_answer(f"{node.url}/openapi.json") in (None, 400)
    finally:
        await cloud.close()


# --- a whole pool on TLS (Docker) ----------------------------------------------


def env_file_values(pool: LocalPool) -> dict[str, str]:
    values = {}
    for line in pool.env_file.read_text().splitlines():
        name, _, value = line.removeprefix("export ").partition("=")
        values[name] = shlex.split(value)[0]
    return values


@pytest.mark.asyncio(loop_scope="module")
async def test_a_pool_on_tls_serves_a_client_with_its_ca(tls_pool, monkeypatch):
    assert tls_pool.url.startswith("https://")
    assert all(a.url.startswith("https://") for a in tls_pool.agents)
    assert env_file_values(tls_pool)["DSEC_CA"] == str(tls_pool.ca)
    monkeypatch.setenv("DSEC_CA", str(tls_pool.ca))
    async with Client(tls_pool.url, token=tls_pool.tokens.client) as client:
        async with client.sandbox() as sb:
            assert sb.lease.agent_url.startswith("https://")
            result = await sb.exec(["sh", "-c", "echo over tls"], timeout=10)
            assert (result.exit_code, result.stdout) == (0, "over tls\n")
            await sb.files.write("/work/t.bin", b"\x00\xff" * 1000)
            assert await sb.files.read("/work/t.bin") == b"\x00\xff" * 1000
        assert all(s.id != sb.id for s in await client.list())  # released


@pytest.mark.asyncio(loop_scope="module")
async def test_plain_text_is_refused_by_every_service_of_a_tls_pool(tls_pool):
    for url in (tls_pool.url, *(a.url for a in tls_pool.agents)):
        assert await status_of(f"{url}/openapi.json", client_ssl(tls_pool.ca)) == 200
        assert await plain_text_answer(f"{url}/openapi.json") in (None, 400), url


@pytest.mark.asyncio(loop_scope="module")
async def test_a_client_without_the_pools_ca_is_refused(tls_pool, monkeypatch):
    monkeypatch.delenv("DSEC_CA", raising=False)
    async with Client(tls_pool.url, token=tls_pool.tokens.client) as client:
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            await client.acquire()
    with pytest.raises(aiohttp.ClientConnectorCertificateError):
        await status_of(f"{tls_pool.agents[0].url}/openapi.json")


@pytest.mark.asyncio(loop_scope="module")
async def test_the_control_plane_and_the_agents_talk_over_tls(tls_pool):
    async with Client(tls_pool.url, token=tls_pool.tokens.admin, ca=tls_pool.ca) as operator:
        nodes = (await operator.nodes()).nodes
        assert sorted(n.node_id for n in nodes) == tls_pool.node_ids
        for node in nodes:  # heartbeats arrive, and the control plane's calls succeed
            assert node.url.startswith("https://") and node.healthy and node.placeable
            assert node.heartbeat_age_s < 4 * tls_pool.spec.heartbeat_s and node.failures == 0

        async def warm() -> bool:  # made by the control plane's calls to the agents
            sandboxes = await operator.list("default")
            return sum(s.state == "warm" for s in sandboxes) >= tls_pool.spec.pool.min_warm

        await eventually(warm, "the warm pool, created over TLS")
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(ssl=client_ssl(tls_pool.ca))
    ) as http:
        async with http.get(f"{tls_pool.url}/v1/sd/prometheus") as resp:
            groups = await resp.json()
    assert {g["labels"]["__scheme__"] for g in groups} == {"https"}
    assert all(not t.startswith("https") for g in groups for t in g["targets"])


@pytest.mark.asyncio(loop_scope="module")
async def test_the_cli_runs_a_sandbox_with_the_env_file(tls_pool):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSEC_")}
    env |= env_file_values(tls_pool)

    async def dsec(*args: str) -> bytes:
        proc = await asyncio.create_subprocess_exec(
            *dsec_argv(*args),
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()
        return out

    sandbox_id = (await dsec("acquire")).decode().strip()
    assert await dsec("exec", sandbox_id, "--", "echo", "hi") == b"hi\n"
    await dsec("release", sandbox_id)
