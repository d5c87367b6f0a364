"""The supervisor's control socket: the ROUTER endpoint, the commands, and the CLI's client.

Owns: `endpoint` (decoding, the check that a worker's message comes from the worker spawned for
it, typed dispatch to handlers passed in), `commands` (what `gpuvisor status`, `reload` and
`sim ...` do, on a `CommandTarget`) and `client` (`send_command`, used by the CLI and the demo).
Nothing here decides what a worker's message means (that is `supervisor.workers.events`).
May import: `common/`, `supervisor.host` (the run dir's socket paths).
"""
