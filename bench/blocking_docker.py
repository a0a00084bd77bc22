"""The agent's Docker driver (`agent.docker_driver.AsyncDocker`) for benchmarks that
drive the engine from threads: the calls run on an event loop of their own, in a
background thread, and every one starts at once (`Work.CLIENT`), so what is measured is
the engine, not the agent's queue in front of it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from agent.docker_driver import AsyncDocker, ContainerSummary
from agent.engine import Work
from dsec.clock import SystemClock
from dsec.models import TemplateSpec

T = TypeVar("T")


class BlockingDocker:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="docker", daemon=True)
        self.thread.start()
        self.docker = AsyncDocker(SystemClock(), lambda op, seconds: None)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def create(self, name: str, spec: TemplateSpec, labels: dict[str, str]) -> str:
        return self._run(self.docker.create(name, spec, labels, Work.CLIENT))

    def pause(self, container_id: str) -> None:
        self._run(self.docker.pause(container_id))

    def unpause(self, container_id: str) -> None:
        self._run(self.docker.unpause(container_id, Work.CLIENT))

    def commit(self, container_id: str, repository: str, tag: str) -> str:
        return self._run(self.docker.commit(container_id, repository, tag))

    def remove_image(self, ref: str) -> None:
        self._run(self.docker.remove_image(ref))

    def remove(self, container_id: str) -> None:
        self._run(self.docker.remove(container_id, Work.CLIENT))

    def exec(self, container_id: str, cmd: list[str], user: str) -> int | None:
        """Run `cmd` in the container to its end, as the agent's exec does; its exit code."""
        code, _, _ = self._run(self.docker.run("exec", container_id, cmd, user=user))
        return code

    def list_labelled(self, node_id: str) -> list[ContainerSummary]:
        return self._run(self.docker.list_labelled(node_id))

    def close(self) -> None:
        self._run(self.docker.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()
