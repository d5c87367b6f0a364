"""MIG on demand: creating a MIG device at a placement, destroying it, MIG mode, and what is there.

`MigMaker(nvml_module)` takes the `pynvml` module (or the simulator standing in for it) and does
what NVIDIA's DRA driver does at prepare and unprepare (v25.12.0 cmd/gpu-kubelet-plugin/nvlib.go
`createMigDevice`, `deleteMigDevice`), with these choices:

- `create(gpu, gi_profile_id, placement_start)`: MIG mode is enabled first if it is off. Where
  the change cannot take effect now (`activationStatus` RESET_REQUIRED: an A100 needs a reset;
  IN_USE: the GPU is not idle) the mode the call left pending is set back to the current one, so
  the GPU is not left half-switched (a pending change somebody else asked for is left alone), and
  `MigError` says why. Then the GPU instance at the placement
  (`nvmlDeviceCreateGpuInstanceWithPlacement`), the compute instance spanning it (the profile
  `migplace.spanning_ci_profile` names, as `nvidia-smi mig -cgi <p> -C` makes), and the new MIG
  device's UUID from the compute instance's info ("A MIG device handle maps 1:1 to a CI", NVIDIA's
  note there). INSUFFICIENT_RESOURCES on the GPU instance is `MigError(kind="taken")` naming the
  instances that overlap the placement. A failure once the GPU instance exists destroys what was
  made before raising: no half-made device is left behind.
- `destroy(gpu, gi_id, ci_id)`: the compute instance, then the GPU instance (the order NVML
  needs); one already gone (NOT_FOUND, or MIG mode off: NOT_SUPPORTED, as NVIDIA treats it) is
  success, so a retried unprepare succeeds. IN_USE is `MigError(kind="busy")`. MIG mode is left on.
- `instances(gpu)`: every GPU instance with its compute instance (the MIG devices by index) and
  any GPU instance without one (by id, `nvmlDeviceGetGpuInstanceById` over ids below
  `GI_ID_LIMIT`): the by-id calls work alike over the real binding, whose instance arrays are ctypes
  arrays, and the simulator, whose are lists.

One lock serialises the calls: NVML's MIG reconfiguration is per GPU and NVIDIA's driver holds
its prepare lock around it too.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from supervisor.node import migplace
from supervisor.node.nvml import (
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    Nvml,
    NvmlCallError,
    text,
)

log = logging.getLogger("gpuvisor.mig")

# NVML return codes (nvmlReturn_t, the C ABI) MIG on demand acts on.
NVML_SUCCESS = 0
NVML_ERROR_INSUFFICIENT_RESOURCES = 23
NVML_ERROR_IN_USE = 19
NVML_ERROR_RESET_REQUIRED = 16
_MIG_DISABLE, _MIG_ENABLE = 0, 1
_CI_ENGINE_PROFILE_SHARED = 0
GI_ID_LIMIT = 32  # GPU instance ids probed for instances without a compute instance (A100/H100: 0-14)

MigErrorKind = Literal["taken", "busy", "reset-required", "unsupported", "nvml"]


class MigError(Exception):
    """A MIG change that could not be made. `kind`: "taken" (the placement overlaps an instance),
    "busy" (processes or instances are in the way), "reset-required" (MIG mode needs a GPU reset),
    "unsupported" (no MIG, or no such profile or placement), "nvml" (any other NVML failure);
    `code` the NVML return code behind it, where there is one."""

    def __init__(self, kind: MigErrorKind, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.kind: MigErrorKind = kind
        self.code = code


@dataclass(frozen=True)
class MadeMig:
    """A GPU instance on a GPU and its compute instance (the MIG device)."""

    gpu_uuid: str
    gi_id: int
    ci_id: int  # -1: a GPU instance without a compute instance (no MIG device)
    uuid: str  # the MIG device's UUID; "" without a compute instance
    profile: str  # "3g.40gb"
    gi_profile_id: int
    placement_start: int
    placement_size: int

    def describe(self) -> str:
        last = self.placement_start + self.placement_size - 1
        what = f"GPU instance {self.gi_id} ({self.profile}, profile id {self.gi_profile_id}, memory slices "
        what += f"{self.placement_start}-{last})"
        return what + (f" with MIG device {self.uuid}" if self.uuid else " without a compute instance")


class MigMode(NamedTuple):
    current: bool  # MIG mode now
    pending: bool  # MIG mode after the next reset


def _placement(module: Any, start: int, size: int) -> Any:
    p = module.c_nvmlGpuInstancePlacement_t()
    p.start, p.size = start, size
    return ctypes.byref(p)


class MigMaker:
    """Creates and destroys MIG devices through NVML (module: `pynvml` or the simulator)."""

    def __init__(self, nvml_module: Any) -> None:
        self.module = nvml_module
        self._nvml = Nvml(nvml_module, sysfs_root=None)
        self._lock = threading.Lock()
        self._profiles: dict[str, list[migplace.GiProfile]] = {}  # per GPU UUID: they never change

    # ------------------------------------------------------------ plumbing

    def _call(self, what: str, function: str, *args: Any) -> Any:
        """An NVML call; its failure is a MigError of kind "nvml" saying what was being done."""
        try:
            return self._nvml.call(function, *args)
        except NvmlCallError as exc:
            raise MigError("nvml", f"{what}: {exc}", exc.code) from exc

    def _gpu(self, gpu_uuid: str) -> Any:
        try:
            return self._nvml.call("nvmlDeviceGetHandleByUUID", gpu_uuid)
        except NvmlCallError as exc:
            reason = "no such GPU" if exc.code == NVML_ERROR_NOT_FOUND else str(exc)
            raise MigError("nvml", f"GPU {gpu_uuid}: {reason}", exc.code) from exc

    def _gi_profiles(self, gpu_uuid: str, h: Any) -> list[migplace.GiProfile]:
        if gpu_uuid not in self._profiles:
            try:
                memory = migplace.gpu_memory_mib(self.module, h)
                self._profiles[gpu_uuid] = migplace.gi_profiles(self.module, h, memory)
            except self.module.NVMLError as exc:
                code = int(getattr(exc, "value", -1))
                raise MigError(
                    "nvml", f"GPU {gpu_uuid}: reading its MIG profiles failed: {exc}", code
                ) from exc
        return self._profiles[gpu_uuid]

    def _profile(self, gpu_uuid: str, h: Any, gi_profile_id: int) -> migplace.GiProfile:
        profiles = self._gi_profiles(gpu_uuid, h)
        for prof in profiles:
            if prof.profile_id == gi_profile_id:
                return prof
        known = ", ".join(f"{p.profile_id} ({p.name})" for p in profiles) or "none: the GPU has no MIG"
        raise MigError(
            "unsupported",
            f"GPU {gpu_uuid} has no MIG profile with id {gi_profile_id} (its profiles: {known})",
        )

    def _name(self, gpu_uuid: str, h: Any, gi_profile_id: int) -> str:
        for prof in self._gi_profiles(gpu_uuid, h):
            if prof.profile_id == gi_profile_id:
                return prof.name
        return f"profile {gi_profile_id}"

    def _mode(self, gpu_uuid: str, h: Any) -> MigMode:
        try:
            current, pending = self._nvml.call("nvmlDeviceGetMigMode", h)
        except NvmlCallError as exc:
            if exc.code == NVML_ERROR_NOT_SUPPORTED:
                raise MigError("unsupported", f"GPU {gpu_uuid} does not support MIG", exc.code) from exc
            raise MigError("nvml", f"GPU {gpu_uuid}: reading its MIG mode failed: {exc}", exc.code) from exc
        return MigMode(int(current) == _MIG_ENABLE, int(pending) == _MIG_ENABLE)

    # ------------------------------------------------------------ MIG mode

    def mig_mode(self, gpu_uuid: str) -> MigMode:
        """The GPU's MIG mode now and after the next reset."""
        with self._lock:
            return self._mode(gpu_uuid, self._gpu(gpu_uuid))

    def set_mig_mode(self, gpu_uuid: str, on: bool) -> MigMode:
        """Turn MIG mode on or off now; raises MigError where it cannot take effect without a reset
        ("reset-required") or while the GPU is in use ("busy"), after setting back the pending mode
        the call left (so a later reset does not switch the GPU unasked)."""
        with self._lock:
            return self._set_mode(gpu_uuid, self._gpu(gpu_uuid), on)

    def _set_mode(self, gpu_uuid: str, h: Any, on: bool) -> MigMode:
        before = self._mode(gpu_uuid, h)
        if before.current == on and before.pending == on:
            return before
        wanted = "on" if on else "off"
        try:
            status = int(self._nvml.call("nvmlDeviceSetMigMode", h, _MIG_ENABLE if on else _MIG_DISABLE))
        except NvmlCallError as exc:
            if exc.code == NVML_ERROR_IN_USE:
                held = "; ".join(m.describe() for m in self._instances(gpu_uuid, h)) or "none listed"
                raise MigError(
                    "busy",
                    f"GPU {gpu_uuid}: MIG mode cannot be turned {wanted}: instances exist ({held})",
                    exc.code,
                ) from exc
            if exc.code == NVML_ERROR_NOT_SUPPORTED:
                raise MigError("unsupported", f"GPU {gpu_uuid} does not support MIG", exc.code) from exc
            raise MigError(
                "nvml", f"GPU {gpu_uuid}: setting MIG mode {wanted} failed: {exc}", exc.code
            ) from exc
        after = self._mode(gpu_uuid, h)
        if after.current == on:
            log.info("GPU %s: MIG mode turned %s", gpu_uuid, wanted, extra={"device": gpu_uuid})
            return after
        reverted = self._revert_pending(gpu_uuid, h, before)
        if status == NVML_ERROR_IN_USE:
            kind: MigErrorKind = "busy"
            why = "the GPU is in use (processes run on it), so it could not be switched"
        else:
            kind = "reset-required"
            why = f"the change needs a GPU reset (activation status: {self._status_text(status)})"
        raise MigError(
            kind, f"GPU {gpu_uuid}: MIG mode cannot be turned {wanted} now: {why}; {reverted}", status
        )

    def _status_text(self, status: int) -> str:
        """An NVML return code as the binding words it, with the code."""
        try:
            return f"{self.module.NVMLError(status)} ({status})"
        except Exception:  # a binding that cannot word it
            return str(status)

    def _revert_pending(self, gpu_uuid: str, h: Any, before: MigMode) -> str:
        """Set the pending mode back to what it was before our call; say what was done."""
        if before.pending != before.current:
            return "the MIG mode change pending before this call is left as it was"
        try:
            self._nvml.call("nvmlDeviceSetMigMode", h, _MIG_ENABLE if before.current else _MIG_DISABLE)
        except NvmlCallError as exc:
            log.warning("GPU %s: setting back the pending MIG mode failed: %s", gpu_uuid, exc)
            return f"setting back the pending mode failed too ({exc}): a reset would switch it"
        return "the pending change was set back, so a reset leaves MIG mode as it is"

    # ------------------------------------------------------------ create

    def create(self, gpu_uuid: str, gi_profile_id: int, placement_start: int) -> MadeMig:
        """A MIG device of a GPU instance profile (by id) at a placement (its first memory slice)."""
        with self._lock:
            h = self._gpu(gpu_uuid)
            prof = self._profile(gpu_uuid, h, gi_profile_id)
            where = f"MIG {prof.name} (profile id {gi_profile_id}) at placement {placement_start} on GPU {gpu_uuid}"
            try:
                starts = dict(migplace.possible_placements(self.module, h, prof.profile_id))
            except self.module.NVMLError as exc:
                code = int(getattr(exc, "value", -1))
                raise MigError("nvml", f"{where}: reading its placements failed: {exc}", code) from exc
            if placement_start not in starts:
                raise MigError(
                    "unsupported", f"{where}: not a placement of {prof.name} (they start at {sorted(starts)})"
                )
            size = starts[placement_start]
            if not self._mode(gpu_uuid, h).current:  # on already: its pending mode is not ours to touch
                self._set_mode(gpu_uuid, h, True)
            try:
                gi = self._nvml.call(
                    "nvmlDeviceCreateGpuInstanceWithPlacement",
                    h,
                    prof.profile_id,
                    _placement(self.module, placement_start, size),
                )
            except NvmlCallError as exc:
                if exc.code == NVML_ERROR_INSUFFICIENT_RESOURCES:
                    raise self._taken(gpu_uuid, h, where, placement_start, size, exc.code) from exc
                raise MigError("nvml", f"{where}: creating the GPU instance failed: {exc}", exc.code) from exc
            return self._finish(gpu_uuid, h, prof, gi, where, placement_start, size)

    def _finish(
        self, gpu_uuid: str, h: Any, prof: migplace.GiProfile, gi: Any, where: str, start: int, size: int
    ) -> MadeMig:
        """The compute instance on a new GPU instance and its UUID; on failure, undo both."""
        ci: Any = None
        step = "reading the new GPU instance"
        try:
            gi_id = int(self._nvml.call("nvmlGpuInstanceGetInfo", gi).id)
            step = "reading its compute instance profile"
            ci_info = self._nvml.call(
                "nvmlGpuInstanceGetComputeInstanceProfileInfo",
                gi,
                prof.ci_profile_id,
                _CI_ENGINE_PROFILE_SHARED,
            )
            step = "creating its compute instance"
            ci = self._nvml.call("nvmlGpuInstanceCreateComputeInstance", gi, int(ci_info.id))
            step = "reading the compute instance"
            info = self._nvml.call("nvmlComputeInstanceGetInfo", ci)
            step = "reading the new MIG device's UUID"
            uuid = text(self._nvml.call("nvmlDeviceGetUUID", info.device))
        except NvmlCallError as exc:
            undone = self._undo(gi, ci)
            raise MigError("nvml", f"{where}: {step} failed: {exc}; {undone}", exc.code) from exc
        made = MadeMig(gpu_uuid, gi_id, int(info.id), uuid, prof.name, prof.profile_id, start, size)
        log.info("created %s on GPU %s", made.describe(), gpu_uuid, extra={"device": gpu_uuid})
        return made

    def _undo(self, gi: Any, ci: Any) -> str:
        """Destroy a half-made device (compute instance first); say how it went."""
        failures = []
        for function, handle in (("nvmlComputeInstanceDestroy", ci), ("nvmlGpuInstanceDestroy", gi)):
            if handle is None:
                continue
            try:
                self._nvml.call(function, handle)
            except NvmlCallError as exc:
                failures.append(f"{function}: {exc}")
        if failures:
            log.error("a half-made MIG device could not be destroyed: %s", "; ".join(failures))
            return "destroying what was made failed (" + "; ".join(failures) + "): it is left on the GPU"
        return "what was made is destroyed"

    def _taken(self, gpu_uuid: str, h: Any, where: str, start: int, size: int, code: int) -> MigError:
        try:
            present = self._instances(gpu_uuid, h)
        except MigError as exc:
            return MigError("taken", f"{where} is taken (listing the GPU's instances failed: {exc})", code)
        overlap = [
            m
            for m in present
            if m.placement_start < start + size and start < m.placement_start + m.placement_size
        ]
        if overlap:
            held = "; ".join(m.describe() for m in overlap)
            return MigError(
                "taken", f"{where} is taken: memory slices {start}-{start + size - 1} overlap {held}", code
            )
        others = "; ".join(m.describe() for m in present) or "none"
        return MigError(
            "taken",
            f"{where} is taken: no instance overlaps it, but the GPU's compute slices or the profile's instance"
            f" count are used up (instances: {others})",
            code,
        )

    # ------------------------------------------------------------ destroy

    def destroy(self, gpu_uuid: str, gi_id: int, ci_id: int) -> None:
        """Destroy a compute instance (ci_id < 0: none) and then its GPU instance; what is already
        gone is success."""
        with self._lock:
            h = self._gpu(gpu_uuid)
            where = f"GPU instance {gi_id} (compute instance {ci_id}) on GPU {gpu_uuid}"
            gi = self._gone_or(
                where,
                "nvmlDeviceGetGpuInstanceById",
                h,
                gi_id,
                gone=(NVML_ERROR_NOT_FOUND, NVML_ERROR_NOT_SUPPORTED),
            )
            if gi is None:
                log.info("%s is already gone", where, extra={"device": gpu_uuid})
                return
            if ci_id >= 0:
                ci = self._gone_or(where, "nvmlGpuInstanceGetComputeInstanceById", gi, ci_id)
                if ci is not None:
                    self._destroy_one(
                        where, "nvmlComputeInstanceDestroy", ci, "processes run on its MIG device"
                    )
            self._destroy_one(
                where, "nvmlGpuInstanceDestroy", gi, "compute instances or processes remain on it"
            )
            log.info("destroyed %s", where, extra={"device": gpu_uuid})

    def _gone_or(
        self, where: str, function: str, *args: Any, gone: tuple[int, ...] = (NVML_ERROR_NOT_FOUND,)
    ) -> Any:
        try:
            return self._nvml.call(function, *args)
        except NvmlCallError as exc:
            if exc.code in gone:
                return None
            raise MigError("nvml", f"{where}: {function} failed: {exc}", exc.code) from exc

    def _destroy_one(self, where: str, function: str, handle: Any, busy: str) -> None:
        try:
            self._nvml.call(function, handle)
        except NvmlCallError as exc:
            if exc.code == NVML_ERROR_IN_USE:
                raise MigError(
                    "busy", f"{where} cannot be destroyed: {busy} ({function}: in use)", exc.code
                ) from exc
            if exc.code in (NVML_ERROR_NOT_FOUND, NVML_ERROR_INVALID_ARGUMENT):
                return  # destroyed meanwhile: its handle went stale
            raise MigError("nvml", f"{where}: {function} failed: {exc}", exc.code) from exc

    # ------------------------------------------------------------ what is there

    def instances(self, gpu_uuid: str) -> list[MadeMig]:
        """Every GPU instance on the GPU with its compute instance, by placement; [] with MIG off."""
        with self._lock:
            h = self._gpu(gpu_uuid)
            return self._instances(gpu_uuid, h)

    def _instances(self, gpu_uuid: str, h: Any) -> list[MadeMig]:
        if not self._mode(gpu_uuid, h).current:
            return []
        found: dict[int, MadeMig] = {}
        what = f"GPU {gpu_uuid}: listing its MIG instances"
        for j in range(int(self._call(what, "nvmlDeviceGetMaxMigDeviceCount", h))):
            mh = self._gone_or(
                what,
                "nvmlDeviceGetMigDeviceHandleByIndex",
                h,
                j,
                gone=(NVML_ERROR_NOT_FOUND, NVML_ERROR_INVALID_ARGUMENT),
            )
            if mh is None:
                continue
            gi_id = int(self._call(what, "nvmlDeviceGetGpuInstanceId", mh))
            ci_id = int(self._call(what, "nvmlDeviceGetComputeInstanceId", mh))
            uuid = text(self._call(what, "nvmlDeviceGetUUID", mh))
            found[gi_id] = self._described(gpu_uuid, h, gi_id, ci_id, uuid, what)
        for gi_id in range(GI_ID_LIMIT):
            if gi_id not in found:
                # nvml.h: NOT_FOUND for an id without an instance, INVALID_ARGUMENT for an id the GPU
                # does not have at all.
                gi = self._gone_or(
                    what,
                    "nvmlDeviceGetGpuInstanceById",
                    h,
                    gi_id,
                    gone=(NVML_ERROR_NOT_FOUND, NVML_ERROR_INVALID_ARGUMENT),
                )
                if gi is not None:
                    found[gi_id] = self._described(gpu_uuid, h, gi_id, -1, "", what, gi)
        return sorted(found.values(), key=lambda m: (m.placement_start, m.gi_id))

    def _described(
        self, gpu_uuid: str, h: Any, gi_id: int, ci_id: int, uuid: str, what: str, gi: Any = None
    ) -> MadeMig:
        if gi is None:
            gi = self._call(what, "nvmlDeviceGetGpuInstanceById", h, gi_id)
        info = self._call(what, "nvmlGpuInstanceGetInfo", gi)
        pid = int(info.profileId)
        return MadeMig(
            gpu_uuid, gi_id, ci_id, uuid, self._name(gpu_uuid, h, pid), pid,
            int(info.placement.start), int(info.placement.size),
        )  # fmt: skip
