"""The `Simulator`: an object that stands in for the `pynvml` module.

It has the binding's function names and call signatures, raises the binding's own `NVMLError`
subclasses, and returns the same kinds of values: `str` for names and UUIDs, the binding's own
ctypes structures where they hold no device handle (memory, PCI and device attributes, GPU
instance profile info), and small objects with the same attribute names where the real struct
would hold a handle (event data, GPU instance info). Constants and error classes are the
binding's: any `NVML_*` / `nvmlEventType*` / `NVMLError*` name resolves to `pynvml`'s value.

Every NVML call and every fault-injection method runs under one lock; `nvmlEventSetWait_v2`
waits on a condition built on that lock, so it blocks without polling, wakes at once when an
event is injected, and lets any other thread call in while it waits. Faults can be injected
from any thread.
"""

from __future__ import annotations

import ctypes
import functools
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Concatenate, ParamSpec, TypeVar

import pynvml

from common.simulator import mig
from common.simulator.config import GpuSpec, MigSpec, NodeSpec, derived_mig_uuid

P = ParamSpec("P")
R = TypeVar("R")

_MIB = 1024 * 1024
_NO_INSTANCE = 0xFFFFFFFF  # what NVML puts in gpuInstanceId/computeInstanceId when none applies
_XID_GPU_LOST = 79  # "GPU has fallen off the bus"
_ECC_EVENTS = pynvml.nvmlEventTypeSingleBitEccError | pynvml.nvmlEventTypeDoubleBitEccError


def _err(code: int) -> Exception:
    """The binding's exception for an NVML return code (NVMLError maps codes to subclasses)."""
    exc: Exception = pynvml.NVMLError(code)
    return exc


def _nvml(requires_init: bool = True) -> Callable[[Callable[Concatenate[Simulator, P], R]], Callable[Concatenate[Simulator, P], R]]:
    """Mark a method as a simulated NVML function: lock, injected failures, init check."""

    def deco(fn: Callable[Concatenate[Simulator, P], R]) -> Callable[Concatenate[Simulator, P], R]:
        name = fn.__name__

        def wrapper(self: Simulator, /, *args: P.args, **kwargs: P.kwargs) -> R:
            with self._cond:
                self._calls[name] += 1
                self._maybe_fail(name)
                if requires_init and self._init_count == 0:
                    raise _err(pynvml.NVML_ERROR_UNINITIALIZED)
                return fn(self, *args, **kwargs)

        functools.update_wrapper(wrapper, fn)
        wrapper._sim_nvml = True  # type: ignore[attr-defined]
        return wrapper

    return deco


@dataclass(eq=False, frozen=True)
class SimDeviceHandle:
    """An opaque device handle (like `c_nvmlDevice_t`); one object per device, compared by identity."""

    gpu_index: int
    mig_uuid: str | None = None

    def __repr__(self) -> str:
        what = f"gpu {self.gpu_index}" if self.mig_uuid is None else f"{self.mig_uuid} on gpu {self.gpu_index}"
        return f"<sim device handle {what}>"


@dataclass(eq=False, frozen=True)
class SimGpuInstanceHandle:
    """An opaque GPU-instance handle (like `c_nvmlGpuInstance_t`)."""

    gpu_index: int
    gi: int
    generation: int


@dataclass(frozen=True)
class SimEventData:
    """Same attributes as `c_nvmlEventData_t`."""

    device: SimDeviceHandle
    eventType: int
    eventData: int
    gpuInstanceId: int
    computeInstanceId: int


@dataclass(frozen=True)
class SimGpuInstanceInfo:
    """Same attributes as `c_nvmlGpuInstanceInfo_t`."""

    device: SimDeviceHandle
    id: int
    profileId: int
    placement: Any  # pynvml.c_nvmlGpuInstancePlacement_t


@dataclass(eq=False)
class SimEventSet:
    """An event set (like `c_nvmlEventSet_t`): the events registered per GPU and a queue."""

    registered: dict[int, int] = field(default_factory=dict)  # gpu index -> event mask
    queue: deque[SimEventData] = field(default_factory=deque)
    freed: bool = False


@dataclass
class _GpuState:
    spec: GpuSpec
    lost: bool
    pending_retirement: bool
    remapped_rows_pending: bool
    mig_enabled: bool
    mig: list[MigSpec]
    compute_mode: int = pynvml.NVML_COMPUTEMODE_DEFAULT
    mig_generation: int = 0
    corrected_rows: int = 0
    uncorrected_rows: int = 0


