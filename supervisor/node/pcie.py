"""A GPU's place in the host's PCIe tree, read from sysfs as NVIDIA's DRA driver reads it.

- `pcie_root(sysfs, bus_id)`: the PCIe root complex ("pci0000:00") the device hangs under, as
  k8s.io/dynamic-resource-allocation's `deviceattribute.GetPCIeRootAttributeByPCIBusID` resolves
  it (pci_linux.go, `resolvePCIeRoot`): the bus id must be extended BDF in lower case
  ("0000:04:1f.0"); `<sysfs>/bus/pci/devices/<bus id>` is a symlink whose target, taken relative
  to that directory, must lie under `devices/pci...` and end with the bus id; the root is the
  first path part after `devices/`. Only the link is read, never followed, so an absolute target
  is refused as that function refuses it.
- `pci_numa_node(sysfs, bus_id)`: `<sysfs>/bus/pci/devices/<bus id>/numa_node` as go-nvlib's
  nvpci parses it (a signed integer, base prefixes allowed); None where it is missing, not a
  number, or negative (-1: no NUMA affinity), where NVIDIA's driver publishes no NUMA node.

Both take the bus id as go-nvlib's `GetPCIBusID` writes it (`nvlib_bus_id`); what cannot be read
is None, never an exception: the attribute is then left out, as NVIDIA leaves it out.
"""

from __future__ import annotations

import os
import re
from pathlib import Path, PurePosixPath

_BDF = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-9a-f]")  # verifyPCIBDFFormat
_LONG_DOMAIN = re.compile(r"0{4}[0-9a-f]{4}:")
_MAX_READ = 64  # a numa_node file holds a few characters; never read more


def nvlib_bus_id(nvml_bus_id: str) -> str:
    """NVML's bus id as go-nvlib's GetPCIBusID gives it: lower case, an 8-digit domain cut to 4
    ("00000000:BD:00.0" -> "0000:bd:00.0")."""
    text = nvml_bus_id.strip().lower()
    return text[4:] if _LONG_DOMAIN.match(text) else text


def pcie_root(sysfs: Path, bus_id: str) -> str | None:
    """The PCIe root complex of the device `bus_id` (go-nvlib form), or None where sysfs says none."""
    if not _BDF.fullmatch(bus_id):
        return None
    link = PurePosixPath("bus", "pci", "devices", bus_id)
    try:
        target = os.readlink(sysfs / link)
    except (OSError, ValueError):
        return None
    if target.startswith("/"):
        return None  # filepath.Join keeps it absolute: it cannot start with devices/pci
    resolved = os.path.normpath(str(link.parent / target))
    if not resolved.startswith("devices/pci") or PurePosixPath(resolved).name != bus_id:
        return None
    return resolved.removeprefix("devices/").split("/", 1)[0]


def pci_numa_node(sysfs: Path, bus_id: str) -> int | None:
    """The device's NUMA node from sysfs, or None (missing, unreadable, or -1: no affinity)."""
    try:
        with open(sysfs / "bus/pci/devices" / bus_id / "numa_node", "rb") as f:
            text = f.read(_MAX_READ).decode("ascii").strip()
        value = int(text, 0)
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return value if value >= 0 else None
