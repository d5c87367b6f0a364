"""The simulator's MIG functions: MIG mode, MIG device handles, attributes and GPU instances.

Creating and destroying instances and changing MIG mode are in `migcreate`, on top of these.
"""

from __future__ import annotations

import ctypes
from typing import Any

import pynvml

from supervisor.sim.nvml import mig
from supervisor.sim.nvml.base import (
    GiRecord,
    GpuState,
    SimDeviceHandle,
    SimGpuInstanceHandle,
    SimGpuInstanceInfo,
    SimulatorBase,
    nvml_error,
    nvml_function,
)
from supervisor.sim.nvml.config import MigSpec


def shared_engines(out: Any, prof: mig.MigProfile) -> None:
    """The multiprocessors and shared engines of `prof` into an NVML struct that names them
    `shared<Engine>Count` (a MIG device's attributes, a compute instance profile's info)."""
    out.multiprocessorCount = prof.multiprocessors
    out.sharedCopyEngineCount = prof.copy_engines
    out.sharedDecoderCount = prof.decoders
    out.sharedEncoderCount = 0
    out.sharedJpegCount = prof.jpegs
    out.sharedOfaCount = prof.ofas


class MigFunctions(SimulatorBase):
    """The nvmlDevice*/nvmlGpuInstance* functions of MIG, over the catalogues in `mig`."""

    # ---------------------------------------------------------------- MIG

    @nvml_function()
    def nvmlDeviceGetMigMode(self, device: object) -> list[int]:
        """[current, pending] (nvml.h: the pending mode is the one after the next activation, a
        reset: `nvmlDeviceSetMigMode`); NOT_SUPPORTED on a GPU without MIG."""
        state = self._full_gpu(device)
        self._catalogue(state)
        on, off = int(pynvml.NVML_DEVICE_MIG_ENABLE), int(pynvml.NVML_DEVICE_MIG_DISABLE)
        return [on if state.mig_enabled else off, on if state.mig_pending else off]

    @nvml_function()
    def nvmlDeviceGetMaxMigDeviceCount(self, device: object) -> int:
        self._catalogue(self._full_gpu(device))
        return mig.COMPUTE_SLICES

    @nvml_function()
    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: object, index: int) -> SimDeviceHandle:
        state = self._full_gpu(device)
        self._catalogue(state)
        if not state.mig_enabled:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < mig.COMPUTE_SLICES:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if index >= len(state.mig):
            raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND)
        return self._mig_handle(state.spec.index, state.mig[index])

    @nvml_function()
    def nvmlDeviceIsMigDeviceHandle(self, device: object) -> ctypes.c_uint:
        self._gpu(device, allow_lost=True)
        assert isinstance(device, SimDeviceHandle)
        # The binding returns the c_uint itself, not its value; keep that quirk.
        return ctypes.c_uint(1 if device.mig_uuid is not None else 0)

    @nvml_function()
    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, migDevice: object) -> SimDeviceHandle:
        self._gpu(migDevice)
        assert isinstance(migDevice, SimDeviceHandle)
        if migDevice.mig_uuid is None:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._gpu_handles[migDevice.gpu_index]

    def _mig_device(self, device: object) -> tuple[GpuState, MigSpec]:
        state = self._gpu(device)
        assert isinstance(device, SimDeviceHandle)
        if device.mig_uuid is None:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return state, self._mig_of(state, device)

    @nvml_function()
    def nvmlDeviceGetGpuInstanceId(self, device: object) -> int:
        return self._mig_device(device)[1].gi

    @nvml_function()
    def nvmlDeviceGetComputeInstanceId(self, device: object) -> int:
        return self._mig_device(device)[1].ci

    @nvml_function()
    def nvmlDeviceGetAttributes_v2(self, device: object) -> Any:
        state = self._gpu(device)
        assert isinstance(device, SimDeviceHandle)
        attrs = pynvml.c_nvmlDeviceAttributes()
        if device.mig_uuid is None:
            # A full GPU reports itself as one instance spanning every slice.
            cat = state.spec.catalogue or {}
            full = next((p for p in cat.values() if p.memory_slices == mig.MEMORY_SLICES), None)
            attrs.multiprocessorCount = full.multiprocessors if full else 58
            attrs.gpuInstanceSliceCount = attrs.computeInstanceSliceCount = mig.COMPUTE_SLICES if full else 1
            attrs.memorySizeMB = state.spec.memory_mib
            return attrs
        prof = self._catalogue(state)[self._mig_of(state, device).profile]
        shared_engines(attrs, prof)
        attrs.gpuInstanceSliceCount = prof.compute_slices
        attrs.computeInstanceSliceCount = prof.compute_slices  # one CI spans its whole GI
        attrs.memorySizeMB = prof.memory_mib
        return attrs

    @nvml_function()
    def nvmlDeviceGetAttributes(self, device: object) -> Any:
        return self.nvmlDeviceGetAttributes_v2(device)

    @nvml_function()
    def nvmlDeviceGetGpuInstanceProfileInfo(self, device: object, profile: int, version: int = 2) -> Any:
        state = self._full_gpu(device)
        cat = self._catalogue(state)
        if version not in (1, 2):
            raise nvml_error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        if (
            isinstance(profile, bool)
            or not isinstance(profile, int)
            or not 0 <= profile < pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT
        ):
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        prof = next((p for p in cat.values() if p.enum == profile), None)
        if prof is None:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        info = (
            pynvml.c_nvmlGpuInstanceProfileInfo_v2_t()
            if version == 2
            else pynvml.c_nvmlGpuInstanceProfileInfo_t()
        )
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

    @nvml_function()
    def nvmlDeviceGetGpuInstanceProfileInfoV(self, device: object, profile: int, version: int = 2) -> Any:
        return self.nvmlDeviceGetGpuInstanceProfileInfo(device, profile, version)

    @nvml_function()
    def nvmlDeviceGetGpuInstanceById(self, device: object, gpuInstanceId: int) -> SimGpuInstanceHandle:
        state = self._full_gpu(device)
        self._catalogue(state)
        if not state.mig_enabled:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        record = state.gis.get(gpuInstanceId) if isinstance(gpuInstanceId, int) else None
        if record is None:
            raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND)
        return SimGpuInstanceHandle(state.spec.index, gpuInstanceId, record.serial)

    def _gi_of(self, gpuInstance: object) -> tuple[GpuState, GiRecord]:
        """The GPU and GPU instance behind a GPU-instance handle: INVALID_ARGUMENT for what is not
        one, or for one whose instance was destroyed (nvml.h: the handle becomes invalid)."""
        if not isinstance(gpuInstance, SimGpuInstanceHandle) or not 0 <= gpuInstance.gpu_index < len(
            self._gpus
        ):
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        state = self._gpus[gpuInstance.gpu_index]
        if state.lost:
            raise nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
        record = state.gis.get(gpuInstance.gi)
        if record is None or record.serial != gpuInstance.serial or not state.mig_enabled:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return state, record

    @nvml_function()
    def nvmlGpuInstanceGetInfo(self, gpuInstance: object) -> SimGpuInstanceInfo:
        state, record = self._gi_of(gpuInstance)
        assert isinstance(gpuInstance, SimGpuInstanceHandle)
        prof = self._catalogue(state)[record.profile]
        placement = pynvml.c_nvmlGpuInstancePlacement_t()
        placement.start, placement.size = record.start, prof.memory_slices
        return SimGpuInstanceInfo(
            self._gpu_handles[state.spec.index], gpuInstance.gi, prof.profile_id, placement
        )
