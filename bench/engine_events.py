"""What the Docker engine did during a run, from its own event stream: each container
create, start, end (die), removal (destroy), pause, unpause, commit and exec start it reports for a
pool's containers, dated by the engine. A live run's figures come from here, so that
they can be held against the simulator's model of the same run (bench/fidelity.py),
which counts the same actions of its simulated engines.

The engine keeps only its last 256 events for a query of the past, so the stream is
read while the run goes, in a thread of its own, and counted afterwards over the
run's window.
"""

from __future__ import annotations

import threading
from collections import Counter

import docker

from agent.docker_driver import LABEL_NODE

# the actions a run is compared on; the engine's others (kill, exec_create, exec_die,
# ...) each go with one of these. The agent stops a released sandbox by killing its init
# from the host (agent/docker_driver.py AsyncDocker.kill): the engine reports no kill,
# only the container's end (die)
ACTIONS = ("create", "start", "die", "destroy", "pause", "unpause", "commit", "exec_start")
JOIN_TIMEOUT_S = 10.0


class EngineEventWatch:
    """The engine's container events for the nodes whose id starts with `node_prefix`,
    read from entering to leaving; `counts` over a window of that."""

    def __init__(self, node_prefix: str) -> None:
        self.node_prefix = node_prefix
        self.seen: list[tuple[float, str]] = []  # (the engine's time, in s, action)
        self._client: docker.DockerClient | None = None
        self._stream = None
        self._reader: threading.Thread | None = None

    def __enter__(self) -> EngineEventWatch:
        self._client = docker.from_env()
        filters = {"type": "container", "label": LABEL_NODE}
        self._stream = self._client.events(filters=filters, decode=True)
        self._reader = threading.Thread(target=self._read, name="engine-events", daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        try:
            for event in self._stream:
                node = event.get("Actor", {}).get("Attributes", {}).get(LABEL_NODE, "")
                if node.startswith(self.node_prefix):
                    # an exec's action carries its command: "exec_start: sh -c ..."
                    action = event.get("Action", "").split(":", 1)[0]
                    self.seen.append((event.get("timeNano", 0) / 1e9, action))
        except Exception:  # noqa: BLE001 - the stream closed under the reader: it is done
            return

    def __exit__(self, *exc) -> None:
        if self._stream is not None:
            self._stream.close()
        if self._reader is not None:
            self._reader.join(JOIN_TIMEOUT_S)
        if self._client is not None:
            self._client.close()

    def counts(self, since: float, until: float) -> dict[str, int]:
        """Each of ACTIONS the engine reported from `since` to `until` (Unix seconds)."""
        counted = Counter(action for at, action in self.seen if since <= at <= until)
        return {action: counted.get(action, 0) for action in ACTIONS}
