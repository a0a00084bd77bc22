"""Clients RL stacks already use, against a real pool of python sandboxes:

- `dsec serve fusion`, a real process on a real port, driven by SandboxFusion's own
  client (`sandbox-fusion` from PyPI), sync and async;
- `DsecEnvironment` driven by mini-swe-agent's own DefaultAgent and scripted
  DeterministicModel, whose run is compared with the same script in mini-swe-agent's own
  DockerEnvironment on the same image.
"""

from __future__ import annotations

import asyncio
import base64
import gc
import json
import os
import re
import threading
from collections.abc import AsyncIterator

import aiohttp
import pytest
import pytest_asyncio

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")  # mini-swe-agent's banner, on import

import sandbox_fusion  # noqa: E402
from minisweagent.agents.default import DefaultAgent  # noqa: E402
from minisweagent.environments import get_environment  # noqa: E402
from minisweagent.environments.docker import DockerEnvironment  # noqa: E402
from minisweagent.models.test_models import DeterministicModel, make_output  # noqa: E402
from sandbox_fusion import RunCodeRequest, RunStatus, SummaryMapping  # noqa: E402

from agent.docker_driver import LABEL_NODE  # noqa: E402
from bench.fusion import FusionProcess, start_fusion  # noqa: E402
from dsec.client import Client  # noqa: E402
from dsec.launch.local import LocalPool  # noqa: E402
from dsec.models import PoolParams  # noqa: E402
from dsec.processes import dsec_argv, stop_process  # noqa: E402
from tests.conftest import eventually, make_spec, started_pool  # noqa: E402

pytestmark = [pytest.mark.docker, pytest.mark.asyncio(loop_scope="module")]

MAX_CODE_KB = 64


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def python_pool(docker_client, tmp_path_factory) -> AsyncIterator[LocalPool]:
    spec = make_spec(
        tmp_path_factory.mktemp("integrations"),
        nodes=2,
        python_template=True,
        pool=PoolParams(min_warm=4, recycle=True, templates=["python"]),
    )
    async with started_pool(spec, docker_client) as pool:
        yield pool


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fusion(python_pool) -> AsyncIterator[FusionProcess]:
    flags = ["--concurrency", "16", "--max-code-kb", str(MAX_CODE_KB), "--max-request-mb", "1"]
    service = await start_fusion(python_pool.url, python_pool.tokens.client, *flags)
    yield service
    await stop_process(service.proc)
    assert service.proc.returncode == 0


async def run_sync(fusion: FusionProcess, **fields) -> sandbox_fusion.RunCodeResponse:
    """SandboxFusion's blocking client, off the event loop; no retry, so a SandboxError
    raises at once."""
    request = RunCodeRequest(**fields)
    return await asyncio.to_thread(
        sandbox_fusion.run_code, request, endpoint=fusion.url, max_attempts=1
    )


async def fusion_metrics(service: FusionProcess) -> str:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{service.url}/metrics") as resp:
            return await resp.text()


async def fusion_metrics_include(service: FusionProcess, line: str) -> bool:
    return line in (await fusion_metrics(service)).splitlines()


async def leased(pool: LocalPool) -> list:
    async with Client(pool.url, token=pool.tokens.admin) as operator:
        return [s for s in await operator.list() if s.state == "leased"]


async def test_python_with_stdin_files_and_fetched_files(fusion):
    code = (
        "import sys\n"
        "name = sys.stdin.read().strip()\n"
        "greeting = open('data/greeting.txt').read().strip()\n"
        "open('out.txt', 'w').write(f'{greeting}, {name}!')\n"
        "print(greeting, name)\n"
    )
    answer = await run_sync(
        fusion,
        code=code,
        language="python",
        stdin="dsec\n",
        files={"data/greeting.txt": b64(b"hello\n"), "skipped.txt": None},
        fetch_files=["out.txt", "missing.txt", "data"],
    )
    assert answer.status == RunStatus.Success, answer
    run = answer.run_result
    assert (run.status, run.return_code, run.stdout, run.stderr) == (
        "Finished",
        0,
        "hello dsec\n",
        "",
    )
    assert run.execution_time > 0 and answer.compile_result is None
    # a file that is not there, or a directory, is left out, as SandboxFusion does
    assert answer.files == {"out.txt": b64(b"hello, dsec!")}
    assert answer.executor_pod_name


