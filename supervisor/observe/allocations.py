"""Which pods hold which of our devices, for `gpuvisor status`.

Two sources, the better one first:
- the kubelet's pod-resources API (`/var/lib/kubelet/pod-resources/kubelet.sock`,
  `v1.PodResourcesLister/List`): the supported interface, and the only one that names the pod
  (namespace/name);
- the kubelet's device-manager checkpoint (`<plugin dir>/kubelet_internal_checkpoint`, JSON):
  always there beside the device-plugin sockets, but an internal file that names pods by UID
  only. Its `DeviceIDs` is a map NUMA node -> IDs since Kubernetes 1.20 and a plain list before;
  unknown fields and the checksum are ignored (we only read).

Reading allocations is best effort and never fails a status call: an unreadable or malformed
source yields no allocations plus a warning text saying what and where. A missing checkpoint is
no warning: the kubelet writes it once a device plugin reports devices, so none means nothing is
allocated (a fresh node, or a kubelet not up yet). Only entries of the given resources are kept
(the kubelet lists every plugin's devices).
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

from supervisor.observe.podresources import DEFAULT_SOCKET as POD_RESOURCES_SOCKET

CHECKPOINT_NAME = "kubelet_internal_checkpoint"

__all__ = [
    "CHECKPOINT_NAME",
    "POD_RESOURCES_SOCKET",
    "Allocation",
    "AllocationsView",
    "current_allocations",
    "parse_checkpoint",
    "read_checkpoint",
    "read_pod_resources",
    "registered_resources",
]


@dataclass(frozen=True)
class Allocation:
    """One container's devices of one resource."""

    pod_uid: str  # from the checkpoint; "" from the pod-resources API (it names pods instead)
    container: str
    resource: str
    devices: tuple[str, ...]
    pod_name: str = ""
    namespace: str = ""

    @property
    def pod(self) -> str:
        """How status shows the pod: namespace/name when known, else the UID."""
        if self.pod_name:
            return f"{self.namespace}/{self.pod_name}" if self.namespace else self.pod_name
        return self.pod_uid

    def to_status(self) -> dict[str, Any]:
        """The `gpuvisor status` shape: {"pod", "container", "resource", "devices"} (+ ids)."""
        return {
            "pod": self.pod,
            "pod_uid": self.pod_uid,
            "namespace": self.namespace,
            "container": self.container,
            "resource": self.resource,
            "devices": list(self.devices),
        }


@dataclass
class AllocationsView:
    """What `current_allocations` found, where from, and what went wrong on the way."""

    allocations: list[Allocation] = field(default_factory=list)
    source: str = ""  # "pod-resources", "checkpoint" or "" (nothing readable)
    warnings: list[str] = field(default_factory=list)

    def to_status(self) -> list[dict[str, Any]]:
        return [a.to_status() for a in self.allocations]


def _keep(resource: str, resources: Collection[str] | None) -> bool:
    return resources is None or resource in resources


def _sorted(allocations: Iterable[Allocation]) -> list[Allocation]:
    return sorted(allocations, key=lambda a: (a.resource, a.pod, a.container, a.devices))


# ---------------------------------------------------------------------- checkpoint


def _device_ids(value: Any) -> tuple[str, ...] | None:
    """`DeviceIDs`: {"<numa>": [ids]} (1.20+) or [ids] (older); None when neither."""
    if value is None:
        return ()
    if isinstance(value, list):
        groups: list[Any] = [value]
    elif isinstance(value, dict):
        groups = [value[k] for k in sorted(value, key=str)]
    else:
        return None
    out: list[str] = []
    for group in groups:
        if group is None:
            continue
        if not isinstance(group, list) or not all(isinstance(d, str) for d in group):
            return None
        for device in group:
            if device not in out:  # a device listed under two NUMA nodes is still one device
                out.append(device)
    return tuple(out)


def parse_checkpoint(
    text: str | bytes, resources: Collection[str] | None = None, where: str = "the kubelet checkpoint"
) -> tuple[list[Allocation], list[str]]:
    """Allocations of `resources` (all when None) in a checkpoint's JSON, plus warnings."""
    try:
        doc = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        return [], [f"{where} is not valid JSON ({exc}): allocations not shown"]
    data = doc.get("Data") if isinstance(doc, dict) else None
    if not isinstance(data, dict):
        return [], [f'{where} has no "Data" object: allocations not shown']
    entries = data.get("PodDeviceEntries")
    if entries is None:
        return [], []
    if not isinstance(entries, list):
        return [], [f'{where}: "Data.PodDeviceEntries" is not a list: allocations not shown']
    found: list[Allocation] = []
    bad = 0
    for entry in entries:
        if not isinstance(entry, dict):
            bad += 1
            continue
        uid, container, resource = entry.get("PodUID"), entry.get("ContainerName"), entry.get("ResourceName")
        devices = _device_ids(entry.get("DeviceIDs"))
        if (
            not (isinstance(uid, str) and isinstance(container, str) and isinstance(resource, str))
            or devices is None
        ):
            bad += 1
            continue
        if _keep(resource, resources):
            found.append(Allocation(pod_uid=uid, container=container, resource=resource, devices=devices))
    warnings = (
        [f"{where}: skipped {bad} malformed entr{'y' if bad == 1 else 'ies'} of Data.PodDeviceEntries"]
        if bad
        else []
    )
    return _sorted(found), warnings


