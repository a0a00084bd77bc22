"""`dsec template build` on the real engine: from Debian packages (mmdebstrap), a
Dockerfile and an image; the content-hash tag and its cache; failures that tag nothing.

The Debian build is cached by its tag in the engine, so only a machine's first run
pays for mmdebstrap (about 20 s for this small one)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import uuid

import docker
import pytest
from conftest import TEST_POOL_PREFIX, eventually, started_pool

from agent.docker_driver import LABEL_NODE
from dsec.cli import build_parser
from dsec.cli.up import up_spec
from dsec.client import Client
from dsec.image import BASE_IMAGE, ensure_base_image
from dsec.template_build import TemplateBuildError, build_template

pytestmark = [
    pytest.mark.docker,
    pytest.mark.skipif(shutil.which("mmdebstrap") is None, reason="needs Debian's mmdebstrap"),
]

SMALL = {"debian": "bookworm", "packages": ("busybox",)}


def tags_of(client: docker.DockerClient, name: str) -> list[str]:
    return [t for i in client.images.list(name=name) for t in i.tags]


def run_in(client: docker.DockerClient, image: str, script: str) -> str:
    """What `script` prints in a container of `image` (labelled, no network, removed)."""
    out = client.containers.run(
        image,
        ["sh", "-c", script],
        remove=True,
        network_disabled=True,
        network_mode="none",
        labels={LABEL_NODE: "test-template-build"},
    )
    return out.decode()


@pytest.fixture
def untag(docker_client):
    """Removes, at the test's end, the tags of the names given: a build each run makes anew
    (unlike `small`, kept as the machine's cache) leaves none behind."""
    names: list[str] = []
    yield names.append
    for tag in {t for name in names for t in tags_of(docker_client, name)}:
        if tag.partition(":")[0] in names:  # an image it shares keeps its other names
            docker_client.images.remove(tag)


@pytest.fixture(scope="module")
def small(docker_client):
    return build_template("test-small", **SMALL, client=docker_client)


def test_a_debian_template_has_its_packages_a_sandbox_user_and_a_work_dir(docker_client, small):
    assert small.image.startswith("test-small:") and len(small.image.split(":")[1]) == 16
    assert (
        docker_client.images.get(small.image).id == docker_client.images.get("test-small:latest").id
    )
    script = "busybox true && id sandbox && stat -c %u /work && pwd"
    out = run_in(docker_client, small.image, script)
    assert "uid=1000(sandbox)" in out and out.splitlines()[-2:] == ["1000", "/work"], out


def test_the_same_inputs_are_a_cache_hit_with_the_same_tag(docker_client, small):
    started = time.monotonic()
    again = build_template("test-small", **SMALL, client=docker_client)
    assert again.cached and again.image == small.image
    assert time.monotonic() - started < 10  # no mmdebstrap ran: it takes longer alone


def test_a_dockerfile_starts_from_a_built_template_and_its_content_is_its_tag(
    docker_client, small, tmp_path, untag
):
    untag("test-df")
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(f"FROM {small.image}\nCOPY hello.txt /hello.txt\n")
    run = uuid.uuid4().hex  # this run's content: a tag no earlier run made
    (tmp_path / "hello.txt").write_text(f"one {run}\n")
    first = build_template("test-df", dockerfile=dockerfile, client=docker_client)
    assert run_in(docker_client, first.image, "cat /hello.txt") == f"one {run}\n"
    assert build_template("test-df", dockerfile=dockerfile, client=docker_client).cached
    (tmp_path / "hello.txt").write_text(f"two {run}\n")  # the context changed: a new tag
    second = build_template("test-df", dockerfile=dockerfile, client=docker_client)
    assert not second.cached and second.image != first.image
    assert run_in(docker_client, "test-df:latest", "cat /hello.txt") == f"two {run}\n"


def test_an_image_is_taken_as_it_is(docker_client, untag):
    untag("test-img")
    ensure_base_image(docker_client)
    taken = build_template("test-img", image=BASE_IMAGE, client=docker_client)
    assert docker_client.images.get(taken.image).id == docker_client.images.get(BASE_IMAGE).id


def test_the_cli_draws_a_builds_steps_on_stderr_and_its_answer_on_stdout(docker_client, untag):
    untag("test-bar")
    ensure_base_image(docker_client)
    command = [sys.executable, "-m", "dsec.cli", "template", "build", "test-bar", "--json"]
    built = subprocess.run([*command, "--image", BASE_IMAGE], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    assert json.loads(built.stdout)["cached"] is False  # stdout is the answer alone
    bar = built.stderr.replace("\r", "\n")
    assert "template test-bar: " in bar and "| 1/1 " in bar, built.stderr
    again = subprocess.run([*command, "--image", BASE_IMAGE], capture_output=True, text=True)
    assert json.loads(again.stdout)["cached"] is True and "template test-bar" not in again.stderr


def test_an_unknown_package_fails_with_apts_words_and_tags_nothing(docker_client):
    with pytest.raises(TemplateBuildError) as failed:
        build_template(
            "test-nopkg",
            debian="bookworm",
            packages=("no-such-package-dsec",),
            client=docker_client,
        )
    assert "mmdebstrap of bookworm failed" in str(failed.value)
    assert "no-such-package-dsec" in str(failed.value)
    assert tags_of(docker_client, "test-nopkg") == []


def test_a_failing_dockerfile_and_a_missing_base_fail_and_tag_nothing(docker_client, tmp_path):
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(f"FROM {BASE_IMAGE}\nRUN echo about to fail && false\n")
    with pytest.raises(TemplateBuildError) as failed:
        build_template("test-badfile", dockerfile=dockerfile, client=docker_client)
    assert "the Dockerfile's build failed" in str(failed.value)
    assert "about to fail" in str(failed.value)
    dockerfile.write_text("FROM nowhere-dsec:v9\n")
    with pytest.raises(TemplateBuildError, match="no image 'nowhere-dsec:v9'"):
        build_template("test-badfile", dockerfile=dockerfile, client=docker_client)
    assert tags_of(docker_client, "test-badfile") == []


def test_the_cli_says_what_failed_and_exits_non_zero():
    done = subprocess.run(
        [sys.executable, "-m", "dsec.cli", "template", "build", "test-cli", "--image", "nope:v0"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1 and "no image 'nope:v0'" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    done = subprocess.run(
        [sys.executable, "-m", "dsec.cli", "template", "build", "test-cli"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "one of the arguments" in done.stderr, done.stderr


async def test_dsec_up_with_python_keeps_a_python_sandbox_warm_that_runs_real_code(
    docker_client, tmp_path
):
    """`dsec up --with-python`: the python template built (a cache hit on a machine that
    has built it), named in the summary, kept warm in pool "default" beside "base", its
    env on every command, its toolchain there."""
    argv = ["up", "--nodes", "1", "--port", "0", "--with-python", "--state-dir", str(tmp_path)]
    spec = up_spec(build_parser(["up"]).parse_args(argv))
    spec.name, spec.heartbeat_s = f"{TEST_POOL_PREFIX}{uuid.uuid4().hex[:8]}", 0.5
    async with started_pool(spec, docker_client) as pool:
        image = pool.summary()["templates"]["python"]
        assert image.startswith("python:") and image != "python:latest"
        async with Client(pool.url, token=pool.tokens.admin) as admin:
            info = await admin.template("python")
            assert info.pools == ["default"] and info.nodes_with_image == [pool.node_ids[0]]

            async def warm() -> bool:
                return (await admin.template("python")).sandboxes.get("warm", 0) > 0

            await eventually(warm, "a warm python sandbox")
        async with Client(pool.url, token=pool.tokens.client) as client:
            async with client.sandbox(template="python") as sb:
                result = await sb.exec(
                    [
                        "python3",
                        "-c",
                        "import os, pytest; print(os.environ['PYTHONDONTWRITEBYTECODE'])",
                    ]
                )
                assert (result.exit_code, result.stdout) == (0, "1\n"), result.stderr
                # the README's example (Real code: templates)
                await sb.files.write(
                    "/work/test_add.py", b"def test_add():\n    assert 1 + 1 == 2\n"
                )
                tested = await sb.exec(["python3", "-m", "pytest", "-q"])
                assert tested.exit_code == 0 and "1 passed" in tested.stdout, tested.stdout
                toolchain = await sb.exec(["sh", "-c", "git --version && gcc --version && make -v"])
                assert toolchain.exit_code == 0, toolchain.stderr
