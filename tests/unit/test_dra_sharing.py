"""Tests of claims with sharing through the Preparer (worker.dra.prepare with worker.dra.config and
worker.dra.sharing): NVIDIA's demo claims prepared on a simulated pcie-l4 node, the timeslice set
through a fake nvidia-smi (tests/smifake.py, the command lines of NVIDIA's nvlib.go), MPS handed to
a ClaimMps that records its calls (the real one is another process tree, tested on its own), and
everything undone when a step fails or the last claim goes."""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest

from common.dracheckpoint import MPS, TIME_SLICING, Checkpoint, CheckpointError, DeviceSharing, read_claims
from common.model import ResourcePlan
from supervisor.sim.drakubelet import ClaimStore
from tests import draconfigs as dc
from tests import nodes, smifake
from tests.unit.test_dra_prepare import POOL, plan_for
from worker.dra.claims import ClaimRef, DirectoryClaimSource
from worker.dra.claimspec import ClaimSpecs
from worker.dra.edits import CdiMount, ContainerEdits, MpsLimits, SharingError
from worker.dra.prepare import Preparer
from worker.dra.sharing import TimeSlicer

GI = 1 << 30
GPUS = [g.uuid for g in nodes.pcie_l4().gpus]


class RecordingMps:
    """A ClaimMps that records its calls and returns the edits a daemon's pipe dir would give;
    `fail` makes start raise as a daemon that never answers, `gate` holds start until set."""

    def __init__(self) -> None:
        self.started: list[tuple[str, tuple[str, ...], MpsLimits]] = []
        self.stopped: list[str] = []
        self.fail = ""
        self.gate: threading.Event | None = None
        self.entered = threading.Event()

    def start(self, claim_uid: str, gpu_uuids: Sequence[str], limits: MpsLimits) -> ContainerEdits:
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(10)
        if self.fail:
            raise SharingError(self.fail)
        self.started.append((claim_uid, tuple(gpu_uuids), limits))
        return ContainerEdits(
            env=(f"CUDA_MPS_PIPE_DIRECTORY=/mps/{claim_uid}/pipe",),
            mounts=(CdiMount(f"/run/mps/{claim_uid}/pipe", f"/mps/{claim_uid}/pipe"),),
        )

    def stop(self, claim_uid: str) -> None:
        self.stopped.append(claim_uid)


class Node:
    def __init__(self, tmp: Path, smi: bool = True) -> None:
        self.plan: ResourcePlan = plan_for(tmp)
        assert self.plan.dra is not None
        self.store = ClaimStore(self.plan.dra.claims_dir)
        self.bin = tmp / "bin"
        path = smifake.install(self.bin, GPUS)
        self.timeslicer = TimeSlicer(str(path) if smi else None, run=smifake.runner(self.bin))
        self.mps = RecordingMps()
        self.preparer = self.new_preparer()

    def new_preparer(self, mps: bool = True) -> Preparer:
        assert self.plan.dra is not None
        checkpoint = Checkpoint(self.plan.dra.plugin_dir)
        checkpoint.load()
        source = DirectoryClaimSource(self.plan.dra.claims_dir)
        return Preparer(
            self.plan, source, checkpoint, mps=self.mps if mps else None, timeslicer=self.timeslicer
        )

    def put(self, claim: dc.Claim) -> ClaimRef:
        self.store.put(claim.to_json(POOL))
        return ClaimRef(claim.namespace, claim.name, claim.uid)

    def timeslices(self) -> list[int]:
        state = smifake.timeslices(self.bin)
        return [state[u] for u in GPUS]

    def recorded(self) -> set[str]:
        assert self.plan.dra is not None
        return set(read_claims(f"{self.plan.dra.plugin_dir}/checkpoint.json"))


@pytest.fixture
def n(tmp_path: Path) -> Node:
    return Node(tmp_path)


def test_a_time_sliced_claim_sets_the_gpus_timeslice_and_unprepare_sets_default(n: Node) -> None:
    """gpu-test6 (TimeSlicing, Long) on gpu-1: compute mode DEFAULT then timeslice 3 on that GPU
    alone, as NVIDIA's SetTimeSlice runs them; the sharing is in the checkpoint; its unprepare sets
    timeslice 0 (Default) again."""
    ref = n.put(dc.gpu_test6(["gpu-1"]))
    result = n.preparer.prepare([ref])[ref.uid]
    assert result.error == "" and [d.device for d in result.devices] == ["gpu-1"]
    assert n.timeslices() == [0, 3, 0, 0]
    assert smifake.commands(n.bin) == [
        f"-i {GPUS[1]} -c DEFAULT",
        f"compute-policy -i {GPUS[1]} --set-timeslice 3",
    ]
    assert result.devices[0].sharing == DeviceSharing(TIME_SLICING, GPUS[1], GPUS[1], interval="Long")
    assert n.preparer.unprepare([ref]) == {ref.uid: ""}
    assert n.timeslices() == [0, 0, 0, 0] and n.recorded() == set()


