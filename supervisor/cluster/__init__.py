"""What the API server holds for this node, kept by the supervisor: its config label, health on the Node.

- `side`    `ClusterSide`: off unless `--config-file-srcdir` or `--node-health` is set, or a part
            of a higher layer wants it (`ClusterPart`: the DRA driver's, supervisor/dra); starts,
            after the first registration with the kubelet, the watch of the Node's config label,
            the writer of GPU health and those parts, on threads that never block the main loop;
- `health`  the `GPUUnhealthy` condition and the Events, as pure functions of the health book;
- `writer`  `NodeHealthWriter`: the thread that writes them, newest first, catching up after an
            outage.

The API-server layer (`supervisor.kube`) is imported inside `ClusterSide.start` and by `writer`,
which `side` too imports only there, so `gpuvisor run` does not load it unless a feature needs it.

May import: `supervisor.kube`, `supervisor.health`, `supervisor.observe`, `supervisor.config`.
"""
