"""Fuzzing: schemathesis drives every operation of the OpenAPI documents the control
plane and an agent serve, against a live pool, with valid credentials; whatever it
sends, no answer may be a 5xx.

Each operation runs a bounded number of examples in schemathesis' positive mode (data
the document allows) and, where it has a body, its negative mode (data the document
forbids). Positive examples are steered to where the work is (well-formed sandbox ids
and names, sandboxes created on the node that is asked), and their effects are bounded
and undone: an acquire waits a few seconds at most and its sandbox is released, a
created sandbox is removed, a pool's new parameters are set back or made inert, and the
node has few slots. Agents' heartbeats are fuzzed against a control plane of their own
with no agents, every forged node's address forced to a closed port on loopback: they
must not steer the live pool, and no traffic may leave loopback. The live pool's
operations run twice: on plain HTTP and on a pool whose every service is on TLS.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

import pytest
import pytest_asyncio
import requests
import schemathesis
from conftest import make_spec, started_pool
from hypothesis import HealthCheck, given, settings

from agent.app import agent_api
from controlplane.app import controlplane_api
from controlplane.identities import Identities
from dsec.client import Client, Sandbox
from dsec.httpkit import Api
from dsec.image import BASE_IMAGE
from dsec.launch.local import LocalPool
from dsec.models import NAME_PATTERN, SANDBOX_ID_PATTERN, Capacity, PoolParams
from dsec.tokens import new_token

MAX_EXAMPLES = 40  # per operation and mode: the module, both pools, stays under 90 s
MODES = [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE]
ACQUIRE_TIMEOUT_S = (3.0, 10.0)  # long enough to be served, short enough not to block
EXEC_MAX_TIMEOUT_S = 5.0
HEARTBEAT = ("PUT", "/v1/agents/{node_id}")
CLOSED_PORT_URL = "http://127.0.0.1:9"  # discard: nothing listens, so nothing is sent
# what a pool made by an example is set to: it keeps nothing, yields to every other pool,
# and frees at once whatever it had started to keep
INERT_POOL = {
    "min_warm": 0,
    "max_warm": 0,
    "warm_fraction": 0,
    "templates": [],
    "priority": -1000,
    "freeze_after_s": 1,
    "frozen_ttl_s": 1,
}


def cases(api: Api, exclude: tuple[str, str] | None = None) -> list:
    """(method, path, mode) for the operations of `api`: the positive mode for all, the
    negative one for those with a body (a path parameter is any string: none is wrong)."""
    found = []
    for path, ops in api.openapi()["paths"].items():
        for method, op in ops.items():
            if (method.upper(), path) == exclude:
                continue
            for mode in MODES if "requestBody" in op else MODES[:1]:
                found.append(pytest.param(method.upper(), path, mode, id=f"{method} {path} {mode}"))
    return found


@pytest_asyncio.fixture(
    scope="module", loop_scope="module", params=[False, True], ids=["http", "https"]
)
async def pool(request, docker_client, tmp_path_factory) -> AsyncIterator[LocalPool]:
    spec = make_spec(
        tmp_path_factory.mktemp("fuzz"),
        nodes=1,
        capacity=Capacity(cpus=16, memory_mb=16384, slots=12),
        pool=PoolParams(min_warm=2),
        tls=request.param,
    )
    async with started_pool(spec, docker_client) as p:
        yield p


def verify(pool: LocalPool) -> str | bool:
    """What `requests` verifies the pool's certificates with: its CA, or the default."""
    return str(pool.ca) if pool.ca else True


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def leased(pool: LocalPool) -> AsyncIterator[Sandbox]:
    """The sandbox whose lease token the exec examples carry."""
    async with Client(pool.url, token=pool.tokens.client, ca=pool.ca) as c:
        async with c.sandbox() as sb:
            yield sb


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def lone_controlplane(tmp_path_factory) -> AsyncIterator[tuple[str, Identities]]:
    """A control plane with no agents, for forged heartbeats: (url, its nodes' credentials)."""
    config = tmp_path_factory.mktemp("lone") / "controlplane.json"
    key, agent_token = new_token(), new_token()
    config.write_text(json.dumps({"pools": {"default": {"min_warm": 0}}, "identity_key": key}))
    env = {**os.environ, "DSEC_ADMIN_TOKEN": new_token(), "DSEC_AGENT_TOKEN": agent_token}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dsec.cli", "controlplane", "--config", str(config),
        "--host", "127.0.0.1", "--port", "0",
        stdout=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        yield json.loads(line)["url"], Identities(key, agent_token)
    finally:
        proc.terminate()
        await proc.wait()