async def test_a_fetched_symlink_out_of_the_work_dir_brings_nothing_back(fusion):
    """The workload links /etc/passwd (or the agent's own files) into its work dir and
    asks for it back: a symlink is not a file to fetch, so nothing comes back."""
    code = (
        "import os\n"
        "os.symlink('/etc/passwd', 'leak')\n"
        "os.makedirs('d')\n"
        "os.symlink('/proc/1/environ', 'd/env')\n"
        "open('kept.txt', 'w').write('ok')\n"
    )
    answer = await run_sync(
        fusion, code=code, language="python", fetch_files=["leak", "d/env", "kept.txt"]
    )
    assert answer.status == RunStatus.Success, answer
    assert answer.files == {"kept.txt": b64(b"ok")}


async def test_pytest_passes_and_fails_with_the_tests_own_files(fusion):
    helper = b64(b"def double(x):\n    return 2 * x\n")
    passing = "from helper import double\n\ndef test_double():\n    assert double(2) == 4\n"
    answer = await run_sync(fusion, code=passing, language="pytest", files={"helper.py": helper})
    assert answer.status == RunStatus.Success, answer
    assert "1 passed" in answer.run_result.stdout
    failing = "from helper import double\n\ndef test_double():\n    assert double(2) == 5\n"
    answer = await run_sync(fusion, code=failing, language="pytest", files={"helper.py": helper})
    assert answer.status == RunStatus.Failed and answer.run_result.return_code == 1
    assert "1 failed" in answer.run_result.stdout


async def test_a_timeout_and_a_non_zero_exit(fusion):
    mapping = SummaryMapping(RunTimeout="timeout", RunFailed="failed")
    answer = await run_sync(
        fusion, code="while True:\n    pass\n", language="python", run_timeout=1
    )
    assert answer.status == RunStatus.Failed
    assert answer.run_result.status == "TimeLimitExceeded"
    assert answer.run_result.return_code is None
    assert sandbox_fusion.summary_run_code_result(answer, mapping) == "timeout"
    answer = await run_sync(
        fusion, code="import sys\nprint('out')\nsys.exit('bad: 3')\n", language="python"
    )
    assert answer.status == RunStatus.Failed
    assert (answer.run_result.return_code, answer.run_result.stdout) == (1, "out\n")
    assert "bad: 3" in answer.run_result.stderr
    assert sandbox_fusion.summary_run_code_result(answer, mapping) == "failed"


async def test_cpp_compiles_and_runs_and_a_compile_error_stops_before_the_run(fusion):
    code = "#include <iostream>\nint main(){int a,b;std::cin>>a>>b;std::cout<<a*b<<'\\n';}\n"
    answer = await run_sync(fusion, code=code, language="cpp", stdin="6 7")
    assert answer.status == RunStatus.Success, answer
    assert answer.compile_result.return_code == 0 and answer.run_result.stdout == "42\n"
    answer = await run_sync(fusion, code="int main() { return x; }\n", language="cpp")
    assert answer.status == RunStatus.Failed and answer.run_result is None
    assert answer.compile_result.return_code != 0
    assert "'x' was not declared" in answer.compile_result.stderr
    mapping = SummaryMapping(CompileFailed="compile error")
    assert sandbox_fusion.summary_run_code_result(answer, mapping) == "compile error"


