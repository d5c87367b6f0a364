"""A child process that calls the real `pynvml` binding on a test's behalf, one call at a time.

Run as `python -m tests.fakenvml.driver` in an environment from `tests.fakenvml.environ`; the test
(through `tests.fakenvml.Driver`) writes one Python expression a line on stdin and reads one JSON
line back: {"ok": value} or {"nvml": code} when the binding raised NVMLError. The expression sees
`pynvml`, `ctypes`, `gpu(i)` (a handle by index), `dev(uuid)` (a handle by UUID), `events` (an
event set registered for XID and ECC events on every GPU, made by `open_events()`) and
`wait(ms)` (the next event of that set as a dict). Structures come back as dicts of their fields.
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
    }
    for line in sys.stdin:
        try:
            answer: dict[str, Any] = {"ok": plain(eval(line, scope))}  # the test's own expressions
        except pynvml.NVMLError as exc:
            answer = {"nvml": int(exc.value)}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
