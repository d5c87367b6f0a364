"""Every MIG device a GPU could have: its GPU instance profiles at each of their possible placements.

`mig_options(nvml_module, gpu_handle)` reads them through NVML (the real `pynvml` or the
simulator) the way NVIDIA's DRA driver does for its partitionable devices (v25.12.0
cmd/gpu-kubelet-plugin/nvlib.go `inspectMigProfilesAndPlacements` over go-nvlib's
`VisitMigProfiles`, pkg/nvlib/device/device.go):

- Only a MIG-capable GPU has any (`nvmlDeviceGetMigMode` answers; NotSupported: none), whether
  MIG mode is on or not: the profiles and placements do not depend on it.
- Every GPU instance profile enum `0..NVML_GPU_INSTANCE_PROFILE_COUNT-1` is asked for
  (`nvmlDeviceGetGpuInstanceProfileInfo`); NotSupported or InvalidArgument skip the profile.
- Of go-nvlib's (GPU instance, compute instance) profile pairs NVIDIA keeps those whose compute
  instance spans the GPU instance (C == G) and whose compute instance profile is not
  NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE_REV1: one compute instance profile per GPU instance
  profile, `spanning_ci_profile` (the first enum with that slice count).
- Each profile's placements come from `nvmlDeviceGetGpuInstancePossiblePlacements` (the count
  first, then the array); NotSupported or InvalidArgument skip the profile.
- The sizes are the GPU instance profile's (what partitions.go `PartCapacities` publishes).
- The name is what go-nvlib's MigProfileInfo String method gives (NewMigProfile, getMigMemorySizeGB): the
  slice count of the profile enum, the memory as the GPU's share in eighths of its whole GB
  (rounded half away from zero, as Go's math.Round), and the enum's attribute ("+me", "+me.all",
  "+gfx", "-me"): "1g.10gb", "1g.10gb+me", "3g.71gb" on a 141 GB GPU (`mig_profile_name`).

Options are sorted by GPU instance profile id, then placement start, so one GPU always yields
the same tuple.
"""

from __future__ import annotations

import ctypes
import logging
import math
from dataclasses import dataclass
from typing import Any

from common.model import MigOption

log = logging.getLogger("gpuvisor.nvml")

# NVML return codes (nvmlReturn_t, NVML's C ABI).
_NOT_SUPPORTED = 3
_INVALID_ARGUMENT = 2
_FUNCTION_NOT_FOUND = 13
_GPU_INSTANCE_PROFILE_COUNT = 0x12
_MIB = 1024 * 1024
_GIB = 1024 * 1024 * 1024

# NVML_GPU_INSTANCE_PROFILE_* -> (GPU slices, attribute suffix), as go-nvlib's NewMigProfile maps
# them (the REV1 profiles carry media extensions, "+me"; ALL_ME "+me.all"; GFX "+gfx"; NO_ME
# "-me"). 3_SLICE_GFX (17) postdates the go-nvlib NVIDIA's v25.12.0 vendors; it is named the way
# the other graphics profiles are. An enum not listed is skipped (logged): its name is unknown.
GI_PROFILE_ENUMS: dict[int, tuple[int, str]] = {
    0x0: (1, ""), 0x7: (1, "+me"), 0x9: (1, ""), 0xA: (1, "+gfx"), 0xD: (1, "-me"), 0xF: (1, "+me.all"),
    0x1: (2, ""), 0x8: (2, "+me"), 0xB: (2, "+gfx"), 0xE: (2, "-me"), 0x10: (2, "+me.all"),
    0x2: (3, ""), 0x11: (3, "+gfx"),
    0x3: (4, ""), 0xC: (4, "+gfx"),
    0x6: (6, ""), 0x4: (7, ""), 0x5: (8, ""),
}  # fmt: skip

# NVML_COMPUTE_INSTANCE_PROFILE_* by the slices it spans, in enum order: the first one whose slice
# count is the GPU instance's. 1_SLICE_REV1 (7) is never chosen (NVIDIA skips it) nor is
# 7_SLICE_NVL (8), which go-nvlib does not know.
_CI_PROFILE_FOR_SLICES = {1: 0x0, 2: 0x1, 3: 0x2, 4: 0x3, 7: 0x4, 8: 0x5, 6: 0x6}


def spanning_ci_profile(gi_slices: int) -> int | None:
    """The compute instance profile spanning a GPU instance of `gi_slices` slices, None if none."""
    return _CI_PROFILE_FOR_SLICES.get(gi_slices)


def go_round(x: float) -> int:
    """Go's math.Round for x >= 0: half away from zero (Python's round() rounds half to even)."""
    whole = math.floor(x)
    return int(whole + 1 if x - whole >= 0.5 else whole)


def mig_profile_name(
    slices: int, memory_mib: int, gpu_memory_mib: int, media_extensions: bool = False, suffix: str = ""
) -> str:
    """A MIG profile name from sizes, as go-nvlib's getMigMemorySizeGB names the memory: the GPU's
    share in eighths (rounded up) of its memory in whole GB (rounded up), rounded half away from
    zero. `media_extensions` adds "+me"; `suffix` any other attribute ("+me.all", "+gfx", "-me")."""
    total_gb = math.ceil(gpu_memory_mib / 1024)
    eighths = math.ceil(memory_mib * 8 / gpu_memory_mib) if gpu_memory_mib else 0
    gb = go_round(eighths * total_gb / 8)
    return f"{slices}g.{gb}gb" + ("+me" if media_extensions else suffix)


