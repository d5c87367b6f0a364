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

The functions are grouped one module per area (`devices`, `migfuncs`, `migcreate`, `events`, fault injection
in `faults`, the shared state and lookups in `base`); this class only composes them and names
the binding's constants.
"""

from __future__ import annotations

from pathlib import Path

import pynvml

from supervisor.sim.nvml.devices import DeviceFunctions
from supervisor.sim.nvml.events import EventFunctions
from supervisor.sim.nvml.faults import FaultInjection
from supervisor.sim.nvml.migcreate import MigLifecycle
from supervisor.sim.nvml.pcitree import write_sysfs


class Simulator(DeviceFunctions, MigLifecycle, EventFunctions, FaultInjection):
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
    NVML_ERROR_IN_USE = pynvml.NVML_ERROR_IN_USE
    NVML_ERROR_INSUFFICIENT_RESOURCES = pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES
    NVML_ERROR_RESET_REQUIRED = pynvml.NVML_ERROR_RESET_REQUIRED
    NVML_GPU_INSTANCE_PROFILE_COUNT = pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT
    NVML_FEATURE_DISABLED = pynvml.NVML_FEATURE_DISABLED
    NVML_FEATURE_ENABLED = pynvml.NVML_FEATURE_ENABLED
    NVML_COMPUTEMODE_DEFAULT = pynvml.NVML_COMPUTEMODE_DEFAULT
    NVML_COMPUTEMODE_EXCLUSIVE_PROCESS = pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    nvmlEventTypeXidCriticalError = pynvml.nvmlEventTypeXidCriticalError
    nvmlEventTypeSingleBitEccError = pynvml.nvmlEventTypeSingleBitEccError
    nvmlEventTypeDoubleBitEccError = pynvml.nvmlEventTypeDoubleBitEccError

    def write_sysfs(self, root: str | Path) -> Path:
        """Write this node's PCIe tree under `root` (`pcitree`): the sysfs its GPUs hang in."""
        return write_sysfs(self.spec.gpus, root)