@pytest.fixture(scope="module")
def default_params(pool) -> Iterator[dict]:
    """The default pool's parameters, set back at the end whatever the examples did."""
    url, headers = f"{pool.url}/v1/pools", {"Authorization": f"Bearer {pool.tokens.admin}"}
    answer = requests.get(url, headers=headers, timeout=10, verify=verify(pool)).json()
    params = next(p["params"] for p in answer["pools"] if p["name"] == "default")
    yield params
    requests.put(f"{url}/default", json=params, headers=headers, timeout=10, verify=verify(pool))


def served_schema(
    url: str, static: dict, steer: Callable[[dict], None], tls_verify: str | bool = True
):
    """The document the service serves (it must be the one the tests were built from),
    with `steer` applied to what positive examples may ask for."""
    served = requests.get(f"{url}/openapi.json", timeout=10, verify=tls_verify).json()
    assert served == static
    for ops in served["paths"].values():
        for op in ops.values():
            for param in op.get("parameters", []):
                pattern = SANDBOX_ID_PATTERN if param["name"] == "sandbox_id" else NAME_PATTERN
                param["schema"]["pattern"] = pattern
    steer(served["components"]["schemas"])
    schema = schemathesis.openapi.from_dict(served)
    # every example carries valid credentials: refusals are test_auth.py's subject
    schema.config.generation.update(with_security_parameters=False)
    return schema


def steer_controlplane(schemas: dict) -> None:
    schemas["AcquireRequest"]["properties"]["timeout_s"].update(
        minimum=ACQUIRE_TIMEOUT_S[0], maximum=ACQUIRE_TIMEOUT_S[1]
    )


def steer_agent(node_id: str) -> Callable[[dict], None]:
    def steer(schemas: dict) -> None:
        schemas["ExecRequest"]["properties"]["timeout_s"]["maximum"] = EXEC_MAX_TIMEOUT_S
        # sandboxes this node creates, of an image it has and within its capacity: what
        # Docker makes of the rest of the template is what is fuzzed here
        schemas["CreateSandbox"]["properties"]["sandbox_id"] = {
            "type": "string",
            "pattern": rf"^{node_id}\.[0-9a-f]{{16}}$",
        }
        template = schemas["TemplateSpec"]["properties"]
        template["image"] = {"const": BASE_IMAGE}
        template["cpus"]["maximum"] = 4  # past the host's 2 cores: Docker refuses it
        template["memory_mb"]["maximum"] = template["workdir_mb"]["maximum"] = 1024

    return steer


@dataclass
class Fuzzer:
    base_url: str
    headers: dict[str, str]
    tls_verify: str | bool = True  # a CA bundle for a pool on TLS
    answers: list[int] = field(default_factory=list)

    def send(self, case, headers: dict[str, str] | None = None) -> requests.Response:
        response = case.call(
            base_url=self.base_url,
            headers=headers or self.headers,
            timeout=30,
            verify=self.tls_verify,
        )
        self.answers.append(response.status_code)
        assert response.status_code < 500, (
            f"{case.method} {case.formatted_path} {case.body!r:.300} -> "
            f"{response.status_code} {response.text[:500]}"
        )
        return response

    def undo(self, method: str, path: str, json_body: dict | None = None) -> None:
        answer = requests.request(
            method,
            f"{self.base_url}{path}",
            json=json_body,
            headers=self.headers,
            timeout=30,
            verify=self.tls_verify,
        )
        assert answer.status_code == 200, answer.text


def fuzz(operation, mode, run: Callable) -> None:
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def examples(case) -> None:
        run(case)

    examples()


def clamp_number(body, name: str, low: float, high: float) -> None:
    """A valid number for `name` is brought into [low, high]: the example still says
    what it says, but cannot hold the test for long."""
    value = body.get(name) if isinstance(body, dict) else None
    if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
        body[name] = min(max(value, low), high)


@pytest.mark.parametrize(("method", "path", "mode"), cases(controlplane_api(), HEARTBEAT))
def test_the_control_plane_answers_no_5xx(pool, default_params, method, path, mode):
    schema = served_schema(pool.url, controlplane_api().openapi(), steer_controlplane, verify(pool))
    fuzzer = Fuzzer(pool.url, {"Authorization": f"Bearer {pool.tokens.admin}"}, verify(pool))

    def run(case) -> None:
        acquire = (method, path) == ("POST", "/v1/sandboxes")
        if acquire:
            clamp_number(case.body, "timeout_s", *ACQUIRE_TIMEOUT_S)
        response = fuzzer.send(case)
        if acquire and response.status_code == 201:
            fuzzer.undo("DELETE", f"/v1/sandboxes/{response.json()['id']}")
        if method == "PUT" and response.status_code == 200:
            name = response.json()["name"]
            restore = default_params if name == "default" else INERT_POOL
            fuzzer.undo("PUT", f"/v1/pools/{name}", restore)

    fuzz(schema[path][method], mode, run)
    assert fuzzer.answers
    if method == "PUT":
        wait_until_only_default_holds_sandboxes(fuzzer)


