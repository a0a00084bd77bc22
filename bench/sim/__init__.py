"""The discrete-event simulator: the control plane's own scheduler and policy, run in
virtual time against simulated agents."""

from bench.sim.engine import simulate

__all__ = ["simulate"]
