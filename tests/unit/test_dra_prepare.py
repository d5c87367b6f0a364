"""Tests of the DRA worker's policy (worker.dra.prepare, claims, checkpoint), in-process on a temp
dir: every claim answered with its devices or its error, idempotent, recorded before answered,
and unprepare after a restart."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from common import dracheckpoint as checkpoint_module
from common.dracheckpoint import BootIdSource, Checkpoint, CheckpointError, current_boot_id
from common.driverfiles import DriverFiles
from common.messages import ClaimReply, ClaimRequest
from common.model import ResourcePlan
from supervisor.cdi.spec import build_spec
from supervisor.config import config_from_data
from supervisor.node.draplan import dra_plan
from supervisor.sim.drakubelet import ClaimStore
from tests import nodes
from worker.dra.claims import (
    ClaimError,
    ClaimNotFound,
    ClaimRef,
    DirectoryClaimSource,
    SupervisorClaimSource,
)
from worker.dra.prepare import MAX_CLAIMS_PER_CALL, Preparer, cdi_device_id
from worker.healthboard import Health

POOL = "node-a"


def plan_for(tmp: Path, **flags: object) -> ResourcePlan:
    config = config_from_data(
        {
            "version": "v1",
            "gpuvisor": {
                "mode": "dra",
                "kubeletPluginsDir": str(tmp / "plugins"),
                "draClaimsDir": str(tmp / "claims"),
            },
        },
        flags={"node_name": POOL, **flags},
        source="test",
    )
    return dra_plan(nodes.pcie_l4(), config)


class CountingSource:
    """The claims dir, counting fetches (a prepare answered from the checkpoint fetches nothing)."""

    def __init__(self, directory: str) -> None:
        self.inner = DirectoryClaimSource(directory)
        self.fetches = 0

    def get(self, namespace: str, name: str) -> Mapping[str, Any]:
        self.fetches += 1
        return self.inner.get(namespace, name)


class Setup:
    def __init__(self, tmp: Path, **flags: object) -> None:
        self.plan = plan_for(tmp, **flags)
        assert self.plan.dra is not None
        self.store = ClaimStore(self.plan.dra.claims_dir)
        self.source = CountingSource(self.plan.dra.claims_dir)
        self.health: dict[str, Health] = {}
        self.preparer = self.new_preparer()

    def new_preparer(self, boot_id: BootIdSource = current_boot_id) -> Preparer:
        assert self.plan.dra is not None
        checkpoint = Checkpoint(self.plan.dra.plugin_dir, boot_id)
        checkpoint.load()
        return Preparer(self.plan, self.source, checkpoint, health=self.health.get, clock=lambda: 1.0)

    def claim(self, name: str, *devices: str, **kw: Any) -> ClaimRef:
        ns, n, uid = self.store.allocate("default", name, POOL, list(devices), **kw)
        return ClaimRef(ns, n, uid)


@pytest.fixture
def s(tmp_path: Path) -> Setup:
    return Setup(tmp_path)


def test_a_claim_is_prepared_with_the_cdi_ids_of_the_supervisors_spec(s: Setup) -> None:
    """An allocated claim gets one device per result with its request, pool, name and CDI device
    ID, and every CDI ID answered is a device of the spec the supervisor writes for the same plan."""
    ref = s.claim("c1", "gpu-1", "gpu-3")
    result = s.preparer.prepare([ref])[ref.uid]
    assert result.error == ""
    assert [(d.requests, d.pool, d.device) for d in result.devices] == [
        (("gpu",), POOL, "gpu-1"),
        (("gpu",), POOL, "gpu-3"),
    ]
    spec = build_spec({s.plan.resource: s.plan}, driver_files=DriverFiles())
    in_spec = {f"{spec['kind']}={d['name']}" for d in spec["devices"]}
    answered = {i for d in result.devices for i in d.cdi_device_ids}
    assert answered and answered <= in_spec
    assert answered == {f"k8s.device-plugin.nvidia.com/gpu={nodes.pcie_l4().gpus[i].uuid}" for i in (1, 3)}


def test_index_strategy_names_devices_by_index(tmp_path: Path) -> None:
    """Under the index device-ID strategy the CDI name is the GPU's index, as the spec names it."""
    setup = Setup(tmp_path, device_id_strategy="index")
    ref = setup.claim("c1", "gpu-2")
    device = setup.preparer.prepare([ref])[ref.uid].devices[0]
    assert device.cdi_device_ids == ("k8s.device-plugin.nvidia.com/gpu=2",)
    assert cdi_device_id(setup.plan, setup.plan.devices[2]) == device.cdi_device_ids[0]


