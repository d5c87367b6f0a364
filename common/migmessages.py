"""The control-channel messages of MIG devices made on demand (kinds of `common.messages`).

With gpuvisor.dra.migOnDemand the DRA worker prepares a claim for a MIG placement by asking the
supervisor, which owns NVML (supervisor/dra/migs.py): `MigClaimRequest` with `action`

- "create": make the GPU instance of profile `gi_profile_id` at `placement_start` on GPU
  `gpu_uuid`, and its compute instance spanning it (MIG mode enabled first where it is off and the
  GPU is free), answered with the new MIG device's `uuid`, `gi_id` and `ci_id`;
- "destroy": destroy GPU instance `gi_id` (compute instance `ci_id` first) of `gpu_uuid`; one that
  is gone already is destroyed;
- "full": a claim is to get the whole GPU `gpu_uuid`: MIG mode is turned off where it is on and
  the GPU has no instance (an error naming them where it has);

each answered by one `MigClaimReply` (`error` says why not). Apart from common/messages.py only so
that the one module of the wire format stays a readable size; it registers these kinds there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from common.messagefields import CONTROL_TOPIC, _Flat, _int, _str

CREATE = "create"
DESTROY = "destroy"
FULL = "full"
ACTIONS = (CREATE, DESTROY, FULL)


@dataclass(frozen=True)
class MigClaimRequest(_Flat):
    """DRA worker -> supervisor: make, destroy, or clear the way for a claim's device (see above)."""

    KIND: ClassVar[str] = "mig-claim-request"
    TOPIC: ClassVar[bytes] = CONTROL_TOPIC
    _FIELDS = (
        ("resource", _str),
        ("request_id", _str),
        ("action", _str),
        ("claim_uid", _str),
        ("gpu_uuid", _str),
        ("gi_profile_id", _int),
        ("placement_start", _int),
        ("gi_id", _int),
        ("ci_id", _int),
        ("worker_pid", _int),
        ("mig_uuid", _str),
    )

    resource: str
    request_id: str
    action: str
    claim_uid: str
    gpu_uuid: str
    gi_profile_id: int = 0
    placement_start: int = 0
    gi_id: int = 0
    ci_id: int = 0
    worker_pid: int = 0  # the asking DRA worker's: what it made is its to record, while it lives
    mig_uuid: str = ""  # a destroy: the instance's UUID (GPU instance IDs are reused)


@dataclass(frozen=True)
class MigClaimReply(_Flat):
    """Supervisor -> DRA worker: done (a create's MIG device `uuid`, `gi_id`, `ci_id`), or why not."""

    KIND: ClassVar[str] = "mig-claim-reply"
    TOPIC: ClassVar[bytes] = CONTROL_TOPIC
    _FIELDS = (("request_id", _str), ("error", _str), ("uuid", _str), ("gi_id", _int), ("ci_id", _int))

    request_id: str
    error: str = ""
    uuid: str = ""
    gi_id: int = 0
    ci_id: int = 0
