"""The kubelet stand-in's node-side parts (supervisor/sim/kubelet.py): the extended-resource
name test, the device manager's part of the node-status setter, its checkpoint file, and the
pod-resources API, each as the kubelet of Kubernetes 1.34 has it.

What the stand-in keeps of the device manager (pkg/kubelet/cm/devicemanager/manager.go):

- a resource whose plugin went keeps its capacity (its devices, all unhealthy) and 0
  allocatable for `grace_s` (`endpointStopGracePeriod`, 5 minutes), then the manager forgets it:
  `get_capacity()` names it once as removed. A restart keeps the registered resources with no
  devices (`readCheckpoint`: a stopped endpoint per registered resource, capacity 0) for another
  grace period;
- with `write_checkpoint`, `kubelet_internal_checkpoint` in the plugin dir is kept as
  `writeCheckpoint` keeps it: `RegisteredDevices` lists every resource the manager still has (the
  healthy devices' IDs; none for a plugin that went), `PodDeviceEntries` the pods' devices;
- `node_status(sink, interval)` runs the node-status setter's device-manager part every
  `interval` (`status_setter`); `sink` applies that change to the Node at the API server.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from typing import Any

import grpc

from common.kubeletapi.rpc import unix_target

_NAME_PART = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_DOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def is_extended_resource_name(name: str) -> bool:
    """The kubelet's test for a device plugin's resource name (an extended resource name)."""
    if "/" not in name or name.startswith("kubernetes.io/") or name.startswith("requests."):
        return False
    domain, _, part = name.partition("/")
    if not domain or len(domain) > 253 or not _DOMAIN.match(domain) or "/" in part:
        return False
    return 0 < len(part) <= 63 and bool(_NAME_PART.match(part))


def status_setter(
    capacity: Mapping[str, int], allocatable: Mapping[str, int], removed: Sequence[str]
) -> Callable[[dict[str, Any]], None]:
    """The device manager's part of pkg/kubelet/nodestatus/setters.go `MachineInfo`, for one
    update: each resource's capacity is set; a removed one is set to 0, never deleted ("Set the
    capacity of the removed resource to 0 instead of removing the resource from the node
    status"); allocatable loses the extended keys absent from capacity, takes every capacity
    value, then the device manager's allocatable over it."""

    def setter(status: dict[str, Any]) -> None:
        cap = status.setdefault("capacity", {})
        alloc = status.setdefault("allocatable", {})
        for name, count in capacity.items():
            cap[name] = str(count)
        for name in removed:
            cap[name] = "0"
        for name in list(alloc):
            if name not in cap and is_extended_resource_name(name):
                del alloc[name]
        for name, value in cap.items():
            alloc[name] = value
        for name, count in allocatable.items():
            alloc[name] = str(count)

    return setter


def write_checkpoint(path: str, registered: Mapping[str, list[str]], entries: list[dict[str, Any]]) -> None:
    """`kubelet_internal_checkpoint` as the device manager writes it (its checksum aside: gpuvisor
    does not read it), replaced in one rename."""
    data = {"Data": {"PodDeviceEntries": entries, "RegisteredDevices": dict(registered)}, "Checksum": 0}
    temp = f"{path}.tmp"
    with open(temp, "w", encoding="utf-8") as fh:
        json.dump(data, fh)
    os.replace(temp, path)


def pod_resources_server(
    path: str, pods: Callable[[], list[tuple[str, tuple[str, list[str]]]]]
) -> grpc.Server:
    """The kubelet's pod-resources API (`v1.PodResourcesLister/List`) on `path`: each pod of
    `pods()` (name, (resource, device IDs)) as one container holding its devices."""
    from supervisor.observe.podresources import lister_handler, prpb

    def list_pods(request: Any, context: grpc.ServicerContext) -> Any:
        return prpb.ListPodResourcesResponse(
            pod_resources=[
                prpb.PodResources(
                    name=name,
                    namespace="default",
                    containers=[
                        prpb.ContainerResources(
                            name="main",
                            devices=[prpb.ContainerDevices(resource_name=resource, device_ids=ids)],
                        )
                    ],
                )
                for name, (resource, ids) in pods()
                if ids
            ]
        )

    os.makedirs(os.path.dirname(path), exist_ok=True)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="podresources"))
    server.add_generic_rpc_handlers((lister_handler(list_pods),))
    server.add_insecure_port(unix_target(path))
    server.start()
    return server
