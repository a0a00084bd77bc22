"""dsec: an elastic pool of Docker sandboxes for agentic RL training."""

from dsec.client import (
    Client,
    DsecError,
    ExecChunk,
    ExecOutput,
    ExecStream,
    Sandbox,
    SandboxFiles,
    SandboxLost,
)
from dsec.models import ExecResult, FileInfo
from dsec.sync_client import SyncClient, SyncExecStream, SyncSandbox, SyncSandboxFiles

__all__ = [
    "Client",
    "DsecError",
    "ExecChunk",
    "ExecOutput",
    "ExecResult",
    "ExecStream",
    "FileInfo",
    "Sandbox",
    "SandboxFiles",
    "SandboxLost",
    "SyncClient",
    "SyncExecStream",
    "SyncSandbox",
    "SyncSandboxFiles",
]
