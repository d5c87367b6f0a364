"""The simulator's device and system functions: identity, memory, PCI, topology, NVLink, health."""

from __future__ import annotations

import ctypes
import uuid as uuidlib
from typing import Any

import pynvml

from supervisor.node.facts import FabricInfo, FabricInfoV2
from supervisor.sim.nvml.base import SimDeviceHandle, SimulatorBase, nvml_error, nvml_function

_MIB = 1024 * 1024


class DeviceFunctions(SimulatorBase):
    """nvmlInit/nvmlShutdown, nvmlSystem* and the nvmlDevice* queries of a physical GPU."""

    # ---------------------------------------------------------------- init and system

    @nvml_function(requires_init=False)
    def nvmlInitWithFlags(self, flags: int) -> None:
        self._init_count += 1

    @nvml_function(requires_init=False)
    def nvmlInit(self) -> None:
        self.nvmlInitWithFlags(0)

    @nvml_function()
    def nvmlShutdown(self) -> None:
        self._init_count -= 1
        if self._init_count == 0:
            # NVML is gone: blocked waiters must not sleep on.
            self._cond.notify_all()

    @nvml_function(requires_init=False)
    def nvmlErrorString(self, result: int) -> str:
        return str(pynvml.NVMLError(result))

    @nvml_function()
    def nvmlSystemGetDriverVersion(self) -> str:
        return self._spec.driver_version

    @nvml_function()
    def nvmlSystemGetNVMLVersion(self) -> str:
        return self._spec.nvml_version_text

    @nvml_function()
    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return self._spec.cuda_driver_version

    @nvml_function()
    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        return self._spec.cuda_driver_version

    # ---------------------------------------------------------------- devices

    @nvml_function()
    def nvmlDeviceGetCount(self) -> int:
        # A GPU that fell off the bus stays counted until the driver is reloaded; only calls
        # that reach it fail.
        return len(self._gpus)

    @nvml_function()
    def nvmlDeviceGetHandleByIndex(self, index: int) -> SimDeviceHandle:
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(self._gpus):
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if self._gpus[index].lost:
            raise nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
        return self._gpu_handles[index]

    @nvml_function()
    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> SimDeviceHandle:
        text = uuid.decode() if isinstance(uuid, bytes) else uuid
        if not isinstance(text, str):
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        for i, state in enumerate(self._gpus):
            if state.spec.uuid == text:
                if state.lost:
                    raise nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
                return self._gpu_handles[i]
            for m in state.mig if state.mig_enabled else []:
                if m.uuid == text:
                    if state.lost:
                        raise nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
                    return self._mig_handle(i, m)
        raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND)

    @nvml_function()
    def nvmlDeviceGetUUID(self, handle: object) -> str:
        state = self._gpu(handle)
        assert isinstance(handle, SimDeviceHandle)
        return handle.mig_uuid if handle.mig_uuid is not None else state.spec.uuid

    @nvml_function()
    def nvmlDeviceGetName(self, handle: object) -> str:
        state = self._gpu(handle)
        assert isinstance(handle, SimDeviceHandle)
        if handle.mig_uuid is not None:
            return f"{state.spec.name} MIG {self._mig_of(state, handle).profile}"
        return state.spec.name

    @nvml_function()
    def nvmlDeviceGetBrand(self, handle: object) -> int:
        return self._gpu(handle).spec.brand

    @nvml_function()
    def nvmlDeviceGetArchitecture(self, device: object) -> int:
        return self._gpu(device).spec.architecture

    @nvml_function()
    def nvmlDeviceGetIndex(self, handle: object) -> int:
        return self._full_gpu(handle).spec.index

    @nvml_function()
    def nvmlDeviceGetMinorNumber(self, handle: object) -> int:
        return self._full_gpu(handle).spec.minor

    @nvml_function()
    def nvmlDeviceGetMemoryInfo(self, handle: object, version: int | None = None) -> Any:
        state = self._gpu(handle)
        assert isinstance(handle, SimDeviceHandle)
        if handle.mig_uuid is not None:
            total = self._catalogue(state)[self._mig_of(state, handle).profile].memory_mib * _MIB
        else:
            total = state.spec.memory_mib * _MIB
        if version:
            mem = pynvml.c_nvmlMemory_v2_t()
            mem.version = version
            mem.reserved = 0
        else:
            mem = pynvml.c_nvmlMemory_t()
        mem.total, mem.used, mem.free = total, 0, total
        return mem

    @nvml_function()
    def nvmlDeviceGetPciInfo_v3(self, handle: object) -> Any:
        spec = self._gpu(handle).spec
        return self._pci_info(spec.pci_bus_id, spec.pci_device_id, spec.pci_subsystem_id)

    @nvml_function()
    def nvmlDeviceGetPciInfo(self, handle: object) -> Any:
        return self.nvmlDeviceGetPciInfo_v3(handle)

    @staticmethod
    def _pci_info(bus_id: str, device_id: int, subsystem_id: int = 0) -> Any:
        domain_s, bus_s, rest = bus_id.split(":")
        dev_s = rest.split(".")[0]
        info = pynvml.nvmlPciInfo_t()
        info.busId = bus_id
        info.busIdLegacy = f"{int(domain_s, 16):04X}:{bus_s}:{rest}"
        info.domain = int(domain_s, 16)
        info.bus = int(bus_s, 16)
        info.device = int(dev_s, 16)
        info.pciDeviceId = device_id
        info.pciSubSystemId = subsystem_id
        return info

    @nvml_function()
    def nvmlDeviceGetPciInfoExt(self, handle: object, c_info: object) -> None:
        """Fills an `nvmlPciInfoExt_v1_t` passed by reference, as the binding does (returns None)."""
        spec = self._full_gpu(handle).spec
        info = _out_struct(c_info, pynvml.nvmlPciInfoExt_v1_t)
        if info.version != pynvml.nvmlPciInfoExt_v1:
            raise nvml_error(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        legacy = self._pci_info(spec.pci_bus_id, spec.pci_device_id)
        info.domain, info.bus, info.device = legacy.domain, legacy.bus, legacy.device
        info.pciDeviceId, info.pciSubSystemId = spec.pci_device_id, spec.pci_subsystem_id
        info.baseClass, info.subClass = spec.pci_class >> 16, (spec.pci_class >> 8) & 0xFF
        info.busId = spec.pci_bus_id.encode()

    @nvml_function()
    def nvmlDeviceGetGpuFabricInfo(self, device: object, gpuFabricInfo: object) -> int:
        """Fills an nvmlGpuFabricInfo_t passed by reference (the binding's structure or gpuvisor's
        own, laid out as nvml.h); NotSupported without a fabric."""
        info = _out_struct(gpuFabricInfo, (pynvml.c_nvmlGpuFabricInfo_t, FabricInfo))
        self._fill_fabric(device, info)
        return int(pynvml.NVML_SUCCESS)

    @nvml_function()
    def nvmlDeviceGetGpuFabricInfoV(self, device: object, gpuFabricInfo: object) -> int:
        """The versioned call: a v2 or v3 structure whose `version` field says which (and, as a
        real driver trusts it, whose size that version's struct must have)."""
        info = _out_struct(
            gpuFabricInfo, (pynvml.c_nvmlGpuFabricInfo_v2_t, pynvml.c_nvmlGpuFabricInfo_v3_t, FabricInfoV2)
        )
        sizes = {
            pynvml.nvmlGpuFabricInfo_v2: ctypes.sizeof(pynvml.c_nvmlGpuFabricInfo_v2_t),
            pynvml.nvmlGpuFabricInfo_v3: ctypes.sizeof(pynvml.c_nvmlGpuFabricInfo_v3_t),
        }
        if sizes.get(int(info.version)) != ctypes.sizeof(info):
            raise nvml_error(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        self._fill_fabric(device, info)
        info.healthMask = 0
        return int(pynvml.NVML_SUCCESS)

    def _fill_fabric(self, device: object, info: Any) -> None:
        fabric = self._full_gpu(device).spec.fabric
        if fabric is None:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        ctypes.memmove(info.clusterUuid, uuidlib.UUID(fabric.cluster_uuid).bytes, 16)
        info.status, info.cliqueId, info.state = fabric.status, fabric.clique_id, fabric.state

    @nvml_function()
    def nvmlDeviceGetCudaComputeCapability(self, handle: object) -> tuple[int, int]:
        return self._gpu(handle).spec.compute_capability

    @nvml_function()
    def nvmlDeviceGetNumaNodeId(self, handle: object) -> int:
        numa = self._full_gpu(handle).spec.numa_node
        if numa is None:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return numa

    @nvml_function()
    def nvmlDeviceGetAddressingMode(self, device: object) -> int:
        """nvmlDeviceAddressingModeType_t on a coherent-memory system; NotSupported elsewhere."""
        mode = self._full_gpu(device).spec.addressing_mode
        if mode is None:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return mode

    @nvml_function()
    def nvmlDeviceGetTopologyCommonAncestor(self, device1: object, device2: object) -> int:
        a = self._full_gpu(device1).spec.index
        b = self._full_gpu(device2).spec.index
        if a == b:
            return int(pynvml.NVML_TOPOLOGY_INTERNAL)
        return self._spec.ancestors[(min(a, b), max(a, b))]

    def _link(self, device: object, link: int) -> tuple[str, bool]:
        links = self._links[self._full_gpu(device).spec.index]
        if (
            isinstance(link, bool)
            or not isinstance(link, int)
            or not 0 <= link < pynvml.NVML_NVLINK_MAX_LINKS
        ):
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if link >= len(links):
            # A GPU without NVLink (or a link number past its last one) answers NotSupported.
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return links[link]

    @nvml_function()
    def nvmlDeviceGetNvLinkState(self, device: object, link: int) -> int:
        self._link(device, link)
        return int(pynvml.NVML_FEATURE_ENABLED)

    @nvml_function()
    def nvmlDeviceGetNvLinkRemotePciInfo(self, device: object, link: int) -> Any:
        bus, is_gpu = self._link(device, link)
        device_id = next((g.pci_device_id for g in self._spec.gpus if g.pci_bus_id == bus), 0x000010DE)
        return self._pci_info(bus, device_id if is_gpu else 0x000010DE)

    @nvml_function()
    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: object, link: int) -> int:
        _, is_gpu = self._link(handle, link)
        return int(pynvml.NVML_NVLINK_DEVICE_TYPE_GPU if is_gpu else pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH)

    # ---------------------------------------------------------------- memory health, compute mode

    @nvml_function()
    def nvmlDeviceGetRetiredPagesPendingStatus(self, device: object) -> int:
        state = self._full_gpu(device)
        if not state.spec.retired_pages:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return int(pynvml.NVML_FEATURE_ENABLED if state.pending_retirement else pynvml.NVML_FEATURE_DISABLED)

    @nvml_function()
    def nvmlDeviceGetRemappedRows(self, device: object) -> tuple[int, int, int, int]:
        state = self._full_gpu(device)
        if not state.spec.remapped_rows:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return (
            state.corrected_rows,
            state.uncorrected_rows,
            int(state.remapped_rows_pending),
            int(state.row_remap_failure),
        )

    @nvml_function()
    def nvmlDeviceGetComputeMode(self, handle: object) -> int:
        return self._full_gpu(handle).compute_mode

    @nvml_function()
    def nvmlDeviceSetComputeMode(self, handle: object, mode: int) -> None:
        state = self._full_gpu(handle)
        valid = (
            pynvml.NVML_COMPUTEMODE_DEFAULT,
            pynvml.NVML_COMPUTEMODE_PROHIBITED,
            pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS,
        )
        if mode == pynvml.NVML_COMPUTEMODE_EXCLUSIVE_THREAD:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)  # removed from NVML
        if mode not in valid:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        state.compute_mode = int(mode)


def _out_struct(arg: object, kind: type | tuple[type, ...]) -> Any:
    """The structure an output argument points at: `ctypes.byref(s)` or `ctypes.pointer(s)`, which
    is how callers of the real binding pass it; anything else is an invalid argument there too."""
    target = getattr(arg, "_obj", None)  # what ctypes.byref() wraps
    if target is None and isinstance(arg, ctypes._Pointer):
        target = arg.contents
    if not isinstance(target, kind):
        raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    return target
