"""Bad input gets a 4xx with a JSON body saying what is wrong, and loses nothing."""

from __future__ import annotations

import asyncio
import base64
import gzip
import io
import json
import os
import sys
import tarfile

import aiohttp
import pytest
from conftest import pool_containers

from controlplane.config import MAX_CLAIM_FILES_BYTES
from dsec.httpkit import body_limit_with_files, form_body

pytestmark = pytest.mark.asyncio(loop_scope="module")


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def tar_of(name: str) -> bytes:
    """An uncompressed tar of one empty file named `name`."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        tar.addfile(tarfile.TarInfo(name))
    return out.getvalue()


async def call(method: str, url: str, token: str | None, data=None, json=None):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as http:
        async with http.request(method, url, headers=headers, data=data, json=json) as resp:
            body = await resp.json(content_type=None)
            return resp.status, body


def assert_error(status: int, body: dict, expected_status: int, code: str) -> None:
    assert status == expected_status, body
    assert body["error"]["code"] == code, body
    assert body["error"]["message"]


@pytest.fixture
def acquire_url(pool) -> str:
    return f"{pool.url}/v1/sandboxes"


@pytest.fixture
def app_acquire_url(controlplane_app) -> str:
    return f"{controlplane_app.url}/v1/sandboxes"


# refused before any queue: the control plane in this process (no agents, no Docker)
@pytest.mark.parametrize(
    ("payload", "status", "code", "field"),
    [
        (b"{not json", 400, "malformed_json", None),
        (b"[1, 2]", 400, "malformed_json", None),
        (b'{"pool": "nope"}', 422, "unknown_pool", "pool"),
        (b'{"template": "nope"}', 422, "unknown_template", "template"),
        (b'{"timeout_s": -1}', 422, "validation_error", "timeout_s"),
        (b'{"timeout_s": 1e12}', 422, "validation_error", "timeout_s"),
        (b'{"timeout_s": "soon"}', 422, "validation_error", "timeout_s"),
        (b'{"priority": 10000000}', 422, "validation_error", "priority"),
        (b'{"colour": "blue"}', 422, "validation_error", "colour"),
        (b'{"pool": "../etc"}', 422, "validation_error", "pool"),
        (b'{"idempotency_key": "a b/c"}', 422, "validation_error", "idempotency_key"),
        # personalised claims (controlplane/claims.py): refused before a sandbox is taken
        (b'{"env": {"1BAD": "x"}}', 422, "validation_error", "env"),
        (b'{"env": {"A-B": "x"}}', 422, "validation_error", "env"),
        (b'{"env": {"A": "x\\u0000y"}}', 422, "validation_error", "env"),
        (b'{"files": {"../up": "aGk="}}', 422, "path_outside_workdir", "files.../up"),
        (b'{"files": {"/etc/passwd": "aGk="}}', 422, "path_outside_workdir", "files./etc/passwd"),
        (b'{"files": {"/work/../etc/x": "aGk="}}', 422, "path_outside_workdir", "files./work"),
        (b'{"files": {"dir/": "aGk="}}', 422, "path_outside_workdir", "files.dir/"),
        (b'{"files": {"a": "not base64!"}}', 422, "validation_error", "files"),
        (
            json.dumps({"files": b64(gzip.compress(tar_of("a"), mtime=0))}).encode(),
            422,
            "validation_error",
            "files",
        ),
        (
            json.dumps({"files": b64(tar_of("../evil"))}).encode(),
            422,
            "path_outside_workdir",
            "files.../evil",
        ),
        (
            json.dumps({"files": b64(tar_of("/etc/cron.d/x"))}).encode(),
            422,
            "path_outside_workdir",
            "files./etc",
        ),
        (b'{"setup": []}', 422, "validation_error", "setup"),
        (b'{"setup": "make"}', 422, "validation_error", "setup"),
    ],
    # a tar's body, whole, would make an id of kilobytes
    ids=lambda v: v[:48].decode("ascii", "replace") if isinstance(v, bytes) else None,
)
async def test_bad_acquire_bodies(controlplane_app, app_acquire_url, payload, status, code, field):
    got, body = await call("POST", app_acquire_url, controlplane_app.tokens.client, data=payload)
    assert_error(got, body, status, code)
    if field:
        details = body["error"].get("details") or []
        assert any(field in d["loc"] for d in details), body


async def test_claim_files_past_the_limit_are_422_saying_the_limit(
    controlplane_app, app_acquire_url
):
    files = {
        "a": b64(b"x" * (MAX_CLAIM_FILES_BYTES // 2)),
        "b": b64(b"y" * (MAX_CLAIM_FILES_BYTES // 2 + 1)),
    }
    got, body = await call(
        "POST", app_acquire_url, controlplane_app.tokens.client, json={"files": files}
    )
    assert_error(got, body, 422, "files_too_large")
    assert str(MAX_CLAIM_FILES_BYTES) in body["error"]["message"]


async def test_oversize_body(controlplane_app, app_acquire_url):
    token = controlplane_app.tokens.client
    too_large = body_limit_with_files(MAX_CLAIM_FILES_BYTES) + 1
    got, body = await call("POST", app_acquire_url, token, data=b"x" * too_large)
    assert_error(got, body, 413, "body_too_large")


# a multipart acquire (docs/contracts.md, "Personalised claims"): files as parts
REQUEST = ("request", None, "{}")


@pytest.mark.parametrize(
    ("parts", "status", "code", "says"),
    [
        ([("file", "a.txt", b"hi")], 422, "validation_error", "first part must be 'request'"),
        ([("request", None, "{not json")], 400, "malformed_json", "not valid JSON"),
        ([("request", None, '{"pool": "nope"}')], 422, "unknown_pool", "nope"),
        (
            [("request", None, '{"files": {"a": "aGk="}}'), ("file", "b", b"hi")],
            422,
            "validation_error",
            "give them once",
        ),
        ([REQUEST, ("file", None, b"hi")], 422, "validation_error", "filename"),
        ([REQUEST, ("tar", None, b"x"), ("tar", None, b"y")], 422, "validation_error", "one 'tar'"),
        ([REQUEST, ("file", "../up", b"hi")], 422, "path_outside_workdir", "../up"),
        ([REQUEST, ("file", "/etc/passwd", b"hi")], 422, "path_outside_workdir", "/etc/passwd"),
        ([REQUEST, ("file", "a\x00b", b"hi")], 422, "validation_error", "path is invalid"),
        ([REQUEST, ("tar", None, tar_of("../evil"))], 422, "path_outside_workdir", "../evil"),
        ([REQUEST, ("tar", None, b"not a tar")], 422, "validation_error", "not an uncompressed"),
    ],
)
async def test_bad_acquire_forms(controlplane_app, app_acquire_url, parts, status, code, says):
    token = controlplane_app.tokens.client
    got, body = await call("POST", app_acquire_url, token, data=form_body(parts))
    assert_error(got, body, status, code)
    assert says in json.dumps(body["error"]), body


async def test_a_form_past_the_claim_limit_is_refused_without_being_read_whole(
    controlplane_app, app_acquire_url
):
    token = controlplane_app.tokens.client
    files = [("file", f"f{i}", b"x" * (MAX_CLAIM_FILES_BYTES // 2)) for i in range(2)]
    got, body = await call(
        "POST", app_acquire_url, token, data=form_body([REQUEST, *files, ("file", "g", b"y")])
    )
    assert_error(got, body, 422, "files_too_large")
    past_body = [("file", f"f{i}", b"x" * (MAX_CLAIM_FILES_BYTES // 2)) for i in range(4)]
    got, body = await call("POST", app_acquire_url, token, data=form_body([REQUEST, *past_body]))
    assert_error(got, body, 413, "body_too_large")


@pytest.mark.parametrize(
    ("content_type", "body", "says"),
    [
        ("multipart/form-data", b"--b\r\n\r\n{}\r\n--b--\r\n", "no boundary"),
        (
            "multipart/form-data; boundary=b",
            b"--b\r\nContent-Disposition: form-data; name=request\r\n\r\n{}",
            "ends before",
        ),
        (
            "multipart/form-data; boundary=b",
            b"--b\r\n" + b"X-A: 1\r\n" * 64 + b"\r\n{}\r\n--b--\r\n",
            "not a valid form",
        ),
        ("multipart/form-data; boundary=b", b"no form here", "not a valid form"),
    ],
    ids=["no-boundary", "no-end", "too-many-part-headers", "garbage"],
)
async def test_malformed_forms_are_400_saying_what_is_wrong(
    controlplane_app, app_acquire_url, content_type, body, says
):
    headers = {
        "Authorization": f"Bearer {controlplane_app.tokens.client}",
        "Content-Type": content_type,
    }
    async with aiohttp.ClientSession() as http:
        async with http.post(app_acquire_url, data=body, headers=headers) as resp:
            got = await resp.json()
            assert_error(resp.status, got, 400, "malformed_form")
            assert says in got["error"]["message"], got


@pytest.mark.parametrize(
    "sandbox_id", ["..%2F..%2Fetc", "a.b", "UPPER.0123456789abcdef", "x" * 300, "%00"]
)
async def test_sandbox_ids_with_path_characters(controlplane_app, sandbox_id):
    url, token = f"{controlplane_app.url}/v1/sandboxes/{sandbox_id}", controlplane_app.tokens.client
    got, body = await call("GET", url, token)
    assert_error(got, body, 400, "invalid_sandbox_id")
    got, body = await call("DELETE", url, token)
    assert_error(got, body, 400, "invalid_sandbox_id")


async def test_unknown_routes_and_methods_answer_json(controlplane_app):
    base, token = controlplane_app.url, controlplane_app.tokens.client
    got, body = await call("GET", f"{base}/v1/nothing", token)
    assert_error(got, body, 404, "not_found")
    got, body = await call("PATCH", f"{base}/v1/sandboxes", token)
    assert_error(got, body, 405, "method_not_allowed")


async def test_credentials_are_required(controlplane_app, app_acquire_url):
    got, body = await call("POST", app_acquire_url, None, json={})
    assert_error(got, body, 401, "unauthenticated")
    got, body = await call("POST", app_acquire_url, "wrong", json={})
    assert_error(got, body, 403, "forbidden")
    # a client token cannot change a pool's parameters
    base, token = controlplane_app.url, controlplane_app.tokens.client
    got, body = await call("PUT", f"{base}/v1/pools/default", token, json={})
    assert_error(got, body, 403, "forbidden")


async def test_bad_pool_parameters_change_nothing(controlplane_app):
    base, admin = controlplane_app.url, controlplane_app.tokens.admin
    url = f"{base}/v1/pools/default"
    _, before = await call("GET", f"{base}/v1/pools", admin)
    for params in (
        {"min_warm": -1},
        {"min_warm": 10, "max_warm": 5},
        {"templates": ["nope"]},
        {"freeze_after_s": "later"},
        {"overflow_threshold": 1.5},
    ):
        got, body = await call("PUT", url, admin, json=params)
        assert 400 <= got < 500 and body["error"]["message"], (params, body)
    _, after = await call("GET", f"{base}/v1/pools", admin)
    assert after == before or [p["params"] for p in after["pools"]] == [
        p["params"] for p in before["pools"]
    ]


# on a live pool: these need a sandbox, its agent and its container
async def test_exec_bad_input_and_released_sandbox(pool, client, docker_client):
    sb = await client.acquire()
    url = f"{sb.lease.agent_url}/v1/sandboxes/{sb.id}/exec"
    token = sb.lease.lease_token
    for payload, field in [
        ({"cmd": "echo hi"}, "cmd"),
        ({"cmd": ["echo", 1]}, "cmd"),
        ({"cmd": []}, "cmd"),
        ({"cmd": ["true"], "timeout_s": 0}, "timeout_s"),
        ({"cmd": ["true"], "max_output_bytes": -5}, "max_output_bytes"),
        ({"cmd": ["true"], "shell": True}, "shell"),
    ]:
        got, body = await call("POST", url, token, json=payload)
        assert_error(got, body, 422, "validation_error")
        assert any(field in d["loc"] for d in body["error"]["details"]), body
    got, body = await call("POST", url, None, json={"cmd": ["true"]})
    assert_error(got, body, 401, "unauthenticated")
    got, body = await call("POST", url, pool.tokens.client, json={"cmd": ["true"]})
    assert_error(got, body, 403, "forbidden")
    got, body = await call("POST", url, token, data=b"{")
    assert_error(got, body, 400, "malformed_json")
    # the sandbox still works after all that
    assert (await sb.exec(["echo", "ok"])).stdout == "ok\n"

    await sb.release()
    got, body = await call("POST", url, token, json={"cmd": ["true"]})
    assert_error(got, body, 410, "released")
    got, body = await call("DELETE", f"{pool.url}/v1/sandboxes/{sb.id}", pool.tokens.client)
    assert_error(got, body, 409, "already_released")
    got, body = await call("GET", f"{pool.url}/v1/sandboxes/{sb.id}", pool.tokens.client)
    assert_error(got, body, 410, "released")
    unknown = f"{pool.node_ids[0]}.0123456789abcdef"
    got, body = await call("DELETE", f"{pool.url}/v1/sandboxes/{unknown}", pool.tokens.client)
    assert_error(got, body, 404, "unknown_sandbox")


async def test_bad_input_leaves_no_container_behind(pool, operator, docker_client, acquire_url):
    async def settled_containers() -> set[str]:
        for _ in range(200):  # wait out warm-pool refills from earlier tests
            if not any(s.state == "creating" for s in await operator.list()):
                break
            await asyncio.sleep(0.05)
        return {
            c.attrs["Labels"]["dsec.sandbox"]
            for c in pool_containers(docker_client, pool.spec.name + "-")
        }

    before = await settled_containers()
    for payload in (b"{", b'{"pool": "nope"}', b'{"timeout_s": -1}', b'{"template": "x"}'):
        got, _ = await call("POST", acquire_url, pool.tokens.client, data=payload)
        assert 400 <= got < 500
    await asyncio.sleep(2 * pool.spec.tick_s)  # let the policy run on whatever it saw
    assert await settled_containers() == before


@pytest.mark.parametrize(
    ("argv", "extra_env", "message"),
    [
        (["up", "--nodes", "0"], {}, "--nodes"),
        (["up", "--slots-per-node", "-3"], {}, "slots"),
        (["plan", "--acceptance", "2"], {}, "acceptance"),
        (["status", "--url", "http://127.0.0.1:9"], {}, "DSEC_ADMIN_TOKEN"),
        (["agent", "--node-id", "n1"], {}, "DSEC_AGENT_TOKEN"),
        (["agent", "--node-id", "Bad Id!"], {"DSEC_AGENT_TOKEN": "x" * 32}, "node_id"),
        (
            ["controlplane", "--config", "/nonexistent.json"],
            {"DSEC_ADMIN_TOKEN": "a", "DSEC_AGENT_TOKEN": "x" * 32},
            "cannot read config",
        ),
    ],
)
async def test_cli_says_what_is_wrong(argv, extra_env, message):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSEC_")} | extra_env
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dsec.cli", *argv, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await proc.communicate()
    assert proc.returncode == 2, (out, err)
    text = err.decode()
    assert message in text and "Traceback" not in text
    assert len(text.strip().splitlines()) == 1
