"""Tests of the DRA worker's MIG devices made on demand (worker.dra.prepare with
worker.dra.migdemand.SupervisorMig): what a prepare asks the supervisor, what the claim's spec and
checkpoint keep, and what is undone when a step fails. The supervisor is a function here that
answers the worker's requests as supervisor/dra/migs.py does (tests/unit/test_dra_migs.py tests
that side over the real maker; tests/process/test_dra_mig_on_demand.py both together)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from common.dracheckpoint import Checkpoint, CheckpointError
from common.migmessages import CREATE, DESTROY, FULL, MigClaimReply, MigClaimRequest
from common.model import ResourcePlan
from supervisor.config import config_from_data
from supervisor.node.draplan import dra_plan
from supervisor.sim.drakubelet import ClaimStore
from tests.unit.test_dra_partitions import _node
from worker.dra.claims import ClaimRef, DirectoryClaimSource
from worker.dra.claimspec import ClaimSpecs
from worker.dra.migdemand import SupervisorMig
from worker.dra.prepare import Preparer

POOL = "node-a"
PLACEMENT = "gpu-0-mig-1g10gb-19-2"


class Supervisor:
    """Answers each request at once; `fail` makes the next request of that action fail."""

    def __init__(self) -> None:
        self.asked: list[MigClaimRequest] = []
        self.fail: dict[str, str] = {}
        self.mig: SupervisorMig | None = None

    def send(self, request: MigClaimRequest) -> None:
        self.asked.append(request)
        assert self.mig is not None
        error = self.fail.pop(request.action, "")
        if request.action == CREATE and not error:
            reply = MigClaimReply(
                request.request_id, uuid=f"MIG-{request.placement_start}", gi_id=11, ci_id=0
            )
        else:
            reply = MigClaimReply(request.request_id, error=error)
        self.mig.answer(reply)


class Setup:
    def __init__(self, tmp: Path) -> None:
        data = {
            "version": "v1",
            "gpuvisor": {"mode": "dra", "kubeletPluginsDir": str(tmp / "plugins"), "draClaimsDir": str(tmp / "claims"),
                         "dra": {"migOnDemand": True}},
        }  # fmt: skip
        self.plan: ResourcePlan = dra_plan(
            _node(), config_from_data(data, flags={"node_name": POOL}, source="t")
        )
        assert self.plan.dra is not None
        self.store = ClaimStore(self.plan.dra.claims_dir)
        self.supervisor = Supervisor()
        self.mig = SupervisorMig(self.plan.resource, self.supervisor.send, timeout=5, pid=42)
        self.supervisor.mig = self.mig
        self.checkpoint = Checkpoint(self.plan.dra.plugin_dir)
        self.checkpoint.load()
        minors = {"gpu0/gi11/access": 100, "gpu0/gi11/ci0/access": 101}
        self.specs = ClaimSpecs(self.plan, str(tmp / "cdi"), minors_reader=lambda path: minors)
        self.preparer = Preparer(
            self.plan,
            DirectoryClaimSource(self.plan.dra.claims_dir),
            self.checkpoint,
            specs=self.specs,
            mig=self.mig,
        )

    def claim(self, name: str, *devices: str) -> ClaimRef:
        return ClaimRef(*self.store.allocate("default", name, POOL, list(devices)))

    def actions(self) -> list[str]:
        return [r.action for r in self.supervisor.asked]


@pytest.fixture
def s(tmp_path: Path) -> Setup:
    return Setup(tmp_path)


def test_a_placement_is_made_at_prepare_named_in_the_spec_and_destroyed_at_unprepare(s: Setup) -> None:
    """A claim of a placement asks the supervisor to create it (its GPU instance profile, placement
    and this worker's pid), records the made device in the checkpoint, names it in the claim's CDI
    spec (its capability nodes), answers from the checkpoint when asked again, and asks to destroy
    exactly that instance at unprepare."""
    ref = s.claim("c1", PLACEMENT)
    result = s.preparer.prepare([ref])[ref.uid]
    assert result.error == ""
    (create,) = s.supervisor.asked
    assert (create.action, create.gi_profile_id, create.placement_start, create.worker_pid) == (
        CREATE,
        19,
        2,
        42,
    )
    made = s.checkpoint.get(ref.uid).devices[0].made  # type: ignore[union-attr]
    assert made is not None and (made.uuid, made.gi_id, made.ci_id) == ("MIG-2", 11, 0)
    spec = json.dumps(
        json.loads(Path(s.specs.spec_dir, next(iter(Path(s.specs.spec_dir).iterdir())).name).read_text())
    )
    assert "nvidia-cap100" in spec and "nvidia-cap101" in spec
    assert s.preparer.prepare([ref])[ref.uid].error == "" and s.actions() == [CREATE]
    assert s.preparer.unprepare([ref])[ref.uid] == ""
    destroy = s.supervisor.asked[-1]
    assert (destroy.action, destroy.gi_id, destroy.ci_id) == (DESTROY, 11, 0)
    assert s.checkpoint.get(ref.uid) is None


def test_a_full_gpu_of_a_partitionable_gpu_has_the_way_cleared_first(s: Setup) -> None:
    """A claim of gpu-0 (partitionable) asks `full` before it is answered; a plain GPU's claim asks nothing."""
    ref = s.claim("whole", "gpu-0")
    assert s.preparer.prepare([ref])[ref.uid].error == ""
    assert s.actions() == [FULL]
    plain = s.claim("plain", "gpu-1")
    assert s.preparer.prepare([plain])[plain.uid].error == ""
    assert s.actions() == [FULL]


def test_a_refused_create_is_the_claims_error_and_leaves_nothing(s: Setup) -> None:
    """The supervisor refuses (a placement taken): the claim's error says so, nothing is recorded."""
    s.supervisor.fail[CREATE] = "MIG 1g.10gb at placement 2 is taken: memory slices 2 overlap GPU instance 3"
    ref = s.claim("c1", PLACEMENT)
    assert "is taken" in s.preparer.prepare([ref])[ref.uid].error
    assert s.checkpoint.get(ref.uid) is None


def test_a_record_that_fails_destroys_what_was_made(s: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checkpoint cannot be written after the device was made: the claim fails and the device
    is destroyed again, so nothing is left that no claim holds."""

    def broken(claims: Any) -> None:
        raise CheckpointError("disk full")

    monkeypatch.setattr(s.checkpoint, "put", broken)
    ref = s.claim("c1", PLACEMENT)
    assert "disk full" in s.preparer.prepare([ref])[ref.uid].error
    assert s.actions() == [CREATE, DESTROY]


def test_a_destroy_that_fails_keeps_the_claim_for_the_kubelets_retry(s: Setup) -> None:
    """A destroy refused (a process still on the device): the unprepare fails with why and the
    claim stays in the checkpoint; the retry destroys it and forgets the claim."""
    ref = s.claim("c1", PLACEMENT)
    assert s.preparer.prepare([ref])[ref.uid].error == ""
    s.supervisor.fail[DESTROY] = "GPU instance 11 cannot be destroyed: processes run on its MIG device"
    assert "processes run" in s.preparer.unprepare([ref])[ref.uid]
    assert s.checkpoint.get(ref.uid) is not None
    assert s.preparer.unprepare([ref])[ref.uid] == ""
    assert s.checkpoint.get(ref.uid) is None


def test_a_made_device_with_a_sharing_config_is_refused(s: Setup) -> None:
    """A device made on demand cannot also be MPS-shared by its claim's config (a MIG device's
    TimeSlicing NVIDIA ignores, and so does gpuvisor): the claim fails saying so, nothing is made."""
    ref = s.claim("c1", PLACEMENT)
    claim = json.loads(Path(s.store.directory, ref.namespace, f"{ref.name}.json").read_text())
    claim["status"]["allocation"]["devices"]["config"] = [
        {"source": "FromClaim", "requests": [], "opaque": {"driver": "gpu.nvidia.com", "parameters": {
            "apiVersion": "resource.nvidia.com/v1beta1", "kind": "MigDeviceConfig",
            "sharing": {"strategy": "MPS"}}}}
    ]  # fmt: skip
    s.store.put(claim)
    error = s.preparer.prepare([ref])[ref.uid].error
    assert "made on demand" in error, error
    assert s.actions() == [] and s.checkpoint.get(ref.uid) is None


def test_without_a_supervisor_a_placement_is_refused_saying_why(tmp_path: Path) -> None:
    """A DRA worker run alone (no --control) cannot have devices made: the claim says so."""
    setup = Setup(tmp_path)
    assert setup.plan.dra is not None
    source = DirectoryClaimSource(setup.plan.dra.claims_dir)
    alone = Preparer(setup.plan, source, setup.checkpoint, specs=setup.specs, mig=None)
    ref = setup.claim("c1", PLACEMENT)
    assert "no supervisor" in alone.prepare([ref])[ref.uid].error
