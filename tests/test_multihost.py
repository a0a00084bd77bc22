"""Beyond one machine: where a service says it is (`--advertise-url`), the control plane's
refusal of a node no one can reach, and a pool whose control plane, agents and client
each live in a network namespace of their own, talking over real TCP and TLS."""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import tomllib
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from conftest import STARTED_POOLS, TEST_POOL_PREFIX, pool_containers
from inprocess import inprocess_controlplane
from pydantic import ValidationError

from agent.config import AgentConfig
from bench.multihost import Cluster, NamespacesUnavailable, first_report, ours
from controlplane.config import ControlPlaneConfig
from dsec.addresses import advertised_url, check_advertise_url, is_loopback, unroutable
from dsec.cli import build_parser
from dsec.tokens import new_token

UNROUTABLE = ("http://0.0.0.0:8701", "https://[::]:8701", "http://224.0.0.1:8701", "http://:8701")


# --- where a service says it is ---------------------------------------------------------


def test_what_no_other_machine_can_reach():
    for url in UNROUTABLE:
        assert unroutable(url) is not None, url
    for url in ("http://10.0.0.12:8701", "https://node-7.example.org", "http://127.0.0.2:1"):
        assert unroutable(url) is None, url
    assert is_loopback("http://127.0.0.9:1") and is_loopback("https://[::1]:2")
    assert is_loopback("http://localhost:3") and not is_loopback("http://10.0.0.1:4")


def test_an_advertised_url_without_a_port_takes_the_one_listened_on():
    bound = "http://0.0.0.0:40113"
    assert advertised_url(bound, None) == bound
    assert advertised_url(bound, "http://10.0.0.12") == "http://10.0.0.12:40113"
    assert advertised_url(bound, "https://node-7.example.org:443/") == (
        "https://node-7.example.org:443"
    )


def test_an_agent_on_every_address_must_say_where_it_is(tmp_path):
    settings = dict(node_id="n1", agent_token=new_token(), state_dir=tmp_path)
    for host in ("0.0.0.0", "::", ""):
        with pytest.raises(ValidationError, match="--advertise-url"):
            AgentConfig(host=host, **settings)
    config = AgentConfig(host="0.0.0.0", advertise_url="http://10.0.0.12/", **settings)
    assert config.advertised("http://0.0.0.0:8701") == "http://10.0.0.12:8701"
    for url in (*UNROUTABLE, "ftp://10.0.0.12", "http://10.0.0.12/path", "10.0.0.12:8701"):
        with pytest.raises(ValidationError):
            AgentConfig(host="0.0.0.0", advertise_url=url, **settings)


