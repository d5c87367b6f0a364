"""The worker process: one per resource, the kubelet-facing server.

`main` (the process), `process` (what every worker process does alike: its spawn secret, its
parent check, no `ssl`; its command line is `common.workerargs`), `link` (its link to the
supervisor, the DRA worker's too: the ZeroMQ sockets, the health snapshot then deltas,
heartbeats, the main loop), `healthboard` (its devices' health, for both kinds of worker),
`devicebook` (that board as ListAndWatch lists it), `service` (the DevicePlugin gRPC servicer),
`server` (one start of the server on its socket), `rpcserver` (the gRPC servers both kinds of
worker serve on: grpc.aio on one event loop, so an idle server never wakes), `allocate` and
`preferred` (the Allocate and GetPreferredAllocation policies, pure), `registrar` (the thread that keeps either kind of
worker registered: states, backoff, triggers), `registration` (what registering is for a device
plugin: serve, then register; re-register on a kubelet restart), `healthcopy` (its copy of the supervisor's health book),
`stats`, `zygote` (the process that forks workers) and `pages` (what the zygote does before
its first fork so that its pages stay shared). `dra` is the other kind of worker: the DRA kubelet
plugin, which a plan with DRA settings runs instead. May import: `common/` only.
"""
