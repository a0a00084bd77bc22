"""Templates added, changed and removed while the pool runs (`/v1/templates`): real
processes, real HTTP, real containers."""

from __future__ import annotations

import json

import aiohttp
import pytest
from conftest import assert_stopped_then_removed, eventually
from test_cli_sandbox import cli_env, dsec

from agent.docker_driver import LABEL_SANDBOX
from dsec.client import Client, DsecError
from dsec.image import BASE_IMAGE
from dsec.models import PoolParams

pytestmark = pytest.mark.asyncio(loop_scope="module")

ENV = {"PYTHONDONTWRITEBYTECODE": "1", "GREETING": "from-template"}
SHOW_ENV = ["sh", "-c", 'echo "$GREETING $PYTHONDONTWRITEBYTECODE $HOME"']


def live_template(**overrides) -> dict:
    return {"image": BASE_IMAGE, "recyclable": True, "env": ENV, **overrides}


async def removed_soon(docker_client, sandbox_id: str) -> None:
    """An idle sandbox the policy removes: its container is gone within a few ticks."""

    def gone() -> bool:
        filters = {"label": f"{LABEL_SANDBOX}={sandbox_id}"}
        return not docker_client.containers.list(all=True, sparse=True, filters=filters)

    await eventually(gone, f"{sandbox_id} removed")


async def warm_ids(operator: Client, pool: str, template: str) -> set[str]:
    return {
        s.id for s in await operator.list(pool=pool) if s.template == template and s.state == "warm"
    }


async def test_a_template_put_live_serves_warm_sandboxes_with_its_environment(
    client, operator, pool
):
    added = await operator.put_template("live", live_template())
    assert added.name == "live" and added.spec.env == ENV
    assert added.nodes_with_image == sorted(pool.node_ids)
    assert "live" in {t.name for t in await client.templates()}  # a client may read them
    await operator.set_pool("live-pool", PoolParams(templates=["live"], min_warm=2, recycle=True))
    await eventually(
        lambda: warm_ids(operator, "live-pool", "live"), "warm sandboxes of the new template"
    )
    async with client.sandbox(pool="live-pool", template="live") as sb:
        assert sb.lease.path == "warm"
        assert (await sb.exec(SHOW_ENV)).stdout == "from-template 1 /work\n"
        # a command's own environment comes before the template's
        mine = await sb.exec(SHOW_ENV, env={"GREETING": "mine"})
        assert mine.stdout == "mine 1 /work\n"


async def test_a_changed_template_replaces_its_idle_sandboxes_and_lets_leases_finish(
    client, operator, docker_client
):
    old_warm = await eventually(lambda: warm_ids(operator, "live-pool", "live"), "warm ones")
    held = await client.acquire(pool="live-pool", template="live")
    try:
        changed = await operator.put_template(
            "live", live_template(env={**ENV, "GREETING": "changed"})
        )
        assert changed.spec.env["GREETING"] == "changed"
        for sandbox_id in old_warm - {held.id}:
            await removed_soon(docker_client, sandbox_id)

        async def new_warm() -> set[str]:
            return await warm_ids(operator, "live-pool", "live") - old_warm

        await eventually(new_warm, "warm sandboxes of the changed template")
        # the lease made from the old template runs on, as it was made
        assert (await held.exec(SHOW_ENV)).stdout == "from-template 1 /work\n"
    finally:
        await held.release()
    # released, it is removed although its pool recycles: it is of the old template
    await assert_stopped_then_removed(docker_client, held.id)
    async with client.sandbox(pool="live-pool", template="live") as sb:
        assert (await sb.exec(SHOW_ENV)).stdout == "changed 1 /work\n"


