"""An MPS claim's control daemon, as the DRA worker asks the supervisor for it: `SupervisorMps`.

The supervisor runs and supervises each MPS claim's daemon (supervisor/mps/claims.py says why
there and not here: the daemon outlives this process, which restarts more often than it). This
side turns a claim's `MpsLimits` into the request NVIDIA's kubelet plugin would send the daemon,
waits (bounded) for the answer, and gives the claim's containers what NVIDIA's
`GetCDIContainerEdits` gives them (cmd/gpu-kubelet-plugin/sharing.go at v0.4.1):
`CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps`, the claim's pipe directory mounted there and its shm
directory as /dev/shm, both `rw,nosuid,nodev,bind`. The limits are the daemon's defaults for its
clients; the containers need no variable of their own for them.

Limits: the default pinned memory limit applies to every GPU of the claim and a per-device one
overrides it (NVIDIA's `MpsPerDevicePinnedMemoryLimit.Normalize`), each in whole MiB, rounded
down; a limit under 1 MiB is refused, as NVIDIA refuses it ("value set too low").

`start` and `stop` run on a gRPC thread: the request goes to `send` (posted to the main thread,
which owns the DEALER), the answer comes back through `answer` (main thread; worker.dra.asking).
Unanswered requests end at `timeout`, under the kubelet's 45 s prepare timeout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from common.mpsmessages import START, STOP, MpsClaimReply, MpsClaimRequest
from worker.dra.asking import Asking
from worker.dra.edits import CdiMount, ContainerEdits, MpsLimits, SharingError

CONTAINER_PIPE_DIR = "/tmp/nvidia-mps"
CONTAINER_SHM_DIR = "/dev/shm"
MOUNT_OPTIONS = ("rw", "nosuid", "nodev", "bind")
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
TIMEOUT_S = 40.0  # the supervisor answers a start within 25 s plus a failed daemon's stop
MIB = 1024 * 1024


def limits_mib(gpu_uuids: Sequence[str], limits: MpsLimits) -> dict[str, int]:
    """The pinned memory limit per GPU UUID in MiB (NVIDIA's merge); raises SharingError."""
    out: dict[str, int] = {}
    if limits.pinned_memory_limit is not None:
        mib = limits.pinned_memory_limit // MIB
        if mib <= 0:
            raise SharingError(
                f"defaultPinnedDeviceMemoryLimit {limits.pinned_memory_limit} bytes is too low: at least 1Mi"
            )
        out = dict.fromkeys(gpu_uuids, mib)
    for uuid, value in sorted(limits.per_device_pinned_memory_limit.items()):
        if uuid not in gpu_uuids:
            raise SharingError(
                f"defaultPerDevicePinnedMemoryLimit names {uuid}, which is not a device of the claim"
            )
        if value // MIB <= 0:
            raise SharingError(
                f"defaultPerDevicePinnedMemoryLimit {value} bytes for {uuid} is too low: at least 1Mi"
            )
        out[uuid] = value // MIB
    return out


def container_edits(pipe_dir: str, shm_dir: str) -> ContainerEdits:
    return ContainerEdits(
        env=(f"{PIPE_ENV}={CONTAINER_PIPE_DIR}",),
        mounts=(
            CdiMount(shm_dir, CONTAINER_SHM_DIR, MOUNT_OPTIONS),
            CdiMount(pipe_dir, CONTAINER_PIPE_DIR, MOUNT_OPTIONS),
        ),
    )


class SupervisorMps:
    """`ClaimMps` (worker/dra/edits.py) through the supervisor, over the control channel."""

    def __init__(
        self, resource: str, send: Callable[[MpsClaimRequest], None], timeout: float = TIMEOUT_S
    ) -> None:
        self.resource = resource
        self._asking: Asking[MpsClaimReply] = Asking(send, timeout)

    def start(self, claim_uid: str, gpu_uuids: Sequence[str], limits: MpsLimits) -> ContainerEdits:
        if limits.active_thread_percentage is not None and not 1 <= limits.active_thread_percentage <= 100:
            raise SharingError(
                f"defaultActiveThreadPercentage {limits.active_thread_percentage} is not within 1-100"
            )
        pinned = limits_mib(gpu_uuids, limits)
        reply = self._ask(
            MpsClaimRequest(
                self.resource,
                "",
                START,
                claim_uid,
                gpu_uuids=",".join(gpu_uuids),
                thread_percentage=limits.active_thread_percentage or 0,
                pinned_limits={uuid: float(mib) for uuid, mib in pinned.items()},
            )
        )
        if not reply.pipe_dir or not reply.shm_dir:
            raise SharingError(f"claim {claim_uid}: the supervisor named no MPS pipe directory")
        return container_edits(reply.pipe_dir, reply.shm_dir)

    def stop(self, claim_uid: str) -> None:
        self._ask(MpsClaimRequest(self.resource, "", STOP, claim_uid))

    def _ask(self, request: MpsClaimRequest) -> MpsClaimReply:
        what = (
            f"claim {request.claim_uid}: the supervisor, which runs MPS control daemons, did not answer "
            f"the {request.action}"
        )
        return self._asking.ask(request, what)

    def answer(self, reply: MpsClaimReply) -> None:
        """The supervisor's reply (main thread); one nobody waits for any more is dropped."""
        self._asking.answer(reply)

    def waiting(self) -> int:
        return self._asking.waiting()
