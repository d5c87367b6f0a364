"""What GPU Feature Discovery reads about a node, as plain data, and GFD's rules for reading it.

`facts_from_nvml(nvml)` fills it from NVML (and sysfs for the PCI class) with GFD's rules
for what may be missing; `supervisor.labels.compute_labels` turns it into labels. It is separate
from `common.model.Node` (what the device plugin advertises) because GFD reads a different set
(MIG capability, PCI class, fabric clique, MIG engine counts) and fails differently: discovery
skips a GPU it cannot describe, GFD writes no labels at all.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.uuidtext import uuid_text
from supervisor.node.nvml import (
    MIB,
    NVML_ERROR_FUNCTION_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    Nvml,
    NvmlCallError,
    text,
)

log = logging.getLogger("gpuvisor.nvml")

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
    return FabricClique(uuid_text(cluster_uuid), str(clique_id))


# ---------------------------------------------------------------------- read from NVML, as GFD reads


def facts_from_nvml(nvml: Nvml) -> NodeFacts:
    """What GFD v0.20.0 (internal/lm, internal/resource) reads for the labels. Raises NvmlCallError
    where GFD fails; only the memory size (0) and the PCI class (None) may be missing."""
    count = int(nvml.call("nvmlDeviceGetCount"))
    gpus = tuple(_gpu_facts(nvml, i, nvml.call("nvmlDeviceGetHandleByIndex", i)) for i in range(count))
    if not gpus:  # GFD asks for the versions only when there are devices
        return NodeFacts()
    driver = text(nvml.call("nvmlSystemGetDriverVersion"))
    return NodeFacts(driver, int(nvml.call("nvmlSystemGetCudaDriverVersion")), gpus)


def _gpu_facts(nvml: Nvml, index: int, h: Any) -> GpuFacts:
    name = text(nvml.call("nvmlDeviceGetName", h))
    try:
        memory_mib = int(nvml.call("nvmlDeviceGetMemoryInfo", h).total) // MIB
    except NvmlCallError as exc:
        log.warning("GPU %d: no memory size (%s); its memory label is left out, as GFD does", index, exc)
        memory_mib = 0
    major, minor = nvml.call("nvmlDeviceGetCudaComputeCapability", h)
    capable, enabled = nvml.mig_mode(h)
    return GpuFacts(
        index=index,
        name=name,
        memory_mib=memory_mib,
        compute_capability=(int(major), int(minor)),
        mig_capable=capable,
        mig_enabled=enabled,
        migs=_mig_facts(nvml, h, memory_mib) if enabled else (),
        pci_class=_pci_class(nvml, h),
        fabric=_fabric_clique(nvml, h),
    )


def _mig_facts(nvml: Nvml, h: Any, gpu_memory_mib: int) -> tuple[MigFacts, ...]:
    return tuple(
        MigFacts(
            profile=profile,
            memory_mib=int(attrs.memorySizeMB),
            multiprocessors=int(attrs.multiprocessorCount),
            gi_slices=int(attrs.gpuInstanceSliceCount),
            ci_slices=int(attrs.computeInstanceSliceCount),
            copy_engines=int(attrs.sharedCopyEngineCount),
            decoders=int(attrs.sharedDecoderCount),
            encoders=int(attrs.sharedEncoderCount),
            jpegs=int(attrs.sharedJpegCount),
            ofas=int(attrs.sharedOfaCount),
        )
        for _j, _mh, _gi, attrs, profile, _info, _prof in nvml.each_mig(h, gpu_memory_mib)
    )


def _pci_class(nvml: Nvml, h: Any) -> int | None:
    """The GPU's PCI class from sysfs, as GFD reads it; None when unknown (gpu.mode "unknown")."""
    try:
        if nvml.sysfs is not None:
            return read_pci_class(nvml.sysfs, text(nvml.call("nvmlDeviceGetPciInfo", h).busId))
        info = nvml.module.nvmlPciInfoExt_v1_t()  # no sysfs for these GPUs: ask NVML
        info.version = nvml.module.nvmlPciInfoExt_v1
        nvml.call("nvmlDeviceGetPciInfoExt", h, ctypes.byref(info))
    except (NvmlCallError, AttributeError):  # AttributeError: a binding without the call
        return None
    return pci_gpu_class(int(info.baseClass) << 16 | int(info.subClass) << 8)


class FabricInfo(ctypes.Structure):
    """nvmlGpuFabricInfo_t as NVIDIA's nvml.h lays it out.

    gpuvisor passes its own structures rather than the binding's: nvidia-ml-py up to 12.535 declares
    `clusterUuid` as 80 chars (and the clique as `partitionId`), so the driver's answer would be
    read from the wrong offsets, and its structure decodes the UUID bytes as UTF-8 and fails."""

    _fields_ = [
        ("clusterUuid", ctypes.c_ubyte * 16),
        ("status", ctypes.c_int),
        ("cliqueId", ctypes.c_uint),
        ("state", ctypes.c_uint),
    ]


class FabricInfoV2(ctypes.Structure):
    """nvmlGpuFabricInfo_v2_t as nvml.h lays it out (`version` = FABRIC_INFO_V2)."""

    _fields_ = [
        ("version", ctypes.c_uint),
        ("clusterUuid", ctypes.c_ubyte * 16),
        ("status", ctypes.c_int),
        ("cliqueId", ctypes.c_uint),
        ("state", ctypes.c_uint),
        ("healthMask", ctypes.c_uint),
    ]


FABRIC_INFO_V2 = ctypes.sizeof(FabricInfoV2) | 2 << 24  # nvml.h: NVML_STRUCT_VERSION(GpuFabricInfo, 2)


def _fabric_clique(nvml: Nvml, h: Any) -> FabricClique | None:
    """go-nvlib IsFabricAttached + GetFabricIDs: the v1 call if the library has it, else the V one."""
    for function, struct in (
        ("nvmlDeviceGetGpuFabricInfo", FabricInfo),
        ("nvmlDeviceGetGpuFabricInfoV", FabricInfoV2),
    ):
        info: FabricInfo | FabricInfoV2 = struct()
        if isinstance(info, FabricInfoV2):
            info.version = FABRIC_INFO_V2
        try:
            nvml.call(function, h, ctypes.byref(info))
        except NvmlCallError as exc:
            if exc.code == NVML_ERROR_FUNCTION_NOT_FOUND:
                continue
            if exc.code == NVML_ERROR_NOT_SUPPORTED:
                return None
            raise
        return fabric_clique(bytes(info.clusterUuid), int(info.cliqueId), int(info.state), int(info.status))
    return None