def test_prepare_is_idempotent_and_answers_from_the_checkpoint(s: Setup) -> None:
    """The same claim again gets the same answer without a fetch (a kubelet restart re-prepares
    running pods' claims, maybe while the API server is away), and is recorded once."""
    ref = s.claim("c1", "gpu-0")
    first = s.preparer.prepare([ref])
    s.store.delete("default", "c1")  # the API server would not answer now
    again = s.preparer.prepare([ref, ref])
    assert again == first and s.source.fetches == 1
    assert s.preparer.prepared() == 1


def test_every_claim_gets_its_own_answer_and_a_bad_one_spoils_none(s: Setup) -> None:
    """Several claims in one call: each is answered; a missing one gets its error beside the others' devices."""
    good = s.claim("c1", "gpu-0")
    missing = ClaimRef("default", "nope", "uid-x")
    results = s.preparer.prepare([good, missing])
    assert set(results) == {good.uid, missing.uid}
    assert results[good.uid].devices and not results[good.uid].error
    assert "claim default/nope not found" in results[missing.uid].error


@pytest.mark.parametrize(
    ("build", "error"),
    [
        (lambda s: s.store.put(_without(s.store.get("default", "c1"), "status")), "not allocated"),
        (lambda s: s.store.put(_with_uid(s.store.get("default", "c1"), "other")), "got replaced"),
        (lambda s: s.store.put(_result(s.store.get("default", "c1"), pool="node-b")), "not this node's pool"),
        (lambda s: s.store.put(_result(s.store.get("default", "c1"), device="gpu-9")), "is not on this node"),
        (lambda s: s.store.put(_result(s.store.get("default", "c1"), driver="other.example.com")), "no device of driver"),
    ],
)  # fmt: skip
def test_a_claim_that_is_not_ours_to_prepare_is_refused_with_why(s: Setup, build: Any, error: str) -> None:
    """Not allocated, replaced (another UID), another node's pool, a device this node lacks, no
    result of this driver: each is that claim's error, nothing is recorded."""
    ref = s.claim("c1", "gpu-0")
    build(s)
    result = s.preparer.prepare([ref])[ref.uid]
    assert error in result.error and result.devices == ()
    assert s.preparer.prepared() == 0


def test_other_drivers_results_are_left_to_them_and_subrequests_name_their_request(s: Setup) -> None:
    """A claim spanning drivers: only this driver's results are prepared; `req/sub` answers as `req`."""
    other = {"request": "nic", "driver": "nic.example.com", "pool": "p", "device": "eth0"}
    ref = s.claim("c1", "gpu-0", request="gpu/big", extra_results=[other])
    result = s.preparer.prepare([ref])[ref.uid]
    assert [(d.device, d.requests) for d in result.devices] == [("gpu-0", ("gpu",))]