def test_the_time_sliced_and_mps_demo_claim_starts_one_daemon_and_carries_its_edits(n: Node) -> None:
    """gpu-test5: `ts-gpu` time-sliced (Long), `mps-gpu` handed to the ClaimMps with its limits (50 %,
    10Gi); the edits it returns are the claim's (PrepareResult.edits, and the checkpoint's, so a
    re-prepare answers them too); unprepare stops the daemon and sets the timeslice back."""
    ref = n.put(dc.gpu_test5("gpu-0", "gpu-2"))
    result = n.preparer.prepare([ref])[ref.uid]
    assert result.error == ""
    assert n.mps.started == [(ref.uid, (GPUS[2],), MpsLimits(50, 10 * GI, {}))]
    assert result.edits.env == (f"CUDA_MPS_PIPE_DIRECTORY=/mps/{ref.uid}/pipe",)
    assert n.timeslices() == [3, 0, 0, 0]
    again = n.new_preparer().prepare([ref])[ref.uid]  # a restarted worker, from the checkpoint
    assert again == result and len(n.mps.started) == 1
    assert n.new_preparer().unprepare([ref]) == {ref.uid: ""}
    assert n.mps.stopped == [ref.uid] and n.timeslices() == [0, 0, 0, 0]


def test_only_the_mps_devices_of_a_claim_get_the_daemons_edits_in_its_spec(n: Node, tmp_path: Path) -> None:
    """gpu-test5 with a claim spec: the daemon's pipe env and mount are on `mps-gpu`'s device
    only; `ts-gpu`'s device in the same spec has none (NVIDIA's prepareDevices gives each config
    group's devices that group's edits, device_state.go v0.4.1), so its containers do not join
    a daemon that does not serve their GPU."""
    assert n.plan.dra is not None
    checkpoint = Checkpoint(n.plan.dra.plugin_dir)
    checkpoint.load()
    source = DirectoryClaimSource(n.plan.dra.claims_dir)
    specs = ClaimSpecs(n.plan, str(tmp_path / "cdi"))
    preparer = Preparer(n.plan, source, checkpoint, mps=n.mps, timeslicer=n.timeslicer, specs=specs)
    ref = n.put(dc.gpu_test5("gpu-0", "gpu-2"))
    assert preparer.prepare([ref])[ref.uid].error == ""
    with open(tmp_path / "cdi" / f"k8s.gpu.nvidia.com-claim_{ref.uid}.yaml", encoding="utf-8") as fh:
        devices = {d["name"]: d["containerEdits"] for d in json.load(fh)["devices"]}
    assert devices[f"{ref.uid}-gpu-2"]["env"] == [f"CUDA_MPS_PIPE_DIRECTORY=/mps/{ref.uid}/pipe"]
    assert [m["containerPath"] for m in devices[f"{ref.uid}-gpu-2"]["mounts"]] == [f"/mps/{ref.uid}/pipe"]
    assert "env" not in devices[f"{ref.uid}-gpu-0"] and "mounts" not in devices[f"{ref.uid}-gpu-0"]
    assert preparer.unprepare([ref]) == {ref.uid: ""}


def test_a_bad_config_is_its_claims_error_and_the_others_are_prepared(n: Node) -> None:
    """Three claims in one call: a plain one, a time-sliced one and one with a bad interval: the bad
    one's error names the entry and the field, the other two are prepared as usual."""
    plain = n.put(dc.gpu_test1(["gpu-0"]))
    sliced = n.put(dc.gpu_test6(["gpu-1"]))
    bad = dc.Claim(
        "default",
        "bad",
        [dc.Request("gpu", ["gpu-2"])],
        [dc.Config(dc.gpu_config(dc.time_slicing("Fast")), ["gpu"])],
    )
    bad_ref = n.put(bad)
    results = n.preparer.prepare([plain, bad_ref, sliced])
    assert results[plain.uid].error == "" and results[sliced.uid].error == ""
    assert results[bad_ref.uid].error == (
        "claim default/bad: status.allocation.devices.config[0] (FromClaim, requests gpu): "
        "opaque.parameters.sharing.timeSlicingConfig.interval: unknown time-slice interval 'Fast', "
        "supported time-slice intervals: Default, Short, Medium, Long"
    )
    assert n.recorded() == {plain.uid, sliced.uid} and n.timeslices() == [0, 3, 0, 0]


