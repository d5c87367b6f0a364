"""What the labeller reads from the host: NVML facts, the machine-type file and the vGPU scan.

Each reader follows GFD v0.20.0 and its failure rule: the machine type falls back to "unknown"
(internal/lm/machine-type.go), a vGPU scan that cannot read sysfs gives no vGPU label at all
(internal/lm/vgpu.go logs and returns nothing), an NVML init failure is fatal only with
--fail-on-init-error (internal/resource/factory.go, fallback.go), and everything else NVML
refuses fails the labelling. Everything read is bounded (file sizes, record walks), so a strange
sysfs cannot hang or flood the labeller.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from supervisor.labels.rules import LabelConfig, LabelError, VgpuDevice, compute_labels
from supervisor.node.facts import NodeFacts, facts_from_nvml
from supervisor.node.nvml import Nvml, NvmlCallError

log = logging.getLogger("gpuvisor.labels")

SYSFS = "/sys"
DEFAULT_MACHINE_TYPE_FILE = "/sys/class/dmi/id/product_name"  # GFD's --machine-type-file default
MACHINE_TYPE_UNKNOWN = "unknown"
MAX_MACHINE_TYPE_BYTES = 64 * 1024
MAX_PCI_CONFIG_BYTES = 4096  # PCIe extended configuration space
MAX_PCI_DEVICES = 4096

# internal/vgpu/pciutil.go and vgpu.go
_PCI_STATUS_BYTE = 0x06
_PCI_STATUS_CAPABILITY_LIST = 0x10
_PCI_CAPABILITY_LIST = 0x34
_PCI_CAPABILITY_VENDOR_SPECIFIC = 0x09
_VGPU_RECORD_START = 5
_HOST_DRIVER_VERSION_LENGTH = 10
_HOST_DRIVER_BRANCH_LENGTH = 10


class NvmlUnavailable(Exception):
    """NVML could not be initialised and --fail-on-init-error is set: what failed and what to check."""


def read_machine_type(path: str) -> str:
    """The machine type (DMI product name), "unknown" when the file is not given or unreadable."""
    if not path:
        return MACHINE_TYPE_UNKNOWN
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_MACHINE_TYPE_BYTES)
    except OSError as exc:
        log.warning(
            "cannot read the machine type from %s (%s): using %r, as GFD does",
            path,
            exc.strerror or exc,
            MACHINE_TYPE_UNKNOWN,
        )
        return MACHINE_TYPE_UNKNOWN
    return data.decode("utf-8", errors="replace").strip()


def label_node(
    facts: NodeFacts,
    config: LabelConfig,
    *,
    machine_type_file: str,
    sysfs_root: str | None,
    timestamp: int | None,
) -> dict[str, str]:
    """GFD's labels for `facts` with what the host adds: the machine type from `machine_type_file`
    ("" gives "unknown") and the vGPU scan of `sysfs_root` (None: a simulated node, no vGPU).

    Each caller says where to look: `gpuvisor labels` reads its --machine-type-file (simulated
    node or not: the flag is there to point it elsewhere), the supervisor GFD's default file, or
    none on a simulated node, whose machine is not the host's. Raises LabelError.
    """
    return compute_labels(
        facts,
        config,
        machine_type=read_machine_type(machine_type_file),
        vgpu=scan_vgpu(sysfs_root),
        timestamp=timestamp,
    )


def read_node_facts(module: Any, sysfs_root: str | None, *, fail_on_init_error: bool) -> NodeFacts:
    """NVML's facts about the node, between one nvmlInit and nvmlShutdown (GFD does the same per run).

    With fail_on_init_error false, an init failure gives a node with no GPU (GFD's null manager),
    and the next call tries again. Raises NvmlUnavailable, or NvmlCallError for any other failure.
    """
    nvml = Nvml(module, sysfs_root)
    try:
        nvml.init()
    except NvmlCallError as exc:
        if fail_on_init_error:
            raise NvmlUnavailable(
                f"NVML could not be initialised ({exc}). Check that the NVIDIA driver is loaded, that "
                "libnvidia-ml.so.1 is on the library path and, in a container, that the NVIDIA container "
                "runtime runs this pod; --fail-on-init-error=false labels the node without GPU labels instead"
            ) from None
        log.warning(
            "NVML could not be initialised (%s): no GPU labels this time (--fail-on-init-error=false)", exc
        )
        return NodeFacts()
    try:
        return facts_from_nvml(nvml)
    finally:
        try:
            nvml.shutdown()
        except NvmlCallError as exc:
            log.debug("nvmlShutdown failed: %s", exc)


def scan_vgpu(sysfs_root: str | None) -> tuple[VgpuDevice, ...] | None:
    """NVIDIA PCI devices that are vGPUs, with their host driver (internal/vgpu).

    None when the scan cannot be done (GFD logs it and writes no vGPU label); `sysfs_root` None
    is a simulated node, which has no vGPU. Raises LabelError where GFD fails the labelling (a
    vGPU whose capability record holds no driver version).
    """
    if sysfs_root is None:
        return ()
    root = Path(sysfs_root) / "bus/pci/devices"
    try:
        names = sorted(os.listdir(root))[:MAX_PCI_DEVICES]
        found: list[VgpuDevice] = []
        for name in names:
            device = root / name
            if (device / "vendor").read_text()[:64].strip() != "0x10de":
                continue
            with open(device / "config", "rb") as fh:
                config = fh.read(MAX_PCI_CONFIG_BYTES)
            if len(config) < 256:
                log.error(
                    "unable to get vGPU devices: the PCI configuration of %s is not fully readable "
                    "(it needs CAP_SYS_ADMIN): no vGPU labels", name
                )  # fmt: skip
                return None
            capability = vendor_capability(config)
            if capability is not None and is_vgpu(capability):
                found.append(vgpu_info(capability, name))
    except OSError as exc:
        log.error("unable to get vGPU devices: %s: no vGPU labels", exc)
        return None
    return tuple(found)


def vendor_capability(config: bytes) -> bytes | None:
    """The vendor-specific capability in a PCI configuration space (GetVendorSpecificCapability).

    Offsets are bytes, as in GFD, and a looping or broken chain ends the walk.
    """
    if not config[_PCI_STATUS_BYTE] & _PCI_STATUS_CAPABILITY_LIST:
        return None
    visited = bytearray(256)
    pos = config[_PCI_CAPABILITY_LIST]
    while pos != 0:
        cap_id, nxt, length = config[pos], config[(pos + 1) & 0xFF], config[(pos + 2) & 0xFF]
        if visited[pos] or cap_id == 0xFF:
            break
        if cap_id == _PCI_CAPABILITY_VENDOR_SPECIFIC:
            return config[pos : pos + length]
        visited[pos] = 1
        pos = nxt
    return None


def is_vgpu(capability: bytes) -> bool:
    """IsVGPUDevice: the vendor capability carries the "VF" signature at bytes 3 and 4."""
    return len(capability) >= 5 and capability[3] == 0x56 and capability[4] == 0x46


def vgpu_info(capability: bytes, where: str) -> VgpuDevice:
    """GetInfo: walk the records from byte 5 to the one with id 0, which holds 10 bytes of driver
    version and 10 of branch."""
    pos = _VGPU_RECORD_START
    record = capability[pos] if pos < len(capability) else 0
    for _ in range(256):  # record lengths are bytes: 256 steps visit every offset
        if record == 0 or pos >= len(capability):
            break
        step = capability[pos + 1] if pos + 1 < len(capability) else 0
        pos = (pos + step) & 0xFF
        record = capability[pos] if pos < len(capability) else 0xFF
    end = pos + 2 + _HOST_DRIVER_VERSION_LENGTH + _HOST_DRIVER_BRANCH_LENGTH
    if record != 0 or end > len(capability):
        raise LabelError(
            f"error getting vGPU device info: cannot find driver version record in vendor specific capability for device {where}"
        )
    version = capability[pos + 2 : pos + 2 + _HOST_DRIVER_VERSION_LENGTH]
    branch = capability[pos + 2 + _HOST_DRIVER_VERSION_LENGTH : end]
    return VgpuDevice(version.decode("latin-1").strip("\x00"), branch.decode("latin-1").strip("\x00"))
