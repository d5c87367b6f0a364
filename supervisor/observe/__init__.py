"""What an operator sees: metrics, the HTTP probes, readiness and status, the allocations view.

Owns: `metrics` (every Prometheus series), `series` (the counters and gauges under them, plain
numbers until a scrape), `drafamilies` (the DRA worker's request figures as `gpuvisor_dra_*`,
beside NVIDIA's names), `exposition` (the text format a scrape reads, and the process's own
figures), `http` (/metrics, /healthz, /readyz on a thread of
its own), `status` (the one definition of readiness, and the status document assembled from the
parts' own views) and `allocations` (who holds which device, from the kubelet, asked through `podresources`: the
kubelet's pod-resources API). The parts it
reads are seen through small protocols, so this package sits low: every part may report to it.
May import: `common/`, `supervisor.config`.
"""
