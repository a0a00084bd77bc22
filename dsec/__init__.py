"""dsec: an elastic pool of Docker sandboxes for agentic RL training."""

from dsec.client import (
    Client,
    DsecError,
    ExecChunk,
    ExecOutput,
    ExecStream,
    Sandbox,
    SandboxFiles,
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
    "SyncClient",
    "SyncExecStream",
    "SyncSandbox",
    "SyncSandboxFiles",
]
