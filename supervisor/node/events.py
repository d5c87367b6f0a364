"""NVML's health events: an event set with XID and ECC events on every GPU that supports them.

`EventWatch.open(nvml)` builds the set over the adapter (supervisor/node/nvml.py) and `wait()`
returns one `NvmlEvent` at a time, naming the physical GPU and, on a MIG GPU, the GPU and compute
instance. A GPU that cannot register is left out with the reason (`skipped`), never the whole set.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal

from supervisor.node.nvml import (
    NO_INSTANCE,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_TIMEOUT,
    NVML_ERROR_UNKNOWN,
    Nvml,
    NvmlCallError,
    handle_key,
    text,
)

log = logging.getLogger("gpuvisor.nvml")

EventKind = Literal["xid", "single-bit-ecc", "double-bit-ecc", "other"]


@dataclass(frozen=True)
class NvmlEvent:
    """One event from the event set. `gpu_uuid` is None when NVML named a device we cannot tell."""

    gpu_uuid: str | None
    event_type: int  # nvmlEventType* bit
    kind: EventKind
    data: int  # eventData: the XID number for XID events
    gi_id: int | None  # GPU instance on a MIG GPU, None when the event names none
    ci_id: int | None

    @property
    def xid(self) -> int | None:
        return self.data if self.kind == "xid" else None


class EventWatch:
    """An NVML event set with XID and ECC events registered on every GPU that supports them."""

    def __init__(
        self,
        nvml: Nvml,
        event_set: Any,
        uuids: dict[Any, str],
        registered: dict[str, int],
        skipped: dict[str, str],
    ) -> None:
        self._nvml = nvml
        self._set = event_set
        self._uuids = uuids
        self.registered = registered  # GPU UUID -> registered event mask
        self.skipped = skipped  # GPU UUID (or "index N") -> why nothing is registered for it
        self._closed = False

    def wait(self, timeout_ms: int) -> NvmlEvent | None:
        """The next event, or None when `timeout_ms` passes. Other NVML errors raise NvmlCallError."""
        m = self._nvml.module
        try:
            data = m.nvmlEventSetWait_v2(self._set, timeout_ms)
        except m.NVMLError as exc:
            code = int(getattr(exc, "value", NVML_ERROR_UNKNOWN))
            if code == NVML_ERROR_TIMEOUT:
                return None
            raise NvmlCallError("nvmlEventSetWait_v2", code, exc) from exc
        uuid = self._event_uuid(data.device)
        event_type = int(data.eventType)
        kind: EventKind = "other"
        if event_type & m.nvmlEventTypeXidCriticalError:
            kind = "xid"
        elif event_type & m.nvmlEventTypeDoubleBitEccError:
            kind = "double-bit-ecc"
        elif event_type & m.nvmlEventTypeSingleBitEccError:
            kind = "single-bit-ecc"
        gi, ci = int(data.gpuInstanceId), int(data.computeInstanceId)
        return NvmlEvent(
            gpu_uuid=uuid,
            event_type=event_type,
            kind=kind,
            data=int(data.eventData),
            gi_id=None if gi == NO_INSTANCE else gi,
            ci_id=None if ci == NO_INSTANCE else ci,
        )

    def _event_uuid(self, device: Any) -> str | None:
        """The physical GPU an event names: looked up among the registered handles first, since a
        lost GPU's handle can no longer tell its own UUID."""
        uuid = self._uuids.get(handle_key(device))
        if uuid is not None:
            return uuid
        m = self._nvml.module
        try:
            # Not a handle we registered: if it is a MIG device, report its parent GPU.
            is_mig = m.nvmlDeviceIsMigDeviceHandle(device)
            if bool(getattr(is_mig, "value", is_mig)):
                device = m.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(device)
                uuid = self._uuids.get(handle_key(device))
            return uuid if uuid is not None else text(m.nvmlDeviceGetUUID(device))
        except m.NVMLError:
            return None

    def add(self, uuids: list[str]) -> None:
        """Register GPUs that joined after the set was opened (found again by rediscovery), into
        this set, which the health thread may be waiting on: NVML is thread-safe, and the wait in
        progress delivers their events, so a GPU is watched before it is advertised. A GPU that
        cannot register is recorded in `skipped`, as in `open`; a failure of the set raises."""
        wanted = _wanted(self._nvml)
        for uuid in uuids:
            try:
                h = self._nvml.call("nvmlDeviceGetHandleByUUID", uuid)
                supported = self._nvml.try_call("nvmlDeviceGetSupportedEventTypes", h)
                mask = wanted & (int(supported) if supported is not None else wanted)
                done = _register(self._nvml, h, uuid, mask, self._set)
            except NvmlCallError as exc:
                if not exc.gpu_lost and exc.code != NVML_ERROR_NOT_FOUND:
                    raise
                self.skipped[uuid] = "GPU is lost"
                continue
            if done:
                self._uuids[handle_key(h)] = uuid  # before `registered`: the waiter reads the map
                self.registered[uuid] = done
                self.skipped.pop(uuid, None)
            else:
                self.skipped[uuid] = "no XID/ECC event type supported"

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        m = self._nvml.module
        try:
            m.nvmlEventSetFree(self._set)
        except m.NVMLError as exc:
            # After nvmlShutdown the set is gone with the library state; nothing to free.
            log.debug("nvmlEventSetFree failed: %s", exc)

    def __enter__(self) -> EventWatch:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    @classmethod
    def open(cls, nvml: Nvml) -> EventWatch:
        """An event set with XID and single/double-bit ECC events on every GPU that supports them.

        A GPU that supports none of them, or only some, is registered for what it supports; one
        that is lost, or that fails any other per-GPU call, is skipped with the reason, so one bad
        GPU never costs the others their events. Both are listed in `EventWatch.skipped` /
        `.registered`. What fails the whole set raises NvmlCallError: the set itself or the device
        count, or every GPU failing with an error other than "GPU lost" (then NVML is broken
        rather than one GPU, and the caller's wait-failure handling applies).
        """
        wanted = _wanted(nvml)
        event_set = nvml.call("nvmlEventSetCreate")
        uuids: dict[Any, str] = {}
        registered: dict[str, int] = {}
        skipped: dict[str, str] = {}
        errors: list[NvmlCallError] = []
        try:
            count = int(nvml.call("nvmlDeviceGetCount"))
            for i in range(count):
                uuid = ""
                try:
                    h = nvml.call("nvmlDeviceGetHandleByIndex", i)
                    uuid = text(nvml.call("nvmlDeviceGetUUID", h))
                    supported = nvml.try_call("nvmlDeviceGetSupportedEventTypes", h)
                    mask = wanted & (int(supported) if supported is not None else wanted)
                    done = _register(nvml, h, uuid, mask, event_set)
                except NvmlCallError as exc:
                    key = uuid or f"index {i}"
                    if exc.gpu_lost:
                        skipped[key] = "GPU is lost"
                    else:
                        skipped[key] = f"cannot register its events: {exc}"
                        errors.append(exc)
                    continue
                if done:
                    registered[uuid] = done
                    uuids[handle_key(h)] = uuid
                else:
                    skipped[uuid] = "no XID/ECC event type supported"
            if errors and not registered:
                raise errors[0]
        except NvmlCallError:
            cls(nvml, event_set, {}, {}, {}).close()
            raise
        return cls(nvml, event_set, uuids, registered, skipped)


def _wanted(nvml: Nvml) -> int:
    m = nvml.module
    return int(
        m.nvmlEventTypeXidCriticalError | m.nvmlEventTypeSingleBitEccError | m.nvmlEventTypeDoubleBitEccError
    )


def _register(nvml: Nvml, h: Any, uuid: str, mask: int, event_set: Any) -> int:
    """Register `mask` (type by type if NVML refuses it whole); returns what was registered."""
    if not mask:
        return 0
    try:
        nvml.call("nvmlDeviceRegisterEvents", h, mask, event_set)
        return mask
    except NvmlCallError as exc:
        if exc.gpu_lost:
            return 0
        if exc.code != NVML_ERROR_NOT_SUPPORTED:
            raise
    done = 0
    for bit in (1 << n for n in range(mask.bit_length()) if mask & (1 << n)):
        try:
            nvml.call("nvmlDeviceRegisterEvents", h, bit, event_set)
            done |= bit
        except NvmlCallError as exc:
            if exc.code != NVML_ERROR_NOT_SUPPORTED and not exc.gpu_lost:
                raise
    log.info("GPU %s accepts only event mask 0x%x of 0x%x", uuid, done, mask, extra={"device": uuid})
    return done
