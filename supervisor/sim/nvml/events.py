"""The simulator's event sets: create, register, wait (blocking on the lock's condition), free."""

from __future__ import annotations

import time

import pynvml

from supervisor.sim.nvml.base import (
    GpuState,
    SimEventData,
    SimEventSet,
    SimulatorBase,
    nvml_error,
    nvml_function,
)

_ECC_EVENTS = pynvml.nvmlEventTypeSingleBitEccError | pynvml.nvmlEventTypeDoubleBitEccError


class EventFunctions(SimulatorBase):
    """nvmlEventSet* and the event registration functions."""

    # ---------------------------------------------------------------- events

    @nvml_function()
    def nvmlEventSetCreate(self) -> SimEventSet:
        es = SimEventSet()
        self._event_sets.append(es)
        return es

    def _event_set(self, eventSet: object) -> SimEventSet:
        if not isinstance(eventSet, SimEventSet) or eventSet.freed or eventSet not in self._event_sets:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return eventSet

    def _supported_events(self, state: GpuState) -> int:
        mask = int(pynvml.nvmlEventTypeXidCriticalError)
        if state.spec.ecc_events:
            mask |= _ECC_EVENTS
        return mask

    @nvml_function()
    def nvmlDeviceGetSupportedEventTypes(self, handle: object) -> int:
        return self._supported_events(self._full_gpu(handle))

    @nvml_function()
    def nvmlDeviceRegisterEvents(self, handle: object, eventTypes: int, eventSet: object) -> None:
        # Events are registered on physical GPUs; MIG-specific ones carry GI/CI ids.
        state = self._full_gpu(handle)
        es = self._event_set(eventSet)
        if eventTypes & ~self._supported_events(state):
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        es.registered[state.spec.index] = es.registered.get(state.spec.index, 0) | int(eventTypes)

    @nvml_function()
    def nvmlEventSetWait_v2(self, eventSet: object, timeoutms: int) -> SimEventData:
        es = self._event_set(eventSet)
        deadline = time.monotonic() + max(0, int(timeoutms)) / 1000.0
        while True:
            if es.queue:
                return es.queue.popleft()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise nvml_error(pynvml.NVML_ERROR_TIMEOUT)
            self._cond.wait(remaining)
            # Whatever woke us may have changed the rules: shutdown, free, an injected failure.
            if self._init_count == 0:
                raise nvml_error(pynvml.NVML_ERROR_UNINITIALIZED)
            self._event_set(es)
            self._maybe_fail("nvmlEventSetWait_v2")

    @nvml_function()
    def nvmlEventSetWait(self, eventSet: object, timeoutms: int) -> SimEventData:
        return self.nvmlEventSetWait_v2(eventSet, timeoutms)

    @nvml_function()
    def nvmlEventSetFree(self, eventSet: object) -> None:
        es = self._event_set(eventSet)
        es.freed = True
        self._event_sets.remove(es)
        self._cond.notify_all()
