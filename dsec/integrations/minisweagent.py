"""A mini-swe-agent environment whose commands run in a dsec sandbox.

    environment:
      environment_class: dsec.integrations.minisweagent.DsecEnvironment
      template: python
      pool: default
      url: http://127.0.0.1:8000     # or $DSEC_URL; the token from $DSEC_TOKEN

It answers as mini-swe-agent's own DockerEnvironment does: `execute` runs the command
with the configured interpreter (`bash -lc`) in `cwd`, with `env` set, its stderr merged
into its stdout as `docker exec` with `stderr=STDOUT` gives them, and returns
`{"output", "returncode", "exception_info"}`; a command past its timeout answers
returncode -1 with what it wrote and the reason; output whose first line is
`COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT` (exit 0) ends the run (`Submitted`). Commands go
through the sandbox's resident loop, not an engine exec. The sandbox is acquired when
the environment is made and released by `close()` (or `cleanup()`, or when it is
garbage-collected); a harness that dies without either loses it to the lease's idle
timeout.
"""

from __future__ import annotations

import logging
import platform
import sys
from typing import Any

from pydantic import BaseModel

try:
    from minisweagent.exceptions import Submitted
    from minisweagent.utils.serialize import recursive_merge
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError(
        "dsec.integrations.minisweagent needs mini-swe-agent: pip install 'dsec[integrations]'"
    ) from e

from dsec.sync_client import SyncClient, SyncSandbox

SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
# merges the command's stderr into its stdout, in the order they were written
MERGED = ["sh", "-c", 'exec "$@" 2>&1', "sh"]


class DsecEnvironmentConfig(BaseModel):
    template: str = "python"
    pool: str = "default"
    url: str | None = None
    """The control plane; $DSEC_URL when not given."""
    token: str | None = None
    """A client token; $DSEC_TOKEN when not given."""
    cwd: str = "/work"
    """Where commands run unless `execute` is given another."""
    env: dict[str, str] = {}
    """Set on every command."""
    timeout: int = 30
    """Seconds a command may run."""
    acquire_timeout: float = 60.0
    interpreter: list[str] = ["bash", "-lc"]
    """What runs the command line, as in mini-swe-agent's Docker environment."""


class DsecEnvironment:
    def __init__(
        self,
        *,
        config_class: type = DsecEnvironmentConfig,
        logger: logging.Logger | None = None,
        **kwargs: Any,
    ) -> None:
        self._client: SyncClient | None = None
        self._scope: Any = None
        self.logger = logger or logging.getLogger("minisweagent.environment")
        self.config = config_class(**kwargs)
        self._client = SyncClient(self.config.url, self.config.token)
        try:
            self._scope = self._client.sandbox(
                self.config.pool, self.config.template, timeout=self.config.acquire_timeout
            )
            self.sandbox: SyncSandbox = self._scope.__enter__()
        except BaseException:
            self._scope = None
            self.close()
            raise
        self.logger.info("acquired dsec sandbox %s on %s", self.sandbox.id, self.sandbox.node)

    def execute(
        self, action: dict | str, cwd: str = "", *, timeout: int | None = None
    ) -> dict[str, Any]:
        """Run one command (an action's `command`, or the command line itself)."""
        command = action.get("command", "") if isinstance(action, dict) else action
        limit = timeout or self.config.timeout
        done = self.sandbox.exec(
            [*MERGED, *self.config.interpreter, command],
            timeout=limit,
            env=self.config.env,
            workdir=cwd or self.config.cwd,
        )
        if done.timed_out:
            output = {
                "output": done.stdout,
                "returncode": -1,
                "exception_info": "An error occurred while executing the command: "
                f"Command {command!r} timed out after {limit} seconds",
                "extra": {"exception_type": "TimeoutExpired", "exception": "timed out"},
            }
        else:
            output = {"output": done.stdout, "returncode": done.exit_code, "exception_info": ""}
        self._check_finished(output)
        return output

    def _check_finished(self, output: dict) -> None:
        lines = output.get("output", "").lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT_MARKER and output["returncode"] == 0:
            submission = "".join(lines[1:])
            raise Submitted(
                {
                    "role": "exit",
                    "content": submission,
                    "extra": {"exit_status": "Submitted", "submission": submission},
                }
            )

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        return recursive_merge(self.config.model_dump(), platform.uname()._asdict(), kwargs)

    def serialize(self) -> dict:
        config = self.config.model_dump(mode="json", exclude={"token"})
        return {
            "info": {
                "config": {
                    "environment": config,
                    "environment_type": f"{type(self).__module__}.{type(self).__name__}",
                }
            }
        }

    def close(self) -> None:
        """Release the sandbox (once; later calls do nothing)."""
        scope, self._scope = self._scope, None
        client, self._client = self._client, None
        try:
            if scope is not None:
                scope.__exit__(None, None, None)
        finally:
            if client is not None:
                client.close()

    cleanup = close  # mini-swe-agent's own environments' name for it

    def __del__(self) -> None:
        # at the interpreter's exit the client's thread no longer runs: the lease's idle
        # timeout ends the sandbox instead
        if not sys.is_finalizing():
            self.close()
