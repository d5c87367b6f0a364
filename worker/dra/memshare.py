"""A GPU shared by memory: a claim's share, enforced through MPS (gpuvisor.dra.memorySharing).

Where the node publishes its full GPUs for several claims by memory (supervisor/dra/memshare.py),
the scheduler gives each claim a result with a `shareID` and `consumedCapacity.memory`, the
memory it may use (resource.k8s.io/v1 DeviceRequestAllocationResult, kubernetes/api v0.34.0
resource/v1/types.go:1560-1580). A share is enforced, not only counted: every claim with a share
of a GPU is a client of that GPU's one MPS control daemon (two daemons cannot serve one GPU; the
supervisor runs it as it runs an MPS claim's, `memory_share_uid` its owner, kept while any such
claim is prepared), and the claim's containers get, through its CDI spec, the daemon's pipe dir
and `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=<MiB>M`: the MPS client's pinned device memory limit,
in the form NVIDIA's MPS documentation gives (docs.nvidia.com/deploy/mps, "Environment
Variables", CUDA_MPS_PINNED_DEVICE_MEM_LIMIT: `<device ordinal>=<limit>` entries joined by ",",
e.g. `0=1G,1=512M`). The ordinal is 0: the daemon runs with CUDA_VISIBLE_DEVICES set to that one
GPU, so its clients see it as their device 0. An allocation past the share fails in the client
that makes it (out of memory), not in a neighbour.

Rules, each a claim's error: the device is a full GPU (a MIG device's memory is its instance's);
the share is at least 1 MiB (handed on in whole MiB, rounded down); no GpuConfig sharing applies
to it as well (its containers are MPS clients already: TimeSlicing or an MPS entry of its own
would mean a second daemon on the GPU); and one GPU per claim shared by memory (a container
reaches one MPS daemon through CUDA_MPS_PIPE_DIRECTORY).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from common.dracheckpoint import MEMORY_SHARE, MPS, DeviceSharing, PreparedClaim, memory_share_uid
from common.model import AllocatableDevice
from worker.dra.claims import AllocatedDevice, ClaimError, ClaimRef
from worker.dra.edits import ClaimMps, ContainerEdits, MpsLimits

PINNED_ENV = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
MIB = 1 << 20


def pinned_env(share_bytes: int) -> str:
    """The MPS client's limit for a share of one GPU (its device 0), in whole MiB."""
    return f"{PINNED_ENV}=0={share_bytes // MIB}M"


def memory_sharing(
    ref: ClaimRef,
    allocated: Sequence[AllocatedDevice],
    devices: Sequence[AllocatableDevice],
    sharing: Sequence[DeviceSharing | None],
) -> list[DeviceSharing | None]:
    """Each device's sharing with the claim's memory shares added; raises ClaimError."""
    out = list(sharing)
    gpus: set[str] = set()
    for i, (a, device) in enumerate(zip(allocated, devices, strict=True)):
        if a.consumed_memory is None:
            continue
        what = f"claim {ref}: device {a.device} (request {a.request})"
        if device.is_mig:
            raise ClaimError(
                f"{what}: a MIG device is not shared by memory; its memory is its GPU instance's"
            )
        if a.consumed_memory < MIB:
            raise ClaimError(f"{what}: its memory share {a.consumed_memory} bytes is under 1Mi")
        given = out[i]
        if given is not None:
            raise ClaimError(
                f"{what}: shared by memory (its containers are MPS clients of the GPU's daemon), so a "
                f"GpuConfig sharing ({given.strategy}) cannot apply to it as well"
            )
        gpus.add(device.gpu_uuid)
        if len(gpus) > 1:
            raise ClaimError(
                f"claim {ref}: memory shares of {len(gpus)} GPUs: a claim shares the memory of one GPU "
                "(its containers reach one MPS daemon)"
            )
        out[i] = DeviceSharing(
            MEMORY_SHARE, uuid=device.uuid, gpu_uuid=device.gpu_uuid, pinned_memory_limit=a.consumed_memory
        )
    if gpus and any(s is not None and s.strategy == MPS for s in out):
        raise ClaimError(
            f"claim {ref}: a memory share and an MPS configuration in one claim: its containers would need "
            "two MPS daemons (one CUDA_MPS_PIPE_DIRECTORY)"
        )
    return out


def memory_edits(mps: ClaimMps, sharing: DeviceSharing) -> ContainerEdits:
    """Start (or join) the GPU's shared daemon; the edits of a client with the claim's share."""
    edits = mps.start(memory_share_uid(sharing.gpu_uuid), [sharing.gpu_uuid], MpsLimits())
    return edits + ContainerEdits(env=(pinned_env(sharing.pinned_memory_limit or 0),))


def still_shared(gpu_uuid: str, others: Iterable[PreparedClaim]) -> bool:
    """Does another prepared claim share this GPU by memory (its daemon stays)?"""
    return any(
        d.sharing is not None and d.sharing.strategy == MEMORY_SHARE and d.sharing.gpu_uuid == gpu_uuid
        for c in others
        for d in c.devices
    )
