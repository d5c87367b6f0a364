"""Tests of supervisor.dra.migs.MigRequests over the real MigMaker and the NVML simulator (an H100
node, MIG mode off): the DRA worker's requests answered, MIG mode never toggled on a GPU a
claim holds, and the clean-up that keeps what claims hold and destroys the rest."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from common.dracheckpoint import Checkpoint, MadeMigRecord, PreparedClaim, PreparedDevice
from common.messages import Message
from common.migmessages import CREATE, DESTROY, FULL, MigClaimReply, MigClaimRequest
from common.model import Node
from supervisor.dra.migs import MigRequests
from supervisor.node.migmaker import MigMaker
from supervisor.node.nvml import Nvml
from supervisor.sim.nvml import load_simulator
from tests.helpers import wait_until


class Rig:
    def __init__(self, tmp: Path) -> None:
        self.sim = load_simulator("dgx-h100")
        self.nvml = Nvml(self.sim, sysfs_root=None, mig_options=True)
        self.nvml.init()
        self.node: Node = self.nvml.discover()
        self.maker = MigMaker(self.sim)
        self.checkpoint = Checkpoint(str(tmp))
        self.replies: dict[str, MigClaimReply] = {}
        self.rediscovered: list[str] = []
        self.counted: list[tuple[str, str]] = []
        self.done = threading.Condition()
        self.requests = MigRequests(
            maker=lambda: self.maker,
            checkpoint_path=self.checkpoint.path,
            node=lambda: self.node,
            answer=self._answer,
            rediscover=self._rediscover,
            clock=lambda: self.now,
            on_count=lambda what, result: self.counted.append((what, result)),
        )
        self.now = 1000.0
        self.gpu = self.node.gpus[0].uuid
        self._ids = 0

    def _answer(self, resource: str, reply: Message) -> None:
        assert isinstance(reply, MigClaimReply)
        self.replies[reply.request_id] = reply

    def _rediscover(self, trigger: str) -> None:
        self.node = self.nvml.discover()
        self.rediscovered.append(trigger)

    def ask(self, action: str, **kw: Any) -> MigClaimReply:
        self._ids += 1
        rid = str(self._ids)
        args = {"claim_uid": "u1", "gpu_uuid": self.gpu, "worker_pid": 7, **kw}
        self.requests.request(MigClaimRequest("gpu.nvidia.com", rid, action, **args))
        assert wait_until(lambda: rid in self.replies, 10)
        return self.replies[rid]

    def hold(self, uid: str, device: str, made: MadeMigRecord | None = None) -> None:
        self.checkpoint.put(
            [
                PreparedClaim(
                    uid, "default", uid, (PreparedDevice(("r",), "node-a", device, (), made=made),), 1.0
                )
            ]
        )

    def uuids(self) -> set[str]:
        return {m.uuid for m in self.maker.instances(self.gpu)}


@pytest.fixture
def rig(tmp_path: Path) -> Any:
    r = Rig(tmp_path)
    yield r
    r.requests.close()


def test_a_create_turns_mig_mode_on_makes_the_device_and_a_destroy_removes_it(rig: Rig) -> None:
    """MIG mode off and no claim on the GPU: a create turns it on and answers with the new MIG
    device; a destroy removes it, and a second destroy of it is a success."""
    reply = rig.ask(CREATE, gi_profile_id=19, placement_start=3)
    assert reply.error == "" and reply.uuid.startswith("MIG-")
    assert rig.maker.mig_mode(rig.gpu).current and rig.uuids() == {reply.uuid}
    assert wait_until(lambda: "mig-create" in rig.rediscovered, 10)  # asked for after the reply
    for _ in range(2):
        assert rig.ask(DESTROY, gi_id=reply.gi_id, ci_id=reply.ci_id).error == ""
    assert rig.uuids() == set()


def test_mig_mode_is_not_turned_on_while_a_claim_holds_the_full_gpu(rig: Rig) -> None:
    """A prepared claim holds gpu-0 (the full GPU): a create on it is refused naming that claim,
    and MIG mode stays off."""
    rig.hold("whole", "gpu-0")
    reply = rig.ask(CREATE, claim_uid="other", gi_profile_id=19, placement_start=0)
    assert "claim default/whole holds its device gpu-0" in reply.error
    assert not rig.maker.mig_mode(rig.gpu).current


def test_a_full_gpu_claim_turns_mig_mode_off_only_without_instances(rig: Rig) -> None:
    """`full` on a GPU with an instance is refused naming it; once it is gone MIG mode is turned
    off; on a GPU with MIG mode off it changes nothing."""
    made = rig.ask(CREATE, gi_profile_id=9, placement_start=0)
    refused = rig.ask(FULL, claim_uid="whole")
    assert made.uuid in refused.error and rig.maker.mig_mode(rig.gpu).current
    rig.ask(DESTROY, gi_id=made.gi_id, ci_id=made.ci_id)
    assert rig.ask(FULL, claim_uid="whole").error == ""
    assert not rig.maker.mig_mode(rig.gpu).current
    assert rig.ask(FULL, claim_uid="whole").error == ""


def test_an_overlapping_placement_is_refused_naming_the_instance(rig: Rig) -> None:
    """A 3g.40gb at 0 takes memory slices 0-3: a 1g.10gb at 2 is refused as taken, naming it."""
    first = rig.ask(CREATE, gi_profile_id=9, placement_start=0)
    second = rig.ask(CREATE, claim_uid="u2", gi_profile_id=19, placement_start=2)
    assert "taken" in second.error and first.uuid in second.error
    assert rig.uuids() == {first.uuid}


def test_a_refusal_is_counted_once(rig: Rig) -> None:
    """A create NVML refuses is one `refused` in the metrics and one `failed` in the status, not
    also a `failed` metric beside it; the create before it is one `ok`."""
    rig.ask(CREATE, gi_profile_id=9, placement_start=0)
    rig.ask(CREATE, claim_uid="u2", gi_profile_id=19, placement_start=2)
    assert rig.counted == [("mig:create", "ok"), ("mig:create", "refused")]
    assert rig.requests.status()["failed"] == 1 and rig.requests.status()["created"] == 1


def test_the_clean_up_keeps_what_claims_hold_and_what_a_live_worker_made(rig: Rig) -> None:
    """Four instances: one a claim's made record holds, one a claim holds by its device name
    (prepared before the GPU was partitionable), one made for a DRA worker that still lives, one
    made by hand: only the last is destroyed. With that worker gone, its unrecorded one goes too."""
    recorded = rig.ask(CREATE, gi_profile_id=19, placement_start=0)
    rig.hold(
        "a", "gpu-0-mig-1g10gb-19-0", MadeMigRecord(rig.gpu, recorded.gi_id, recorded.ci_id, recorded.uuid)
    )
    by_name = rig.maker.create(rig.gpu, 19, 1)
    rig.checkpoint.put(
        [
            PreparedClaim(
                "b", "default", "b", (PreparedDevice(("r",), "node-a", "gpu-0-mig-1g10gb-19-1", ()),), 1.0
            )
        ]
    )
    live = rig.ask(CREATE, claim_uid="c", gi_profile_id=19, placement_start=2)
    hand = rig.maker.create(rig.gpu, 19, 3)
    rig.node = rig.nvml.discover()
    rig.now += 1
    rig.requests.reconcile(frozenset({rig.gpu}), frozenset({7}), "test")
    assert wait_until(lambda: hand.uuid not in rig.uuids(), 10)
    assert rig.uuids() == {recorded.uuid, by_name.uuid, live.uuid}
    rig.requests.reconcile(frozenset({rig.gpu}), frozenset({8}), "worker replaced")
    assert wait_until(lambda: live.uuid not in rig.uuids(), 10)
    assert rig.uuids() == {recorded.uuid, by_name.uuid}


def test_an_unreadable_checkpoint_destroys_nothing(rig: Rig) -> None:
    """A checkpoint that cannot be read says nothing about what claims hold: nothing is destroyed."""
    hand = rig.maker.create(rig.gpu, 19, 4)
    Path(rig.checkpoint.path).write_text("{not json")
    rig.requests.reconcile(frozenset({rig.gpu}), frozenset(), "test")
    rig.requests.request(
        MigClaimRequest("gpu.nvidia.com", "x", "nothing", "u", rig.gpu)
    )  # after it, in order
    assert wait_until(lambda: "x" in rig.replies, 10)
    assert "unknown MIG action" in rig.replies["x"].error
    assert rig.uuids() == {hand.uuid}


def test_a_destroy_spares_another_claims_instance_at_reused_ids(rig: Rig) -> None:
    """GPU instance IDs are reused: a destroy retried after its instance went and another claim's
    got the same IDs names the old UUID, is answered as done, and the other instance stays."""
    first = rig.ask(CREATE, gi_profile_id=19, placement_start=0)
    assert rig.ask(DESTROY, gi_id=first.gi_id, ci_id=first.ci_id, mig_uuid=first.uuid).error == ""
    second = rig.ask(CREATE, claim_uid="u2", gi_profile_id=19, placement_start=0)
    assert (second.gi_id, second.ci_id) == (first.gi_id, first.ci_id)  # reused, as NVML reuses them
    assert rig.ask(DESTROY, gi_id=first.gi_id, ci_id=first.ci_id, mig_uuid=first.uuid).error == ""
    assert rig.uuids() == {second.uuid}


def test_a_create_asked_again_for_the_same_claim_and_placement_gets_the_same_device(rig: Rig) -> None:
    """The worker's wait ended before the answer and the kubelet asks again: the instance made for
    that claim at that placement is the answer, not a `taken` refusal."""
    first = rig.ask(CREATE, gi_profile_id=9, placement_start=4)
    again = rig.ask(CREATE, gi_profile_id=9, placement_start=4)
    assert again.error == "" and again.uuid == first.uuid and rig.uuids() == {first.uuid}
    other = rig.ask(CREATE, claim_uid="u2", gi_profile_id=9, placement_start=4)
    assert "taken" in other.error


def test_a_live_workers_unrecorded_instance_goes_after_the_grace(rig: Rig) -> None:
    """Made for a DRA worker that still lives but never recorded (its prepare gave up): kept while
    its record may still come, destroyed by a clean-up GRACE_S after it was made."""
    from supervisor.dra.migs import GRACE_S

    made = rig.ask(CREATE, gi_profile_id=19, placement_start=5)
    rig.now += 10
    rig.requests.reconcile(frozenset({rig.gpu}), frozenset({7}), "periodic")
    rig.ask(FULL, claim_uid="probe", gpu_uuid=rig.node.gpus[1].uuid)  # after the clean-up, in order
    assert rig.uuids() == {made.uuid}
    rig.now += GRACE_S
    rig.requests.reconcile(frozenset({rig.gpu}), frozenset({7}), "periodic")
    assert wait_until(lambda: rig.uuids() == set(), 10)
