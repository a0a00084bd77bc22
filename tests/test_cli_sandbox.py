"""The sandbox and pool commands of the CLI (`dsec acquire | exec | shell | cp | release`,
`dsec pool get | set`), run as a user runs them: `python -m dsec.cli ...` processes.

Without Docker: `pool` against a control plane in this process, and exec, shell and cp
against the agent double (tests/agent_double.py). With Docker (the `pool` fixture's real
agents, which need the agent's side of issue 13): the whole round from acquire to release,
and `dsec shell` on a pseudo-terminal. Bad input answers one line on stderr and a non-zero
exit status, never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import importlib
import json
import os
import pty
import struct
import sys
import termios
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from agent_double import DoublePool, double_pool
from conftest import eventually
from inprocess import InProcessControlPlane, inprocess_controlplane

from dsec.cli import TOPIC_OF
from dsec.processes import dsec_argv

pytestmark = pytest.mark.asyncio(loop_scope="module")

REPO = Path(__file__).resolve().parents[1]
BINARY = bytes(range(256)) * 64
FAILED = 125  # dsec exec and shell: dsec failed, not the command


def cli_env(url: str, token: str | None = None, admin: str | None = None) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("DSEC_") and k not in ("COLUMNS", "LINES")
    }
    env["DSEC_URL"] = url
    if token:
        env["DSEC_TOKEN"] = token
    if admin:
        env["DSEC_ADMIN_TOKEN"] = admin
    return env


async def dsec(
    *args: str, env: dict[str, str], stdin: bytes | None = None, timeout: float = 120
) -> tuple[int, bytes, str]:
    """Run the CLI; its exit status, stdout (bytes) and stderr, which has no traceback."""
    proc = await asyncio.create_subprocess_exec(
        *dsec_argv(*args),
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
        cwd=REPO,
    )
    out, err = await asyncio.wait_for(proc.communicate(stdin), timeout)
    assert "Traceback" not in err.decode(), err.decode()
    return proc.returncode, out, err.decode()


def make_tree(root: Path) -> Path:
    tree = root / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "top.txt").write_text("top\n")
    (tree / "sub" / "blob.bin").write_bytes(BINARY)
    return tree


class Terminal:
    """A dsec command whose controlling terminal is a pseudo-terminal, as after a login:
    what it shows, typing, resizing the window, its terminal settings."""

    def __init__(
        self, master: int, slave: int, proc: asyncio.subprocess.Process, settings: list
    ) -> None:
        self.master, self.slave, self.proc = master, slave, proc
        self.settings = settings  # as they were before the command started
        self.screen = bytearray()

    async def shows(self, text: bytes, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.screen:
            assert time.monotonic() < deadline, f"no {text!r} in {bytes(self.screen)!r}"
            await asyncio.sleep(0.05)

    def type(self, keys: bytes) -> None:
        os.write(self.master, keys)

    def resize(self, rows: int, cols: int) -> None:  # the kernel sends SIGWINCH
        fcntl.ioctl(self.master, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

    async def exit_status(self, timeout: float = 30) -> int:
        return await asyncio.wait_for(self.proc.wait(), timeout)

    def settings_restored(self) -> bool:
        return termios.tcgetattr(self.slave) == self.settings


@contextlib.asynccontextmanager
async def on_a_terminal(
    *args: str, env: dict[str, str], rows: int = 33, cols: int = 101
) -> AsyncIterator[Terminal]:
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

    def own_terminal() -> None:  # a session of its own, with the pty as its terminal
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    settings = termios.tcgetattr(slave)
    proc = await asyncio.create_subprocess_exec(
        *dsec_argv(*args),
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env,
        cwd=REPO,
        preexec_fn=own_terminal,
    )
    term = Terminal(master, slave, proc, settings)
    loop = asyncio.get_running_loop()
    loop.add_reader(master, lambda: term.screen.extend(os.read(master, 65536)))
    try:
        yield term
    finally:
        loop.remove_reader(master)
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        os.close(master)
        os.close(slave)


# --- dsec pool, on a control plane in this process -----------------------------------


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def controlplane() -> AsyncIterator[InProcessControlPlane]:
    async with inprocess_controlplane() as cp:
        yield cp


async def test_pool_get_and_set(controlplane):
    env = cli_env(controlplane.url, controlplane.tokens.client, controlplane.tokens.admin)
    code, out, _ = await dsec("pool", "get", "default", "--json", env=env)
    before = json.loads(out)["params"]
    code, out, err = await dsec(
        "pool", "set", "default", "min_warm=3", 'templates=["base"]', "recycle=true", "--json",
        env=env,
    )  # fmt: skip
    assert code == 0, err
    after = json.loads(out)["params"]
    assert after == {**before, "min_warm": 3, "templates": ["base"], "recycle": True}
    code, out, _ = await dsec("pool", "get", "default", env=env)
    assert code == 0
    table = out.decode()
    assert "min_warm" in table and "recycle" in table and "true" in table
    assert "pool default: queue depth 0" in table


async def test_pool_set_bad_input(controlplane):
    env = cli_env(controlplane.url, controlplane.tokens.client, controlplane.tokens.admin)
    _, out, _ = await dsec("pool", "get", "default", "--json", env=env)
    before = json.loads(out)["params"]
    for args, status, says in (
        (["warmth=3"], 2, "unknown pool parameter 'warmth'; known: priority, min_warm"),
        (["min_warm"], 2, "expected key=value"),
        (["min_warm=many"], 2, "min_warm"),
        (["overflow_threshold=1.5"], 1, "overflow_threshold: Input should be less than"),
        (["min_warm=5", "max_warm=4"], 1, "max_warm (4) is below min_warm (5)"),
        (['templates=["nope"]'], 1, "unknown_template"),
    ):
        code, _, err = await dsec("pool", "set", "default", *args, env=env)
        assert code == status and says in err, (args, code, err)
        assert len(err.strip().splitlines()) == 1, err
    code, _, err = await dsec("pool", "set", "nosuchpool", "min_warm=1", env=env)
    assert code == 1 and "404 unknown_pool" in err, err
    code, _, err = await dsec("pool", "get", "nosuchpool", env=env)
    assert code == 1 and "no pool named 'nosuchpool'" in err, err
    client_only = cli_env(controlplane.url, controlplane.tokens.client)
    code, _, err = await dsec("pool", "set", "default", "min_warm=1", env=client_only)
    assert code == 1 and "403 forbidden" in err, err
    code, _, err = await dsec("pool", "get", "default", env=cli_env(controlplane.url))
    assert code == 2 and "set DSEC_TOKEN or DSEC_ADMIN_TOKEN" in err, err
    _, out, _ = await dsec("pool", "get", "default", "--json", env=env)
    assert json.loads(out)["params"] == before  # nothing above changed anything


async def test_an_unreachable_pool_is_one_line():
    env = cli_env("http://127.0.0.1:9", "some-token")
    code, _, err = await dsec("exec", "n.0123456789abcdef", "--", "true", env=env)
    assert code == FAILED and "no answer from http://127.0.0.1:9" in err, err
    code, _, err = await dsec("release", "n.0123456789abcdef", env=env)
    assert code == 1 and "no answer" in err, err


# Which of the CLI's topic modules (dsec/cli/) a fresh interpreter has imported once it
# has built the parser of a command line, and which its parser offers.
TOPICS_IMPORTED = """
import re
import sys
from dsec.cli import build_parser
parser = build_parser(sys.argv[1:])
topics = {m.split(".")[2] for m in sys.modules if re.fullmatch(r"dsec\\.cli\\.\\w+", m)}
print(*sorted(topics - {"common", "remote"}))
print(*sorted(m for m in ("docker", "agent", "controlplane", "bench") if m in sys.modules))
print(re.search(r"{(.*?)}", parser.format_usage(), re.S).group(1).replace(",", " "))
"""


async def test_each_topic_registers_the_commands_the_table_gives_it():
    """dsec.cli.TOPIC_OF, by which a command line imports its command's topic alone,
    says what each topic registers, in the order help lists them."""
    registered: dict[str, str] = {}
    for topic in dict.fromkeys(TOPIC_OF.values()):
        commands = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(f"dsec.cli.{topic}").register(commands)
        registered.update(dict.fromkeys(commands.choices, topic))
    assert list(registered.items()) == list(TOPIC_OF.items())


async def topics_imported(*argv: str) -> list[str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", TOPICS_IMPORTED, *argv, stdout=asyncio.subprocess.PIPE, cwd=REPO
    )
    out, _ = await proc.communicate()
    assert proc.returncode == 0
    return out.decode().splitlines()


async def test_a_command_line_imports_its_own_topic_alone():
    """`dsec exec` (and a worker may run one per command) imports neither the other
    topics nor what they need: the Docker SDK, agent/, controlplane/, bench/. A line
    that names no known command gets them all, to list them."""
    topics, services, commands = await topics_imported("--log-level", "INFO", "exec", "x")
    assert (topics, services) == ("sandbox", "")
    assert commands.split() == [c for c, topic in TOPIC_OF.items() if topic == "sandbox"]
    topics, services, commands = await topics_imported("no-such-command")
    assert topics.split() == sorted(set(TOPIC_OF.values()))
    assert services.split() == ["agent", "bench", "controlplane", "docker"]
    assert commands.split() == list(TOPIC_OF)


# --- exec, shell and cp, on the agent double -----------------------------------------


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def double(tmp_path_factory) -> AsyncIterator[DoublePool]:
    async with double_pool(tmp_path_factory.mktemp("double")) as served:
        yield served


async def test_exec_streams_output_and_exits_with_the_commands_status(double):
    env, sid = cli_env(double.url, double.client_token), double.sandbox_id
    code, out, err = await dsec(
        "exec", sid, "--", "sh", "-c", "echo out; echo err >&2; exit 3", env=env
    )
    assert (code, out, err) == (3, b"out\n", "err\n")
    code, out, _ = await dsec("exec", sid, "--", "printf", r"\377\000x", env=env)
    assert (code, out) == (0, b"\xff\x00x")
    # stdin goes only with -i
    code, out, _ = await dsec("exec", "-i", sid, "--", "cat", env=env, stdin=BINARY)
    assert (code, out) == (0, BINARY)
    code, out, _ = await dsec("exec", sid, "--", "cat", env=env, stdin=b"not sent")
    assert (code, out) == (0, b"")
    code, out, _ = await dsec(
        "exec", "--env", "GREETING=hi", sid, "--", "sh", "-c", "echo $GREETING", env=env
    )
    assert (code, out) == (0, b"hi\n")


async def test_shell_with_piped_input(double):
    env = cli_env(double.url, double.client_token)
    script = b"echo $((6 * 7))\nexit 4\n"
    code, out, err = await dsec("shell", double.sandbox_id, env=env, stdin=script)
    assert (code, out) == (4, b"42\n"), err


async def test_shell_on_a_terminal_follows_its_size(double):
    """On a pseudo-terminal: raw mode, the window's size sent at the start and on every
    change (SIGWINCH), the terminal's settings restored. The double runs no terminal of
    its own (the live test below has a real one)."""
    env, asked_before = cli_env(double.url, double.client_token), len(double.agent.stream_requests)
    async with on_a_terminal("shell", double.sandbox_id, env=env) as term:
        await eventually(lambda: len(double.agent.stream_requests) > asked_before, "the command")
        asked = double.agent.stream_requests[-1]
        assert (asked.cmd, asked.tty, asked.stdin) == (["sh"], True, True)
        assert (asked.rows, asked.cols) == (33, 101)
        assert not termios.tcgetattr(term.slave)[3] & termios.ICANON  # raw meanwhile
        term.resize(40, 120)
        await eventually(lambda: double.agent.resizes[-1:] == [(40, 120)], "the resize")
        term.type(b"echo $((6 * 7)); exit 3\n")
        assert await term.exit_status() == 3
        await term.shows(b"42")
        assert term.settings_restored()


async def test_cp_files_and_directories(double, tmp_path):
    env, sid = cli_env(double.url, double.client_token), double.sandbox_id
    tree = make_tree(tmp_path)
    code, _, err = await dsec("cp", str(tree), f"{sid}:/work/copied", env=env)
    assert code == 0, err
    code, _, err = await dsec("cp", str(tree / "top.txt"), f"{sid}:/work/copied/sub/", env=env)
    assert code == 0, err  # into an existing directory, under its own name
    back = tmp_path / "back"
    code, _, err = await dsec("cp", f"{sid}:/work/copied", str(back), env=env)
    assert code == 0, err
    assert (back / "sub" / "blob.bin").read_bytes() == BINARY
    assert (back / "sub" / "top.txt").read_text() == "top\n"
    code, _, err = await dsec("cp", f"{sid}:/work/copied/top.txt", str(back), env=env)
    assert code == 0 and (back / "top.txt").read_text() == "top\n", err


async def test_bad_input_is_one_line(double, tmp_path):
    env, sid = cli_env(double.url, double.client_token), double.sandbox_id
    other = "double.0123456789abcdef"
    for args, status, says in (
        (["exec", other, "--", "true"], FAILED, "no sandbox double.0123456789abcdef"),
        (["shell", other], FAILED, "404 unknown_sandbox"),
        (["release", other], 1, "404 unknown_sandbox"),
        (["cp", "a", "b"], 2, "one side must be a sandbox path"),
        (["cp", f"{sid}:/work/a", f"{sid}:/work/b"], 2, "one side must be a sandbox path"),
        (["cp", str(tmp_path / "missing"), f"{sid}:/work/x"], 2, "no such local file"),
        (["cp", str(tmp_path), f"{sid}:work/x"], 2, "a sandbox path is absolute"),
        (["cp", f"{sid}:/work/nothing-here", str(tmp_path / "x")], 1, "404 no_such_file"),
        (["cp", str(tmp_path), f"{sid}:/etc/x"], 1, "400 path_outside_workdir"),
        (["exec", "--env", "NOEQUALS", sid, "--", "true"], 2, "--env must be KEY=VALUE"),
    ):
        code, _, err = await dsec(*args, env=env)
        assert code == status and says in err, (args, code, err)
    # another client's sandbox is not found, as one that does not exist
    stranger = cli_env(double.url, double.other_client_token)
    code, _, err = await dsec("exec", sid, "--", "true", env=stranger)
    assert code == FAILED and "404 unknown_sandbox" in err, err
    code, _, err = await dsec("cp", f"{sid}:/work/x", str(tmp_path / "x"), env=stranger)
    assert code == 1 and "404 unknown_sandbox" in err, err
    unknown = cli_env(double.url, "a-token-the-pool-does-not-know")
    code, _, err = await dsec("exec", sid, "--", "true", env=unknown)
    assert code == FAILED and "403 forbidden" in err, err


# --- end to end, on real agents (docker) ---------------------------------------------


async def test_live_acquire_exec_cp_release(pool, tmp_path, docker_client):
    env = cli_env(pool.url, pool.tokens.client)
    code, out, err = await dsec("acquire", "--json", env=env)
    assert code == 0, err
    lease = json.loads(out)
    sid = lease["id"]
    try:
        code, out, err = await dsec(
            "exec", sid, "--", "sh", "-c", "echo out; echo err >&2; exit 7", env=env
        )
        assert (code, out, err) == (7, b"out\n", "err\n")
        code, out, _ = await dsec("exec", sid, "--", "printf", r"\377\000x", env=env)
        assert (code, out) == (0, b"\xff\x00x")
        code, out, _ = await dsec("exec", "-i", sid, "--", "cat", env=env, stdin=BINARY)
        assert (code, out) == (0, BINARY)
        code, _, err = await dsec("exec", "--timeout", "1", sid, "--", "sleep", "30", env=env)
        assert code == 124 and "timed out" in err, err
        tree = make_tree(tmp_path)
        code, _, err = await dsec("cp", str(tree), f"{sid}:/work/tree", env=env)
        assert code == 0, err
        code, out, _ = await dsec("exec", sid, "--", "cat", "/work/tree/sub/blob.bin", env=env)
        assert out == BINARY
        code, _, err = await dsec("cp", f"{sid}:/work/tree", str(tmp_path / "back"), env=env)
        assert code == 0, err
        assert (tmp_path / "back" / "sub" / "blob.bin").read_bytes() == BINARY
        code, out, _ = await dsec("shell", sid, env=env, stdin=b"echo $((6 * 7))\nexit 4\n")
        assert (code, out) == (4, b"42\n")
    finally:
        code, out, err = await dsec("release", sid, env=env)
    assert code == 0 and out.decode().split() == [sid, "gone"], err
    code, _, err = await dsec("exec", sid, "--", "true", env=env)
    assert code == FAILED and "released" in err, err
    code, _, err = await dsec("release", sid, env=env)
    assert code == 1 and "released" in err, err


async def test_live_personalised_acquire(pool, tmp_path):
    """`dsec acquire --env --file --setup`: the sandbox is the caller's own before its id
    is printed; a setup that fails prints its output and exits 1, leaving no lease."""
    env = cli_env(pool.url, pool.tokens.client)
    (tmp_path / "task.json").write_bytes(b'{"task": 7}')
    claim = ["--env", "TASK=7", "--file", f"in/task.json={tmp_path / 'task.json'}"]
    code, out, err = await dsec(
        "acquire", *claim, "--setup", 'cp in/task.json copied.json && echo "$TASK" > t', env=env
    )
    assert code == 0, err
    sid = out.decode().strip()
    try:
        code, out, _ = await dsec(
            "exec", sid, "--", "sh", "-c", "cat copied.json t; echo $TASK", env=env
        )
        assert (code, out) == (0, b'{"task": 7}7\n7\n')
    finally:
        await dsec("release", sid, env=env)
    code, out, err = await dsec("acquire", "--setup", "echo making; echo no >&2; exit 2", env=env)
    assert (code, out) == (1, b"making\n"), err
    assert err.startswith("no\n") and "setup_failed" in err, err
    code, _, err = await dsec("acquire", "--file", f"x={tmp_path / 'missing'}", env=env)
    assert code == 2 and "cannot read" in err, err


async def test_live_fork_prints_the_copies_ids(pool):
    """`dsec fork ID --count 2`: two new sandboxes with the source's files, one id a line;
    a count past the maximum is refused with the reason and exit 1, leaving no lease."""
    env = cli_env(pool.url, pool.tokens.client)
    code, out, err = await dsec("acquire", env=env)
    assert code == 0, err
    sid = out.decode().strip()
    copies: list[str] = []
    try:
        await dsec("exec", sid, "--", "sh", "-c", "echo state > /work/s", env=env)
        code, out, err = await dsec("fork", sid, "--count", "2", env=env)
        assert code == 0, err
        copies = out.decode().split()
        assert len(set(copies)) == 2 and sid not in copies
        for copy in copies:
            code, out, _ = await dsec("exec", copy, "--", "cat", "/work/s", env=env)
            assert (code, out) == (0, b"state\n")
        code, _, err = await dsec("fork", sid, "--count", "65", env=env)
        assert code == 2 and "Traceback" not in err and "count" in err, err
    finally:
        for each in (sid, *copies):
            await dsec("release", each, env=env)


async def test_live_shell_on_a_terminal(pool):
    """`dsec shell` on a pseudo-terminal: a terminal in the sandbox of our size, which
    follows a resize, and our terminal's settings restored at the end."""
    env = cli_env(pool.url, pool.tokens.client)
    code, out, err = await dsec("acquire", env=env)
    assert code == 0, err
    sid = out.decode().strip()
    try:
        async with on_a_terminal("shell", sid, env=env, rows=33, cols=101) as term:
            await term.shows(b"$ ")  # the prompt: as a user, type once the shell is there
            term.type(b"tty; stty size; echo $((6 * 7))\n")
            await term.shows(b"\r\n33 101\r\n")
            await term.shows(b"\r\n42\r\n")
            assert b"/dev/pts/" in term.screen  # a terminal there too
            term.resize(40, 120)
            await asyncio.sleep(0.5)  # SIGWINCH, then the resize message
            term.type(b"stty size; exit 3\n")
            await term.shows(b"\r\n40 120\r\n")
            assert await term.exit_status() == 3
            assert term.settings_restored()  # raw mode undone
    finally:
        await dsec("release", sid, env=env)
