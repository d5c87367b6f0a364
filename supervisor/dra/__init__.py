"""The supervisor's side of DRA (`--mode dra`): what the node publishes to the API server.

Owns: `slices` (the node's ResourceSlices as NVIDIA's DRA driver publishes them: devices,
attributes, capacities and health taints, a pure function of the node and the health book's
conditions; and the API server's rules for them). Publishing them, and the API-server claim
source of the DRA worker, come with the API-server layer (gpuvisor issue 28). May import:
`common/`, `supervisor.config`, `supervisor.node`, `supervisor.health`.
"""
