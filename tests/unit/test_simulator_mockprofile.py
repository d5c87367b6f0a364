"""The simulator's reading of NVIDIA's mock NVML profile format (supervisor/sim/nvml/mockprofile.py),
on small documents written here; NVIDIA's own profiles are checked in the conformance tier."""

from __future__ import annotations

import copy
from typing import Any

import pynvml
import pytest
import yaml

from supervisor.node.nvml import Nvml
from supervisor.sim.nvml import Simulator, SimulatorConfigError
from supervisor.sim.nvml.config import parse_spec

DOC: dict[str, Any] = {
    "version": "1.0",
    "system": {
        "driver_version": "550.163.01",
        "nvml_version": "12.550.163.01",
        "cuda_version_major": 12,
        "cuda_version_minor": 4,
    },
    "device_defaults": {
        "name": "NVIDIA H100 80GB HBM3",
        "brand": "nvidia",
        "architecture": "hopper",
        "compute_capability": {"major": 9, "minor": 0},
        "memory": {"total_bytes": 85899345920},
        "pci": {"device_id": 0x233010DE},
        "ecc": {"mode_current": "enabled"},
        "mig": {"mode_current": "disabled", "max_gpu_instances": 7},
        "fabric": {"cluster_uuid": "00000000-0000-0000-0000-000000000001", "clique_id": 3, "state": "auto"},
    },
    "devices": [
        {
            "index": 0,
            "uuid": "GPU-12345678-1234-1234-1234-123456780000",
            "pci": {"bus_id": "0000:07:00.0"},
            "minor_number": 0,
        },
        {
            "index": 1,
            "uuid": "GPU-12345678-1234-1234-1234-123456780001",
            "pci": {"bus_id": "0000:0F:00.0"},
            "minor_number": 1,
        },
        {
            "index": 2,
            "uuid": "GPU-12345678-1234-1234-1234-123456780002",
            "pci": {"bus_id": "0000:87:00.0"},
            "minor_number": 2,
        },
    ],
    "nvlink": {"links_per_gpu": 18, "switches": [{"bdf": "0000:05:00.0"}, {"bdf": "0000:06:00.0"}]},
    "pcie_topology": {
        "root_complexes": [
            {"id": "pci0000:00", "numa_node": 0, "devices": ["0000:07:00.0", "0000:0F:00.0"]},
            {"id": "pci0000:80", "numa_node": 1, "devices": ["0000:87:00.0"]},
        ]
    },
}


def sim_of(doc: dict[str, Any]) -> Simulator:
    sim = Simulator(parse_spec(yaml.safe_dump(doc), "mock-nvml-config-test.yaml"))
    sim.nvmlInit()
    return sim


def test_the_profile_becomes_the_same_node_in_the_simulators_terms() -> None:
    """Versions, GPUs (defaults merged under each device), NUMA from the root complexes, host bridge
    within a root complex and system across NUMA nodes, links_per_gpu NVLinks through the switches."""
    sim = sim_of(DOC)
    spec = sim.spec
    assert (spec.driver_version, spec.cuda_driver_version, spec.nvml_version_text) == (
        "550.163.01",
        12040,
        "12.550.163.01",
    )
    assert [g.numa_node for g in spec.gpus] == [0, 0, 1]
    assert [g.memory_mib for g in spec.gpus] == [81920] * 3
    node = Nvml(sim, sysfs_root=None).discover()
    assert [(link.a, link.b, link.ancestor, link.nvlinks) for link in node.links] == [
        (0, 1, 30, 18), (0, 2, 50, 18), (1, 2, 50, 18)
    ]  # fmt: skip
    h = sim.nvmlDeviceGetHandleByIndex(0)
    assert sim.nvmlDeviceGetArchitecture(h) == 9 and sim.nvmlDeviceGetBrand(h) == 14


def test_mig_capability_ecc_and_fabric_follow_the_profile() -> None:
    """max_gpu_instances > 0 makes a GPU MIG-capable (mode as mode_current); ECC events only where
    ECC is enabled; a fabric in state auto is completed."""
    doc = copy.deepcopy(DOC)
    doc["devices"][1]["mig"] = {"max_gpu_instances": 0}
    doc["devices"][2]["ecc"] = {"mode_current": "disabled"}
    sim = sim_of(doc)
    handles = [sim.nvmlDeviceGetHandleByIndex(i) for i in range(3)]
    assert sim.nvmlDeviceGetMigMode(handles[0]) == [0, 0]
    with pytest.raises(pynvml.NVMLError_NotSupported):
        sim.nvmlDeviceGetMigMode(handles[1])
    assert sim.nvmlDeviceGetSupportedEventTypes(handles[0]) == 11
    assert sim.nvmlDeviceGetSupportedEventTypes(handles[2]) == pynvml.nvmlEventTypeXidCriticalError
    fabric = sim.spec.gpus[0].fabric
    assert fabric is not None and (fabric.state, fabric.clique_id) == (
        pynvml.NVML_GPU_FABRIC_STATE_COMPLETED,
        3,
    )


def test_a_profile_missing_what_cannot_be_invented_is_refused_with_the_key() -> None:
    """A device without a PCI bus id, or per-device NVLinks, is an error naming the key, not a guess."""
    doc = copy.deepcopy(DOC)
    del doc["devices"][1]["pci"]
    with pytest.raises(SimulatorConfigError) as err:
        sim_of(doc)
    assert err.value.key == "devices[1].pci.bus_id"
    doc = copy.deepcopy(DOC)
    doc["devices"][0]["nvlink"] = [{"peer": 1}]
    with pytest.raises(SimulatorConfigError) as err:
        sim_of(doc)
    assert err.value.key == "devices[0].nvlink"