async def test_bash_and_perl_run_and_a_language_the_template_lacks_is_a_sandbox_error(fusion):
    answer = await run_sync(fusion, code='echo "$((6 * 7))" "$0"', language="bash")
    assert answer.status == RunStatus.Success and answer.run_result.stdout.startswith("42 ")
    answer = await run_sync(fusion, code='print "perl ok\\n";', language="perl")
    assert answer.run_result.stdout == "perl ok\n"
    with pytest.raises(Exception, match="language 'go' is not served by template 'python'"):
        await run_sync(fusion, code="package main", language="go")


async def test_the_async_client_runs_64_requests_at_once_all_answered_right(fusion, python_pool):
    async def one(i: int) -> tuple[int, str]:
        request = RunCodeRequest(
            code=f"import os\nprint({i} * {i}, sorted(os.listdir('.')))\n",
            language="python",
            files={f"only-{i}.txt": b64(str(i).encode())},
        )
        answer = await sandbox_fusion.run_code_async(request, endpoint=fusion.url, max_attempts=1)
        assert answer.status == RunStatus.Success, answer
        return i, answer.run_result.stdout

    results = await asyncio.gather(*(one(i) for i in range(64)))
    for i, stdout in results:
        square, listing = stdout.split(" ", 1)
        assert int(square) == i * i
        # its own file and its code's, nobody else's
        names = eval(listing)  # noqa: S307 - our own program's print of a list of names
        assert f"only-{i}.txt" in names and len(names) == 2, names
    assert await leased(python_pool) == []


async def test_one_requests_files_and_processes_are_not_seen_by_the_next(python_pool):
    """In a pool of one warm sandbox, recycled: the next request gets the same one."""
    async with Client(python_pool.url, token=python_pool.tokens.admin) as admin:
        one = PoolParams(min_warm=1, max_warm=1, recycle=True, templates=["python"])
        await admin.set_pool("one-warm", one)
    service = await start_fusion(python_pool.url, python_pool.tokens.client, "--pool", "one-warm")
    leave = (
        "import os, subprocess\n"
        "open('/work/secret.txt', 'w').write('mine')\n"
        "open('/tmp/secret.txt', 'w').write('mine')\n"
        "subprocess.Popen(['sleep', '600'], start_new_session=True,\n"
        "                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
    )
    look = (
        "import os, subprocess\n"
        "ps = subprocess.run(['ps', '-eo', 'args'], capture_output=True, text=True).stdout\n"
        "print(os.path.exists('/work/secret.txt'), os.path.exists('/tmp/secret.txt'),\n"
        "      'sleep 600' in ps)\n"
    )
    reused = 0
    try:
        for _ in range(4):
            left = await run_sync(service, code=leave, language="python")
            assert left.status == RunStatus.Success, left
            seen = await run_sync(service, code=look, language="python")
            assert seen.run_result.stdout == "False False False\n"
            reused += seen.executor_pod_name == left.executor_pod_name
    finally:
        await stop_process(service.proc)
    assert reused, "no sandbox served a second request: recycling was not exercised"


async def test_requests_past_the_concurrency_wait_in_line_and_one_past_its_timeout_is_answered(
    python_pool,
):
    service = await start_fusion(python_pool.url, python_pool.tokens.client, "--concurrency", "1")
    try:
        sleep_then_done = "import time\ntime.sleep(1)\nprint('done')"
        slow = [
            asyncio.ensure_future(run_sync(service, code=sleep_then_done, language="python"))
            for _ in range(3)
        ]
        # the slow three must be in the service (one holding the sandbox, two in line)
        # before the impatient one arrives, or it could take the sandbox first
        await eventually(
            lambda: fusion_metrics_include(service, "dsec_fusion_waiting 2.0"), "two in line"
        )
        impatient = run_sync(
            service, code="print(1)", language="python", compile_timeout=0.2, run_timeout=0.3
        )
        *answers, cut_short = await asyncio.gather(*slow, impatient, return_exceptions=True)
        for answer in answers:  # waited their turn, one sandbox at a time
            assert answer.status == RunStatus.Success and answer.run_result.stdout == "done\n"
        assert isinstance(cut_short, Exception)
        assert "waited 0.5 s" in str(cut_short) and "none came free" in str(cut_short)
        page = await fusion_metrics(service)
        assert 'dsec_fusion_requests_total{language="python",status="Success"} 3.0' in page
        assert 'dsec_fusion_requests_total{language="python",status="SandboxError"} 1.0' in page
        assert re.search(r'dsec_fusion_request_seconds_count\{language="python"\} 4\.0', page)
    finally:
        await stop_process(service.proc)


