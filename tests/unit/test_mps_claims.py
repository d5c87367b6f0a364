"""The MPS claim daemons' rules (supervisor/mps/claims.py, supervisor/mps/claimwiring.py) and the
DRA worker's side of them (worker/dra/mps.py): settings and their checks, NVIDIA's daemon ID and
limit merge, the container edits.

NVIDIA's rules are read in kubernetes-sigs/dra-driver-nvidia-gpu v0.4.1:
cmd/gpu-kubelet-plugin/sharing.go (GetMpsControlDaemonID, GetCDIContainerEdits) and
api/nvidia.com/resource/v1beta1/sharing.go (MpsPerDevicePinnedMemoryLimit.Normalize, limit.Megabyte).
"""

from __future__ import annotations

import hashlib
import os
import threading

import pytest

from common.mpsmessages import MpsClaimReply, MpsClaimRequest
from supervisor.mps.claims import claim_settings, daemon_id
from supervisor.mps.claimwiring import claims_root
from supervisor.mps.layout import MpsError
from worker.dra.edits import CdiMount, MpsLimits, SharingError
from worker.dra.mps import SupervisorMps, limits_mib

UID = "0b0e7c6e-3f4a-4b7e-9a55-6c1f0d2e8a11"
A, B = "GPU-aaaaaaaa-0000-0000-0000-000000000000", "GPU-bbbbbbbb-0000-0000-0000-000000000000"
MIB = 1 << 20


def test_daemon_id_and_commands_are_nvidias() -> None:
    """The ID is <uid>-<sha256(uuids joined by ',')[:5]>; commands: thread share first, then the
    per-UUID limits by UUID; CUDA_VISIBLE_DEVICES is the claim's GPUs in its order."""
    s = claim_settings("/r", UID, (B, A), 60, {B: 512, A: 256})
    assert s.daemon_id == f"{UID}-{hashlib.sha256(f'{B},{A}'.encode()).hexdigest()[:5]}"
    assert daemon_id(UID, (B, A)) == s.daemon_id
    assert s.commands() == [
        "set_default_active_thread_percentage 60",
        f"set_default_device_pinned_mem_limit {A} 256M",
        f"set_default_device_pinned_mem_limit {B} 512M",
    ]
    assert s.extra_env() == {"CUDA_VISIBLE_DEVICES": f"{B},{A}"}
    assert (s.pipe_dir, s.shm_dir) == (f"/r/{s.daemon_id}/pipe", f"/r/{s.daemon_id}/shm")


@pytest.mark.parametrize(
    ("uid", "gpus", "thread", "limits", "error"),
    [
        ("../x", (A,), None, {}, "is not a UID"),
        ("a/b", (A,), None, {}, "is not a UID"),
        (UID, (), None, {}, "1 to 32 GPUs, not 0"),
        (UID, (A, A), None, {}, "named twice"),
        (UID, ("nvidia0",), None, {}, "is not a GPU UUID"),
        (UID, (A,), 0, {}, "not within 1-100"),
        (UID, (A,), None, {B: 5}, "not one of its GPUs"),
        (UID, (A,), None, {A: 0.5}, "not a whole number of MiB"),
    ],
)
def test_bad_settings_are_refused(
    uid: str, gpus: tuple[str, ...], thread: int | None, limits: dict[str, float], error: str
) -> None:
    """Each bad value is refused with what and why, before any path is made of it."""
    with pytest.raises(MpsError, match=error):
        claim_settings("/r", uid, gpus, thread, limits)


def test_claims_root_is_under_the_mps_root_else_nvidias() -> None:
    """<mpsRoot>/dra with --mps-root, else <kubelet plugins dir>/gpu.nvidia.com/mps (NVIDIA's)."""
    assert claims_root("/run/nvidia/mps", "/var/lib/kubelet/plugins") == "/run/nvidia/mps/dra"
    assert claims_root("", "/var/lib/kubelet/plugins") == "/var/lib/kubelet/plugins/gpu.nvidia.com/mps"


def test_limits_merge_as_nvidia_normalizes() -> None:
    """The default applies to every GPU, a per-device limit overrides it; bytes become whole MiB
    rounded down; under 1 MiB is too low."""
    limits = MpsLimits(pinned_memory_limit=2 * 1024 * MIB, per_device_pinned_memory_limit={B: 3 * MIB + 7})
    assert limits_mib((A, B), limits) == {A: 2048, B: 3}
    assert limits_mib((A,), MpsLimits()) == {}
    with pytest.raises(SharingError, match="too low"):
        limits_mib((A,), MpsLimits(pinned_memory_limit=MIB - 1))
    with pytest.raises(SharingError, match="not a device of the claim"):
        limits_mib((A,), MpsLimits(per_device_pinned_memory_limit={B: MIB}))


def test_worker_side_sends_the_request_and_returns_nvidias_edits() -> None:
    """start sends the claim's GPUs and limits and, on the answer, gives the containers
    CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps and the pipe and shm binds NVIDIA gives them."""
    sent: list[MpsClaimRequest] = []

    def send(request: MpsClaimRequest) -> None:
        sent.append(request)
        threading.Thread(
            target=mps.answer, args=(MpsClaimReply(request.request_id, "", "/h/pipe", "/h/shm"),)
        ).start()

    mps = SupervisorMps("gpu.nvidia.com", send)
    edits = mps.start(UID, (A, B), MpsLimits(active_thread_percentage=20, pinned_memory_limit=MIB))
    rid = sent[0].request_id  # this process's own IDs (worker.dra.asking): "<pid>.<random>-<n>"
    assert rid.startswith(f"{os.getpid()}.") and rid.endswith("-1")
    assert sent[0] == MpsClaimRequest("gpu.nvidia.com", rid, "start", UID, f"{A},{B}", 20, {A: 1.0, B: 1.0})
    options = ("rw", "nosuid", "nodev", "bind")
    assert edits.env == ("CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps",)
    assert edits.mounts == (
        CdiMount("/h/shm", "/dev/shm", options),
        CdiMount("/h/pipe", "/tmp/nvidia-mps", options),
    )
    assert mps.waiting() == 0


def test_worker_side_errors_are_sharing_errors() -> None:
    """The supervisor's error, and no answer within the timeout, are SharingErrors naming the claim."""
    mps = SupervisorMps(
        "gpu.nvidia.com", lambda r: mps.answer(MpsClaimReply(r.request_id, error="no binary"))
    )
    with pytest.raises(SharingError, match=r"^no binary$"):
        mps.stop(UID)
    silent = SupervisorMps("gpu.nvidia.com", lambda r: None, timeout=0.05)
    with pytest.raises(
        SharingError, match=f"claim {UID}: the supervisor.*did not answer the start within 0.05s"
    ):
        silent.start(UID, (A,), MpsLimits())
    with pytest.raises(SharingError, match="not within 1-100"):
        silent.start(UID, (A,), MpsLimits(active_thread_percentage=101))
