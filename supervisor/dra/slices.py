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
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from common.model import Node
from supervisor.dra.devices import (
    MAX_TAINTS,
    device_conditions,
    device_taints,
    gpu_device,
    mig_device,
)
from supervisor.dra.memshare import MemoryPolicy, capacity_problems, share
from supervisor.dra.partitions import part_specs, parts
from supervisor.health.book import ConditionView
from supervisor.node.draplan import DRIVER, dra_devices

API_VERSION = "resource.k8s.io/v1"
KIND = "ResourceSlice"
MAX_DEVICES = 128  # ResourceSliceMaxDevices
MAX_DEVICES_WITH_TAINTS = 64  # 1.35: a slice whose devices carry taints or consume counters
MAX_ATTRIBUTES_AND_CAPACITIES = 32
MAX_VALUE_LENGTH = 64  # DeviceAttributeMaxValueLength (strings and versions)
MAX_ID_LENGTH = 32  # DeviceMaxIDLength: an attribute name's part after the domain
MAX_DOMAIN_LENGTH = 63

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_C_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_LABEL_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_SEMVER = re.compile(
    r"(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)"
    r"(-[0-9A-Za-z-]+(\.[0-9A-Za-z-]+)*)?(\+[0-9A-Za-z-]+(\.[0-9A-Za-z-]+)*)?"
)


def unhealthy_devices(
    node: Node, conditions: Sequence[ConditionView], exclude: Container[str] = ()
) -> dict[str, tuple[str, ...]]:
    """The devices `build_slices(taints=False)` leaves out as unhealthy, each with the names of its
    conditions (the most severe first); those in `exclude` are left out for another reason."""
    out: dict[str, tuple[str, ...]] = {}
    for gpu, mig, name in dra_devices(node):
        hits = device_conditions(gpu, mig, conditions)
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
    partitions: bool = False  # gpuvisor.dra.migOnDemand: MIG-capable GPUs published partitionable


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
    layout: str = "",
) -> list[dict[str, Any]]:
    """The pool's ResourceSlice objects (without owner references: the publisher adds the Node's UID).

    `generation` is the pool's (the publisher bumps it for each new content); `taints=False`
    leaves unhealthy devices out instead of tainting them; `exclude` names devices left out
    (held by containers of the device plugin this node ran before); `memory_sharing` publishes
    each full GPU for several claims by memory (supervisor.dra.memshare); `layout` publishes
    partitionable GPUs (gpuvisor.dra.migOnDemand) in that layout (supervisor.dra.partitions), ""
    as plain full GPUs (an API server that drops shared counters).
    """
    devices: list[dict[str, Any]] = []
    for gpu, mig, name in dra_devices(node):
        if name in exclude or (layout and gpu.mig_options):
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
    specs: list[dict[str, Any]] = [{"devices": devices[i : i + size]} for i in range(0, len(devices), size)]
    if layout:
        specs += part_specs(parts(node, conditions, taints=taints, exclude=exclude), layout)
    specs = specs or [{"devices": []}]
    return [
        {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "metadata": {"generateName": f"{node_name}-{driver}-"},
            "spec": {
                "driver": driver,
                "pool": {"name": node_name, "generation": generation, "resourceSliceCount": len(specs)},
                "nodeName": node_name,
                **part,
            },
        }
        for part in specs
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