async def test_a_removed_template_takes_its_warm_sandboxes_and_leaves_its_leases(
    client, operator, docker_client
):
    with pytest.raises(DsecError) as in_use:
        await operator.delete_template("live")
    assert (in_use.value.status, in_use.value.code) == (409, "template_in_use")
    assert "live-pool" in in_use.value.message
    held = await client.acquire(pool="live-pool", template="live")
    try:
        warm = await eventually(lambda: warm_ids(operator, "live-pool", "live"), "warm ones")
        await operator.patch_pool("live-pool", templates=["base"], recycle=False)
        removed = await operator.delete_template("live")
        assert removed.leases_left == 1
        assert "live" not in {t.name for t in await operator.templates()}
        for sandbox_id in warm:
            await removed_soon(docker_client, sandbox_id)
        assert (await held.exec(["echo", "still here"])).stdout == "still here\n"
        # a new acquire of it is refused: it is gone
        with pytest.raises(DsecError) as gone:
            await client.acquire(pool="live-pool", template="live", timeout=5)
        assert gone.value.status == 422
    finally:
        await held.release()
    await assert_stopped_then_removed(docker_client, held.id)


@pytest.mark.parametrize(
    "body, status, code, says",
    [
        (live_template(image="nowhere-to-be-found:v1"), 422, "image_not_found", "nowhere"),
        (live_template(env={"1BAD": "x"}), 422, "validation_error", "env"),
        (live_template(env={"OK": "a\x00b"}), 422, "validation_error", "env"),
        (live_template(name="other"), 422, "template_name_mismatch", "other"),
        (live_template(memory_mb=1), 422, "validation_error", "memory_mb"),
        ({"image": BASE_IMAGE, "colour": "red"}, 422, "validation_error", "colour"),
    ],
)
async def test_a_bad_template_is_refused_and_changes_nothing(
    operator, pool, body, status, code, says
):
    before = await operator.templates()
    resp = await pool_http(pool, "PUT", "/v1/templates/bad", pool.tokens.admin, body)
    assert resp[0] == status and resp[1]["error"]["code"] == code, resp
    assert says in str(resp[1]), resp
    assert await operator.templates() == before


async def test_templates_are_an_operators_to_change_and_unknown_ones_say_so(pool):
    status, body = await pool_http(
        pool, "PUT", "/v1/templates/mine", pool.tokens.client, live_template()
    )
    assert status == 403, body
    for method in ("GET", "DELETE"):
        status, body = await pool_http(pool, method, "/v1/templates/ghost", pool.tokens.admin)
        assert (status, body["error"]["code"]) == (404, "unknown_template"), body
    status, body = await pool_http(pool, "GET", "/v1/templates/Not_A_Name", pool.tokens.admin)
    assert status == 400, body


async def pool_http(pool, method: str, path: str, token: str, body=None) -> tuple[int, dict]:
    """A raw call, for what the SDK would refuse before sending."""
    async with aiohttp.ClientSession() as http:
        async with http.request(
            method, pool.url + path, json=body, headers={"Authorization": f"Bearer {token}"}
        ) as resp:
            return resp.status, await resp.json()


async def test_the_cli_adds_shows_lists_and_removes_a_template(pool):
    env = cli_env(pool.url, pool.tokens.client, pool.tokens.admin)
    code, out, err = await dsec(
        "template", "add", "from-cli", "--image", BASE_IMAGE, "cpus=0.25",
        'env={"A": "1"}', "--json", env=env,
    )  # fmt: skip
    assert code == 0, err
    added = json.loads(out)
    assert (added["spec"]["cpus"], added["spec"]["env"]) == (0.25, {"A": "1"})
    code, out, err = await dsec("template", "list", "--json", env=env)
    assert code == 0 and "from-cli" in {t["name"] for t in json.loads(out)}, err
    code, out, err = await dsec("template", "show", "from-cli", env=env)
    assert code == 0 and "template from-cli: kept warm by no pool" in out.decode(), err
    code, _, err = await dsec("template", "add", "x", "--image", BASE_IMAGE, "colour=red", env=env)
    assert code != 0 and "unknown template setting 'colour'" in err, err
    code, _, err = await dsec("template", "add", "x", "--image", "nowhere:v1", env=env)
    assert code != 0 and "nowhere:v1" in err, err
    code, out, err = await dsec("template", "rm", "from-cli", env=env)
    assert code == 0 and "template from-cli removed" in out.decode(), err
    code, _, err = await dsec("template", "rm", "from-cli", env=env)
    assert code != 0 and "no template named 'from-cli'" in err, err
