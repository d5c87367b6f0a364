"""What GPU Feature Discovery reads about a node, as plain data, and GFD's rules for reading it.

`common.nvml.Nvml.node_facts()` fills it from NVML (and sysfs for the PCI class) with GFD's rules
for what may be missing; `supervisor.labels.compute_labels` turns it into labels. It is separate
from `common.model.Node` (what the device plugin advertises) because GFD reads a different set
(MIG capability, PCI class, fabric clique, MIG engine counts) and fails differently: discovery
skips a GPU it cannot describe, GFD writes no labels at all.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path

# PCI classes GFD recognises (go-nvlib nvpci: PCIVgaControllerClass, PCI3dControllerClass).
PCI_CLASS_VGA = 0x030000  # a GPU in graphics mode
PCI_CLASS_3D = 0x030200  # a GPU in compute mode
PCI_VENDOR_NVIDIA = 0x10DE
FABRIC_STATE_COMPLETED = 3  # NVML_GPU_FABRIC_STATE_COMPLETED


@dataclass(frozen=True)
class MigFacts:
    """One MIG device: its profile and `nvmlDeviceGetAttributes`."""

    profile: str  # as NVML names it: "1g.10gb", "1g.10gb+me", "1c.3g.40gb"
    memory_mib: int
    multiprocessors: int
    gi_slices: int
    ci_slices: int
    copy_engines: int
    decoders: int
    encoders: int
    jpegs: int
    ofas: int


@dataclass(frozen=True)
class FabricClique:
    """A GPU's completed NVLink fabric registration: the IMEX domain it belongs to."""

    cluster_uuid: str  # canonical lower-case UUID
    clique_id: str  # decimal


@dataclass(frozen=True)
class GpuFacts:
    """One physical GPU."""

    index: int
    name: str  # nvmlDeviceGetName, e.g. "NVIDIA A100-SXM4-80GB"
    memory_mib: int  # 0 when NVML could not tell (GFD then leaves the memory label out)
    compute_capability: tuple[int, int]
    mig_capable: bool
    mig_enabled: bool
    migs: tuple[MigFacts, ...] = ()
    pci_class: int | None = None  # None: unknown (no sysfs entry, or not a GPU class)
    fabric: FabricClique | None = None


@dataclass(frozen=True)
class NodeFacts:
    """The whole node. No GPU at all (or NVML down with --fail-on-init-error=false) is `gpus=()`."""

    driver_version: str = ""  # "550.54.15"; read only when there are GPUs, as GFD does
    cuda_driver_version: int = 0  # nvmlSystemGetCudaDriverVersion: 12040 is CUDA 12.4
    gpus: tuple[GpuFacts, ...] = ()


def pci_gpu_class(value: int) -> int | None:
    """`value` if it is one of the two GPU classes GFD knows, else None (GFD: not a GPU)."""
    return value if value in (PCI_CLASS_VGA, PCI_CLASS_3D) else None


def sysfs_pci_name(nvml_bus_id: str) -> str:
    """go-nvlib GetPCIBusID: NVML's "00000000:18:00.0" as sysfs names it, "0000:18:00.0"."""
    bus = nvml_bus_id.strip().lower()
    if len(bus.split(":", 1)[0]) == 8 and bus.startswith("0000"):
        bus = bus[4:]
    return bus


def read_pci_class(sysfs_root: Path, nvml_bus_id: str) -> int | None:
    """The PCI class GFD reads (go-nvlib nvpci: <sysfs>/bus/pci/devices/<id>/{vendor,class}).

    None when the device is missing, unreadable, not NVIDIA's, or not a GPU class; GFD then
    labels the mode "unknown" (where it does not crash on a non-GPU class, nvml-device.go).
    """
    device = sysfs_root / "bus/pci/devices" / sysfs_pci_name(nvml_bus_id)
    try:
        vendor = int((device / "vendor").read_text()[:32].strip(), 16)
        value = int((device / "class").read_text()[:32].strip(), 16)
    except (OSError, ValueError):
        return None
    return pci_gpu_class(value) if vendor == PCI_VENDOR_NVIDIA else None


def fabric_clique(cluster_uuid: bytes, clique_id: int, state: int, status: int) -> FabricClique | None:
    """go-nvlib IsFabricAttached: registration completed, a non-zero cluster UUID, status success."""
    if state != FABRIC_STATE_COMPLETED or not any(cluster_uuid) or status != 0:
        return None
    return FabricClique(str(uuid.UUID(bytes=cluster_uuid)), str(clique_id))
