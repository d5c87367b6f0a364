"""CDI: the spec that names every device gpuvisor advertises, kept in step with the plans.

Owns: `spec` (the spec's content and its atomic write, or nvidia-ctk's) and `sync` (rewritten
when the plans change, retried until it is written). May import: `common/`, `supervisor.config`.
"""
