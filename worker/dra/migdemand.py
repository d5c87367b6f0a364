"""MIG devices made on demand (gpuvisor.dra.migOnDemand), as the DRA worker asks for them.

A claim allocated a MIG placement of a partitionable GPU (a plan device with `on_demand`) gets its
MIG device made at prepare and destroyed at unprepare; a claim allocated the full GPU of such a
GPU has MIG mode turned off first where it is on. The supervisor does both (it owns NVML:
supervisor/dra/migs.py); this side asks (`SupervisorMig`, over the control channel, bounded by
`TIMEOUT_S`) and keeps what was made in the claim's checkpoint entry (`MadeMigRecord`), so that an
unprepare after a restart destroys it and the supervisor keeps it while the claim is prepared.

The claim's CDI spec names the made device: `made_record` is its plan record with the instance's
UUID and GPU and compute instance IDs, which the spec's device nodes (the MIG capability
minors) need.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

from common.dracheckpoint import MadeMigRecord
from common.migmessages import CREATE, DESTROY, FULL, MigClaimReply, MigClaimRequest
from common.model import AllocatableDevice
from worker.dra.asking import Asking

TIMEOUT_S = 40.0  # a GPU instance takes about a second on a real GPU; MIG mode more


def made_record(record: AllocatableDevice, made: MadeMigRecord) -> AllocatableDevice:
    """The plan record of a placement, as the MIG device made at it."""
    return dataclasses.replace(record, uuid=made.uuid, mig_gi=made.gi_id, mig_ci=made.ci_id)


class SupervisorMig:
    def __init__(
        self,
        resource: str,
        send: Callable[[MigClaimRequest], None],
        timeout: float = TIMEOUT_S,
        pid: int | None = None,
    ) -> None:
        self.resource = resource
        self.pid = os.getpid() if pid is None else pid
        self._asking: Asking[MigClaimReply] = Asking(send, timeout)

    def create(self, claim_uid: str, device: AllocatableDevice) -> MadeMigRecord:
        """Make the MIG device of placement `device`; raises SharingError saying why not."""
        where = {"gi_profile_id": device.mig_gi_profile_id, "placement_start": device.mig_placement_start}
        reply = self._ask(CREATE, claim_uid, device.gpu_uuid, f"make MIG device {device.id}", **where)
        return MadeMigRecord(device.gpu_uuid, reply.gi_id, reply.ci_id, reply.uuid)

    def destroy(self, claim_uid: str, made: MadeMigRecord) -> None:
        what = f"destroy MIG device {made.uuid}"
        self._ask(
            DESTROY, claim_uid, made.gpu_uuid, what, gi_id=made.gi_id, ci_id=made.ci_id, mig_uuid=made.uuid
        )

    def full(self, claim_uid: str, gpu_uuid: str) -> None:
        """Clear the way for the claim to get GPU `gpu_uuid` whole (MIG mode off)."""
        self._ask(FULL, claim_uid, gpu_uuid, f"give GPU {gpu_uuid} whole")

    def _ask(self, action: str, claim_uid: str, gpu_uuid: str, what: str, **fields: Any) -> MigClaimReply:
        request = MigClaimRequest(
            self.resource, "", action, claim_uid, gpu_uuid, worker_pid=self.pid, **fields
        )
        return self._asking.ask(
            request, f"claim {claim_uid}: the supervisor, which makes MIG devices, did not {what}"
        )

    def answer(self, reply: MigClaimReply) -> None:
        self._asking.answer(reply)
