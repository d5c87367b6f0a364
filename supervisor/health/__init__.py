"""Device health on the supervisor's side: policy, book, the NVML monitor, and the publisher.

Owns: `policy` (what each XID and ECC kind means: ignore, transient, until-reset), `book` (the
single truth of every device's health, pure data), `findings` (what the monitor thread saw, as
data), `monitor` (the thread that waits on NVML events and probes the GPUs), `eventlog` (one
line per event, bursts summarised) and `hub` (applies findings to the book on the main loop,
publishes every change on the PUB socket). May import: `common/`, `supervisor.config`,
`supervisor.node`, `supervisor.observe`.
"""