class Simulator:
    """A simulated node behind the `pynvml` API, with fault injection. Build with `load_simulator`."""

    # The constants and error classes gpuvisor uses, spelled out for readers and type checkers;
    # every other NVML_*/nvmlEventType*/NVMLError* name comes from pynvml through __getattr__.
    NVMLError = pynvml.NVMLError
    NVMLError_Uninitialized = pynvml.NVMLError_Uninitialized
    NVMLError_InvalidArgument = pynvml.NVMLError_InvalidArgument
    NVMLError_NotSupported = pynvml.NVMLError_NotSupported
    NVMLError_NotFound = pynvml.NVMLError_NotFound
    NVMLError_Timeout = pynvml.NVMLError_Timeout
    NVMLError_LibraryNotFound = pynvml.NVMLError_LibraryNotFound
    NVMLError_FunctionNotFound = pynvml.NVMLError_FunctionNotFound
    NVMLError_GpuIsLost = pynvml.NVMLError_GpuIsLost
    NVMLError_Unknown = pynvml.NVMLError_Unknown
    NVML_SUCCESS = pynvml.NVML_SUCCESS
    NVML_ERROR_UNINITIALIZED = pynvml.NVML_ERROR_UNINITIALIZED
    NVML_ERROR_INVALID_ARGUMENT = pynvml.NVML_ERROR_INVALID_ARGUMENT
    NVML_ERROR_NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED
    NVML_ERROR_NOT_FOUND = pynvml.NVML_ERROR_NOT_FOUND
    NVML_ERROR_TIMEOUT = pynvml.NVML_ERROR_TIMEOUT
    NVML_ERROR_LIBRARY_NOT_FOUND = pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
    NVML_ERROR_FUNCTION_NOT_FOUND = pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
    NVML_ERROR_GPU_IS_LOST = pynvml.NVML_ERROR_GPU_IS_LOST
    NVML_ERROR_UNKNOWN = pynvml.NVML_ERROR_UNKNOWN
    NVML_TOPOLOGY_INTERNAL = pynvml.NVML_TOPOLOGY_INTERNAL
    NVML_TOPOLOGY_SINGLE = pynvml.NVML_TOPOLOGY_SINGLE
    NVML_TOPOLOGY_MULTIPLE = pynvml.NVML_TOPOLOGY_MULTIPLE
    NVML_TOPOLOGY_HOSTBRIDGE = pynvml.NVML_TOPOLOGY_HOSTBRIDGE
    NVML_TOPOLOGY_NODE = pynvml.NVML_TOPOLOGY_NODE
    NVML_TOPOLOGY_SYSTEM = pynvml.NVML_TOPOLOGY_SYSTEM
    NVML_NVLINK_MAX_LINKS = pynvml.NVML_NVLINK_MAX_LINKS
    NVML_NVLINK_DEVICE_TYPE_GPU = pynvml.NVML_NVLINK_DEVICE_TYPE_GPU
    NVML_NVLINK_DEVICE_TYPE_SWITCH = pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH
    NVML_DEVICE_MIG_DISABLE = pynvml.NVML_DEVICE_MIG_DISABLE
    NVML_DEVICE_MIG_ENABLE = pynvml.NVML_DEVICE_MIG_ENABLE
    NVML_GPU_INSTANCE_PROFILE_COUNT = pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT
    NVML_FEATURE_DISABLED = pynvml.NVML_FEATURE_DISABLED
    NVML_FEATURE_ENABLED = pynvml.NVML_FEATURE_ENABLED
    NVML_COMPUTEMODE_DEFAULT = pynvml.NVML_COMPUTEMODE_DEFAULT
    NVML_COMPUTEMODE_EXCLUSIVE_PROCESS = pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    nvmlEventTypeXidCriticalError = pynvml.nvmlEventTypeXidCriticalError
    nvmlEventTypeSingleBitEccError = pynvml.nvmlEventTypeSingleBitEccError
    nvmlEventTypeDoubleBitEccError = pynvml.nvmlEventTypeDoubleBitEccError

    def __init__(self, spec: NodeSpec) -> None:
        self._spec = spec
        self._cond = threading.Condition(threading.RLock())
        self._init_count = 0
        self._failures: dict[str, list[int | None]] = {}  # name -> [code, remaining or None]
        self._calls: Counter[str] = Counter()
        self._event_sets: list[SimEventSet] = []
        self._gpus = [
            _GpuState(
                spec=g,
                lost=g.uuid in spec.lost,
                pending_retirement=g.uuid in spec.pending_retirement,
                remapped_rows_pending=g.uuid in spec.remapped_rows_pending,
                mig_enabled=g.mig_enabled,
                mig=list(g.mig),
            )
            for g in spec.gpus
        ]
        self._gpu_handles = [SimDeviceHandle(i) for i in range(len(spec.gpus))]
        self._mig_handles: dict[str, SimDeviceHandle] = {}
        # NVLink wiring per GPU: link number -> remote bus id and whether the remote is a GPU.
        self._links: list[list[tuple[str, bool]]] = [[] for _ in spec.gpus]
        for (a, b), count in sorted(spec.nvlinks.items()):
            for _ in range(count):
                self._links[a].append((spec.gpus[b].pci_bus_id, True))
                self._links[b].append((spec.gpus[a].pci_bus_id, True))
        for g in spec.switch_gpus:
            for k in range(spec.switch_links):
                self._links[g].append((spec.switch_bus_ids[k % len(spec.switch_bus_ids)], False))

    # ---------------------------------------------------------------- plumbing

    def __getattr__(self, name: str) -> Any:
        # Only reached for names not defined on the class: forward the binding's constants,
        # structures and error classes, but never its functions (they would call the real
        # library), so a function the simulator lacks fails loudly.
        if name.startswith("__"):
            raise AttributeError(name)
        value = getattr(pynvml, name, None)
        if value is None or (callable(value) and not isinstance(value, type)):
            raise AttributeError(f"the NVML simulator does not implement {name!r}")
        return value

    @classmethod
    def nvml_functions(cls) -> list[str]:
        """The NVML functions this simulator implements."""
        return sorted(n for n, v in vars(cls).items() if getattr(v, "_sim_nvml", False))

    @property
    def spec(self) -> NodeSpec:
        return self._spec

    def call_count(self, function_name: str) -> int:
        """How many times an NVML function was called (including calls that raised)."""
        with self._cond:
            return self._calls[function_name]

    @property
    def initialized(self) -> bool:
        with self._cond:
            return self._init_count > 0

    def _maybe_fail(self, name: str) -> None:
        entry = self._failures.get(name)
        if entry is None:
            return
        code, remaining = entry
        if remaining is not None:
            if remaining <= 1:
                del self._failures[name]
            else:
                entry[1] = remaining - 1
        raise _err(int(code or pynvml.NVML_ERROR_UNKNOWN))

    def _gpu(self, handle: object, allow_lost: bool = False) -> _GpuState:
        """The GPU behind a handle (a MIG handle's parent), checking it is live."""
        if not isinstance(handle, SimDeviceHandle) or not 0 <= handle.gpu_index < len(self._gpus):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        state = self._gpus[handle.gpu_index]
        if state.lost and not allow_lost:
            raise _err(pynvml.NVML_ERROR_GPU_IS_LOST)
        if handle.mig_uuid is not None:
            self._mig_of(state, handle)
        return state

    def _mig_of(self, state: _GpuState, handle: SimDeviceHandle) -> MigSpec:
        for m in state.mig if state.mig_enabled else []:
            if m.uuid == handle.mig_uuid:
                return m
        # The instance was destroyed by a MIG reconfiguration: the handle is stale.
        raise _err(pynvml.NVML_ERROR_NOT_FOUND)

    def _full_gpu(self, handle: object) -> _GpuState:
        """Like _gpu, for calls that NVML answers only for a physical GPU."""
        state = self._gpu(handle)
        assert isinstance(handle, SimDeviceHandle)
        if handle.mig_uuid is not None:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return state

    def _mig_handle(self, gpu_index: int, m: MigSpec) -> SimDeviceHandle:
        h = self._mig_handles.get(m.uuid)
        if h is None:
            h = self._mig_handles[m.uuid] = SimDeviceHandle(gpu_index, m.uuid)
        return h

    def _catalogue(self, state: _GpuState) -> dict[str, mig.MigProfile]:
        cat = mig.catalogue_for(state.spec.name)
        if cat is None:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return cat

    # ---------------------------------------------------------------- init and system

    @_nvml(requires_init=False)
    def nvmlInitWithFlags(self, flags: int) -> None:
        self._init_count += 1

    @_nvml(requires_init=False)
    def nvmlInit(self) -> None:
        self.nvmlInitWithFlags(0)

    @_nvml()
    def nvmlShutdown(self) -> None:
        self._init_count -= 1
        if self._init_count == 0:
            # NVML is gone: blocked waiters must not sleep on.
            self._cond.notify_all()

    @_nvml(requires_init=False)
    def nvmlErrorString(self, result: int) -> str:
        return str(pynvml.NVMLError(result))

    @_nvml()
    def nvmlSystemGetDriverVersion(self) -> str:
        return self._spec.driver_version

    @_nvml()
    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return self._spec.cuda_driver_version

    @_nvml()
    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        return self._spec.cuda_driver_version

    # ---------------------------------------------------------------- devices

    @_nvml()
    def nvmlDeviceGetCount(self) -> int:
        # A GPU that fell off the bus stays counted until the driver is reloaded; only calls
        # that reach it fail.
        return len(self._gpus)

    @_nvml()
    def nvmlDeviceGetHandleByIndex(self, index: int) -> SimDeviceHandle:
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(self._gpus):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if self._gpus[index].lost:
            raise _err(pynvml.NVML_ERROR_GPU_IS_LOST)
        return self._gpu_handles[index]

    @_nvml()
    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> SimDeviceHandle:
        text = uuid.decode() if isinstance(uuid, bytes) else uuid
        if not isinstance(text, str):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        for i, state in enumerate(self._gpus):
            if state.spec.uuid == text:
                if state.lost:
                    raise _err(pynvml.NVML_ERROR_GPU_IS_LOST)
                return self._gpu_handles[i]
            for m in state.mig if state.mig_enabled else []:
                if m.uuid == text:
                    if state.lost:
                        raise _err(pynvml.NVML_ERROR_GPU_IS_LOST)
                    return self._mig_handle(i, m)
        raise _err(pynvml.NVML_ERROR_NOT_FOUND)

    @_nvml()
    def nvmlDeviceGetUUID(self, handle: object) -> str:
        state = self._gpu(handle)
        assert isinstance(handle, SimDeviceHandle)
        return handle.mig_uuid if handle.mig_uuid is not None else state.spec.uuid

    @_nvml()
    def nvmlDeviceGetName(self, handle: object) -> str:
        state = self._gpu(handle)
        assert isinstance(handle, SimDeviceHandle)
        if handle.mig_uuid is not None:
            return f"{state.spec.name} MIG {self._mig_of(state, handle).profile}"
        return state.spec.name

    @_nvml()
    def nvmlDeviceGetIndex(self, handle: object) -> int:
        return self._full_gpu(handle).spec.index

    @_nvml()
    def nvmlDeviceGetMinorNumber(self, handle: object) -> int:
        return self._full_gpu(handle).spec.minor

    @_nvml()
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

    @_nvml()
    def nvmlDeviceGetPciInfo_v3(self, handle: object) -> Any:
        spec = self._gpu(handle).spec
        return self._pci_info(spec.pci_bus_id, spec.pci_device_id)

    @_nvml()
    def nvmlDeviceGetPciInfo(self, handle: object) -> Any:
        return self.nvmlDeviceGetPciInfo_v3(handle)

    @staticmethod
    def _pci_info(bus_id: str, device_id: int) -> Any:
        domain_s, bus_s, rest = bus_id.split(":")
        dev_s = rest.split(".")[0]
        info = pynvml.nvmlPciInfo_t()
        info.busId = bus_id
        info.busIdLegacy = f"{int(domain_s, 16):04X}:{bus_s}:{rest}"
        info.domain = int(domain_s, 16)
        info.bus = int(bus_s, 16)
        info.device = int(dev_s, 16)
        info.pciDeviceId = device_id
        info.pciSubSystemId = 0
        return info

    @_nvml()
    def nvmlDeviceGetCudaComputeCapability(self, handle: object) -> tuple[int, int]:
        return self._gpu(handle).spec.compute_capability

    @_nvml()
    def nvmlDeviceGetNumaNodeId(self, handle: object) -> int:
        numa = self._full_gpu(handle).spec.numa_node
        if numa is None:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return numa

    @_nvml()
    def nvmlDeviceGetTopologyCommonAncestor(self, device1: object, device2: object) -> int:
        a = self._full_gpu(device1).spec.index
        b = self._full_gpu(device2).spec.index
        if a == b:
            return int(pynvml.NVML_TOPOLOGY_INTERNAL)
        return self._spec.ancestors[(min(a, b), max(a, b))]

    def _link(self, device: object, link: int) -> tuple[str, bool]:
        links = self._links[self._full_gpu(device).spec.index]
        if isinstance(link, bool) or not isinstance(link, int) or not 0 <= link < pynvml.NVML_NVLINK_MAX_LINKS:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if link >= len(links):
            # A GPU without NVLink (or a link number past its last one) answers NotSupported.
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return links[link]

    @_nvml()
    def nvmlDeviceGetNvLinkState(self, device: object, link: int) -> int:
        self._link(device, link)
        return int(pynvml.NVML_FEATURE_ENABLED)

    @_nvml()
    def nvmlDeviceGetNvLinkRemotePciInfo(self, device: object, link: int) -> Any:
        bus, is_gpu = self._link(device, link)
        device_id = next((g.pci_device_id for g in self._spec.gpus if g.pci_bus_id == bus), 0x000010DE)
        return self._pci_info(bus, device_id if is_gpu else 0x000010DE)

    @_nvml()
    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: object, link: int) -> int:
        _, is_gpu = self._link(handle, link)
        return int(pynvml.NVML_NVLINK_DEVICE_TYPE_GPU if is_gpu else pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH)

    # ---------------------------------------------------------------- MIG

    @_nvml()
    def nvmlDeviceGetMigMode(self, device: object) -> list[int]:
        state = self._full_gpu(device)
        self._catalogue(state)
        mode = int(pynvml.NVML_DEVICE_MIG_ENABLE if state.mig_enabled else pynvml.NVML_DEVICE_MIG_DISABLE)
        return [mode, mode]

    @_nvml()
    def nvmlDeviceGetMaxMigDeviceCount(self, device: object) -> int:
        self._catalogue(self._full_gpu(device))
        return mig.COMPUTE_SLICES

    @_nvml()
    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: object, index: int) -> SimDeviceHandle:
        state = self._full_gpu(device)
        self._catalogue(state)
        if not state.mig_enabled:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < mig.COMPUTE_SLICES:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if index >= len(state.mig):
            raise _err(pynvml.NVML_ERROR_NOT_FOUND)
        return self._mig_handle(state.spec.index, state.mig[index])

    @_nvml()
    def nvmlDeviceIsMigDeviceHandle(self, device: object) -> ctypes.c_uint:
        self._gpu(device, allow_lost=True)
        assert isinstance(device, SimDeviceHandle)
        # The binding returns the c_uint itself, not its value; keep that quirk.
        return ctypes.c_uint(1 if device.mig_uuid is not None else 0)

    @_nvml()
    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, migDevice: object) -> SimDeviceHandle:
        self._gpu(migDevice)
        assert isinstance(migDevice, SimDeviceHandle)
        if migDevice.mig_uuid is None:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._gpu_handles[migDevice.gpu_index]

    def _mig_device(self, device: object) -> tuple[_GpuState, MigSpec]:
        state = self._gpu(device)
        assert isinstance(device, SimDeviceHandle)
        if device.mig_uuid is None:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return state, self._mig_of(state, device)

    @_nvml()
    def nvmlDeviceGetGpuInstanceId(self, device: object) -> int:
        return self._mig_device(device)[1].gi

    @_nvml()
    def nvmlDeviceGetComputeInstanceId(self, device: object) -> int:
        return self._mig_device(device)[1].ci

    @_nvml()
    def nvmlDeviceGetAttributes_v2(self, device: object) -> Any:
        state = self._gpu(device)
        assert isinstance(device, SimDeviceHandle)
        attrs = pynvml.c_nvmlDeviceAttributes()
        if device.mig_uuid is None:
            # A full GPU reports itself as one instance spanning every slice.
            cat = mig.catalogue_for(state.spec.name)
            full = cat["7g.80gb"] if cat and "7g.80gb" in cat else None
            attrs.multiprocessorCount = full.multiprocessors if full else 58
            attrs.gpuInstanceSliceCount = attrs.computeInstanceSliceCount = mig.COMPUTE_SLICES if full else 1
            attrs.memorySizeMB = state.spec.memory_mib
            return attrs
        prof = self._catalogue(state)[self._mig_of(state, device).profile]
        attrs.multiprocessorCount = prof.multiprocessors
        attrs.sharedCopyEngineCount = prof.copy_engines
        attrs.sharedDecoderCount = prof.decoders
        attrs.sharedEncoderCount = 0
        attrs.sharedJpegCount = prof.jpegs
        attrs.sharedOfaCount = prof.ofas
        attrs.gpuInstanceSliceCount = prof.compute_slices
        attrs.computeInstanceSliceCount = prof.compute_slices  # one CI spans its whole GI
        attrs.memorySizeMB = prof.memory_mib
        return attrs

    @_nvml()
    def nvmlDeviceGetAttributes(self, device: object) -> Any:
        return self.nvmlDeviceGetAttributes_v2(device)

    @_nvml()
    def nvmlDeviceGetGpuInstanceProfileInfo(self, device: object, profile: int, version: int = 2) -> Any:
        state = self._full_gpu(device)
        cat = self._catalogue(state)
        if version not in (1, 2):
            raise _err(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        if isinstance(profile, bool) or not isinstance(profile, int) or not 0 <= profile < pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        prof = next((p for p in cat.values() if p.enum == profile), None)
        if prof is None:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        info = pynvml.c_nvmlGpuInstanceProfileInfo_v2_t() if version == 2 else pynvml.c_nvmlGpuInstanceProfileInfo_t()
        info.id = prof.profile_id
        info.isP2pSupported = 0
        info.sliceCount = prof.compute_slices
        info.instanceCount = prof.max_instances
        info.multiprocessorCount = prof.multiprocessors
        info.copyEngineCount = prof.copy_engines
        info.decoderCount = prof.decoders
        info.encoderCount = 0
        info.jpegCount = prof.jpegs
        info.ofaCount = prof.ofas
        info.memorySizeMB = prof.memory_mib
        if version == 2:
            info.name = f"MIG {prof.name}"
        return info

    @_nvml()
    def nvmlDeviceGetGpuInstanceProfileInfoV(self, device: object, profile: int, version: int = 2) -> Any:
        return self.nvmlDeviceGetGpuInstanceProfileInfo(device, profile, version)

    @_nvml()
    def nvmlDeviceGetGpuInstanceById(self, device: object, gpuInstanceId: int) -> SimGpuInstanceHandle:
        state = self._full_gpu(device)
        self._catalogue(state)
        if not state.mig_enabled:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not any(m.gi == gpuInstanceId for m in state.mig):
            raise _err(pynvml.NVML_ERROR_NOT_FOUND)
        return SimGpuInstanceHandle(state.spec.index, gpuInstanceId, state.mig_generation)

    @_nvml()
    def nvmlGpuInstanceGetInfo(self, gpuInstance: object) -> SimGpuInstanceInfo:
        if not isinstance(gpuInstance, SimGpuInstanceHandle) or not 0 <= gpuInstance.gpu_index < len(self._gpus):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        state = self._gpus[gpuInstance.gpu_index]
        if state.lost:
            raise _err(pynvml.NVML_ERROR_GPU_IS_LOST)
        found = next((m for m in state.mig if m.gi == gpuInstance.gi), None)
        if found is None or gpuInstance.generation != state.mig_generation or not state.mig_enabled:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        prof = self._catalogue(state)[found.profile]
        placement = pynvml.c_nvmlGpuInstancePlacement_t()
        placement.start, placement.size = found.placement, prof.memory_slices
        return SimGpuInstanceInfo(self._gpu_handles[state.spec.index], found.gi, prof.profile_id, placement)

    # ---------------------------------------------------------------- events

    @_nvml()
    def nvmlEventSetCreate(self) -> SimEventSet:
        es = SimEventSet()
        self._event_sets.append(es)
        return es

    def _event_set(self, eventSet: object) -> SimEventSet:
        if not isinstance(eventSet, SimEventSet) or eventSet.freed or eventSet not in self._event_sets:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return eventSet

    def _supported_events(self, state: _GpuState) -> int:
        mask = int(pynvml.nvmlEventTypeXidCriticalError)
        if state.spec.ecc_events:
            mask |= _ECC_EVENTS
        return mask

    @_nvml()
    def nvmlDeviceGetSupportedEventTypes(self, handle: object) -> int:
        return self._supported_events(self._full_gpu(handle))

    @_nvml()
    def nvmlDeviceRegisterEvents(self, handle: object, eventTypes: int, eventSet: object) -> None:
        # Events are registered on physical GPUs; MIG-specific ones carry GI/CI ids.
        state = self._full_gpu(handle)
        es = self._event_set(eventSet)
        if eventTypes & ~self._supported_events(state):
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        es.registered[state.spec.index] = es.registered.get(state.spec.index, 0) | int(eventTypes)

    @_nvml()
    def nvmlEventSetWait_v2(self, eventSet: object, timeoutms: int) -> SimEventData:
        es = self._event_set(eventSet)
        deadline = time.monotonic() + max(0, int(timeoutms)) / 1000.0
        while True:
            if es.queue:
                return es.queue.popleft()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _err(pynvml.NVML_ERROR_TIMEOUT)
            self._cond.wait(remaining)
            # Whatever woke us may have changed the rules: shutdown, free, an injected failure.
            if self._init_count == 0:
                raise _err(pynvml.NVML_ERROR_UNINITIALIZED)
            self._event_set(es)
            self._maybe_fail("nvmlEventSetWait_v2")

    @_nvml()
    def nvmlEventSetWait(self, eventSet: object, timeoutms: int) -> SimEventData:
        return self.nvmlEventSetWait_v2(eventSet, timeoutms)

    @_nvml()
    def nvmlEventSetFree(self, eventSet: object) -> None:
        es = self._event_set(eventSet)
        es.freed = True
        self._event_sets.remove(es)
        self._cond.notify_all()

    # ---------------------------------------------------------------- memory health, compute mode

    @_nvml()
    def nvmlDeviceGetRetiredPagesPendingStatus(self, device: object) -> int:
        state = self._full_gpu(device)
        if not state.spec.retired_pages:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return int(pynvml.NVML_FEATURE_ENABLED if state.pending_retirement else pynvml.NVML_FEATURE_DISABLED)

    @_nvml()
    def nvmlDeviceGetRemappedRows(self, device: object) -> tuple[int, int, int, int]:
        state = self._full_gpu(device)
        if not state.spec.remapped_rows:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return (state.corrected_rows, state.uncorrected_rows, int(state.remapped_rows_pending), 0)

    @_nvml()
    def nvmlDeviceGetComputeMode(self, handle: object) -> int:
        return self._full_gpu(handle).compute_mode

    @_nvml()
    def nvmlDeviceSetComputeMode(self, handle: object, mode: int) -> None:
        state = self._full_gpu(handle)
        valid = (pynvml.NVML_COMPUTEMODE_DEFAULT, pynvml.NVML_COMPUTEMODE_PROHIBITED, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
        if mode == pynvml.NVML_COMPUTEMODE_EXCLUSIVE_THREAD:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)  # removed from NVML
        if mode not in valid:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        state.compute_mode = int(mode)

    # ---------------------------------------------------------------- fault injection

    def _find(self, uuid: str) -> tuple[_GpuState, MigSpec | None]:
        for state in self._gpus:
            if state.spec.uuid == uuid:
                return state, None
            for m in state.mig if state.mig_enabled else []:
                if m.uuid == uuid:
                    return state, m
        raise ValueError(f"no GPU or MIG device with UUID {uuid!r} in simulated node {self._spec.name!r}")

    def _find_gpu(self, uuid: str, what: str) -> _GpuState:
        state, m = self._find(uuid)
        if m is not None:
            raise ValueError(f"{what} needs a GPU UUID, {uuid} is a MIG device")
        return state

    def _deliver(self, state: _GpuState, event_type: int, data: int, gi: int, ci: int) -> None:
        event = SimEventData(self._gpu_handles[state.spec.index], int(event_type), data, gi, ci)
        for es in self._event_sets:
            if es.registered.get(state.spec.index, 0) & event_type:
                es.queue.append(event)
        self._cond.notify_all()

    def _instance_ids(self, m: MigSpec | None, gpu_instance: int | None, compute_instance: int | None) -> tuple[int, int]:
        if m is not None:
            return m.gi, m.ci
        gi = _NO_INSTANCE if gpu_instance is None else gpu_instance
        ci = _NO_INSTANCE if compute_instance is None else compute_instance
        return gi, ci

    def inject_xid(self, uuid: str, xid: int, gpu_instance: int | None = None, compute_instance: int | None = None) -> None:
        """Deliver an XID critical-error event for a GPU or (by its UUID) a MIG device."""
        with self._cond:
            state, m = self._find(uuid)
            gi, ci = self._instance_ids(m, gpu_instance, compute_instance)
            self._deliver(state, pynvml.nvmlEventTypeXidCriticalError, int(xid), gi, ci)

    def inject_ecc(self, uuid: str, kind: str = "double", gpu_instance: int | None = None, compute_instance: int | None = None) -> None:
        """Deliver a single- or double-bit ECC event (`kind` is "single" or "double")."""
        types = {"single": pynvml.nvmlEventTypeSingleBitEccError, "double": pynvml.nvmlEventTypeDoubleBitEccError}
        if kind not in types:
            raise ValueError(f"ECC kind must be 'single' or 'double', got {kind!r}")
        with self._cond:
            state, m = self._find(uuid)
            gi, ci = self._instance_ids(m, gpu_instance, compute_instance)
            self._deliver(state, types[kind], 0, gi, ci)

    def lose(self, uuid: str) -> None:
        """The GPU falls off the bus: its calls raise GpuIsLost and an XID 79 event is sent."""
        with self._cond:
            state = self._find_gpu(uuid, "lose")
            state.lost = True
            self._deliver(state, pynvml.nvmlEventTypeXidCriticalError, _XID_GPU_LOST, _NO_INSTANCE, _NO_INSTANCE)

    def restore(self, uuid: str) -> None:
        """The lost GPU is reachable and healthy again (same handles, same MIG layout)."""
        with self._cond:
            self._find_gpu(uuid, "restore").lost = False
            self._cond.notify_all()

    def reset(self, uuid: str) -> None:
        """A GPU reset: reachable again, pending page retirement and row remapping applied."""
        with self._cond:
            state = self._find_gpu(uuid, "reset")
            state.lost = False
            state.pending_retirement = False
            state.remapped_rows_pending = False
            self._cond.notify_all()

    def set_pending_retirement(self, uuid: str, pending: bool = True) -> None:
        """Set whether the GPU has retired pages waiting for a reset."""
        with self._cond:
            self._find_gpu(uuid, "set_pending_retirement").pending_retirement = pending

    def set_remapped_rows_pending(self, uuid: str, pending: bool = True) -> None:
        """Set whether the GPU has row remappings waiting for a reset."""
        with self._cond:
            state = self._find_gpu(uuid, "set_remapped_rows_pending")
            if pending and not state.remapped_rows_pending:
                state.uncorrected_rows += 1
            state.remapped_rows_pending = pending

    def set_mig_layout(self, gpu_index: int, profiles: list[str] | None) -> list[str]:
        """Reconfigure MIG on one GPU; None disables MIG. Returns the new MIG UUIDs in order.

        New UUIDs derive from the GPU UUID, the number of layout changes so far, and each
        instance's GI/CI ids, so the same sequence of changes always gives the same UUIDs.
        """
        with self._cond:
            if not 0 <= gpu_index < len(self._gpus):
                raise ValueError(f"no GPU with index {gpu_index} (the node has {len(self._gpus)})")
            state = self._gpus[gpu_index]
            cat = mig.catalogue_for(state.spec.name)
            if cat is None:
                raise ValueError(f"GPU {gpu_index} ({state.spec.name}) is not MIG-capable")
            new: list[MigSpec] = []
            if profiles is None:
                state.mig_enabled = False
            else:
                unknown = [p for p in profiles if p not in cat]
                if unknown:
                    raise ValueError(f"unknown MIG profile(s) {unknown} for {state.spec.name} (known: {sorted(cat)})")
                chosen = [cat[p] for p in profiles]
                starts = mig.place(chosen)
                if starts is None:
                    raise ValueError(f"MIG layout {profiles} does not fit on {state.spec.name}")
                generation = state.mig_generation + 1
                for prof, start in zip(chosen, starts, strict=True):
                    gi = mig.gi_id_for(prof, start)
                    uuid = derived_mig_uuid(state.spec.uuid, generation, gi, 0, prof.name)
                    new.append(MigSpec(profile=prof.name, placement=start, gi=gi, ci=0, uuid=uuid))
                state.mig_enabled = True
            state.mig_generation += 1
            state.mig = new
            return [m.uuid for m in new]

    def fail(self, function_name: str, error_code: int, count: int | None = None) -> None:
        """Make an NVML function raise `NVMLError(error_code)` `count` times (None: until cleared)."""
        if function_name not in self.nvml_functions():
            raise ValueError(f"the simulator has no NVML function {function_name!r}")
        if isinstance(error_code, bool) or not isinstance(error_code, int) or error_code == pynvml.NVML_SUCCESS:
            raise ValueError(f"error_code must be a non-zero NVML return code, got {error_code!r}")
        if count is not None and count < 1:
            raise ValueError(f"count must be >= 1 or None, got {count}")
        with self._cond:
            self._failures[function_name] = [error_code, count]
            self._cond.notify_all()  # a blocked wait should notice

    def clear_failures(self, function_name: str | None = None) -> None:
        """Stop injected failures of one function, or of all."""
        with self._cond:
            if function_name is None:
                self._failures.clear()
            else:
                self._failures.pop(function_name, None)

    def gpu_uuids(self) -> list[str]:
        return [g.spec.uuid for g in self._gpus]

    def mig_uuids(self, gpu_index: int) -> list[str]:
        with self._cond:
            state = self._gpus[gpu_index]
            return [m.uuid for m in state.mig] if state.mig_enabled else []
