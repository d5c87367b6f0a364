"""What the supervisor should run, and making it so.

Owns: `discovery` (NVML brought up with retries; rediscovery that keeps a lost GPU listed),
`replan` (reload and rediscovery: each gives an outcome, a `Desired` state, `Deferred` until NVML
is up, `Unchanged` or a `Refusal`, never half of one),
`reconcile` (the one owner of the running config, node and plans, of a pending desired state
and of the last refusal: plan files first, then the parts, then the workers) and `follow`
(the parts brought in step with a new desired state). May import every package below it.
"""
