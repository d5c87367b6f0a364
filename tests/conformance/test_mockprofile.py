"""NVIDIA's mock NVML node profiles (`../shared/mocknvml/configs`) as the simulator's loader reads them.

Every node of the real-binding tier that comes from NVIDIA's profiles passes through
`supervisor/sim/nvml/mockprofile.py`. Here the discovered node (over the simulator, which
test_realnvml.py holds the fake library equal to) is checked against the profile file read
independently (`expected_node`, with the mock's own rules), so the translation cannot invent or
drop what NVIDIA's profile says.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pytest
import yaml

from common.model import Node
from supervisor.node.nvml import Nvml, sysfs_bus_id
from supervisor.sim.nvml import Simulator
from tests import fakenvml

MIB = 1024 * 1024
PROFILES = fakenvml.mock_profiles()


@dataclass(frozen=True)
class ExpectedGpu:
    index: int
    uuid: str
    bus_id: str  # as the profile writes it: "0000:07:00.0"
    numa_node: int | None
    name: str
    memory_mib: int
    minor: int
    compute_capability: tuple[int, int]


@dataclass(frozen=True)
class ExpectedNode:
    gpus: tuple[ExpectedGpu, ...]
    driver_version: str
    cuda_driver_version: int  # NVML's encoding: major * 1000 + minor * 10
    nvlinks_per_pair: int  # NVLinks between any two GPUs (all pairs alike in NVIDIA's profiles)


def _merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = (
            _merge(out[key], value)
            if isinstance(value, Mapping) and isinstance(out.get(key), Mapping)
            else value
        )
    return out


def expected_node(profile: str) -> ExpectedNode:
    """The node as the profile file describes it, read with the mock's own rules: a device entry is
    merged over `device_defaults`; a device's NUMA node is its `pcie_topology` root complex's;
    NVLinks exist only through the declared NVSwitches (`links_per_gpu` links per GPU)."""
    with open(fakenvml.mock_config(profile), encoding="utf-8") as fh:
        data: dict[str, Any] = yaml.safe_load(fh)
    system = data["system"]
    numa = {
        dev.lower(): int(rc["numa_node"])
        for rc in (data.get("pcie_topology") or {}).get("root_complexes", [])
        for dev in rc.get("devices", [])
    }
    gpus = []
    for entry in data["devices"]:
        dev = _merge(data.get("device_defaults") or {}, entry)
        bus_id = str(dev["pci"]["bus_id"])
        cc = dev["compute_capability"]
        gpus.append(
            ExpectedGpu(
                index=int(dev["index"]),
                uuid=str(dev["uuid"]),
                bus_id=bus_id,
                numa_node=numa.get(bus_id.lower()),
                name=str(dev["name"]),
                memory_mib=int(dev["memory"]["total_bytes"]) // MIB,
                minor=int(dev["minor_number"]),
                compute_capability=(int(cc["major"]), int(cc["minor"])),
            )
        )
    nvlink = data.get("nvlink") or {}
    return ExpectedNode(
        gpus=tuple(sorted(gpus, key=lambda g: g.index)),
        driver_version=str(system["driver_version"]),
        cuda_driver_version=int(system["cuda_version_major"]) * 1000 + int(system["cuda_version_minor"]) * 10,
        nvlinks_per_pair=int(nvlink.get("links_per_gpu") or 0) if nvlink.get("switches") else 0,
    )


def discovered(profile: str) -> Node:
    nvml = Nvml(Simulator(fakenvml.spec_for(profile)), sysfs_root=None)
    nvml.init()
    return nvml.discover()


@pytest.fixture(params=PROFILES or ["(none)"])
def profile(request: pytest.FixtureRequest) -> str:
    if not PROFILES:
        pytest.skip(
            f"NVIDIA's mock NVML profiles are not here ({fakenvml.MOCK_CONFIGS}; set GPUVISOR_MOCKNVML_DIR)"
        )
    return str(request.param)


def test_gpu_identity_matches_the_profile(profile: str) -> None:
    """Every GPU of the profile, by index: UUID, PCI bus id, name, memory, minor, compute capability."""
    node, want = discovered(profile), expected_node(profile)
    got = [
        (g.index, g.uuid, sysfs_bus_id(g.pci_bus_id), g.name, g.memory_mib, g.minor, g.compute_capability)
        for g in node.gpus
    ]
    expected = [
        (g.index, g.uuid, g.bus_id.lower(), g.name, g.memory_mib, g.minor, g.compute_capability)
        for g in want.gpus
    ]
    assert got == expected


def test_numa_nodes_match_the_profile(profile: str) -> None:
    """Each GPU's NUMA node is its root complex's in the profile's pcie_topology."""
    node, want = discovered(profile), expected_node(profile)
    assert [g.numa_node for g in node.gpus] == [g.numa_node for g in want.gpus]
    assert all(g.numa_node is not None for g in want.gpus), "the profile names every GPU's root complex"


def test_nvlinks_match_the_profile(profile: str) -> None:
    """NVLinks between every GPU pair: links_per_gpu through the profile's NVSwitches, none without."""
    node, want = discovered(profile), expected_node(profile)
    count = len(want.gpus)
    assert sorted((link.a, link.b) for link in node.links) == [
        (a, b) for a in range(count) for b in range(a + 1, count)
    ]
    assert {link.nvlinks for link in node.links} == {want.nvlinks_per_pair}


def test_pci_ancestors_follow_the_root_complexes(profile: str) -> None:
    """Two GPUs under one root complex share a host bridge; on different NUMA nodes, the system."""
    node, want = discovered(profile), expected_node(profile)
    numa = {g.index: g.numa_node for g in want.gpus}
    for link in node.links:
        if numa[link.a] != numa[link.b]:
            assert link.ancestor == 50, link  # NVML_TOPOLOGY_SYSTEM
        else:
            assert link.ancestor in (30, 40), link  # HOSTBRIDGE or NODE


def test_driver_and_cuda_versions_match_the_profile(profile: str) -> None:
    """The driver version string and the CUDA driver version (major*1000 + minor*10) of the profile."""
    node, want = discovered(profile), expected_node(profile)
    assert (node.driver_version, node.cuda_driver_version) == (want.driver_version, want.cuda_driver_version)
