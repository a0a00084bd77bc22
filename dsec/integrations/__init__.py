"""dsec under the clients RL stacks already use (the `integrations` extra).

- `fusion`: `dsec serve fusion`, a service that answers SandboxFusion's HTTP API
  (`POST /run_code`, what verl's and SkyRL's code rewards and tools call) from a pool,
  a sandbox per request.
- `minisweagent`: `DsecEnvironment`, a mini-swe-agent environment whose commands run in
  a dsec sandbox.

Both are clients of a pool, like any SDK user: they hold a client token and never reach
past the control plane's and the agents' HTTP API.
"""
