"""MIG on demand in the simulator: placements, creating and destroying GPU and compute instances,
and MIG mode changes, with NVML's rules and return codes.

Every rule below is NVML's own as `nvml.h` (NVIDIA's header, PyPI `nvidia-nvml-dev`; the same text
as the NVML API reference, "Multi Instance GPU Management") states it for the function, unless it
names another source; call signatures and return values are those of `nvidia-ml-py`'s `pynvml.py`
(13.x), so code written against the real binding runs here:

- An instance created at run time is a MIG device like one a node description lays out: it is
  in `nvmlDeviceGetMigDeviceHandleByIndex` (GPU instances in creation order, layout first, each
  listing its compute instance), `nvmlDeviceGetHandleByUUID`, the memory and attribute queries,
  fault injection by its UUID, and so in what gpuvisor discovers.
- A GPU instance holds at most one compute instance, the one spanning it (the compute-instance
  profile of its whole slice count): what `nvidia-smi mig -cgi <p> -C` makes and what NVIDIA's DRA
  driver creates (v0.4.1 cmd/gpu-kubelet-plugin/nvlib.go skips profiles whose C != G). Smaller
  compute-instance profiles answer NOT_SUPPORTED.
- Handles go stale as nvml.h says ("If the parent device is unbound, reset or the GPU instance is
  destroyed explicitly, the GPU instance handle would become invalid"): INVALID_ARGUMENT after.
- Processes: `set_processes(uuid, n)` (fault injection) says how many processes run on a GPU or
  a MIG device; they make the destroy and MIG-mode calls answer NVML_ERROR_IN_USE.
- Arrays of handles (`nvmlDeviceGetGpuInstances`, `nvmlGpuInstanceGetComputeInstances`) are Python
  lists here, filled in place: a ctypes array cannot hold a simulator handle. Placements are the
  binding's own ctypes arrays, as with the real library.
"""

from __future__ import annotations

import ctypes
from typing import Any

import pynvml

from supervisor.sim.nvml import mig
from supervisor.sim.nvml.base import (
    GiRecord,
    GpuState,
    SimComputeInstanceHandle,
    SimComputeInstanceInfo,
    SimGpuInstanceHandle,
    nvml_error,
    nvml_function,
)
from supervisor.sim.nvml.config import MigSpec
from supervisor.sim.nvml.devices import _out_struct
from supervisor.sim.nvml.migfuncs import MigFunctions, shared_engines

_SUCCESS = int(pynvml.NVML_SUCCESS)


