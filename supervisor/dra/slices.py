"""The node's ResourceSlices (resource.k8s.io/v1) as NVIDIA's DRA driver publishes them: a pure function.

`build_slices(node, health, ...)` gives the slice objects for the node's pool of driver
`gpu.nvidia.com`: one pool named after the node, its devices named by `supervisor.node.draplan`
(the names the DRA worker prepares) and described with the attribute names, types and
capacities of NVIDIA's kubelet plugin (kubernetes-sigs/dra-driver-nvidia-gpu v0.4.1 and its
main branch after it, `cmd/gpu-kubelet-plugin/deviceinfo.go` `GpuInfo.Attributes`, `mig.go`
`CommonAttributesMig` / `CommonCapacitiesMig`; the list, line by line, is the test data
tests/data/nvidia_dra_attributes.json), so DeviceClasses and CEL selectors written for that
driver select the same devices:

- a GPU: `type` "gpu", `uuid`, `productName`, `brand`, `architecture` (strings),
  `cudaComputeCapability`, `driverVersion`, `cudaDriverVersion` (versions, semver),
  `resource.kubernetes.io/pciBusID`, `resource.kubernetes.io/pcieRoot` (strings),
  `resource.kubernetes.io/numaNode` (int), `addressingMode` (string); capacity `memory`
  (bytes, binary quantity);
- a MIG device: `type` "mig", `uuid`, `parentUUID`, `profile`, and its parent's `productName`,
  `brand`, `architecture`, versions, `pciBusID`, `pcieRoot`, `numaNode` and `addressingMode`;
  capacities `multiprocessors`, `copyEngines`, `decoders`, `encoders`, `jpegEngines`,
  `ofaEngines` (its GPU instance profile's), `memory`, and `memorySlice<i>` = 1 for each memory
  slice of its placement.

What NVML or sysfs did not tell (a brand, an architecture, a placement, a PCIe root, a NUMA node,
an addressing mode) is left out rather than guessed, as NVIDIA leaves out the last three.

Health (the book's conditions, `supervisor.health.book.ConditionView`) becomes device taints
(KEP-5055) with NVIDIA's keys, effect NoSchedule for every condition gpuvisor counts as
unhealthy (NVIDIA's driver uses effect None for `unmonitored`, which 1.34 does not accept):
`gpu.nvidia.com/xid=<n>`, `gpu.nvidia.com/gpu-lost`, `gpu.nvidia.com/unmonitored` (the event
wait failed), and for gpuvisor's other conditions `gpu.nvidia.com/ecc=<kind>` and
`gpu.nvidia.com/unhealthy=<condition>`; the most severe first, at most 4 per device (1.34's
DeviceTaintsMaxLength), `timeAdded` the condition's start. Where the API server drops device
taints (DRADeviceTaints off), `taints=False` leaves unhealthy devices out instead, as NVIDIA's
v25.12.0 does. A slice holds at most 128 devices, 64 when any carries taints (1.35's rule).
With `memory_sharing` (gpuvisor.dra.memorySharing), each full GPU allows multiple allocations
and carries a request policy on its `memory` (supervisor.dra.memshare).

`slice_problems(obj)` checks an object against the API server's rules that the JSON schema does
not carry (names, lengths, counts, semver): the publisher refuses to send what the server would
reject, with the reason. `PoolWant` is what the main loop wants the pool to show; publishing it
(generations, the owner reference to the Node, republishing after the kubelet wipes the node's
slices) is `supervisor.dra.publish`'s.
"""

from __future__ import annotations

import re
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from common.model import Gpu, MigDevice, Node
from supervisor.dra.memshare import MemoryPolicy, capacity_problems, share
from supervisor.dra.memshare import binary as binary_quantity
from supervisor.health.book import SEVERITY, ConditionView, overlaps
from supervisor.node.draplan import DRIVER, dra_devices
from supervisor.node.pcie import nvlib_bus_id

API_VERSION = "resource.k8s.io/v1"
KIND = "ResourceSlice"
PCI_BUS_ID = "resource.kubernetes.io/pciBusID"
PCIE_ROOT = "resource.kubernetes.io/pcieRoot"  # deviceattribute.StandardDeviceAttributePCIeRoot
NUMA_NODE = "resource.kubernetes.io/numaNode"  # NVIDIA's standardNumaNodeAttribute (deviceinfo.go)
MAX_DEVICES = 128  # ResourceSliceMaxDevices
MAX_DEVICES_WITH_TAINTS = 64  # 1.35: a slice whose devices carry taints or consume counters
MAX_TAINTS = 4  # DeviceTaintsMaxLength in 1.34 (16 from 1.35)
MAX_ATTRIBUTES_AND_CAPACITIES = 32
MAX_VALUE_LENGTH = 64  # DeviceAttributeMaxValueLength (strings and versions)
MAX_ID_LENGTH = 32  # DeviceMaxIDLength: an attribute name's part after the domain
MAX_DOMAIN_LENGTH = 63
NO_SCHEDULE = "NoSchedule"

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_C_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_LABEL_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_SEMVER = re.compile(
    r"(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)"
    r"(-[0-9A-Za-z-]+(\.[0-9A-Za-z-]+)*)?(\+[0-9A-Za-z-]+(\.[0-9A-Za-z-]+)*)?"
)


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


