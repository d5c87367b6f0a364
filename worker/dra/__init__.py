"""The DRA worker: the kubelet plugin of DRA driver `gpu.nvidia.com`, one process like any worker.

`main` (the process: what it does with health and plan updates, which reach it through
`worker.link`), `sockets` (serve the DRA service socket, then register through the plugin
watcher's socket; keep both up), `services` (the gRPC servicers: DRAPlugin v1 and v1beta1,
DRAResourceHealth, Registration), `prepare` (what preparing and unpreparing a claim means, as
data), `claims` (where claims come from, `ClaimSource`, and what is checked in one) and `health`
(the devices' health as the kubelet's health stream shows it), `edits` (what a claim adds to its
containers, and the sharing steps that add it), `config` (a claim's opaque configuration, NVIDIA's
`GpuConfig` and `MigDeviceConfig`, resolved per device), `quantity` (Kubernetes quantities, for
its memory limits), `sharing` (applying and undoing a claim's sharing: the GPUs' timeslice
through nvidia-smi, the claim's MPS daemon), `mps` (an MPS claim's daemon, asked of the
supervisor, which runs it), `migdemand` (a MIG device made on demand for a claim, and destroyed,
asked of the supervisor, which owns NVML), `asking` (a request to the supervisor and the wait for
its answer, for `claims`, `mps` and `migdemand`), `memshare` (a GPU shared by memory: the claim's share as an MPS
client's pinned memory limit, through the GPU's one daemon), `claimspec` (each prepared claim's own CDI spec) and `figures` (the
per-claim request figures NVIDIA's plugin counts, for the supervisor's `gpuvisor_dra_*`). The
prepared claims on disk are `common.dracheckpoint`, which the supervisor reads too. May import:
`common/` and the rest of `worker/`.
"""
