"""What every role process shares, whichever role it runs and whoever spawned it.

The node's layout (ring and stream names), the waits and heartbeats of a role's main
loop (`flow`), and how a server runs as a process of its own (`service`). The roles
(loader, planner, constructor, remote, autoscale) build on it; the supervisor
(`overlord.sidecar`) and the trainer side (`overlord.torch`) build on the roles.
"""
