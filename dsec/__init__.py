"""dsec: an elastic pool of Docker sandboxes for agentic RL training."""

from dsec.client import Client, DsecError, Sandbox
from dsec.models import ExecResult

__all__ = ["Client", "DsecError", "ExecResult", "Sandbox"]
