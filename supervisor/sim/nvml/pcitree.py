"""The simulated node's PCIe tree: where each GPU hangs in sysfs, written out to a directory.

A description gives each GPU's root complex (`pcie_root`: "pci0000:00"; by default the GPU's own
domain and its bus rounded down to a multiple of 16, "00000000:2A:00.0" -> "pci0000:20") beside
its NUMA node; `write_sysfs(spec.gpus, root)` lays the GPUs out under `root` as Linux does under /sys:

    <root>/devices/<pcie root>/<domain>:<root bus>:<port>.0/<bus id>/
        numa_node vendor device class subsystem_vendor subsystem_device
    <root>/bus/pci/devices/<bus id> -> ../../../devices/<pcie root>/<port>/<bus id>

with one root port per GPU (ports 01, 02, ... in GPU order within a root complex). The NVML
adapter given `sysfs_root=<root>` then reads each GPU's PCIe root complex and NUMA node as it
reads them on a host (`supervisor.node.pcie`), and the labeller its PCI class. A GPU without a
NUMA node gets -1, as Linux writes it. `ADDRESSING_MODES` names nvmlDeviceAddressingModeType_t
for the description's `addressing_mode` key.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

PCIE_ROOT_RE = re.compile(r"pci[0-9a-f]{4}:[0-9a-f]{2}")
ADDRESSING_MODES = {"none": 0, "hmm": 1, "ats": 2}  # NVML_DEVICE_ADDRESSING_MODE_*
PCI_VENDOR_NVIDIA = 0x10DE


class PciGpu(Protocol):
    """What the tree needs of a GPU's description (`config.GpuSpec`)."""

    @property
    def pci_bus_id(self) -> str: ...
    @property
    def pcie_root(self) -> str: ...
    @property
    def numa_node(self) -> int | None: ...
    @property
    def pci_device_id(self) -> int: ...
    @property
    def pci_class(self) -> int: ...
    @property
    def pci_subsystem_id(self) -> int: ...


def sysfs_name(nvml_bus_id: str) -> str:
    """NVML's canonical "00000000:2A:00.0" as sysfs names the device: "0000:2a:00.0"."""
    domain, rest = nvml_bus_id.split(":", 1)
    return f"{int(domain, 16):04x}:{rest.lower()}"


def default_pcie_root(nvml_bus_id: str) -> str:
    """The root complex of a GPU whose description names none: its domain, its bus & ~0xF."""
    domain, bus, _ = nvml_bus_id.split(":", 2)
    return f"pci{int(domain, 16):04x}:{int(bus, 16) & 0xF0:02x}"


def write_sysfs(gpus: Iterable[PciGpu], root: str | Path) -> Path:
    """Write the PCIe tree of the GPUs (a `NodeSpec`'s `gpus`) under `root` (created; files there
    are replaced)."""
    base = Path(root)
    links = base / "bus/pci/devices"
    links.mkdir(parents=True, exist_ok=True)
    ports: dict[str, int] = {}
    for gpu in gpus:
        name = sysfs_name(gpu.pci_bus_id)
        ports[gpu.pcie_root] = ports.get(gpu.pcie_root, 0) + 1
        domain, root_bus = gpu.pcie_root.removeprefix("pci").split(":")
        port = f"{domain}:{root_bus}:{ports[gpu.pcie_root]:02x}.0"
        rel = Path("devices", gpu.pcie_root, port, name)
        device = base / rel
        device.mkdir(parents=True, exist_ok=True)
        files = {
            "numa_node": str(-1 if gpu.numa_node is None else gpu.numa_node),
            "vendor": f"0x{PCI_VENDOR_NVIDIA:04x}",
            "device": f"0x{gpu.pci_device_id >> 16:04x}",
            "class": f"0x{gpu.pci_class:06x}",
            "subsystem_vendor": f"0x{gpu.pci_subsystem_id & 0xFFFF:04x}",
            "subsystem_device": f"0x{gpu.pci_subsystem_id >> 16:04x}",
        }
        for file, text in files.items():
            (device / file).write_text(text + "\n")
        link = links / name
        if link.is_symlink() or link.exists():
            link.unlink()
        os.symlink(Path("../../..") / rel, link)
    return base
