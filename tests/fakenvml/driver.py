"""A child process that calls the real `pynvml` binding on a test's behalf, one call at a time.

Run as `python -m tests.fakenvml.driver` in an environment from `tests.fakenvml.environ`; the test
(through `tests.fakenvml.Driver`) writes one Python expression a line on stdin and reads one JSON
line back: {"ok": value} or {"nvml": code} when the binding raised NVMLError. The expression sees
`pynvml`, `ctypes`, `gpu(i)` (a handle by index), `dev(uuid)` (a handle by UUID), `events` (an
event set registered for XID and ECC events on every GPU, made by `open_events()`) and
`wait(ms)` (the next event of that set as a dict), and the MIG helpers in `HELPERS` (`placement`,
`gpu_instances`, `compute_instances`, `placements`, `mig_uuids`). Structures come back as dicts of their fields.
The process lives between calls, so a fault the test sends meanwhile is seen by the next call.
"""

from __future__ import annotations

import ctypes
import json
import sys
from typing import Any

import pynvml

events: Any = None
registered: dict[int | None, str] = {}  # handle address -> UUID: a lost GPU's handle cannot tell its own


def gpu(index: int) -> Any:
    return pynvml.nvmlDeviceGetHandleByIndex(index)


def dev(uuid: str) -> Any:
    return pynvml.nvmlDeviceGetHandleByUUID(uuid)


def open_events() -> dict[str, int]:
    """An event set with XID and ECC events on every GPU; returns what each GPU registered."""
    global events
    events = pynvml.nvmlEventSetCreate()
    wanted = (
        pynvml.nvmlEventTypeXidCriticalError
        | pynvml.nvmlEventTypeSingleBitEccError
        | pynvml.nvmlEventTypeDoubleBitEccError
    )
    done = {}
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = gpu(i)
        mask = wanted & pynvml.nvmlDeviceGetSupportedEventTypes(h)
        pynvml.nvmlDeviceRegisterEvents(h, mask, events)
        uuid = pynvml.nvmlDeviceGetUUID(h)
        registered[ctypes.cast(h, ctypes.c_void_p).value] = uuid
        done[uuid] = int(mask)
    return done


def wait(ms: int, version: int = 2) -> dict[str, Any]:
    call = pynvml.nvmlEventSetWait_v2 if version == 2 else pynvml.nvmlEventSetWait
    data = call(events, ms)
    return {
        "uuid": registered.get(ctypes.cast(data.device, ctypes.c_void_p).value, "?"),
        "eventType": int(data.eventType),
        "eventData": int(data.eventData),
        "gpuInstanceId": int(data.gpuInstanceId),
        "computeInstanceId": int(data.computeInstanceId),
    }


def placement(start: int, size: int) -> Any:
    """A GPU-instance placement passed by reference, as nvmlDeviceCreateGpuInstanceWithPlacement takes it."""
    p = pynvml.c_nvmlGpuInstancePlacement_t()
    p.start, p.size = start, size
    return ctypes.byref(p)


def gpu_instances(device: Any, profile_id: int) -> list[Any]:
    """nvmlDeviceGetGpuInstances into a ctypes array: the GPU instances of a profile."""
    count = ctypes.c_uint(7)
    found = (pynvml.c_nvmlGpuInstance_t * 7)()
    pynvml.nvmlDeviceGetGpuInstances(device, profile_id, found, ctypes.byref(count))
    return list(found[: count.value])


def compute_instances(gpu_instance: Any, profile: int) -> list[Any]:
    """nvmlGpuInstanceGetComputeInstances into a ctypes array: the compute instances of a profile."""
    count = ctypes.c_uint(8)
    found = (pynvml.c_nvmlComputeInstance_t * 8)()
    pynvml.nvmlGpuInstanceGetComputeInstances(gpu_instance, profile, found, ctypes.byref(count))
    return list(found[: count.value])


def placements(device: Any, profile_id: int, nvml: Any = pynvml) -> list[list[int]]:
    """nvmlDeviceGetGpuInstancePossiblePlacements: the count first (a NULL array), then the
    placements as [start, size]; `nvml` is the binding or the simulator, which take the same arrays."""
    count = ctypes.c_uint(0)
    nvml.nvmlDeviceGetGpuInstancePossiblePlacements(device, profile_id, None, ctypes.byref(count))
    found = (pynvml.c_nvmlGpuInstancePlacement_t * count.value)()
    nvml.nvmlDeviceGetGpuInstancePossiblePlacements(device, profile_id, found, ctypes.byref(count))
    return [[int(p.start), int(p.size)] for p in found[: count.value]]


def mig_uuids(device: Any, nvml: Any = pynvml) -> list[str]:
    """The UUIDs of a GPU's MIG devices in index order (the binding or the simulator as `nvml`)."""
    out = []
    for j in range(nvml.nvmlDeviceGetMaxMigDeviceCount(device)):
        try:
            out.append(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetMigDeviceHandleByIndex(device, j)))
        except pynvml.NVMLError_NotFound:
            break
    return out


HELPERS = {
    "placement": placement,
    "gpu_instances": gpu_instances,
    "compute_instances": compute_instances,
    "placements": placements,
    "mig_uuids": mig_uuids,
}


def plain(value: Any) -> Any:
    """A JSON-able form of what the binding returned."""
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    if isinstance(value, ctypes.Structure):
        return {name: plain(getattr(value, name)) for name, *_ in value._fields_}
    if isinstance(value, ctypes.Array):
        return [plain(v) for v in value]
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, ctypes._SimpleCData):
        return plain(value.value)
    if isinstance(value, ctypes._Pointer) or value is None:
        return None if value is None else "<handle>"
    return value


def main() -> None:
    scope = {
        "pynvml": pynvml,
        "ctypes": ctypes,
        "gpu": gpu,
        "dev": dev,
        "open_events": open_events,
        "wait": wait,
        **HELPERS,
    }
    for line in sys.stdin:
        try:
            answer: dict[str, Any] = {"ok": plain(eval(line, scope))}  # the test's own expressions
        except pynvml.NVMLError as exc:
            answer = {"nvml": int(exc.value)}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
