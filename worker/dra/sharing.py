"""Applying a prepared claim's sharing, and undoing it: the GPUs' timeslice, the claim's MPS daemon.

TimeSlicing is set as NVIDIA's DRA driver sets it (kubernetes-sigs/dra-driver-nvidia-gpu v0.4.1,
cmd/gpu-kubelet-plugin/sharing.go `TimeSlicingManager.SetTimeSlice`, nvlib.go `setComputeMode`
and `setTimeSlice`): for each full GPU, `nvidia-smi -i <uuid> -c DEFAULT`, then
`nvidia-smi compute-policy -i <uuid> --set-timeslice <n>` with the interval's number (Default 0,
Short 1, Medium 2, Long 3). NVIDIA sets Default again at every unprepare of a group; gpuvisor
sets it when the last prepared claim that time-slices that GPU is unprepared, so a claim that
shares the GPU keeps its interval. `nvidia-smi` is looked up on PATH, then under the driver root;
where there is none, a claim asking for an interval other than Default is refused saying so (a
Default one changes nothing there is to change).

MPS is handed to a `ClaimMps` (worker.dra.edits): its `start` returns the container edits for
the claim's CDI spec. `SharingSteps.apply` runs a claim's steps in order and, when one fails,
undoes the ones before it, so nothing half applied stays.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from common.dracheckpoint import (
    MEMORY_SHARE,
    MPS,
    TIME_SLICING,
    DeviceSharing,
    PreparedClaim,
    memory_share_uid,
)
from worker.dra.config import INTERVALS
from worker.dra.edits import CdiMount, ClaimMps, ContainerEdits, MpsLimits, SharingError
from worker.dra.memshare import memory_edits, still_shared

log = logging.getLogger("gpuvisor.worker")

NVIDIA_SMI = "nvidia-smi"
DRIVER_BIN_DIRS = ("usr/bin", "usr/local/bin", "bin", "usr/sbin")  # as supervisor/mps/layout.py
SMI_TIMEOUT_S = 15.0  # two runs per GPU stay well inside the kubelet's 45 s call timeout
MAX_OUTPUT = 400  # of nvidia-smi's words kept in an error

Runner = Callable[[Sequence[str], float], "tuple[int, str]"]  # argv, timeout -> (status, output)


def run_command(argv: Sequence[str], timeout: float) -> tuple[int, str]:
    """Run argv, stdin closed; (exit status, stdout and stderr). Raises OSError where it cannot run."""
    import subprocess  # here: a node whose claims share nothing never loads it

    try:
        done = subprocess.run(
            list(argv), stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return -1, f"no answer within {timeout:g}s"
    return done.returncode, (done.stdout + done.stderr).decode("utf-8", "replace")


def find_nvidia_smi(driver_root: str = "/", path: str | None = None, binary: str = NVIDIA_SMI) -> str | None:
    """nvidia-smi on PATH (`path`, default $PATH), else under the driver root; None where neither."""
    if "/" in binary:
        return binary if os.path.isfile(binary) and os.access(binary, os.X_OK) else None
    import shutil  # here, as above

    found = shutil.which(binary, path=os.environ.get("PATH", os.defpath) if path is None else path)
    if found:
        return found
    for d in DRIVER_BIN_DIRS:
        candidate = os.path.join(driver_root, d, binary)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


class TimeSlicer:
    """Sets a GPU's compute-policy timeslice through nvidia-smi, as NVIDIA's driver does."""

    def __init__(
        self,
        binary: str | None,
        run: Runner = run_command,
        timeout: float = SMI_TIMEOUT_S,
        where: str = "",
        find: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.binary = binary  # None: none found yet (`where` says where `find` looks)
        self._run = run
        self._timeout = timeout
        self._where = where
        self._find = find

    @classmethod
    def on_node(cls, driver_root: str = "/") -> TimeSlicer:
        """nvidia-smi looked up at the first claim that needs it (a node without one pays nothing)."""
        where = f"neither on PATH nor under the driver root {driver_root}"
        return cls(None, where=where, find=lambda: find_nvidia_smi(driver_root))

    def set(self, gpu_uuid: str, interval: str) -> None:
        """Compute mode DEFAULT, then the interval's timeslice; raises SharingError saying why."""
        if self.binary is None:
            self.binary = self._find()
        if self.binary is None:
            if interval == "Default":
                return  # nothing to change: without nvidia-smi nobody set another one
            raise SharingError(
                f"TimeSlicing with interval {interval} needs nvidia-smi to set GPU {gpu_uuid}'s compute-policy "
                f"timeslice, and nvidia-smi is {self._where or 'not given'}: install the driver's utilities "
                "or mount the driver root (--driver-root)"
            )
        steps = (
            ("-i", gpu_uuid, "-c", "DEFAULT"),
            ("compute-policy", "-i", gpu_uuid, "--set-timeslice", str(INTERVALS[interval])),
        )
        for args in steps:
            argv = (self.binary, *args)
            try:
                status, output = self._run(argv, self._timeout)
            except OSError as exc:
                raise SharingError(f"cannot run {self.binary}: {exc.strerror or exc}") from None
            if status != 0:
                words = " ".join(output.split())[:MAX_OUTPUT]
                raise SharingError(
                    f"setting GPU {gpu_uuid}'s timeslice to {interval}: `{' '.join(argv)}` failed "
                    f"(exit status {status}): {words or 'no output'}"
                )


