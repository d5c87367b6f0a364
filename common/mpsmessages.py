"""The control-channel messages of a DRA claim's MPS control daemon (kinds of `common.messages`).

The DRA worker prepares an MPS claim by asking the supervisor, which runs and supervises the
claim's daemon (supervisor/mps/claims.py says why there): `MpsClaimRequest` with `action`
"start" (the claim's GPUs and limits) or "stop", answered by one `MpsClaimReply` once the daemon
is up with its limits set, or gone, or with why not. Apart from common/messages.py only so that the
one module of the wire format stays a readable size; it registers these kinds there.

Limits travel as NVIDIA's kubelet plugin sends them to the daemon: the active thread percentage
(0: unset) and a pinned device memory limit per GPU UUID in MiB (the claim's default for every
GPU, overridden per GPU, already merged by the worker).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from common.messagefields import CONTROL_TOPIC, _Flat, _int, _number_dict, _str

START = "start"
STOP = "stop"


@dataclass(frozen=True)
class MpsClaimRequest(_Flat):
    """DRA worker -> supervisor: start (or stop) the MPS control daemon of claim `claim_uid`.

    `gpu_uuids` is the claim's GPUs, comma-separated, in the claim's order (the daemon's
    CUDA_VISIBLE_DEVICES); `thread_percentage` 0 leaves the daemon's default; `pinned_limits`
    maps a GPU UUID to its limit in MiB. A stop names only the claim.
    """

    KIND: ClassVar[str] = "mps-claim-request"
    TOPIC: ClassVar[bytes] = CONTROL_TOPIC
    _FIELDS = (
        ("resource", _str),
        ("request_id", _str),
        ("action", _str),
        ("claim_uid", _str),
        ("gpu_uuids", _str),
        ("thread_percentage", _int),
        ("pinned_limits", _number_dict),
    )

    resource: str
    request_id: str
    action: str
    claim_uid: str
    gpu_uuids: str = ""
    thread_percentage: int = 0
    pinned_limits: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class MpsClaimReply(_Flat):
    """Supervisor -> DRA worker: the daemon is up (`pipe_dir`, `shm_dir`: its host directories
    for the claim's containers), or stopped (both empty), or why not (`error`)."""

    KIND: ClassVar[str] = "mps-claim-reply"
    TOPIC: ClassVar[bytes] = CONTROL_TOPIC
    _FIELDS = (("request_id", _str), ("error", _str), ("pipe_dir", _str), ("shm_dir", _str))

    request_id: str
    error: str = ""
    pipe_dir: str = ""
    shm_dir: str = ""
