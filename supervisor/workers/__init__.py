"""The worker processes, one per resource: their lifecycle, how they are made, what they say.

Owns: `lifecycle` (the state machine and restart rules of every worker, `WorkerSet.tick(now)`),
`spawner` and `zygote` (starting a worker: forked from the zygote, or exec'd), `zygoteproc`
(starting the zygote's process, with few imports, so `gpuvisor run` can do it first), and `events`
(what worker messages and kubelet-dir events mean: lifecycle facts, registration metrics, health
snapshots, re-registration). May import: `common/`, `supervisor.config`, `supervisor.host`,
`supervisor.observe`, `supervisor.control`, `supervisor.health`.
"""
