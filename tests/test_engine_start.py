"""An engine exec whose runc init died before the command started (a sandbox at its pids
limit: runc's own threads count against it) is started again, and only then: the
agent's retry logic (agent/execs.py `_engine_start`), against stand-in processes. That
a command which ran is never run again, on a real sandbox, is test_resident's."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

from agent.config import AgentConfig
from agent.docker_driver import STDERR, STDOUT
from agent.execs import ENGINE_START_TRIES, Execs
from agent.metrics import AgentMetrics

INIT_DIED = (
    b"OCI runtime exec failed: exec failed: unable to start container process: "
    b"read init-p: connection reset by peer: unknown\r\n"
)


class Started:
    """What `AsyncDocker.start` gives back, as the engine answered: its first chunk and
    whether it ran a process."""

    def __init__(self, first: tuple[int, bytes] | None, ran: bool) -> None:
        self.first, self.ran, self.closed = first, ran, False

    async def first_within(self, seconds: float):
        return self.first

    async def never_started(self) -> bool:
        return not self.ran

    async def read(self):
        return self.first

    async def close(self) -> None:
        self.closed = True


def execs_answering(*answers: Started) -> tuple[Execs, list[Started]]:
    started: list[Started] = []
    queue = list(answers)

    async def start(container_id, argv, **how):
        started.append(queue.pop(0))
        return started[-1]

    async def sleep(seconds: float) -> None:
        await asyncio.sleep(0)

    unused = SimpleNamespace()  # what `_engine_start` never reaches
    execs = Execs(
        leases=unused,  # type: ignore[arg-type]
        resident=unused,  # type: ignore[arg-type]
        docker=SimpleNamespace(start=start),  # type: ignore[arg-type]
        docker_failed=unused,  # type: ignore[arg-type]
        audit=unused,  # type: ignore[arg-type]
        config=AgentConfig(node_id="n1", agent_token="t" * 16, state_dir=Path("/nonexistent")),
        clock=SimpleNamespace(sleep=sleep),  # type: ignore[arg-type]
        metrics=AgentMetrics("n1"),
    )
    return execs, started


async def test_a_start_whose_runc_init_died_is_made_again():
    ok = Started((STDOUT, b"hello\n"), ran=True)
    execs, started = execs_answering(Started((STDOUT, INIT_DIED), ran=False), ok)
    assert await execs._engine_start("c", ["echo", "hello"], user="1000") is ok
    assert len(started) == 2 and started[0].closed and not ok.closed


async def test_the_last_try_answers_whatever_it_is():
    died = [Started((STDOUT, INIT_DIED), ran=False) for _ in range(ENGINE_START_TRIES)]
    execs, started = execs_answering(*died)
    assert await execs._engine_start("c", ["true"], user="1000") is died[-1]
    assert len(started) == ENGINE_START_TRIES


async def test_a_command_that_ran_is_never_started_again_whatever_it_printed():
    for answer in (
        Started((STDOUT, INIT_DIED), ran=True),  # a tenant's command printing runc's words
        Started((STDERR, INIT_DIED), ran=False),  # runc speaks on stdout
        Started(None, ran=False),  # the output ended with nothing: nothing says runc failed
        Started(False, ran=False),  # no output yet: the command runs
        Started((STDOUT, b"OCI runtime exec failed: exec: no such file\r\n"), ran=False),
    ):
        execs, started = execs_answering(answer)
        assert await execs._engine_start("c", ["x"], user="1000") is answer
        assert started == [answer] and not answer.closed