@dataclass(frozen=True)
class GiProfile:
    """One GPU instance profile of a GPU whose compute instance can span it."""

    enum: int  # NVML_GPU_INSTANCE_PROFILE_*: what nvmlDeviceGetGpuInstanceProfileInfo takes
    profile_id: int  # the info's `id`: what placements and the create call take
    name: str  # "1g.10gb", "1g.10gb+me"
    slices: int
    ci_profile_id: int  # NVML_COMPUTE_INSTANCE_PROFILE_* spanning it
    info: Any  # the nvmlGpuInstanceProfileInfo struct


def _code(exc: BaseException) -> int:
    return int(getattr(exc, "value", -1))


def gi_profiles(nvml_module: Any, gpu_handle: Any, gpu_memory_mib: int) -> list[GiProfile]:
    """The GPU's GPU instance profiles with a spanning compute instance, in enum order. Raises the
    binding's NVMLError for an answer other than NotSupported / InvalidArgument (a lost GPU)."""
    out: list[GiProfile] = []
    count = int(getattr(nvml_module, "NVML_GPU_INSTANCE_PROFILE_COUNT", _GPU_INSTANCE_PROFILE_COUNT))
    for enum in range(count):
        try:
            info = nvml_module.nvmlDeviceGetGpuInstanceProfileInfo(gpu_handle, enum)
        except nvml_module.NVMLError as exc:
            if _code(exc) in (_NOT_SUPPORTED, _INVALID_ARGUMENT):
                continue
            raise
        known = GI_PROFILE_ENUMS.get(enum)
        if known is None:
            log.debug("GPU instance profile enum %d is not one gpuvisor can name; skipped", enum)
            continue
        slices, suffix = known
        ci = spanning_ci_profile(slices)
        if ci is None:
            continue
        name = mig_profile_name(slices, int(info.memorySizeMB), gpu_memory_mib, suffix=suffix)
        out.append(GiProfile(enum, int(info.id), name, slices, ci, info))
    return out


def possible_placements(nvml_module: Any, gpu_handle: Any, profile_id: int) -> list[tuple[int, int]]:
    """(start, size) of every placement of a GPU instance profile, by its id; the count first."""
    count = ctypes.c_uint(0)
    nvml_module.nvmlDeviceGetGpuInstancePossiblePlacements(gpu_handle, profile_id, None, ctypes.byref(count))
    if count.value == 0:
        return []
    placement_type = nvml_module.c_nvmlGpuInstancePlacement_t
    found = (placement_type * count.value)()
    nvml_module.nvmlDeviceGetGpuInstancePossiblePlacements(gpu_handle, profile_id, found, ctypes.byref(count))
    return [(int(p.start), int(p.size)) for p in found[: count.value]]


def gpu_memory_mib(nvml_module: Any, gpu_handle: Any) -> int:
    return int(nvml_module.nvmlDeviceGetMemoryInfo(gpu_handle).total) // _MIB


def mig_capable(nvml_module: Any, gpu_handle: Any) -> bool:
    """go-nvlib IsMigCapable: nvmlDeviceGetMigMode answers (NotSupported or no symbol: not capable)."""
    try:
        nvml_module.nvmlDeviceGetMigMode(gpu_handle)
    except nvml_module.NVMLError as exc:
        if _code(exc) in (_NOT_SUPPORTED, _FUNCTION_NOT_FOUND):
            return False
        raise
    return True


def mig_options(nvml_module: Any, gpu_handle: Any) -> tuple[MigOption, ...]:
    """Every (profile, placement) a MIG device of this GPU could have; () on a GPU without MIG.

    Raises the binding's NVMLError for any other failure (a lost GPU), as NVIDIA's driver fails
    the GPU's enumeration then."""
    if not mig_capable(nvml_module, gpu_handle):
        return ()
    options: list[MigOption] = []
    for prof in gi_profiles(nvml_module, gpu_handle, gpu_memory_mib(nvml_module, gpu_handle)):
        try:
            placements = possible_placements(nvml_module, gpu_handle, prof.profile_id)
        except nvml_module.NVMLError as exc:
            if _code(exc) in (_NOT_SUPPORTED, _INVALID_ARGUMENT):
                continue
            raise
        info = prof.info
        for start, size in placements:
            options.append(
                MigOption(
                    profile=prof.name,
                    gi_profile_id=prof.profile_id,
                    ci_profile_id=prof.ci_profile_id,
                    placement_start=start,
                    placement_size=size,
                    memory_mib=int(info.memorySizeMB),
                    multiprocessors=int(info.multiprocessorCount),
                    copy_engines=int(info.copyEngineCount),
                    decoders=int(info.decoderCount),
                    encoders=int(info.encoderCount),
                    jpeg_engines=int(info.jpegCount),
                    ofa_engines=int(info.ofaCount),
                )
            )
    options.sort(key=lambda o: (o.gi_profile_id, o.placement_start))
    return tuple(options)