async def dsec(*argv: str, **env: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dsec.cli", *argv, env={**os.environ, **env},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode, err.decode()


async def test_the_command_line_refuses_an_address_no_one_can_reach(tmp_path):
    token = {"DSEC_AGENT_TOKEN": new_token()}
    agent = ["agent", "--node-id", "n1", "--state-dir", str(tmp_path)]
    code, err = await dsec(*agent, "--host", "0.0.0.0", **token)
    assert code == 2 and "--advertise-url" in err and "Traceback" not in err, err
    code, err = await dsec(*agent, "--advertise-url", "http://0.0.0.0:8701", **token)
    assert code == 2 and "cannot be advertised" in err, err
    # an agent serving HTTPS says so in the address it advertises
    code, err = await dsec(*agent, "--advertise-url", "https://10.0.0.12", **token)
    assert code == 2 and "serves http://" in err, err
    tokens = {"DSEC_ADMIN_TOKEN": new_token(), "DSEC_AGENT_TOKEN": new_token()}
    code, err = await dsec("controlplane", "--advertise-url", "http://[::]:8700", **tokens)
    assert code == 2 and "--advertise-url" in err and "cannot be advertised" in err, err


async def test_a_node_that_advertises_no_address_is_refused_at_registration():
    # allowed anywhere: the refusal is about reachability, not the operator's rules
    anywhere = ["http://0.0.0.0/0", "https://0.0.0.0/0", "http://::/0", "https://::/0"]
    async with inprocess_controlplane(agent_urls=anywhere) as cp:
        auth = {"Authorization": f"Bearer {cp.identities.node_token('n1')}"}
        for url in UNROUTABLE:
            resp = await cp.http.put("/v1/agents/n1", json=first_report("n1", url), headers=auth)
            assert resp.status == 422, (url, await resp.text())
            error = (await resp.json())["error"]
            assert error["code"] == "unroutable_url", error
            assert "--advertise-url" in error["message"] and url in error["message"]
        nodes = await cp.http.get(
            "/v1/nodes", headers={"Authorization": f"Bearer {cp.tokens.admin}"}
        )
        assert (await nodes.json())["nodes"] == []
        # loopback from loopback: the same machine, as `dsec up` runs
        ok = await cp.http.put(
            "/v1/agents/n1", json=first_report("n1", "http://127.0.0.2:8701"), headers=auth
        )
        assert ok.status == 200, await ok.text()


# --- a pool across network namespaces --------------------------------------------------


@pytest.mark.docker
async def test_a_pool_across_network_namespaces_over_tls(docker_client, tmp_path):
    """The control plane, three agents and the client each in a network namespace with an
    address of its own, over HTTPS: 30 acquires at once land on all three agents, each
    command goes from the client straight to its agent, a node advertising loopback from
    another machine is refused, and the namespaces are gone afterwards."""
    name = f"{TEST_POOL_PREFIX}mh{uuid.uuid4().hex[:6]}"
    STARTED_POOLS.add(name)
    cluster = Cluster(name, tmp_path, netns=True, tls=True, warm=30)
    try:
        async with cluster:
            assert cluster.client is not None and cluster.namespaces is not None
            address = cluster.namespaces.address
            assert urlsplit(cluster.controlplane.url).hostname == address("controlplane")

            samples = (await cluster.client.ask(op="round", acquires=30))["samples"]
            assert len(samples) == 30 and {s["path"] for s in samples} == {"warm"}
            assert {s["node"] for s in samples} == set(cluster.node_ids)
            for s in samples:
                agent = urlsplit(s["agent_url"])
                # the address its agent advertised: its own namespace's, over TLS
                assert (agent.scheme, agent.hostname) == ("https", address(s["node"])), s
                assert s["exec_ok"], s

            probe = f"{name}-x"
            refused = await cluster.client.ask(
                op="advertise",
                node_id=probe,
                urls=["https://127.0.0.1:8701", "https://0.0.0.0:8701", "https://[::]:8701"],
            )
            for answer in refused["answers"]:
                assert answer["status"] == 422, answer
                assert answer["error"]["code"] == "unroutable_url", answer
                assert "--advertise-url" in answer["error"]["message"], answer
            loopback = refused["answers"][0]["error"]["message"]
            assert f"from {address('client')}, another machine" in loopback
            assert probe not in refused["listed"]
    except NamespacesUnavailable as e:
        pytest.skip(f"network namespaces cannot be made here: {e}")
    finally:
        assert ours() == [], "the test's network namespaces outlived it"
    assert not pool_containers(docker_client, name + "-")

    # every command reached its agent from the client's own address, not through the
    # control plane's: each agent's audit log says who asked
    by_node: dict[str, set[str]] = {}
    for s in samples:
        by_node.setdefault(s["node"], set()).add(s["sandbox"])
    for node_id, sandboxes in by_node.items():
        lines = cluster.audit_log(node_id).read_text().splitlines()
        execs = [r for r in map(json.loads, lines) if r.get("event", "exec") == "exec"]
        assert {r["sandbox"] for r in execs} == sandboxes
        assert {r["peer"] for r in execs} == {address("client")}


# --- the deploy files ----------------------------------------------------------------

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def env_file(name: str) -> dict[str, str]:
    lines = (DEPLOY / "env" / name).read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


def exec_start(unit: str, env: dict[str, str]) -> list[str]:
    """A unit's ExecStart as systemd runs it: ${X} one word, $X split on whitespace."""
    lines = (DEPLOY / "systemd" / unit).read_text().splitlines()
    (line,) = [x for x in lines if x.startswith("ExecStart=")]
    words = []
    for word in shlex.split(line.removeprefix("ExecStart=")):
        if word.startswith("${"):
            words.append(env[word[2:-1]])
        elif word.startswith("$"):
            words += env.get(word[1:], "").split()
        else:
            words.append(word)
    return words


def test_the_units_start_dsec_with_flags_it_takes():
    parser = build_parser()
    for unit, env in (
        ("dsec-controlplane.service", "controlplane.env"),
        ("dsec-agent.service", "agent.env"),
    ):
        argv = exec_start(unit, env_file(env))
        assert argv[0] == "/opt/dsec/bin/dsec", argv
        args = parser.parse_args(argv[1:])  # an unknown flag exits
        if args.advertise_url:
            check_advertise_url(args.advertise_url)
        if args.command == "agent":
            AgentConfig(
                node_id=args.node_id,
                host=args.host,
                port=args.port,
                advertise_url=args.advertise_url,
                agent_token=env_file("agent.env")["DSEC_NODE_TOKEN"],
                state_dir=args.state_dir,
            )
    # the control plane's config file, with the tokens its env file gives it
    tokens = env_file("controlplane.env")
    config = ControlPlaneConfig.model_validate(
        json.loads((DEPLOY / "controlplane.json").read_text())
        | {
            "admin_tokens": [tokens["DSEC_ADMIN_TOKEN"]],
            "client_tokens": [tokens["DSEC_TOKEN"]],
            "agent_token": tokens["DSEC_AGENT_TOKEN"],
        }
    )
    assert str(config.state_dir) == "/var/lib/dsec-controlplane"  # its StateDirectory=


def test_systemd_takes_the_units():
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("no systemd-analyze here")
    dsec_path = shutil.which("dsec")
    assert dsec_path is not None
    with tempfile.TemporaryDirectory() as work:
        for unit in (DEPLOY / "systemd").glob("*.service"):
            # where dsec is installed here, instead of the units' /opt/dsec
            text = unit.read_text().replace("/opt/dsec/bin/dsec", dsec_path)
            (Path(work) / unit.name).write_text(text)
        checked = subprocess.run(
            [analyze, "verify", "--man=no", *sorted(str(p) for p in Path(work).iterdir())],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert checked.returncode == 0 and not checked.stderr.strip(), checked.stderr


def test_the_image_recipe_copies_every_package_and_runs_dsec():
    recipe = (DEPLOY / "Dockerfile").read_text().splitlines()
    repo = DEPLOY.parent
    copied = set()
    for line in recipe:
        if line.startswith("COPY "):
            *sources, _ = line.split()[1:]
            for source in sources:
                assert (repo / source).exists(), f"deploy/Dockerfile copies {source}: not there"
                copied.add(source)
    pyproject = tomllib.loads((repo / "pyproject.toml").read_text())
    packages = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    assert {p.rstrip("*") for p in packages} <= copied
    assert pyproject["project"]["readme"] in copied  # the build reads it
    assert 'ENTRYPOINT ["dsec"]' in recipe and "dsec" in pyproject["project"]["scripts"]


def test_the_prometheus_configuration_takes_the_control_planes_address(tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("this test needs Debian's promtool (./run installs prometheus with apt)")
    (tmp_path / "ca.pem").write_text("")
    (tmp_path / "token").write_text("metrics-token")
    shutil.copy(DEPLOY / "alerts.yml", tmp_path)

    def render(**env: str) -> str:
        done = subprocess.run(
            [str(DEPLOY / "prometheus-config")], env={"PATH": os.environ["PATH"], **env},
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        (tmp_path / "prometheus.yml").write_text(done.stdout)
        checked = subprocess.run(
            [promtool, "check", "config", str(tmp_path / "prometheus.yml")],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert checked.returncode == 0, checked.stdout + checked.stderr
        return done.stdout

    # dsec up's own: the shipped file, unchanged
    shipped = (DEPLOY / "prometheus.yml").read_text()
    assert render(DSEC_CONTROLPLANE_URL="http://127.0.0.1:8700") == shipped
    plain = render(DSEC_CONTROLPLANE_URL="http://10.0.0.5:8700")
    assert plain == shipped.replace("127.0.0.1:8700", "10.0.0.5:8700")
    full = render(
        DSEC_CONTROLPLANE_URL="https://10.0.0.5:8700",
        DSEC_CA_FILE=str(tmp_path / "ca.pem"),
        DSEC_METRICS_TOKEN_FILE=str(tmp_path / "token"),
    )
    live = [line.split("#")[0].strip() for line in full.splitlines()]
    assert live.count('- targets: ["10.0.0.5:8700"]') == 1
    assert live.count("- url: https://10.0.0.5:8700/v1/sd/prometheus") == 1
    assert live.count("scheme: https") == 1  # the control plane's job; agents' from discovery
    assert live.count(f"ca_file: {tmp_path / 'ca.pem'}") == 3
    assert live.count(f"credentials_file: {tmp_path / 'token'}") == 3
    assert "127.0.0.1" not in full
    refused = subprocess.run(
        [str(DEPLOY / "prometheus-config")], env={"DSEC_CONTROLPLANE_URL": "10.0.0.5:8700"},
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert refused.returncode == 2 and "not http:// or https://" in refused.stderr
