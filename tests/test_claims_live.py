"""Personalised claims on the real engine: an acquire's `env`, `files` and `setup` are
applied to the warm sandbox it gets before the answer (which is still a warm hit), and a
setup that fails fails the acquire with its output and removes the sandbox."""

from __future__ import annotations

import base64
import io
import tarfile

import aiohttp
import pytest
import pytest_asyncio
from conftest import eventually, make_spec, started_pool

from agent.docker_driver import LABEL_SANDBOX
from controlplane.config import MAX_CLAIM_FILES_BYTES
from dsec.client import Client, DsecError, Sandbox
from dsec.models import Lease, PoolParams

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pool(docker_client, tmp_path_factory):
    spec = make_spec(tmp_path_factory.mktemp("claims"), nodes=2, pool=PoolParams(min_warm=3))
    async with started_pool(spec, docker_client) as p:
        yield p


async def warm_pool(client: Client, count: int = 3) -> None:
    async def warm() -> bool:
        return (await client.pool("default")).sandboxes.get("warm", 0) >= count

    await eventually(warm, f"{count} warm sandboxes")


async def out(sb, script: str) -> str:
    result = await sb.exec(["sh", "-c", script], timeout=20)
    assert result.exit_code == 0, result
    return result.stdout


async def test_env_is_on_every_command_of_the_lease_and_a_command_s_own_is_over_it(client):
    await warm_pool(client)
    env = {"TASK_ID": "t-17", "SPACED": "a b  c", "OVERRIDDEN": "lease"}
    async with client.sandbox(env=env) as sb:
        assert sb.lease.path == "warm" and sb.lease.setup_ms is not None
        assert await out(sb, 'echo "$TASK_ID|$SPACED|$OVERRIDDEN"') == "t-17|a b  c|lease\n"
        again = await sb.exec(["sh", "-c", "echo $TASK_ID $OVERRIDDEN"], env={"OVERRIDDEN": "own"})
        assert again.stdout == "t-17 own\n"
        streamed = [c.data async for c in sb.exec_stream(["sh", "-c", "echo $TASK_ID"])]
        assert b"".join(streamed) == b"t-17\n"
    async with client.sandbox() as plain:  # another lease: none of it
        assert plain.lease.setup_ms is None
        assert await out(plain, 'echo "[$TASK_ID]"') == "[]\n"


async def test_files_are_in_the_work_dir_before_the_answer_as_the_sandbox_s_user(client):
    await warm_pool(client)
    files = {"src/app.py": b"print('hi')\n", "/work/data.bin": bytes(range(256))}
    async with client.sandbox(files=files) as sb:
        assert sb.lease.path == "warm"
        assert await sb.files.read("/work/src/app.py") == files["src/app.py"]
        assert await sb.files.read("/work/data.bin") == files["/work/data.bin"]
        owner = await out(sb, "stat -c '%u %a' /work/src/app.py; id -u")
        file_uid, mode, uid = owner.split()
        assert (file_uid, mode) == (uid, "644")


async def test_files_in_base64_json_and_as_a_form_s_parts_are_the_same_bytes(pool, client):
    """The SDK sends a claim's files as a tar in a form's part, bytes as they are; an
    acquire in JSON gives them in base64. Both land the same, whatever the path's
    characters."""
    await warm_pool(client)
    files = {'d i r/naïve %41 "q";x.bin': bytes(range(256)) * 3, "b.txt": b"b\n"}
    async with client.sandbox(files=files) as sb:
        for path, data in files.items():
            assert await sb.files.read(f"/work/{path}") == data, path
    body = {"files": {path: base64.b64encode(data).decode() for path, data in files.items()}}
    headers = {"Authorization": f"Bearer {pool.tokens.client}"}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{pool.url}/v1/sandboxes", json=body, headers=headers) as resp:
            assert resp.status == 201, await resp.text()
            lease = Lease.model_validate(await resp.json())
    sb = Sandbox(client, lease)
    try:
        for path, data in files.items():
            assert await sb.files.read(f"/work/{path}") == data, path
    finally:
        await sb.release()


async def test_a_tar_is_unpacked_into_the_work_dir(client):
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w") as tar:
        for name, data in (("repo/README", b"readme\n"), ("repo/pkg/__init__.py", b"")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    async with client.sandbox(files=archive.getvalue()) as sb:
        assert await out(sb, "cat /work/repo/README; ls /work/repo/pkg") == "readme\n__init__.py\n"


async def test_setup_runs_after_the_files_with_the_env_before_the_answer(client):
    await warm_pool(client)
    setup = ["sh", "-c", 'cp /work/in.txt /work/out.txt && echo "$STAGE" >> /work/out.txt']
    async with client.sandbox(
        files={"in.txt": b"given\n"}, env={"STAGE": "set"}, setup=setup
    ) as sb:
        assert sb.lease.path == "warm"
        assert await sb.files.read("/work/out.txt") == b"given\nset\n"


async def test_a_failed_setup_fails_the_acquire_with_its_output_and_removes_the_sandbox(
    client, docker_client
):
    await warm_pool(client)
    setup = ["sh", "-c", "echo building; echo 'no compiler' >&2; exit 3"]
    with pytest.raises(DsecError) as failed:
        await client.acquire(setup=setup)
    e = failed.value
    assert (e.status, e.code) == (422, "setup_failed"), e
    [result] = e.details
    assert result["exit_code"] == 3
    assert (result["stdout"], result["stderr"]) == ("building\n", "no compiler\n")
    sandbox_id = result["sandbox"]

    async def removed() -> bool:
        containers = docker_client.containers.list(
            all=True, filters={"label": f"{LABEL_SANDBOX}={sandbox_id}"}
        )
        return not containers and sandbox_id not in {s.id for s in await client.list()}

    await eventually(removed, f"{sandbox_id} removed")
    # the pool goes on: the next claim gets a sandbox
    async with client.sandbox(setup=["true"]) as sb:
        assert sb.id != sandbox_id


async def test_a_setup_past_its_time_fails_the_acquire_as_timed_out(client):
    with pytest.raises(DsecError) as failed:
        await client.acquire(setup=["sleep", "30"], timeout=3)
    e = failed.value
    assert (e.status, e.code) == (422, "setup_failed"), e
    assert e.details[0]["timed_out"] is True


async def test_the_most_files_a_claim_may_carry_are_written(client):
    most = {"a.bin": bytes(range(256)) * (MAX_CLAIM_FILES_BYTES // 256)}
    async with client.sandbox(files=most) as sb:
        assert await sb.files.read("/work/a.bin") == most["a.bin"]
