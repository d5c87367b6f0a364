"""gpuvisor's published devices against NVIDIA's published attribute list, name by name.

The list is tests/data/nvidia_dra_attributes.json: every attribute and capacity NVIDIA's DRA
kubelet plugin (kubernetes-sigs/dra-driver-nvidia-gpu) publishes, with its type, the device kinds
that carry it, when it is there, and the file and line of tag v0.4.1 and of main (commit
95932046) it was read from: `cmd/gpu-kubelet-plugin/deviceinfo.go` (`GpuInfo.Attributes` at
main:170, the MIG device's `GetDevice` at main:258, `addNumaNodeAttribute` at main:333),
`mig.go` (`CommonCapacitiesMig` at 118, `CommonAttributesMig` at 139) and `partitions.go`
(`fullGpuCapacity` at 34). NVIDIA's values come from the sources the data names: NVML for the
identity and versions, the GPU instance profile for a MIG device's capacities, sysfs for the PCIe
root and NUMA node, `nvmlDeviceGetAddressingMode` for the addressing mode. The expected values
here are computed from the simulator's own NVML answers and its node description by those rules,
not from gpuvisor's code.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from common.model import Node
from supervisor.dra.slices import build_slices
from supervisor.node.nvml import Nvml
from supervisor.sim.nvml import Simulator, load_simulator
from supervisor.sim.nvml.config import NodeSpec
from tests.kubeapi.validation import resource_slice_problems

DATA = Path(__file__).resolve().parents[1] / "data" / "nvidia_dra_attributes.json"
VALUE_KEY = {"string": "string", "int": "int", "version": "version", "bool": "bool"}
# Attributes and capacities gpuvisor publishes that NVIDIA's driver does not, each with the reason.
# None today: a selector written for NVIDIA's driver sees exactly NVIDIA's names.
EXTENSIONS: dict[str, str] = {}
MODES = {0: "None", 1: "HMM", 2: "ATS"}  # go-nvlib GetAddressingModeAsString


def nvidia_entries(kind: str, *, gated: bool = False) -> list[dict[str, Any]]:
    """NVIDIA's entries for a device kind; those behind a feature gate (off by default) only if asked."""
    rows = json.loads(DATA.read_text())["entries"]
    return [r for r in rows if kind in r["devices"] and r["when"].startswith("gate:") == gated]


def coherent_mig_node(tmp_path: Path) -> tuple[Simulator, Node]:
    """mig-a100 (GPUs 0-3 in MIG mode, 4-7 whole) with GPUs 0, 1 and 4 reporting ATS, HMM and None
    addressing (the others NotSupported), discovered over its PCIe tree."""
    spec: NodeSpec = load_simulator("mig-a100").spec
    gpus = list(spec.gpus)
    for index, mode in ((0, 2), (1, 1), (4, 0)):
        gpus[index] = dataclasses.replace(gpus[index], addressing_mode=mode)
    sim = Simulator(dataclasses.replace(spec, gpus=tuple(gpus)))
    sysfs = sim.write_sysfs(tmp_path / "sys")
    nvml = Nvml(sim, sysfs_root=sysfs)
    nvml.init()
    return sim, nvml.discover()


def published(node: Node) -> dict[str, dict[str, Any]]:
    slices = build_slices(node, [], node_name="node-a")
    for i, obj in enumerate(slices):
        named = copy.deepcopy(obj)
        named["metadata"]["name"] = f"node-a-gpu.nvidia.com-{i}"
        assert resource_slice_problems(named) == []  # the fake API server's schema and rules
    return {d["name"]: d for s in slices for d in s["spec"]["devices"]}


def kind_of(device: dict[str, Any]) -> str:
    return str(device["attributes"]["type"]["string"])


