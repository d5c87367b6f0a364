"""Devices in use outside DRA, as DRA device names: what the slices must leave out.

A node switched from device-plugin mode to DRA keeps the containers that were allocated GPUs
through the device plugin: those devices are theirs until the pods end, so the pool does not
offer them. The kubelet says which they are (its pod-resources API, else its device-manager
checkpoint: `supervisor.observe.allocations`), by the device IDs the plugin advertised:

- `GPU-<uuid>` / `MIG-<uuid>`, with `::<n>` for a time-slicing or MPS replica (the default
  `--device-id-strategy uuid`);
- `<index>` / `<gpu index>:<mig index>` (the index strategy), taken only for resources of the
  `nvidia.com/` domain, where gpuvisor's and NVIDIA's plugins advertise them.

A full GPU in use holds its DRA device `gpu-<minor>`, or, when the GPU has MIG mode on now, every
MIG device of it; a MIG device in use holds its own. Pure functions of the node and the
allocations; reading them (a gRPC call that may block for seconds) is the caller's, on a thread
that may wait.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from common.model import Node
from supervisor.node.draplan import dra_devices
from supervisor.observe.allocations import Allocation

RESOURCE_DOMAIN = "nvidia.com/"


def held_by_pods(node: Node, allocations: Iterable[Allocation]) -> dict[str, tuple[str, ...]]:
    """DRA device name -> the pods (namespace/name, or UID) whose containers hold it."""
    by_gpu_uuid: dict[str, list[str]] = {}
    by_mig_uuid: dict[str, str] = {}
    by_gpu_index: dict[str, str] = {}
    by_mig_index: dict[str, str] = {}
    for gpu, mig, name in dra_devices(node):
        by_gpu_uuid.setdefault(gpu.uuid, []).append(name)
        by_gpu_index.setdefault(str(gpu.index), gpu.uuid)
        if mig is not None:
            by_mig_uuid[mig.uuid] = name
            by_mig_index[f"{gpu.index}:{mig.index}"] = name
    held: dict[str, set[str]] = {}
    for allocation in allocations:
        ours = allocation.resource.startswith(RESOURCE_DOMAIN)
        for device_id in allocation.devices:
            base = device_id.partition("::")[0]  # a replica holds its GPU
            names: list[str] = []
            if base in by_gpu_uuid:
                names = by_gpu_uuid[base]
            elif base in by_mig_uuid:
                names = [by_mig_uuid[base]]
            elif ours and base in by_gpu_index:
                names = by_gpu_uuid[by_gpu_index[base]]
            elif ours and base in by_mig_index:
                names = [by_mig_index[base]]
            for name in names:
                held.setdefault(name, set()).add(allocation.pod)
    return {name: tuple(sorted(pods)) for name, pods in sorted(held.items())}


def describe(held: Mapping[str, tuple[str, ...]]) -> str:
    """A log line's list: `gpu-0 (default/train), gpu-3 (ml/a, ml/b)`."""
    return ", ".join(f"{name} ({', '.join(pods)})" for name, pods in held.items()) or "none"