def _uint(value: object) -> int:
    """An `unsigned int` argument: a non-negative int that fits 32 bits, else INVALID_ARGUMENT."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 0xFFFFFFFF:
        raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    return value


class MigLifecycle(MigFunctions):
    """The NVML calls that change a MIG layout, and the placement and capacity queries they need."""

    # ---------------------------------------------------------------- lookups

    def _profile_by_id(self, state: GpuState, profile_id: object) -> mig.MigProfile:
        """The GPU-instance profile with this NVML profile id; INVALID_ARGUMENT for an unknown id
        ("If device, profileId or count are invalid")."""
        pid = _uint(profile_id)
        prof = next((p for p in self._catalogue(state).values() if p.profile_id == pid), None)
        if prof is None:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return prof

    def _mig_on(self, device: object) -> GpuState:
        """A physical MIG-capable GPU whose current MIG mode is enabled, else NOT_SUPPORTED ("If
        device doesn't have MIG mode enabled")."""
        state = self._full_gpu(device)
        self._catalogue(state)
        if not state.mig_enabled:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return state

    def _why_not(self, state: GpuState, prof: mig.MigProfile, start: int) -> str | None:
        """Why a GPU instance of `prof` at `start` cannot be added to the GPU's instances."""
        cat = self._catalogue(state)
        profiles = [cat[r.profile] for r in state.gis.values()] + [prof]
        starts = [r.start for r in state.gis.values()] + [start]
        return mig.check_placements(profiles, starts)

    def _ci_of(self, computeInstance: object) -> tuple[GpuState, MigSpec]:
        if not isinstance(
            computeInstance, SimComputeInstanceHandle
        ) or not 0 <= computeInstance.gpu_index < len(self._gpus):
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        state = self._gpus[computeInstance.gpu_index]
        if state.lost:
            raise nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
        found = next((m for m in state.mig if m.uuid == computeInstance.mig_uuid), None)
        if found is None or not state.mig_enabled:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)  # destroyed: a stale handle
        return state, found

    def _ci_profile(self, state: GpuState, record: GiRecord, profile: object) -> int:
        """The one compute-instance profile of a GPU instance: INVALID_ARGUMENT past
        NVML_COMPUTE_INSTANCE_PROFILE_COUNT, NOT_SUPPORTED for another ("If profile isn't supported")."""
        value = _uint(profile)
        if value >= pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        slices = self._catalogue(state)[record.profile].compute_slices
        if value != mig.CI_PROFILE_FOR_SLICES[slices]:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return value

    @staticmethod
    def _fill_count(countRef: object, n: int) -> None:
        _out_struct(countRef, ctypes.c_uint).value = n

    # ---------------------------------------------------------------- GPU instances

    @nvml_function()
    def nvmlDeviceGetGpuInstancePossiblePlacements(
        self, device: object, profileId: int, placementsRef: object, countRef: object
    ) -> int:
        """(the binding calls the library's nvmlDeviceGetGpuInstancePossiblePlacements_v2) Every
        placement {start, size} of a profile "regardless of whether MIG is enabled or not";
        `placementsRef` None asks for the count only; an array shorter than the count answers
        INSUFFICIENT_SIZE with the count set (as the library's other sized outputs do).
        NOT_SUPPORTED on a GPU without MIG, INVALID_ARGUMENT for an unknown profile id or count."""
        state = self._full_gpu(device)
        prof = self._profile_by_id(state, profileId)
        count = _out_struct(countRef, ctypes.c_uint)
        need = len(prof.starts)
        if placementsRef is None:
            count.value = need
            return _SUCCESS
        if (
            not isinstance(placementsRef, ctypes.Array)
            or placementsRef._type_ is not pynvml.c_nvmlGpuInstancePlacement_t
        ):
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if min(count.value, len(placementsRef)) < need:
            count.value = need
            raise nvml_error(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
        for k, start in enumerate(prof.starts):
            placementsRef[k].start, placementsRef[k].size = start, prof.memory_slices
        count.value = need
        return _SUCCESS

    @nvml_function()
    def nvmlDeviceGetGpuInstanceRemainingCapacity(self, device: object, profileId: int) -> int:
        """How many more instances of a profile fit beside the GPU's instances (the most that can be
        placed at once, lowest free placement first). NOT_SUPPORTED with MIG mode disabled,
        INVALID_ARGUMENT for an unknown profile id."""
        state = self._mig_on(device)
        prof = self._profile_by_id(state, profileId)
        cat = self._catalogue(state)
        profiles = [cat[r.profile] for r in state.gis.values()]
        starts = [r.start for r in state.gis.values()]
        for start in prof.starts:
            if mig.check_placements([*profiles, prof], [*starts, start]) is None:
                profiles.append(prof)
                starts.append(start)
        return len(profiles) - len(state.gis)

    def _create_gi(self, state: GpuState, prof: mig.MigProfile, start: int) -> SimGpuInstanceHandle:
        gi = mig.gi_id_for(prof, start)
        self._serial += 1
        state.gis[gi] = GiRecord(prof.name, start, self._serial)
        self._save_state()
        return SimGpuInstanceHandle(state.spec.index, gi, self._serial)

    @nvml_function()
    def nvmlDeviceCreateGpuInstanceWithPlacement(
        self, device: object, profileId: int, placement: object
    ) -> SimGpuInstanceHandle:
        """A GPU instance of a profile at a placement (`ctypes.byref` of a
        c_nvmlGpuInstancePlacement_t, as the binding passes it on). NOT_SUPPORTED with MIG mode
        disabled; INVALID_ARGUMENT for an unknown profile id or a placement not among the profile's
        possible ones; INSUFFICIENT_RESOURCES where it overlaps an instance or the GPU's compute
        slices or the profile's instance count are used up (NVIDIA's DRA driver v0.4.1
        cmd/gpu-kubelet-plugin/nvlib.go, after CreateGpuInstanceWithPlacement: "when requesting a
        specific placement that is already occupied, NVML returns NVML_ERROR_INSUFFICIENT_RESOURCES")."""
        state = self._mig_on(device)
        prof = self._profile_by_id(state, profileId)
        where = _out_struct(placement, pynvml.c_nvmlGpuInstancePlacement_t)
        if where.start not in prof.starts or where.size != prof.memory_slices:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if self._why_not(state, prof, int(where.start)) is not None:
            raise nvml_error(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        return self._create_gi(state, prof, int(where.start))

    @nvml_function()
    def nvmlDeviceCreateGpuInstance(self, device: object, profileId: int) -> SimGpuInstanceHandle:
        """A GPU instance of a profile at its lowest free placement (NVML does not say which it
        takes); same codes as with a placement: INSUFFICIENT_RESOURCES where none is free."""
        state = self._mig_on(device)
        prof = self._profile_by_id(state, profileId)
        for start in prof.starts:
            if self._why_not(state, prof, start) is None:
                return self._create_gi(state, prof, start)
        raise nvml_error(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)

    @nvml_function()
    def nvmlGpuInstanceDestroy(self, gpuInstance: object) -> int:
        """Destroys a GPU instance: NVML_ERROR_IN_USE while a compute instance is on it ("If the GPU
        instance is in use. This error would be returned if processes (e.g. CUDA application) or
        compute instances are active on the GPU instance"); INVALID_ARGUMENT for a stale handle."""
        state, _ = self._gi_of(gpuInstance)
        assert isinstance(gpuInstance, SimGpuInstanceHandle)
        if any(m.gi == gpuInstance.gi for m in state.mig):
            raise nvml_error(pynvml.NVML_ERROR_IN_USE)
        del state.gis[gpuInstance.gi]
        self._save_state()
        return _SUCCESS

    @nvml_function()
    def nvmlDeviceGetGpuInstances(
        self, device: object, profileId: int, gpuInstancesRef: object, countRef: object
    ) -> int:
        """The GPU instances of a profile, into the list `gpuInstancesRef`, their number into
        `countRef`. NOT_SUPPORTED with MIG mode disabled, INVALID_ARGUMENT for an unknown profile."""
        state = self._mig_on(device)
        prof = self._profile_by_id(state, profileId)
        if not isinstance(gpuInstancesRef, list):
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        found = [
            SimGpuInstanceHandle(state.spec.index, gi, r.serial)
            for gi, r in state.gis.items()
            if r.profile == prof.name
        ]
        self._fill_count(countRef, len(found))
        gpuInstancesRef[:] = found
        return _SUCCESS

    # ---------------------------------------------------------------- compute instances

    @nvml_function()
    def nvmlGpuInstanceGetComputeInstanceProfileInfo(
        self, device: object, profile: int, engProfile: int, version: int = 2
    ) -> Any:
        """The compute-instance profile spanning the GPU instance (v2 struct, or v1 with version=1;
        another version: FUNCTION_NOT_FOUND, as the binding raises). INVALID_ARGUMENT for a profile
        past NVML_COMPUTE_INSTANCE_PROFILE_COUNT or an engine profile other than SHARED,
        NOT_SUPPORTED for another profile."""
        if version not in (1, 2):
            raise nvml_error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        state, record = self._gi_of(device)  # the binding names the GPU instance `device`
        value = _uint(profile)
        if _uint(engProfile) != pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        self._ci_profile(state, record, value)
        prof = self._catalogue(state)[record.profile]
        info = (
            pynvml.c_nvmlComputeInstanceProfileInfo_v2_t()
            if version == 2
            else pynvml.c_nvmlComputeInstanceProfileInfo_t()
        )
        info.id = value
        info.sliceCount = prof.compute_slices
        info.instanceCount = 1
        shared_engines(info, prof)
        if version == 2:
            info.version = pynvml.nvmlComputeInstanceProfileInfo_v2
            info.name = f"MIG {prof.name}"  # the spanning CI carries its GI's profile name
        return info

    @nvml_function()
    def nvmlGpuInstanceGetComputeInstanceProfileInfoV(
        self, device: object, profile: int, engProfile: int, version: int = 2
    ) -> Any:
        return self.nvmlGpuInstanceGetComputeInstanceProfileInfo(device, profile, engProfile, version)

    @nvml_function()
    def nvmlGpuInstanceGetComputeInstanceRemainingCapacity(self, gpuInstance: object, profileId: int) -> int:
        """1 while the GPU instance has no compute instance, else 0 (one spans it)."""
        state, record = self._gi_of(gpuInstance)
        assert isinstance(gpuInstance, SimGpuInstanceHandle)
        self._ci_profile(state, record, profileId)
        return 0 if any(m.gi == gpuInstance.gi for m in state.mig) else 1

    @nvml_function()
    def nvmlGpuInstanceCreateComputeInstance(
        self, gpuInstance: object, profileId: int
    ) -> SimComputeInstanceHandle:
        """The compute instance spanning a GPU instance, id 0: a new MIG device with a new UUID
        (`mig.created_mig_uuid`). INVALID_ARGUMENT for a stale handle or a profile past the count,
        NOT_SUPPORTED for another profile, INSUFFICIENT_RESOURCES when it already has one ("If the
        requested compute instance could not be created")."""
        state, record = self._gi_of(gpuInstance)
        assert isinstance(gpuInstance, SimGpuInstanceHandle)
        self._ci_profile(state, record, profileId)
        gi = gpuInstance.gi
        if any(m.gi == gi for m in state.mig):
            raise nvml_error(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        state.created += 1
        uuid = mig.created_mig_uuid(state.spec.uuid, state.created, gi, 0, record.profile)
        order = list(state.gis)
        state.mig = sorted(
            [*state.mig, MigSpec(profile=record.profile, placement=record.start, gi=gi, ci=0, uuid=uuid)],
            key=lambda m: order.index(m.gi),
        )
        self._save_state()
        return SimComputeInstanceHandle(state.spec.index, gi, 0, uuid)

    @nvml_function()
    def nvmlGpuInstanceGetComputeInstances(
        self, gpuInstance: object, profileId: int, computeInstancesRef: object, countRef: object
    ) -> int:
        """The compute instances of a profile on a GPU instance, into the list `computeInstancesRef`;
        INVALID_ARGUMENT for a profile past NVML_COMPUTE_INSTANCE_PROFILE_COUNT."""
        state, record = self._gi_of(gpuInstance)
        assert isinstance(gpuInstance, SimGpuInstanceHandle)
        value = _uint(profileId)
        if value >= pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT or not isinstance(computeInstancesRef, list):
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        spanning = mig.CI_PROFILE_FOR_SLICES[self._catalogue(state)[record.profile].compute_slices]
        found = [
            SimComputeInstanceHandle(state.spec.index, m.gi, m.ci, m.uuid)
            for m in state.mig
            if m.gi == gpuInstance.gi and value == spanning
        ]
        self._fill_count(countRef, len(found))
        computeInstancesRef[:] = found
        return _SUCCESS

    @nvml_function()
    def nvmlGpuInstanceGetComputeInstanceById(
        self, gpuInstance: object, computeInstanceId: int
    ) -> SimComputeInstanceHandle:
        """NOT_FOUND where the GPU instance has no compute instance with that id."""
        state, _ = self._gi_of(gpuInstance)
        assert isinstance(gpuInstance, SimGpuInstanceHandle)
        for m in state.mig:
            if m.gi == gpuInstance.gi and m.ci == computeInstanceId:
                return SimComputeInstanceHandle(state.spec.index, m.gi, m.ci, m.uuid)
        raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND)

    @nvml_function()
    def nvmlComputeInstanceGetInfo_v2(self, computeInstance: object) -> SimComputeInstanceInfo:
        """Its device is the MIG device handle (NVIDIA's DRA driver v0.4.1 nvlib.go takes the new
        MIG device's UUID from it: "A MIG device handle maps 1:1 to a CI in NVML"), its GPU
        instance, id, profile and placement {0, slices}. INVALID_ARGUMENT for a stale handle."""
        state, m = self._ci_of(computeInstance)
        record = state.gis[m.gi]
        slices = self._catalogue(state)[m.profile].compute_slices
        placement = pynvml.c_nvmlComputeInstancePlacement_t()
        placement.start, placement.size = 0, slices
        return SimComputeInstanceInfo(
            self._mig_handle(state.spec.index, m),
            SimGpuInstanceHandle(state.spec.index, m.gi, record.serial),
            m.ci,
            mig.CI_PROFILE_FOR_SLICES[slices],
            placement,
        )

    @nvml_function()
    def nvmlComputeInstanceGetInfo(self, computeInstance: object) -> SimComputeInstanceInfo:
        return self.nvmlComputeInstanceGetInfo_v2(computeInstance)

    @nvml_function()
    def nvmlComputeInstanceDestroy(self, computeInstance: object) -> int:
        """Destroys a compute instance (its MIG device goes): NVML_ERROR_IN_USE while processes run
        on it ("if processes (e.g. CUDA application) are active on the compute instance")."""
        state, m = self._ci_of(computeInstance)
        if state.processes[m.uuid] > 0:
            raise nvml_error(pynvml.NVML_ERROR_IN_USE)
        state.mig = [x for x in state.mig if x.uuid != m.uuid]
        self._mig_handles.pop(m.uuid, None)
        self._save_state()
        return _SUCCESS

    # ---------------------------------------------------------------- MIG mode

    def _busy(self, state: GpuState) -> bool:
        uuids = [state.spec.uuid, *(m.uuid for m in state.mig)]
        return any(state.processes[u] > 0 for u in uuids)

    @nvml_function()
    def nvmlDeviceSetMigMode(self, device: object, mode: int) -> int:
        """Sets the pending MIG mode and returns the activation status (the binding returns
        `activationStatus`). nvml.h: "This API may unbind or reset the device to activate the
        requested mode"; "if device unbind fails because the device isn't idle, NVML_ERROR_IN_USE
        would be returned" (in activationStatus; the mode stays pending); NOT_SUPPORTED "If device
        doesn't support MIG mode"; INVALID_ARGUMENT for a mode other than NVML_DEVICE_MIG_DISABLE/ENABLE.

        The simulator activates at once only on Hopper or newer with no process running: NVIDIA's
        DRA driver (v0.4.1 nvlib.go, supportsMIGModeToggle: architecture >= Hopper) toggles MIG
        without a reset there, and notes "On Ampere/A100, SetMigMode sets a pending mode that
        requires a GPU reset to activate": on an older GPU the status is NVML_ERROR_RESET_REQUIRED
        and the mode is pending until `reset(uuid)` (fault injection). Disabling MIG while GPU
        instances exist is refused with NVML_ERROR_IN_USE (the call's own code; the mode is left
        as it was): they must be destroyed first, as nvmlGpuInstanceDestroy refuses a GPU
        instance that compute instances hold.
        """
        state = self._full_gpu(device)
        self._catalogue(state)
        value = _uint(mode)
        if value not in (pynvml.NVML_DEVICE_MIG_DISABLE, pynvml.NVML_DEVICE_MIG_ENABLE):
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        wanted = value == pynvml.NVML_DEVICE_MIG_ENABLE
        if not wanted and state.mig_enabled and state.gis:
            raise nvml_error(pynvml.NVML_ERROR_IN_USE)
        if state.mig_pending != wanted:
            state.mig_pending = wanted
            self._save_state()
        if state.mig_pending == state.mig_enabled:
            return _SUCCESS
        if self._busy(state):
            return int(pynvml.NVML_ERROR_IN_USE)
        if state.spec.architecture < pynvml.NVML_DEVICE_ARCH_HOPPER:
            return int(pynvml.NVML_ERROR_RESET_REQUIRED)
        self._activate_mig_mode(state)
        return _SUCCESS