def _load(path: str) -> tuple[bytes | None, str]:
    """The file's bytes (None when there is no file), or None and why it cannot be read."""
    try:
        with open(path, "rb") as fh:
            return fh.read(), ""
    except FileNotFoundError:
        return None, ""
    except OSError as exc:
        return None, f"cannot read the kubelet checkpoint {path}: {exc.strerror or exc}"


def read_checkpoint(
    path: str, resources: Collection[str] | None = None
) -> tuple[list[Allocation], list[str]]:
    """Read and parse the checkpoint file at `path`; a missing file holds no allocations, an
    unreadable one is a warning, not an error."""
    raw, problem = _load(path)
    if raw is None:
        return [], [problem] if problem else []
    return parse_checkpoint(raw, resources, where=f"the kubelet checkpoint {path}")


def registered_resources(plugin_dir: str) -> frozenset[str] | None:
    """The resources the kubelet's device manager still has: its checkpoint's `RegisteredDevices`
    (one a plugin left is listed with no device until the manager forgets it), or None when the
    checkpoint is missing or cannot be read."""
    raw, _problem = _load(os.path.join(plugin_dir, CHECKPOINT_NAME))
    try:
        doc = json.loads(raw) if raw is not None else None
    except (ValueError, UnicodeDecodeError):
        return None
    data = doc.get("Data") if isinstance(doc, dict) else None
    registered = data.get("RegisteredDevices") if isinstance(data, dict) else None
    return frozenset(str(name) for name in registered) if isinstance(registered, dict) else None


# ---------------------------------------------------------------------- pod-resources API


def read_pod_resources(
    socket_path: str, resources: Collection[str] | None = None, timeout: float = 3.0
) -> list[Allocation]:
    """Allocations from the pod-resources API; raises OSError with a clear text on failure."""
    import grpc

    from supervisor.observe.podresources import list_pod_resources

    try:
        response = list_pod_resources(socket_path, timeout=timeout)
    except grpc.RpcError as exc:
        code = exc.code() if isinstance(exc, grpc.Call) else None
        detail = exc.details() if isinstance(exc, grpc.Call) else str(exc)
        name = code.name if code is not None else "error"
        raise OSError(f"pod-resources API at {socket_path} failed: {name}: {detail}") from None
    found: list[Allocation] = []
    for pod in response.pod_resources:
        for container in pod.containers:
            for devices in container.devices:
                if not _keep(devices.resource_name, resources) or not devices.device_ids:
                    continue
                found.append(
                    Allocation(
                        pod_uid="",
                        container=container.name,
                        resource=devices.resource_name,
                        devices=tuple(devices.device_ids),
                        pod_name=pod.name,
                        namespace=pod.namespace,
                    )
                )
    return _sorted(found)


# ---------------------------------------------------------------------- both


def current_allocations(
    plugin_dir: str,
    resources: Collection[str] | None = None,
    pod_resources_socket: str = POD_RESOURCES_SOCKET,
    timeout: float = 3.0,
) -> AllocationsView:
    """The pod-resources API when its socket exists, else (or if it fails) the checkpoint."""
    view = AllocationsView()
    if pod_resources_socket and os.path.exists(pod_resources_socket):
        try:
            view.allocations = read_pod_resources(pod_resources_socket, resources, timeout)
            view.source = "pod-resources"
            return view
        except OSError as exc:
            view.warnings.append(f"{exc}; falling back to the kubelet checkpoint")
    path = os.path.join(plugin_dir, CHECKPOINT_NAME)
    raw, problem = _load(path)
    if problem:
        view.warnings.append(problem)
        return view
    if raw is not None:  # no file: the kubelet has allocated nothing yet, which is an answer too
        view.allocations, warnings = parse_checkpoint(raw, resources, where=f"the kubelet checkpoint {path}")
        view.warnings += warnings
    view.source = "checkpoint"
    return view