def quantity(n: int) -> str:
    """resource.NewQuantity(n, BinarySI).String() for the whole numbers NVIDIA publishes."""
    for suffix, shift in (("Ei", 60), ("Pi", 50), ("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10)):
        if n and n % (1 << shift) == 0:
            return f"{n >> shift}{suffix}"
    return str(n)


def semver(text: str) -> str:
    parts = [str(int(p)) for p in text.split(".")]
    return ".".join(parts + ["0"] * (3 - len(parts)))


def nvidia_values(sim: Simulator, spec_gpu: Any, mig_handle: Any = None) -> dict[str, Any]:
    """The values NVIDIA's driver would publish for a GPU (or one of its MIG devices), from NVML
    and the node description by the rules of its source."""
    h = sim.nvmlDeviceGetHandleByIndex(spec_gpu.index)
    bus = sim.nvmlDeviceGetPciInfo(h).busId
    bus = bus.decode() if isinstance(bus, bytes) else str(bus)
    cuda = sim.nvmlSystemGetCudaDriverVersion()
    major, minor = sim.nvmlDeviceGetCudaComputeCapability(h)
    attrs: dict[str, Any] = {
        "productName": sim.nvmlDeviceGetName(h),
        "cudaComputeCapability": semver(f"{major}.{minor}"),
        "driverVersion": semver(sim.nvmlSystemGetDriverVersion()),
        "cudaDriverVersion": semver(f"{cuda // 1000}.{cuda % 1000 // 10}"),
        "resource.kubernetes.io/pciBusID": bus.lower()[4:],  # go-nvlib GetPCIBusID
        "resource.kubernetes.io/pcieRoot": spec_gpu.pcie_root,
        "resource.kubernetes.io/numaNode": spec_gpu.numa_node,
    }
    if spec_gpu.addressing_mode is not None:
        attrs["addressingMode"] = MODES[spec_gpu.addressing_mode]
    if mig_handle is None:
        attrs |= {"type": "gpu", "uuid": sim.nvmlDeviceGetUUID(h)}
        return {"attributes": attrs, "capacity": {"memory": quantity(sim.nvmlDeviceGetMemoryInfo(h).total)}}
    gi = sim.nvmlDeviceGetGpuInstanceById(h, sim.nvmlDeviceGetGpuInstanceId(mig_handle))
    info = sim.nvmlGpuInstanceGetInfo(gi)
    profiles = [sim.nvmlDeviceGetGpuInstanceProfileInfo(h, p) for p in range(sim.NVML_GPU_INSTANCE_PROFILE_COUNT)
                if _answers(sim, h, p)]  # fmt: skip
    (profile,) = [p for p in profiles if p.id == info.profileId]
    attrs |= {
        "type": "mig",
        "uuid": sim.nvmlDeviceGetUUID(mig_handle),
        "parentUUID": sim.nvmlDeviceGetUUID(h),
    }
    capacity = {
        "multiprocessors": quantity(profile.multiprocessorCount),
        "copyEngines": quantity(profile.copyEngineCount),
        "decoders": quantity(profile.decoderCount),
        "encoders": quantity(profile.encoderCount),
        "jpegEngines": quantity(profile.jpegCount),
        "ofaEngines": quantity(profile.ofaCount),
        "memory": quantity(profile.memorySizeMB * 1024 * 1024),
    }
    start, size = info.placement.start, info.placement.size
    capacity |= {f"memorySlice{i}": "1" for i in range(start, start + size)}
    return {"attributes": attrs, "capacity": capacity}


def _answers(sim: Simulator, h: Any, profile: int) -> bool:
    try:
        sim.nvmlDeviceGetGpuInstanceProfileInfo(h, profile)
    except sim.NVMLError:
        return False
    return True


def mig_handles(sim: Simulator, index: int) -> dict[str, Any]:
    h = sim.nvmlDeviceGetHandleByIndex(index)
    out = {}
    for j in range(sim.nvmlDeviceGetMaxMigDeviceCount(h)):
        try:
            m = sim.nvmlDeviceGetMigDeviceHandleByIndex(h, j)
        except sim.NVMLError:
            continue
        out[sim.nvmlDeviceGetUUID(m)] = m
    return out


def names_and_types(device: dict[str, Any]) -> tuple[dict[str, str], set[str]]:
    attrs = {name: next(iter(value)) for name, value in device["attributes"].items()}
    return attrs, set(device["capacity"])


@pytest.mark.parametrize("kind", ["gpu", "mig"])
def test_every_nvidia_attribute_and_capacity_is_published_with_its_type(tmp_path: Path, kind: str) -> None:
    """Every entry of NVIDIA's list for the device kind (not behind a feature gate) is on every such
    device gpuvisor publishes, with NVIDIA's type: those NVIDIA always publishes, the sysfs ones over
    a PCIe tree, `addressingMode` where NVML reports one, a `memorySlice<i>` per placement slice."""
    sim, node = coherent_mig_node(tmp_path)
    devices = [d for d in published(node).values() if kind_of(d) == kind]
    assert devices
    by_uuid = {g.uuid: g for g in sim.spec.gpus}
    for device in devices:
        attrs, capacity = names_and_types(device)
        parent = device["attributes"].get("parentUUID", device["attributes"]["uuid"])["string"]
        gpu_spec = by_uuid[parent]
        for entry in nvidia_entries(kind):
            name, when = entry["name"], entry["when"]
            if when == "nvml" and gpu_spec.addressing_mode is None:
                assert name not in attrs, (device["name"], name)
                continue
            if when == "placement":
                assert any(c.startswith("memorySlice") for c in capacity), device["name"]
                continue
            if entry["kind"] == "attribute":
                assert attrs.get(name) == VALUE_KEY[entry["type"]], (device["name"], name)
            else:
                assert name in capacity, (device["name"], name)


@pytest.mark.parametrize("kind", ["gpu", "mig"])
def test_gpuvisor_publishes_nothing_nvidia_does_not_except_listed_extensions(
    tmp_path: Path, kind: str
) -> None:
    """Every attribute and capacity gpuvisor publishes is one of NVIDIA's for that device kind, or a
    deliberate extension named in EXTENSIONS with its reason; no feature-gated one is published."""
    _, node = coherent_mig_node(tmp_path)
    known = {e["name"] for e in nvidia_entries(kind)}
    gated = {e["name"] for e in nvidia_entries(kind, gated=True)}
    for device in (d for d in published(node).values() if kind_of(d) == kind):
        attrs, capacity = names_and_types(device)
        for name in [*attrs, *capacity]:
            generic = "memorySlice<i>" if name.startswith("memorySlice") else name
            assert generic not in gated, (device["name"], name)
            assert generic in known or name in EXTENSIONS, (device["name"], name)


def test_values_are_nvidias_on_the_simulated_node(tmp_path: Path) -> None:
    """Each GPU's and MIG device's attributes and capacities have the values NVIDIA's driver derives
    from the same NVML and sysfs (identity, versions in semver, go-nvlib's bus id, the PCIe root and
    NUMA node of the tree, the addressing mode by go-nvlib's name, the GPU instance profile's engines
    and memory, the placement's memory slices), as BinarySI quantities where NVIDIA writes them so."""
    sim, node = coherent_mig_node(tmp_path)
    devices = published(node)
    checked = 0
    for gpu_spec, gpu in zip(sim.spec.gpus, node.gpus, strict=True):
        handles = mig_handles(sim, gpu_spec.index) if gpu.mig_enabled else {}
        for device in devices.values():
            attrs = device["attributes"]
            own = attrs["uuid"]["string"]
            if own != gpu.uuid and own not in handles:
                continue
            want = nvidia_values(sim, gpu_spec, handles.get(own))
            got_attrs = {k: next(iter(v.values())) for k, v in attrs.items() if k in want["attributes"]}
            assert got_attrs == want["attributes"], device["name"]
            got_capacity = {k: v["value"] for k, v in device["capacity"].items()}
            assert got_capacity == want["capacity"], device["name"]
            checked += 1
    assert checked == len(devices) and checked > len(node.gpus)  # every device, MIG devices among them


def test_without_sysfs_the_sysfs_attributes_are_left_out() -> None:
    """A node whose GPUs have no sysfs here (a simulated node without its tree) publishes no
    `pcieRoot` and no `numaNode`, as NVIDIA's driver leaves them out where sysfs cannot resolve them;
    everything NVIDIA always publishes is still there."""
    nvml = Nvml(load_simulator("dgx-h100"), sysfs_root=None)
    nvml.init()
    for device in published(nvml.discover()).values():
        attrs, _ = names_and_types(device)
        assert (
            "resource.kubernetes.io/pcieRoot" not in attrs and "resource.kubernetes.io/numaNode" not in attrs
        )
        assert {
            e["name"] for e in nvidia_entries("gpu") if e["when"] == "always" and e["kind"] == "attribute"
        } <= set(attrs)


def test_the_list_names_its_source_lines() -> None:
    """Each entry of the test data names where in NVIDIA's source it was read (v0.4.1 or main), and
    the entries for one name and device kind are not repeated."""
    doc = json.loads(DATA.read_text())
    seen = set()
    for entry in doc["entries"]:
        assert entry["v0.4.1"] or entry["main"], entry
        for where in entry["v0.4.1"] + entry["main"]:
            path, _, line = where.rpartition(":")
            assert path.startswith("cmd/gpu-kubelet-plugin/") and line.isdigit(), where
        for kind in entry["devices"]:
            key = (entry["name"], entry["kind"], kind)
            assert key not in seen, key
            seen.add(key)