def mps_limits(sharing: DeviceSharing) -> MpsLimits:
    return MpsLimits(
        active_thread_percentage=sharing.active_thread_percentage,
        pinned_memory_limit=sharing.pinned_memory_limit,
        per_device_pinned_memory_limit=dict(sharing.per_device_pinned_memory_limit),
    )


def edits_from_json(raw: Mapping[str, Any]) -> ContainerEdits:
    """ContainerEdits from the CDI JSON a checkpoint keeps (`ContainerEdits.to_json`)."""
    env = raw.get("env", [])
    mounts = raw.get("mounts", [])
    if not isinstance(env, list) or not isinstance(mounts, list):
        return ContainerEdits()
    return ContainerEdits(
        env=tuple(e for e in env if isinstance(e, str)),
        mounts=tuple(
            CdiMount(m["hostPath"], m["containerPath"], tuple(m.get("options", ())))
            for m in mounts
            if isinstance(m, dict)
            and isinstance(m.get("hostPath"), str)
            and isinstance(m.get("containerPath"), str)
        ),
    )


def time_sliced(claims: Iterable[PreparedClaim]) -> dict[str, str]:
    """GPU UUID -> the interval of the newest of these claims that time-slices it."""
    out: dict[str, tuple[float, str]] = {}
    for claim in claims:
        for d in claim.devices:
            s = d.sharing
            newer = s is not None and (s.gpu_uuid not in out or out[s.gpu_uuid][0] <= claim.prepared_at)
            if s is not None and s.strategy == TIME_SLICING and newer:
                out[s.gpu_uuid] = (claim.prepared_at, s.interval)
    return {gpu: interval for gpu, (_, interval) in out.items()}


def _intervals(claim: PreparedClaim) -> dict[str, str]:
    return {
        d.sharing.gpu_uuid: d.sharing.interval
        for d in claim.devices
        if d.sharing is not None and d.sharing.strategy == TIME_SLICING
    }


def _devices(claim: PreparedClaim, strategy: str) -> list[DeviceSharing]:
    return [d.sharing for d in claim.devices if d.sharing is not None and d.sharing.strategy == strategy]


class SharingSteps:
    """A claim's sharing steps: the timeslice of its GPUs, then its MPS daemon. The caller
    serializes calls (one claim's steps at a time, so two claims never race on one GPU)."""

    def __init__(self, timeslicer: TimeSlicer | None, mps: ClaimMps | None) -> None:
        self.timeslicer = timeslicer
        self.mps = mps

    def apply(self, claim: PreparedClaim, others: Iterable[PreparedClaim]) -> ContainerEdits:
        """Apply the claim's sharing; on failure undo what was done and raise SharingError.
        `others`: the prepared claims besides it (whose intervals an undo restores)."""
        done: list[str] = []
        try:
            for gpu, interval in sorted(_intervals(claim).items()):
                if self.timeslicer is None:
                    raise SharingError(
                        "TimeSlicing needs nvidia-smi, and this worker was given no way to run it"
                    )
                self.timeslicer.set(gpu, interval)
                done.append(gpu)
            mps, memory = _devices(claim, MPS), _devices(claim, MEMORY_SHARE)
            if not (mps or memory):
                return ContainerEdits()
            if self.mps is None:
                raise SharingError(
                    "MPS sharing needs gpuvisor's MPS control daemons for claims, which this DRA worker does not run"
                )
            if memory:  # a GPU shared by memory: a client of its daemon (worker.dra.memshare)
                return memory_edits(self.mps, memory[0])
            uuids = sorted({s.uuid for s in mps})
            return self.mps.start(claim.uid, uuids, mps_limits(mps[0]))
        except Exception as exc:
            self._restore(done, time_sliced(others), undo=True)
            if isinstance(exc, SharingError):
                raise
            raise SharingError(f"applying the claim's sharing failed: {exc!r}") from exc

    def teardown(self, claim: PreparedClaim, others: Iterable[PreparedClaim]) -> None:
        """Undo the claim's sharing at its unprepare: stop its MPS daemon, and set Default on each
        GPU no other prepared claim time-slices. Raises SharingError (the claim stays prepared)."""
        for s in _devices(claim, MEMORY_SHARE):
            if self.mps is not None and not still_shared(s.gpu_uuid, others):
                self.mps.stop(memory_share_uid(s.gpu_uuid))  # the GPU's last share: its daemon goes
        if _devices(claim, MPS):
            if self.mps is None:
                log.warning(
                    "claim %s/%s had an MPS daemon, but this worker runs none to stop",
                    claim.namespace,
                    claim.name,
                )
            else:
                self.mps.stop(claim.uid)
        self._restore(sorted(_intervals(claim)), time_sliced(others), undo=False)

    def _restore(self, gpus: Iterable[str], still: Mapping[str, str], *, undo: bool) -> None:
        for gpu in gpus:
            if gpu in still and not undo:
                continue  # another claim time-slices it: its interval stays
            if self.timeslicer is not None:
                try:
                    self.timeslicer.set(gpu, still.get(gpu, "Default"))
                except SharingError:
                    if not undo:
                        raise
                    log.error("undoing a failed prepare: GPU %s's timeslice could not be set back", gpu)
