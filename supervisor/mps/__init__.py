"""MPS sharing: one `nvidia-cuda-mps-control` daemon per MPS resource, tied to device health.

Owns: `layout` (the MPS root's paths and the daemon settings of a plan), `tool` (talking to
one control daemon: start, commands, stop), `daemons` (their supervision on a thread of its
own) and `wiring` (a resource's GPUs are Unhealthy while its daemon is down); `claims` (the
daemon of each DRA claim that MPS shares, on the same supervision, kept by the DRA checkpoint)
and `claimwiring` (how the DRA side makes them, on first use). May import:
`common/`, `supervisor.config`, `supervisor.host`, `supervisor.health`.
"""