def test_without_a_claim_mps_an_mps_claim_is_refused_and_its_timeslice_undone(n: Node) -> None:
    """A worker given no ClaimMps refuses gpu-test5 saying MPS needs it, after undoing the timeslice
    it had set on the other GPU: nothing stays applied, nothing recorded, no device held."""
    preparer = n.new_preparer(mps=False)
    ref = n.put(dc.gpu_test5("gpu-0", "gpu-2"))
    error = preparer.prepare([ref])[ref.uid].error
    assert "MPS sharing needs gpuvisor's MPS control daemons" in error
    assert n.timeslices() == [0, 0, 0, 0] and n.recorded() == set()
    later = n.put(dc.gpu_test1(["gpu-0", "gpu-2"]))
    assert preparer.prepare([later])[later.uid].error == ""


def test_a_failing_mps_daemon_undoes_the_timeslice_and_records_nothing(n: Node) -> None:
    """The ClaimMps's start fails (its daemon never answered): the claim's error says why, the
    timeslice set before it is undone, and the claim is neither recorded nor holding devices."""
    n.mps.fail = "the MPS control daemon did not answer within 10s"
    ref = n.put(dc.gpu_test5("gpu-0", "gpu-2"))
    assert n.preparer.prepare([ref])[ref.uid].error.endswith(
        "the MPS control daemon did not answer within 10s"
    )
    assert n.timeslices() == [0, 0, 0, 0] and n.recorded() == set()


def test_a_gpu_that_refuses_its_timeslice_undoes_the_ones_set_before(n: Node) -> None:
    """A two-GPU time-sliced claim whose second GPU's nvidia-smi fails: the error names the GPU,
    the command and nvidia-smi's words; the first GPU is set back to Default."""
    smifake.fail_on(n.bin, GPUS[3])
    ref = n.put(dc.gpu_test6(["gpu-1", "gpu-3"]))
    error = n.preparer.prepare([ref])[ref.uid].error
    assert f"setting GPU {GPUS[3]}'s timeslice to Long" in error and "Not Supported" in error
    assert n.timeslices() == [0, 0, 0, 0] and n.recorded() == set()


