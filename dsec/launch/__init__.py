"""Launchers: a whole pool started as child processes, on loopback (`local.LocalPool`) or
on a Ray cluster (`ray.RayPool`).

They sit above `controlplane/` and `agent/`, whose processes they start, and below
`bench/` and the CLI, which start pools through them; the library part of `dsec/` never
imports them.
"""
