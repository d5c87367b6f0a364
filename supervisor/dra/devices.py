"""One device of the ResourceSlices, described: its attribute values, attributes, capacities and
health taints, as NVIDIA's DRA driver writes them (supervisor.dra.slices says which, and from
where). Pure functions; apart from `slices` so that `partitions` (partitionable GPUs) describes
its devices with the same ones without an import cycle.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from common.model import Gpu, MigDevice, Node
from supervisor.dra.memshare import binary as binary_quantity
from supervisor.health.book import SEVERITY, ConditionView, overlaps
from supervisor.node.draplan import DRIVER
from supervisor.node.pcie import nvlib_bus_id

PCI_BUS_ID = "resource.kubernetes.io/pciBusID"
PCIE_ROOT = "resource.kubernetes.io/pcieRoot"  # deviceattribute.StandardDeviceAttributePCIeRoot
NUMA_NODE = "resource.kubernetes.io/numaNode"  # NVIDIA's standardNumaNodeAttribute (deviceinfo.go)
MAX_TAINTS = 4  # DeviceTaintsMaxLength in 1.34 (16 from 1.35)
NO_SCHEDULE = "NoSchedule"


# ---------------------------------------------------------------------------------- values


def semver(text: str) -> str | None:
    """A version as semver, as NVIDIA's driver reads it (Masterminds' lenient parser: missing
    parts are 0, leading zeros dropped): "550.54.15" -> "550.54.15", "535.104.05" -> "535.104.5",
    "9.0" -> "9.0.0". None for what is not numbers and dots."""
    parts = text.strip().split(".")
    if not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        return None
    numbers = [int(p) for p in parts] + [0] * (3 - len(parts))
    return ".".join(str(n) for n in numbers)


def cuda_version(value: int) -> str | None:
    """NVML's CUDA driver version (12040) as NVIDIA's driver publishes it: "12.4" -> "12.4.0"."""
    if value <= 0:
        return None
    return semver(f"{value // 1000}.{(value % 1000) // 10}")


pci_bus_id = nvlib_bus_id  # NVML's bus id as go-nvlib's GetPCIBusID gives it: "0000:bd:00.0"


Attribute = dict[str, str | int]


def _string(value: str) -> Attribute:
    return {"string": value}


def _version(value: str) -> Attribute:
    return {"version": value}


def _count(value: int) -> dict[str, str]:
    """A count as NVIDIA's `intcap` makes it: a BinarySI quantity (1024 would read "1Ki")."""
    return {"value": binary_quantity(value)}


def common_attributes(gpu: Gpu, node: Node) -> dict[str, Attribute]:
    """The attributes a MIG device shares with its parent GPU."""
    attrs = {"productName": _string(gpu.name)}
    if gpu.brand:
        attrs["brand"] = _string(gpu.brand)
    if gpu.architecture:
        attrs["architecture"] = _string(gpu.architecture)
    for name, version in (
        ("cudaComputeCapability", semver("{}.{}".format(*gpu.compute_capability))),
        ("driverVersion", semver(node.driver_version)),
        ("cudaDriverVersion", cuda_version(node.cuda_driver_version)),
    ):
        if version is not None:
            attrs[name] = _version(version)
    attrs[PCI_BUS_ID] = _string(pci_bus_id(gpu.pci_bus_id))
    if gpu.pcie_root:
        attrs[PCIE_ROOT] = _string(gpu.pcie_root)
    if gpu.pci_numa_node is not None and gpu.pci_numa_node >= 0:
        attrs[NUMA_NODE] = {"int": gpu.pci_numa_node}
    if gpu.addressing_mode:
        attrs["addressingMode"] = _string(gpu.addressing_mode)
    return attrs


def gpu_device(gpu: Gpu, node: Node, name: str) -> dict[str, Any]:
    attrs = {"type": _string("gpu"), "uuid": _string(gpu.uuid), **common_attributes(gpu, node)}
    return {
        "name": name,
        "attributes": attrs,
        "capacity": {"memory": {"value": binary_quantity(gpu.memory_mib << 20)}},
    }


def mig_device(gpu: Gpu, mig: MigDevice, node: Node, name: str) -> dict[str, Any]:
    attrs = {
        "type": _string("mig"),
        "uuid": _string(mig.uuid),
        "parentUUID": _string(gpu.uuid),
        "profile": _string(mig.profile),
        **common_attributes(gpu, node),
    }
    capacity: dict[str, dict[str, str]] = {
        "multiprocessors": _count(mig.multiprocessors),
        "copyEngines": _count(mig.copy_engines),
        "decoders": _count(mig.decoders),
        "encoders": _count(mig.encoders),
        "jpegEngines": _count(mig.jpeg_engines),
        "ofaEngines": _count(mig.ofa_engines),
        "memory": {"value": binary_quantity(mig.memory_mib << 20)},
    }
    if mig.placement_start >= 0:
        for i in range(mig.placement_start, mig.placement_start + mig.placement_size):
            capacity[f"memorySlice{i}"] = _count(1)
    return {"name": name, "attributes": attrs, "capacity": capacity}


# ---------------------------------------------------------------------------------- health -> taints


def _label_value(text: str) -> str:
    value = re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-_.")[:63]
    return value.rstrip("-_.")


def condition_taint(condition: ConditionView) -> dict[str, str]:
    """The taint (key, value, effect, timeAdded) that says why the device is unhealthy."""
    name = condition.name
    key, value = f"{DRIVER}/unhealthy", _label_value(name)
    if name.startswith("xid:"):
        key, value = f"{DRIVER}/xid", name.partition(":")[2]
    elif name == "lost":
        key, value = f"{DRIVER}/gpu-lost", ""
    elif name == "event-wait":
        key, value = f"{DRIVER}/unmonitored", ""
    elif name.startswith("ecc:"):
        key, value = f"{DRIVER}/ecc", _label_value(name.partition(":")[2])
    taint = {"key": key, "effect": NO_SCHEDULE, "timeAdded": _rfc3339(condition.since)}
    if value:
        taint["value"] = value
    return taint


def _rfc3339(wall: float) -> str:
    return datetime.fromtimestamp(int(wall), tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def device_taints(
    gpu: Gpu, mig: MigDevice | None, conditions: Iterable[ConditionView]
) -> list[dict[str, str]]:
    """The taints of one device: every condition that overlaps it, the most severe first."""
    out: list[dict[str, str]] = []
    for condition in device_conditions(gpu, mig, conditions):
        taint = condition_taint(condition)
        if not any((t["key"], t.get("value")) == (taint["key"], taint.get("value")) for t in out):
            out.append(taint)
    return out[:MAX_TAINTS]


def device_conditions(
    gpu: Gpu, mig: MigDevice | None, conditions: Iterable[ConditionView]
) -> list[ConditionView]:
    """The conditions that overlap one device, the most severe first."""
    gi = mig.gi_id if mig is not None else None
    ci = mig.ci_id if mig is not None else None
    return sorted(
        (c for c in conditions if c.gpu_uuid == gpu.uuid and overlaps(c.gi, c.ci, gi, ci)),
        key=lambda c: (SEVERITY[c.recovery], c.since, c.name),
    )