def test_a_device_held_by_another_claim_is_refused_until_unprepared(s: Setup) -> None:
    """Two claims on one device (a stale allocation): the second is refused naming the holder;
    admin access is allowed beside it; once the first is unprepared the second goes through."""
    first, second = s.claim("c1", "gpu-0"), s.claim("c2", "gpu-0")
    s.preparer.prepare([first])
    refused = s.preparer.prepare([second])[second.uid]
    assert "in use by claim default/c1" in refused.error
    admin = {
        "request": "gpu",
        "driver": "gpu.nvidia.com",
        "pool": POOL,
        "device": "gpu-0",
        "adminAccess": True,
    }
    ns, name, uid = s.store.allocate("default", "c3", POOL, [], extra_results=[admin])
    assert s.preparer.prepare([ClaimRef(ns, name, uid)])[uid].error == ""
    assert s.preparer.unprepare([first]) == {first.uid: ""}
    assert s.preparer.prepare([second])[second.uid].error == ""


def test_an_unhealthy_device_is_not_prepared_and_says_why(s: Setup) -> None:
    """A device the supervisor holds unhealthy is refused with the reason; once healthy it prepares."""
    ref = s.claim("c1", "gpu-2")
    s.health["gpu-2"] = Health(False, "XID 48 (double-bit ECC) [until-reset]")
    assert "device gpu-2 is unhealthy: XID 48" in s.preparer.prepare([ref])[ref.uid].error
    s.health["gpu-2"] = Health(True)
    assert s.preparer.prepare([ref])[ref.uid].error == ""


def test_unprepare_forgets_and_is_idempotent(s: Setup) -> None:
    """Unprepare drops the claim; one never prepared (or unprepared twice) is a success."""
    ref = s.claim("c1", "gpu-0")
    s.preparer.prepare([ref])
    assert s.preparer.unprepare([ref, ClaimRef("default", "x", "never")]) == {ref.uid: "", "never": ""}
    assert s.preparer.unprepare([ref]) == {ref.uid: ""}
    assert s.preparer.prepared() == 0


def test_a_restarted_worker_answers_and_unprepares_from_the_checkpoint(s: Setup) -> None:
    """A new Preparer over the same dir (a restarted worker) knows the prepared claims: prepare
    answers them unchanged without a fetch, and unprepare removes them from the file."""
    ref = s.claim("c1", "gpu-1")
    before = s.preparer.prepare([ref])
    fetches = s.source.fetches
    restarted = s.new_preparer()
    assert restarted.prepared() == 1
    assert restarted.prepare([ref]) == before and s.source.fetches == fetches
    assert restarted.unprepare([ref]) == {ref.uid: ""}
    assert s.new_preparer().prepared() == 0


def test_after_a_reboot_the_earlier_boots_claims_hold_nothing(s: Setup) -> None:
    """A worker started in another boot knows none of the claims prepared in the earlier one (a
    reboot ended their containers): an unprepare of one is a success, and its device is prepared
    for a new claim instead of being refused as held."""
    ref = s.claim("c1", "gpu-1")
    assert s.new_preparer(lambda: "boot-1").prepare([ref])[ref.uid].error == ""
    rebooted = s.new_preparer(lambda: "boot-2")
    assert rebooted.prepared() == 0
    assert rebooted.unprepare([ref]) == {ref.uid: ""}
    other = s.claim("c2", "gpu-1")
    assert rebooted.prepare([other])[other.uid].error == ""


