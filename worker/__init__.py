"""The worker process: one per resource, the kubelet-facing DevicePlugin server.

`main` (the process), `server` (the gRPC servicer), `allocate` and `preferred` (the Allocate and
GetPreferredAllocation policies, pure), `registration` (serve, then register; re-register on a
kubelet restart), `healthcopy` (its copy of the supervisor's health book), `stats` and `zygote`
(the process that forks workers). May import: `common/` only.
"""