BAD_BODIES = [
    ({"language": "python"}, 422, "code"),
    ({"code": "print(1)", "language": "cobol"}, 422, "language"),
    ({"code": "print(1)", "language": "python", "run_timeout": "soon"}, 422, "run_timeout"),
    ({"code": "1", "language": "python", "files": {"a.txt": "%%%"}}, 400, "'a.txt' is not base64"),
    ({"code": "1", "language": "python", "files": {"../a.txt": ""}}, 400, "outside the work dir"),
    ({"code": "1", "language": "python", "files": {"/etc/x": ""}}, 400, "outside the work dir"),
    ({"code": "1", "language": "python", "fetch_files": ["/etc/passwd"]}, 400, "outside"),
    ({"code": "1", "language": "python", "run_timeout": 0}, 400, "run_timeout is 0"),
    (
        {"code": "#" * (MAX_CODE_KB * 1024 + 1), "language": "python"},
        413,
        "over this service's limit",
    ),
    ({"code": "#", "language": "python", "stdin": "x" * (2 << 20)}, 413, "Maximum request body"),
]


@pytest.mark.parametrize(("body", "status", "says"), BAD_BODIES)
async def test_bad_input_is_refused_with_what_is_wrong_and_leases_nothing(
    fusion, python_pool, body, status, says
):
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{fusion.url}/run_code", json=body) as resp:
            answer = await resp.json()
            assert resp.status == status, answer
    assert says in json.dumps(answer["detail"]), answer
    assert await leased(python_pool) == []


async def test_a_body_that_is_not_json_is_refused_as_fastapi_does(fusion):
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{fusion.url}/run_code", data=b"{not json") as resp:
            assert resp.status == 422
            (error,) = (await resp.json())["detail"]
    assert error["type"] == "json_invalid" and error["loc"][0] == "body"


async def test_the_service_refuses_to_start_on_a_template_the_pool_lacks(python_pool):
    proc = await asyncio.create_subprocess_exec(
        *dsec_argv("serve", "fusion", "--url", python_pool.url, "--template", "nope"),
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "DSEC_TOKEN": python_pool.tokens.client},
    )
    _, stderr = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 1 and "nope" in stderr.decode(), stderr
    assert "Traceback" not in stderr.decode()


# --- mini-swe-agent ------------------------------------------------------------------