def test_a_checkpoint_that_cannot_be_written_fails_the_prepare_and_records_nothing(
    s: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Disk full: the claim gets the write error (the kubelet retries), nothing is recorded."""

    def full(path: str, text: str, mode: int = 0o600, *, sync_dir: bool = False) -> None:
        raise OSError(28, "No space left on device", path)

    monkeypatch.setattr(checkpoint_module, "write_atomic", full)
    ref = s.claim("c1", "gpu-0")
    result = s.preparer.prepare([ref])[ref.uid]
    assert "No space left on device" in result.error and result.devices == ()
    assert s.preparer.prepared() == 0


def test_too_many_claims_in_one_call_each_get_an_error(s: Setup) -> None:
    """A request over the bound is answered claim by claim with the limit, nothing fetched."""
    refs = [ClaimRef("default", f"c{i}", f"u{i}") for i in range(MAX_CLAIMS_PER_CALL + 1)]
    results = s.preparer.prepare(refs)
    assert len(results) == len(refs) and all("at most" in r.error for r in results.values())
    assert s.source.fetches == 0


@pytest.mark.parametrize(
    ("ref", "error"),
    [
        (ClaimRef("../etc", "c1", "u"), "is not a namespace name"),
        (ClaimRef("default", "a/b", "u"), "is not a claim name"),
        (ClaimRef("default", "c1", "u" * 129), "UID of 1 to 128"),
    ],
)
def test_names_that_are_no_kubernetes_names_are_refused_before_any_lookup(
    s: Setup, ref: ClaimRef, error: str
) -> None:
    """A namespace or name that could walk out of the claims dir, or an absurd UID, is refused."""
    assert error in s.preparer.prepare([ref])[ref.uid].error
    assert s.source.fetches == 0


def test_without_a_claim_source_a_new_claim_says_what_is_missing(s: Setup) -> None:
    """No claim source (a worker run alone, without a claims dir): a new claim's error says so."""
    assert s.plan.dra is not None
    checkpoint = Checkpoint(s.plan.dra.plugin_dir)
    preparer = Preparer(s.plan, None, checkpoint)
    ref = s.claim("c1", "gpu-0")
    assert "no claim source" in preparer.prepare([ref])[ref.uid].error


def test_a_draining_plan_finishes_prepared_claims_and_refuses_new_ones(s: Setup) -> None:
    """After a switch to device-plugin mode (a draining plan): a claim prepared before answers the
    same again (a kubelet restart re-prepares it) and unprepares; a new claim is refused with why,
    without a fetch."""
    before = s.claim("c1", "gpu-0")
    first = s.preparer.prepare([before])[before.uid]
    assert s.plan.dra is not None
    s.preparer.set_plan(dataclasses.replace(s.plan, dra=dataclasses.replace(s.plan.dra, drain=True)))
    assert s.preparer.draining
    fetches = s.source.fetches
    assert s.preparer.prepare([before])[before.uid] == first
    new = s.claim("c2", "gpu-1")
    assert "serves its GPUs through the device plugin now" in s.preparer.prepare([new])[new.uid].error
    assert s.source.fetches == fetches
    assert s.preparer.unprepare([before]) == {before.uid: ""}
    assert s.preparer.prepared() == 0


def test_a_drain_that_comes_during_a_fetch_records_nothing(s: Setup) -> None:
    """A claim whose fetch was under way when the draining plan came is refused, not recorded:
    once the drain is in force the checkpoint the supervisor reads is final."""
    assert s.plan.dra is not None
    draining = dataclasses.replace(s.plan, dra=dataclasses.replace(s.plan.dra, drain=True))

    class SwitchingSource(CountingSource):
        def get(self, namespace: str, name: str) -> Mapping[str, Any]:
            claim = super().get(namespace, name)
            s.preparer.set_plan(draining)  # the switch lands between the fetch and the record
            return claim

    s.source = SwitchingSource(s.plan.dra.claims_dir)
    s.preparer = s.new_preparer()
    ref = s.claim("c1", "gpu-2")
    assert "serves its GPUs through the device plugin now" in s.preparer.prepare([ref])[ref.uid].error
    assert s.preparer.prepared() == 0


def test_the_supervisor_source_sends_a_request_and_takes_its_reply(tmp_path: Path) -> None:
    """SupervisorClaimSource: each get sends a ClaimRequest and returns the claim of the matching
    ClaimReply; a not-found reply is ClaimNotFound, an error reply a ClaimError with its text, and
    no reply within the timeout a ClaimError saying so (nothing is left waiting)."""
    store = ClaimStore(str(tmp_path))
    ns, name, uid = store.allocate("default", "c1", POOL, ["gpu-0"])
    claim_json = json.dumps(store.get(ns, name))
    replies: dict[str, ClaimReply] = {}
    source: SupervisorClaimSource

    def send(request: ClaimRequest) -> None:  # the supervisor, answering on another thread
        assert (request.resource, request.namespace, request.name) == ("gpu.nvidia.com", ns, request.name)
        reply = replies.get(request.name)
        if reply is not None:
            threading.Timer(
                0.01, source.answer, (dataclasses.replace(reply, request_id=request.request_id),)
            ).start()

    source = SupervisorClaimSource("gpu.nvidia.com", send, timeout=0.5)
    replies["c1"] = ClaimReply("", claim_json=claim_json)
    replies["gone"] = ClaimReply("", error='resourceclaims.resource.k8s.io "gone" not found', not_found=True)
    replies["forbidden"] = ClaimReply("", error="403 Forbidden: cannot get resourceclaims")
    assert source.get(ns, "c1")["metadata"]["uid"] == uid
    with pytest.raises(ClaimNotFound, match="not found"):
        source.get(ns, "gone")
    with pytest.raises(ClaimError, match="403 Forbidden"):
        source.get(ns, "forbidden")
    with pytest.raises(ClaimError, match=r"did not answer within 0\.5s"):
        source.get(ns, "silent")
    assert source.waiting() == 0
    source.answer(ClaimReply("999", claim_json="{}"))  # a late reply for nobody is dropped


def test_claim_files_that_are_not_claims_are_errors_not_crashes(tmp_path: Path) -> None:
    """Not JSON, not an object, too big, absent: a ClaimError each, naming the file."""
    source = DirectoryClaimSource(str(tmp_path))
    (tmp_path / "default").mkdir()
    (tmp_path / "default" / "a.json").write_text("{not json")
    (tmp_path / "default" / "b.json").write_text("[1, 2]")
    (tmp_path / "default" / "c.json").write_bytes(b" " * (1 << 20) + b"{}")
    for name, text in (("a", "is not JSON"), ("b", "not an object"), ("c", "is over")):
        with pytest.raises(ClaimError, match=text):
            source.get("default", name)
    with pytest.raises(ClaimNotFound):
        source.get("default", "d")


def test_a_checkpoint_that_cannot_be_trusted_is_moved_aside(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A corrupt or foreign checkpoint file is kept aside (not deleted, not trusted) and logged; the
    worker starts with none."""
    path = tmp_path / "checkpoint.json"
    for text in (
        "{broken",
        json.dumps({"version": 99, "claims": {}}),
        json.dumps({"version": 1, "claims": {"u": 5}}),
    ):
        path.write_text(text)
        cp = Checkpoint(str(tmp_path))
        cp.load()
        assert len(cp) == 0 and not path.exists()
        aside = [p for p in os.listdir(tmp_path) if p.startswith("checkpoint.json.bad-")]
        assert aside
        for p in aside:
            os.unlink(tmp_path / p)
    assert "cannot be used" in caplog.text


def test_the_checkpoint_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """More claims than the bound are refused with a clear error and nothing changes."""
    monkeypatch.setattr(checkpoint_module, "MAX_CLAIMS", 2)
    cp = Checkpoint(str(tmp_path))
    claims = [checkpoint_module.PreparedClaim(f"u{i}", "default", f"c{i}", (), 1.0) for i in range(3)]
    cp.put(claims[:2])
    with pytest.raises(CheckpointError, match="over the limit of 2"):
        cp.put(claims[2:])
    assert len(cp) == 2 and [p for p in os.listdir(tmp_path) if p.endswith(".tmp")] == []


def _without(obj: dict[str, Any], key: str) -> dict[str, Any]:
    obj.pop(key)
    return obj


def _with_uid(obj: dict[str, Any], uid: str) -> dict[str, Any]:
    obj["metadata"]["uid"] = uid
    return obj


def _result(obj: dict[str, Any], **changes: str) -> dict[str, Any]:
    obj["status"]["allocation"]["devices"]["results"][0].update(changes)
    return obj
