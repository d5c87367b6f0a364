"""NVIDIA's mock NVML node profiles (`mock-nvml-config-<p>.yaml`), read as simulator descriptions.

NVIDIA's mock of libnvidia-ml (k8s-test-infra, `pkg/gpu/mocknvml`) describes a node in its own YAML:
`system` (versions), `device_defaults` merged under each entry of `devices`, `nvlink` (NVSwitches
and links per GPU) and `pcie_topology` (root complexes with their NUMA node). `translate` turns
such a document into the simulator's own description (the format in the package docstring), so it
goes through the same validation and yields the same `NodeSpec`: one node description for the
simulator and for the project's fake libnvidia-ml, whichever format it was written in.

What the translation decides, since NVIDIA's format is richer in some places and silent in others:
- A GPU's NUMA node and PCIe root complex (`pcie_root`) are its root complex's; the common PCI ancestor of two GPUs is the host bridge
  when they share a root complex, the NUMA node when only the node is shared, else the system.
- NVLinks: `links_per_gpu` links from every GPU to the declared NVSwitches (the mock's own
  expansion when no per-device links are listed; a profile that lists per-device links is refused).
- MIG: capable when `mig.max_gpu_instances` > 0, enabled when `mig.mode_current` is "enabled".
  NVIDIA's profiles list no GPU instances, so an enabled GPU has none until a layout is set.
- ECC events are registrable when `ecc.mode_current` is "enabled"; a fabric in state "auto" is
  "completed" (the mock's reading when no fabric manager runs).
- Pending page retirement and pending row remapping at start come from `retired_pages` and
  `remapped_rows`; everything else in the profile (clocks, power, processes...) is for nvidia-smi
  and is ignored.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

MIB = 1024 * 1024

# Where a description is NVIDIA's format rather than the simulator's: keys only it has.
MARKERS = ("system", "device_defaults")


def is_mock_profile(raw: object) -> bool:
    return isinstance(raw, Mapping) and all(key in raw for key in MARKERS)


def _merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def translate(raw: Mapping[str, Any], source: str, fail: Callable[[str, str], Exception]) -> dict[str, Any]:
    """The simulator description of NVIDIA's mock profile `raw`; `fail(key, reason)` makes the
    error to raise for what cannot be translated (the caller's SimulatorConfigError)."""

    def section(value: Any, key: str) -> Mapping[str, Any]:
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise fail(key, f"expected a mapping, got {type(value).__name__}")
        return value

    system = section(raw.get("system"), "system")
    defaults = section(raw.get("device_defaults"), "device_defaults")
    devices = raw.get("devices")
    if not isinstance(devices, list) or not devices:
        raise fail("devices", "NVIDIA's mock profile lists no devices")
    try:
        cuda = int(system["cuda_version_major"]) * 1000 + int(system["cuda_version_minor"]) * 10
    except (KeyError, TypeError, ValueError):
        raise fail("system.cuda_version_major", "needs integer cuda_version_major and _minor") from None

    rc_of: dict[str, tuple[str, int]] = {}  # bus id (lower case) -> (root complex id, NUMA node)
    topology = section(raw.get("pcie_topology"), "pcie_topology")
    for k, rc_any in enumerate(topology.get("root_complexes") or []):
        rc = section(rc_any, f"pcie_topology.root_complexes[{k}]")
        for dev in rc.get("devices") or []:
            rc_of[str(dev).lower()] = (str(rc.get("id", k)), int(rc.get("numa_node", 0)))

    gpus: list[dict[str, Any]] = []
    buses: list[str] = []
    for k, entry_any in enumerate(devices):
        key = f"devices[{k}]"
        entry = section(entry_any, key)
        if "nvlink" in entry or "nvlinks" in entry:
            raise fail(f"{key}.nvlink", "per-device NVLinks are not translated; declare NVSwitches instead")
        dev = _merge(defaults, entry)
        if int(dev.get("index", k)) != k:
            raise fail(f"{key}.index", f"devices are listed in index order: expected {k}")
        pci = section(dev.get("pci"), f"{key}.pci")
        if "bus_id" not in pci:
            raise fail(f"{key}.pci.bus_id", "required: the translation does not invent PCI addresses")
        bus = str(pci["bus_id"])
        buses.append(bus.lower())
        cc = section(dev.get("compute_capability"), f"{key}.compute_capability")
        mig = section(dev.get("mig"), f"{key}.mig")
        ecc = section(dev.get("ecc"), f"{key}.ecc")
        gpu: dict[str, Any] = {
            "name": dev.get("name"),
            "uuid": dev.get("uuid"),
            "minor": dev.get("minor_number"),
            "pci_bus_id": bus,
            "memory_mib": int(section(dev.get("memory"), f"{key}.memory").get("total_bytes", 0)) // MIB,
            "numa_node": rc_of[bus.lower()][1] if bus.lower() in rc_of else None,
            **({"pcie_root": rc_of[bus.lower()][0].lower()} if bus.lower() in rc_of else {}),
            "compute_capability": [cc.get("major"), cc.get("minor")],
            "pci_device_id": pci.get("device_id", 0x000010DE),
            "pci_subsystem_id": pci.get("subsystem_id", 0),
            "brand": dev.get("brand", "nvidia"),
            "mig_capable": int(mig.get("max_gpu_instances") or 0) > 0,
            "supports": {"ecc_events": str(ecc.get("mode_current", "enabled")).lower() == "enabled"},
        }
        if dev.get("architecture") is not None:
            gpu["architecture"] = dev["architecture"]
        if gpu["mig_capable"]:
            gpu["mig"] = {"enabled": str(mig.get("mode_current", "disabled")).lower() == "enabled"}
        fabric = section(dev.get("fabric"), f"{key}.fabric")
        if fabric:
            state = str(fabric.get("state", "completed")).lower()
            gpu["fabric"] = {
                "cluster_uuid": fabric.get("cluster_uuid"),
                "clique_id": fabric.get("clique_id", 0),
                "state": "completed" if state == "auto" else state,
            }
        gpus.append(gpu)

    n = len(gpus)
    ancestors = []
    for a in range(n):
        for b in range(a + 1, n):
            ra, rb = rc_of.get(buses[a]), rc_of.get(buses[b])
            if ra is not None and rb is not None and ra[0] == rb[0]:
                level = "HOSTBRIDGE"
            elif ra is not None and rb is not None and ra[1] == rb[1]:
                level = "NODE"
            else:
                level = "SYSTEM"
            ancestors.append([a, b, level])
    topo: dict[str, Any] = {"ancestors": ancestors}
    nvlink = section(raw.get("nvlink"), "nvlink")
    switches = nvlink.get("switches") or []
    links = int(nvlink.get("links_per_gpu") or 0)
    if switches and links:
        topo["nvswitch"] = {
            "links_per_gpu": links,
            "bus_ids": [
                str(section(sw, f"nvlink.switches[{i}]").get("bdf")) for i, sw in enumerate(switches)
            ],
        }

    faults: dict[str, list[str]] = {"pending_retirement": [], "remapped_rows_pending": []}
    for k, entry in enumerate(devices):
        dev = _merge(defaults, entry)
        if section(dev.get("retired_pages"), f"devices[{k}].retired_pages").get("pending_retirement"):
            faults["pending_retirement"].append(str(dev.get("uuid")))
        if section(dev.get("remapped_rows"), f"devices[{k}].remapped_rows").get("pending"):
            faults["remapped_rows_pending"].append(str(dev.get("uuid")))

    return {
        "name": Path(source).stem,
        "description": f"NVIDIA's mock NVML profile {Path(source).name}",
        "driver_version": system.get("driver_version"),
        "nvml_version": system.get("nvml_version"),
        "cuda_driver_version": cuda,
        "gpus": gpus,
        "topology": topo,
        "faults": faults,
    }