def _common_attributes(gpu: Gpu, node: Node) -> dict[str, Attribute]:
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
    attrs = {"type": _string("gpu"), "uuid": _string(gpu.uuid), **_common_attributes(gpu, node)}
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
        **_common_attributes(gpu, node),
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
    for condition in _device_conditions(gpu, mig, conditions):
        taint = condition_taint(condition)
        if not any((t["key"], t.get("value")) == (taint["key"], taint.get("value")) for t in out):
            out.append(taint)
    return out[:MAX_TAINTS]


def _device_conditions(
    gpu: Gpu, mig: MigDevice | None, conditions: Iterable[ConditionView]
) -> list[ConditionView]:
    """The conditions that overlap one device, the most severe first."""
    gi = mig.gi_id if mig is not None else None
    ci = mig.ci_id if mig is not None else None
    return sorted(
        (c for c in conditions if c.gpu_uuid == gpu.uuid and overlaps(c.gi, c.ci, gi, ci)),
        key=lambda c: (SEVERITY[c.recovery], c.since, c.name),
    )


def unhealthy_devices(
    node: Node, conditions: Sequence[ConditionView], exclude: Container[str] = ()
) -> dict[str, tuple[str, ...]]:
    """The devices `build_slices(taints=False)` leaves out as unhealthy, each with the names of its
    conditions (the most severe first); those in `exclude` are left out for another reason."""
    out: dict[str, tuple[str, ...]] = {}
    for gpu, mig, name in dra_devices(node):
        hits = _device_conditions(gpu, mig, conditions)
        if hits and name not in exclude:
            out[name] = tuple(dict.fromkeys(c.name for c in hits))
    return out


# ---------------------------------------------------------------------------------- slices


@dataclass(frozen=True)
class PoolWant:
    """What the pool should show, as the main loop sees it (the publisher's input).

    `publish` False: the node is not a DRA node now; every slice of this node and driver goes.
    `wait`: why not to publish yet (the device plugin's workers are still running after a switch:
    a device they hand out now must not also be offered here); nothing is written meanwhile.
    """

    publish: bool
    node: Node | None = None
    conditions: tuple[ConditionView, ...] = ()
    wait: str = ""
    memory_sharing: MemoryPolicy | None = None  # gpuvisor.dra.memorySharing: full GPUs shared by memory


def build_slices(
    node: Node,
    conditions: Sequence[ConditionView],
    *,
    node_name: str,
    generation: int = 1,
    taints: bool = True,
    driver: str = DRIVER,
    exclude: Container[str] = (),
    memory_sharing: MemoryPolicy | None = None,
) -> list[dict[str, Any]]:
    """The pool's ResourceSlice objects (without owner references: the publisher adds the Node's UID).

    `generation` is the pool's (the publisher bumps it for each new content); `taints=False`
    leaves unhealthy devices out instead of tainting them; `exclude` names devices left out
    (held by containers of the device plugin this node ran before); `memory_sharing` publishes
    each full GPU for several claims by memory (supervisor.dra.memshare).
    """
    devices: list[dict[str, Any]] = []
    for gpu, mig, name in dra_devices(node):
        if name in exclude:
            continue
        device = gpu_device(gpu, node, name) if mig is None else mig_device(gpu, mig, node, name)
        if mig is None and memory_sharing is not None:
            share(device, gpu.memory_mib << 20, memory_sharing)
        marks = device_taints(gpu, mig, conditions)
        if marks and not taints:
            continue
        if marks:
            device["taints"] = marks
        devices.append(device)
    tainted = any("taints" in d for d in devices)
    size = MAX_DEVICES_WITH_TAINTS if tainted else MAX_DEVICES
    chunks = [devices[i : i + size] for i in range(0, len(devices), size)] or [[]]
    return [
        {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "metadata": {"generateName": f"{node_name}-{driver}-"},
            "spec": {
                "driver": driver,
                "pool": {"name": node_name, "generation": generation, "resourceSliceCount": len(chunks)},
                "nodeName": node_name,
                "devices": chunk,
            },
        }
        for chunk in chunks
    ]


# ---------------------------------------------------------------------------------- the API server's rules