def test_a_checkpoint_that_cannot_be_written_undoes_the_applied_sharing(
    n: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sharing applied, then the record fails: the claim gets the checkpoint's error, its daemon is
    stopped and its timeslice set back (no sharing stays for a claim the kubelet was refused)."""
    ref = n.put(dc.gpu_test5("gpu-0", "gpu-2"))

    def refuse(self: Checkpoint, claims: object) -> None:
        raise CheckpointError("cannot write checkpoint.json: No space left on device")

    monkeypatch.setattr(Checkpoint, "put", refuse)
    assert "No space left on device" in n.preparer.prepare([ref])[ref.uid].error
    assert n.mps.stopped == [ref.uid] and n.timeslices() == [0, 0, 0, 0]


def test_without_nvidia_smi_only_a_default_interval_is_prepared(tmp_path: Path) -> None:
    """Where nvidia-smi is not found, TimeSlicing with interval Long is refused saying what is
    missing, and one with interval Default (nothing to change) is prepared."""
    node = Node(tmp_path, smi=False)
    long = node.put(dc.gpu_test6(["gpu-1"]))
    default = node.put(
        dc.Claim(
            "default",
            "d",
            [dc.Request("gpu", ["gpu-2"])],
            [dc.Config(dc.gpu_config(dc.time_slicing("Default")))],
        )
    )
    results = node.preparer.prepare([long, default])
    assert "TimeSlicing with interval Long needs nvidia-smi" in results[long.uid].error
    assert results[default.uid].error == "" and smifake.commands(node.bin) == []


def test_the_last_claim_that_time_slices_a_shared_gpu_sets_it_back(n: Node) -> None:
    """Two claims share gpu-1 (consumable capacity, each with its shareID), one Long, one Short:
    each prepare sets its interval; the first unprepare leaves the other's setting, the last sets
    Default (NVIDIA sets Default at every unprepare, even under a claim still running)."""
    a = n.put(
        dc.Claim(
            "default",
            "a",
            [dc.Request("gpu", ["gpu-1"], share_id="s-a")],
            [dc.Config(dc.gpu_config(dc.time_slicing("Long")))],
        )
    )
    b = n.put(
        dc.Claim(
            "default",
            "b",
            [dc.Request("gpu", ["gpu-1"], share_id="s-b")],
            [dc.Config(dc.gpu_config(dc.time_slicing("Short")))],
        )
    )
    assert n.preparer.prepare([a])[a.uid].error == "" and n.timeslices()[1] == 3
    assert n.preparer.prepare([b])[b.uid].error == "" and n.timeslices()[1] == 1
    assert n.preparer.unprepare([a]) == {a.uid: ""} and n.timeslices()[1] == 1
    assert n.preparer.unprepare([b]) == {b.uid: ""} and n.timeslices()[1] == 0


def test_a_failed_restore_keeps_the_claim_for_the_kubelets_retry(n: Node) -> None:
    """When setting Default back fails at unprepare, the claim stays prepared with the error (the
    kubelet retries), and the retry after the GPU answers again unprepares it."""
    ref = n.put(dc.gpu_test6(["gpu-2"]))
    assert n.preparer.prepare([ref])[ref.uid].error == ""
    smifake.fail_on(n.bin, GPUS[2])
    assert "Not Supported" in n.preparer.unprepare([ref])[ref.uid] and n.recorded() == {ref.uid}
    smifake.fail_on(n.bin, "none")
    assert n.preparer.unprepare([ref]) == {ref.uid: ""} and n.recorded() == set() and n.timeslices()[2] == 0


def test_an_admin_access_claim_is_prepared_beside_the_holder_without_sharing(n: Node) -> None:
    """adminAccess: prepared on a device another claim holds, and its time-slicing entry is checked
    but not applied (the holder's GPU keeps its setting); no nvidia-smi runs for it."""
    holder = n.put(dc.gpu_test1(["gpu-3"]))
    admin = n.put(
        dc.Claim(
            "default",
            "admin",
            [dc.Request("gpu", ["gpu-3"], admin_access=True)],
            [dc.Config(dc.gpu_config(dc.time_slicing("Long")))],
        )
    )
    results = n.preparer.prepare([holder, admin])
    assert results[holder.uid].error == "" and results[admin.uid].error == ""
    assert results[admin.uid].devices[0].admin_access and results[admin.uid].devices[0].sharing is None
    assert smifake.commands(n.bin) == []


def test_a_plain_claim_is_not_held_up_by_a_slow_sharing_step(n: Node) -> None:
    """While an MPS claim's daemon start is under way (held), a plain claim on another GPU prepares
    at once from another thread, and a second prepare of the MPS claim is told it is under way; the
    MPS claim's devices count as held meanwhile."""
    n.mps.gate = threading.Event()
    mps_ref = n.put(dc.gpu_test_mps("gpu-0"))
    out: dict[str, str] = {}
    thread = threading.Thread(target=lambda: out.update(e=n.preparer.prepare([mps_ref])[mps_ref.uid].error))
    thread.start()
    try:
        assert n.mps.entered.wait(10)
        plain = n.put(dc.gpu_test1(["gpu-1"]))
        assert n.preparer.prepare([plain])[plain.uid].error == ""
        assert "is being prepared by another call" in n.preparer.prepare([mps_ref])[mps_ref.uid].error
        thief = n.put(dc.Claim("default", "thief", [dc.Request("gpu", ["gpu-0"])]))
        assert "in use by claim gpu-test-mps/shared-gpu" in n.preparer.prepare([thief])[thief.uid].error
    finally:
        n.mps.gate.set()
        thread.join(10)
    assert out == {"e": ""} and n.recorded() == {plain.uid, mps_ref.uid}


def test_the_checkpoint_keeps_each_devices_sharing_and_reads_older_entries(n: Node) -> None:
    """A prepared claim's sharing and edits survive a write and a read; an entry without them
    (written before them) reads as a claim without sharing."""
    ref = n.put(dc.gpu_test5("gpu-0", "gpu-2"))
    result = n.preparer.prepare([ref])[ref.uid]
    stored = read_claims(f"{n.plan.dra.plugin_dir}/checkpoint.json")[ref.uid]  # type: ignore[union-attr]
    assert stored.devices == result.devices and stored.container_edits == result.edits.to_json()
    assert [d.sharing.strategy for d in stored.devices if d.sharing] == [TIME_SLICING, MPS]
    old = dataclasses.replace(
        stored,
        devices=tuple(dataclasses.replace(d, sharing=None) for d in stored.devices),
        container_edits={},
    )
    raw = old.to_json()
    assert "sharing" not in str(raw) and type(stored).from_json(ref.uid, raw).shared is False