CALC = "def add(a, b):\n    return a - b\n"
TEST = "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
SCRIPT = [
    ("Set up the repository.", f"printf '{CALC}' > calc.py && printf '{TEST}' > test_calc.py"),
    ("Let me read the failing test.", "cat test_calc.py"),
    ("Run it.", "python3 -m pytest -q -p no:cacheprovider test_calc.py"),
    ("add subtracts: fix it.", "sed -i 's/a - b/a + b/' calc.py && cat calc.py"),
    ("Run it again.", "python3 -m pytest -q -p no:cacheprovider test_calc.py"),
    ("Done.", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat calc.py"),
]  # fmt: skip
AGENT_CONFIG = {
    "system_template": "You fix bugs in the repository in your working directory.",
    "instance_template": "{{task}}",
    "step_limit": 20,
    "cost_limit": 100,
}
ENV = {"PYTHONDONTWRITEBYTECODE": "1"}  # as the python template sets it for dsec's own


def scripted_run(environment) -> tuple[dict, list[tuple[str, str]]]:
    model = DeterministicModel(
        outputs=[make_output(thought, [{"command": command}]) for thought, command in SCRIPT]
    )
    agent = DefaultAgent(model, environment, **AGENT_CONFIG)
    result = agent.run("Make test_calc.py pass.")
    # pytest says how long it took; nothing else in a run differs between two runs
    trajectory = [
        (m["role"], re.sub(r"\d+\.\d+s", "<t>", str(m["content"]))) for m in agent.messages
    ]
    return result, trajectory


async def test_minisweagent_solves_a_bug_in_a_dsec_sandbox_as_in_its_own_docker_environment(
    python_pool, docker_client
):
    def in_dsec() -> tuple[dict, list]:
        environment = get_environment(
            {
                "environment_class": "dsec.integrations.minisweagent.DsecEnvironment",
                "template": "python",
                "url": python_pool.url,
                "token": python_pool.tokens.client,
                "env": ENV,
            }
        )
        try:
            return scripted_run(environment)
        finally:
            environment.close()

    def in_docker() -> tuple[dict, list]:
        image = python_pool.spec.templates["python"].image
        label = f"{LABEL_NODE}={python_pool.spec.name}-minisweagent"
        environment = DockerEnvironment(
            image=image,
            cwd="/work",
            env=ENV,
            run_args=["--rm", "--network", "none", "--label", label],
        )
        try:
            return scripted_run(environment)
        finally:
            container = environment.container_id
            environment.container_id = None  # its own clean-up stops it in the background
            docker_client.containers.get(container).remove(force=True)

    dsec_result, dsec_trajectory = await asyncio.to_thread(in_dsec)
    docker_result, docker_trajectory = await asyncio.to_thread(in_docker)
    assert dsec_result["exit_status"] == "Submitted", dsec_trajectory[-2:]
    assert dsec_result["submission"] == "def add(a, b):\n    return a + b\n"
    assert "1 failed" in dsec_trajectory[7][1] and "1 passed" in dsec_trajectory[11][1]
    assert (dsec_result, dsec_trajectory) == (docker_result, docker_trajectory)
    assert await leased(python_pool) == []


async def test_minisweagent_environment_times_out_merges_stderr_and_releases_when_collected(
    python_pool,
):
    from dsec.integrations.minisweagent import DsecEnvironment

    def use() -> tuple[str, dict, dict, dict]:
        environment = DsecEnvironment(
            url=python_pool.url, token=python_pool.tokens.client, cwd="/tmp", timeout=1
        )
        merged = environment.execute({"command": "echo one; echo two >&2; echo three; pwd"})
        late = environment.execute({"command": "echo started; sleep 30"})
        elsewhere = environment.execute("pwd; exit 4", cwd="/work", timeout=5)
        sandbox_id = environment.sandbox.id
        del environment  # no close(): collected, it releases
        gc.collect()
        return sandbox_id, merged, late, elsewhere

    sandbox_id, merged, late, elsewhere = await asyncio.to_thread(use)
    assert merged == {"output": "one\ntwo\nthree\n/tmp\n", "returncode": 0, "exception_info": ""}
    assert late["returncode"] == -1 and late["output"] == "started\n"
    assert "timed out after 1 seconds" in late["exception_info"]
    assert (elsewhere["output"], elsewhere["returncode"]) == ("/work\n", 4)
    assert sandbox_id not in {s.id for s in await leased(python_pool)}
    assert await leased(python_pool) == []


async def test_the_environment_without_a_pool_fails_at_once_and_leaves_no_thread():
    from dsec.integrations.minisweagent import DsecEnvironment

    before = set(threading.enumerate())
    with pytest.raises(aiohttp.ClientError):
        await asyncio.to_thread(
            DsecEnvironment, url="http://127.0.0.1:9", token="t", acquire_timeout=2
        )
    gc.collect()
    assert set(threading.enumerate()) - before == set()