def _qualified_name_problem(name: str) -> str:
    """resource.k8s.io's QualifiedName: an optional DNS-subdomain domain, then a C identifier."""
    domain, sep, ident = name.rpartition("/")
    if sep and (len(domain) > MAX_DOMAIN_LENGTH or not _DNS_SUBDOMAIN.fullmatch(domain)):
        return f"domain {domain!r} is not a DNS subdomain of at most {MAX_DOMAIN_LENGTH} characters"
    if len(ident) > MAX_ID_LENGTH or not _C_IDENTIFIER.fullmatch(ident):
        return f"{ident!r} is not a C identifier of at most {MAX_ID_LENGTH} characters"
    return ""


def _taint_problems(taints: Any, where: str) -> list[str]:
    if not isinstance(taints, list):
        return [f"{where}.taints: not a list"]
    problems = []
    if len(taints) > MAX_TAINTS:
        problems.append(f"{where}.taints: {len(taints)} taints, at most {MAX_TAINTS}")
    for j, taint in enumerate(taints):
        at = f"{where}.taints[{j}]"
        key = taint.get("key", "") if isinstance(taint, Mapping) else ""
        prefix, _, label = key.rpartition("/")
        if (
            not _LABEL_NAME.fullmatch(label)
            or len(label) > 63
            or (prefix and not _DNS_SUBDOMAIN.fullmatch(prefix))
        ):
            problems.append(f"{at}.key: {key!r} is not a label name")
        value = taint.get("value", "") if isinstance(taint, Mapping) else ""
        if len(value) > 63 or not _LABEL_VALUE.fullmatch(value):
            problems.append(f"{at}.value: {value!r} is not a label value")
        if isinstance(taint, Mapping) and taint.get("effect") not in ("NoSchedule", "NoExecute"):
            problems.append(f"{at}.effect: {taint.get('effect')!r} is not NoSchedule or NoExecute (1.34)")
    return problems


def slice_problems(obj: Mapping[str, Any]) -> list[str]:
    """What the API server would reject in this ResourceSlice beyond its JSON schema; [] when none."""
    spec = obj.get("spec")
    if not isinstance(spec, Mapping):
        return ["spec: missing"]
    problems: list[str] = []
    driver = spec.get("driver", "")
    if not isinstance(driver, str) or len(driver) > 63 or not _DNS_SUBDOMAIN.fullmatch(driver):
        problems.append(f"spec.driver: {driver!r} is not a DNS subdomain of at most 63 characters")
    pool = spec.get("pool", {})
    pool_name = pool.get("name", "") if isinstance(pool, Mapping) else ""
    if not pool_name or len(pool_name) > 253:
        problems.append(f"spec.pool.name: {pool_name!r} must have 1 to 253 characters")
    devices = spec.get("devices", [])
    if not isinstance(devices, list):
        return [*problems, "spec.devices: not a list"]
    tainted = any(isinstance(d, Mapping) and d.get("taints") for d in devices)
    limit = MAX_DEVICES_WITH_TAINTS if tainted else MAX_DEVICES
    if len(devices) > limit:
        problems.append(f"spec.devices: {len(devices)} devices, at most {limit}")
    names: set[str] = set()
    for i, device in enumerate(devices):
        where = f"spec.devices[{i}]"
        if not isinstance(device, Mapping):
            problems.append(f"{where}: not an object")
            continue
        name = device.get("name", "")
        if not isinstance(name, str) or len(name) > 63 or not _DNS_LABEL.fullmatch(name):
            problems.append(f"{where}.name: {name!r} is not a DNS label")
        elif name in names:
            problems.append(f"{where}.name: {name!r} appears twice in the slice")
        names.add(str(name))
        attrs = device.get("attributes", {})
        capacity = device.get("capacity", {})
        if len(attrs) + len(capacity) > MAX_ATTRIBUTES_AND_CAPACITIES:
            problems.append(
                f"{where}: {len(attrs)} attributes and {len(capacity)} capacities, at most "
                f"{MAX_ATTRIBUTES_AND_CAPACITIES} together"
            )
        for key in [*attrs, *capacity]:
            why = _qualified_name_problem(key)
            if why:
                problems.append(f"{where}: {key!r}: {why}")
        for key, attr in attrs.items():
            kinds = [k for k in ("int", "bool", "string", "version") if k in attr]
            if len(kinds) != 1:
                problems.append(f"{where}.attributes[{key!r}]: exactly one of int, bool, string, version")
                continue
            value = attr[kinds[0]]
            if kinds[0] in ("string", "version") and len(value) > MAX_VALUE_LENGTH:
                problems.append(f"{where}.attributes[{key!r}]: longer than {MAX_VALUE_LENGTH} characters")
            if kinds[0] == "version" and not _SEMVER.fullmatch(value):
                problems.append(f"{where}.attributes[{key!r}]: {value!r} is not semver 2.0")
        if "taints" in device:
            problems.extend(_taint_problems(device["taints"], where))
        problems.extend(capacity_problems(device, where))
    return problems