def wait_until_only_default_holds_sandboxes(fuzzer: Fuzzer) -> None:
    """Pools made inert free what they had started to keep within a few seconds: the
    tests after this one get the node's slots back."""
    deadline = time.monotonic() + 30
    while True:
        answer = requests.get(
            f"{fuzzer.base_url}/v1/sandboxes",
            headers=fuzzer.headers,
            timeout=10,
            verify=fuzzer.tls_verify,
        )
        others = [s["id"] for s in answer.json()["sandboxes"] if s["pool"] != "default"]
        if not others:
            return
        assert time.monotonic() < deadline, f"sandboxes of inert pools remain: {others}"
        time.sleep(0.2)


@pytest.mark.parametrize("mode", MODES, ids=str)
def test_forged_heartbeats_answer_no_5xx(lone_controlplane, mode):
    url, identities = lone_controlplane
    schema = served_schema(url, controlplane_api().openapi(), steer_controlplane)
    fuzzer = Fuzzer(url, {})

    def run(case) -> None:
        # the forged node's own token: past the credential check, to the report's parser
        node_token = identities.node_token(case.path_parameters["node_id"])
        if isinstance(case.body, dict):
            case.body["url"] = CLOSED_PORT_URL  # whatever node it forges, on loopback
            table = case.body.get("sandboxes")
            busy = table.get("busy_s") if isinstance(table, dict) else None
            if isinstance(busy, list):
                # known: test_a_report_with_negative_busy_time_is_refused
                table["busy_s"] = [abs(b) if isinstance(b, int | float) else b for b in busy]
        fuzzer.send(case, headers={"Authorization": f"Bearer {node_token}"})

    fuzz(schema[HEARTBEAT[1]][HEARTBEAT[0]], mode, run)
    assert fuzzer.answers


@pytest.mark.parametrize(("method", "path", "mode"), cases(agent_api()))
def test_the_agent_answers_no_5xx(pool, leased, method, path, mode):
    agent_url = pool.agents[0].url
    schema = served_schema(
        agent_url, agent_api().openapi(), steer_agent(pool.node_ids[0]), verify(pool)
    )
    call_token = pool.identities.call_token(pool.node_ids[0])
    fuzzer = Fuzzer(agent_url, {"Authorization": f"Bearer {call_token}"}, verify(pool))
    lease = {"Authorization": f"Bearer {leased.lease.lease_token}"}

    def run(case) -> None:
        if path.endswith("/exec"):
            # commands get past the token check only in the one sandbox it holds
            case.path_parameters = {"sandbox_id": leased.id}
            clamp_number(case.body, "timeout_s", 0.001, EXEC_MAX_TIMEOUT_S)
            fuzzer.send(case, headers=lease)
            return
        response = fuzzer.send(case)
        if (method, path) == ("POST", "/v1/sandboxes") and response.status_code in (200, 201):
            fuzzer.undo("DELETE", f"/v1/sandboxes/{response.json()['id']}")

    fuzz(schema[path][method], mode, run)
    assert fuzzer.answers


def test_a_report_with_negative_busy_time_is_refused(lone_controlplane):
    url, identities = lone_controlplane
    row = {
        "id": "forged.0123456789abcdef",
        "pool": "default",
        "template": "base",
        "state": "warm",
        "created_at": 0,
        "cpus": 0.5,
        "memory_mb": 256,
        "lease_id": None,
        "idempotency_key": None,
        "owner": None,
        "busy_s": -1.0,
        "active_at": 0,
        "frozen_at": None,
    }
    report = {
        "node_id": "forged",
        "kind": "local",
        "url": CLOSED_PORT_URL,
        "capacity": {"cpus": 1, "memory_mb": 1024, "slots": 1},
        "usage": {},
        "sandboxes": {column: [value] for column, value in row.items()},
        "incarnation": "1",
        "clock": 1.0,
        "seq": 1,
    }
    answer = requests.put(
        f"{url}/v1/agents/forged",
        json=report,
        headers={"Authorization": f"Bearer {identities.node_token('forged')}"},
        timeout=10,
    )
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"]["details"][0]["loc"] == "sandboxes.busy_s.0"
