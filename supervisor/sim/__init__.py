"""Stand-ins for what a GPU node has and this machine may not: NVML, and the kubelet.

Owns: `nvml` (the NVML simulator, a stand-in for the `pynvml` module with fault injection,
behind `gpuvisor run --simulate`), `kubelet` (the kubelet stand-in: a real `v1beta1.Registration`
server on a real unix socket, used by the demo, the tests and the benchmarks), `kubeletnode`
(its node-side parts: the node-status setter, its checkpoint, the pod-resources API), `drakubelet` (the
kubelet's DRA side: plugin-watcher registration, the v1 and v1beta1 DRAPlugin clients, the health
stream, the kubelet's wipe of a node's ResourceSlices at its start, and a claim store standing in
for the API server) `drivertree` (a driver root laid out as a driver install lays it out, for CDI discovery) and
`demo` (`gpuvisor demo`). The only package that holds test doubles;
production code reaches it only when asked to simulate. May import: `common/`, `supervisor.node`,
`supervisor.control`, `supervisor.observe` (the pod-resources API the kubelet stand-in serves),
`supervisor.kube` (the DRA stand-in's API client).
"""
