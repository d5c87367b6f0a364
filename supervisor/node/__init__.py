"""The node as NVML shows it: the NVML adapter, the facts GFD labels read, and planning.

Owns: `nvml` (every NVML call of the supervisor goes through `Nvml`, which takes the `pynvml`
module, or the simulator standing in for it, as a parameter), `pcie` (a GPU's PCIe root complex
and NUMA node from sysfs, as NVIDIA's DRA driver reads them), `facts` (what the labeller reads),
`events` (the NVML event set: registered on every GPU, one wait at a time), `migplace` (every
MIG device a GPU could have: its profiles at their possible placements), `migmaker` (MIG on
demand: creating and destroying GPU and compute instances, MIG mode),
`planning` (Node + Config -> one `ResourcePlan` per resource, a pure function), `draplan` (the
DRA driver's device names and the DRA worker's plan, in `--mode dra`) and `plansize` (the bound
on a plan's size). May import: `common/`, `supervisor.config`.
"""
