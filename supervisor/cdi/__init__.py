"""CDI: the spec that names every device gpuvisor advertises, kept in step with the plans.

Owns: `spec` (the spec's content and its atomic write, or nvidia-ctk's), `sync` (rewritten
when the plans change, retried until it is written) and `strategy` (which plans use CDI at all,
and `CdiError`: without such a plan, `spec` is never loaded). May import: `common/`, `supervisor.config`.
"""
