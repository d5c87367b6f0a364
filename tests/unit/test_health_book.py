"""Tests of the HealthBook (supervisor/health/book.py): event-to-device mapping, recovery rules,
sequence numbers and snapshots, and reload."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.model import AllocatableDevice, ResourcePlan
from supervisor.health.book import NVML_NO_INSTANCE, ChangeBatch, HealthBook
from supervisor.health.policy import HealthAction, HealthPolicy

QUIET = 60.0
SHARED = "nvidia.com/gpu.shared"
GPU = "nvidia.com/gpu"
MIG1 = "nvidia.com/mig-1g.10gb"
MIG2 = "nvidia.com/mig-2g.20gb.shared"


def dev(
    id_: str,
    gpu: str,
    *,
    replica: int | None = None,
    replicas: int = 1,
    gi: int | None = None,
    ci: int | None = None,
) -> AllocatableDevice:
    uuid = id_.split("::")[0]
    return AllocatableDevice(
        id=id_,
        uuid=uuid,
        index="0",
        gpu_uuid=gpu,
        gpu_index=0,
        gpu_minor=0,
        numa_node=None,
        memory_mib=1,
        replica=replica,
        replicas=replicas,
        mig_gi=gi,
        mig_ci=ci,
        mig_profile=None if gi is None else "1g.10gb",
    )


def plans(shared_replicas: int = 3, with_mig2: bool = True) -> dict[str, ResourcePlan]:
    """GPU-A shared in replicas, GPU-B whole, GPU-M in MIG devices (gi 1, 2 plain; gi 3 shared)."""
    out = {
        SHARED: ResourcePlan(
            SHARED,
            tuple(
                dev(f"GPU-A::{n}", "GPU-A", replica=n, replicas=shared_replicas)
                for n in range(shared_replicas)
            ),
        ),
        GPU: ResourcePlan(GPU, (dev("GPU-B", "GPU-B"),)),
        MIG1: ResourcePlan(MIG1, (dev("MIG-1", "GPU-M", gi=1, ci=0), dev("MIG-2", "GPU-M", gi=2, ci=0))),
    }
    if with_mig2:
        out[MIG2] = ResourcePlan(
            MIG2, tuple(dev(f"MIG-3::{n}", "GPU-M", replica=n, replicas=2, gi=3, ci=0) for n in range(2))
        )
    return out


def book(
    *, disable: str | None = None, enable: str | None = None, xids: Mapping[str, str] | None = None
) -> HealthBook:
    pol = HealthPolicy.from_settings(disable, enable, xids or {}, QUIET)
    return HealthBook(plans(), pol, now=0.0)


# No XID is transient by default; the tests of that rule map 94 to it, as a config may.
AS_TRANSIENT = {"94": "transient"}


def unhealthy(b: HealthBook) -> set[str]:
    return {d for r in b.resources for d, (ok, _, _) in b.health_for(r).items() if not ok}


ALL_IDS = {"GPU-A::0", "GPU-A::1", "GPU-A::2", "GPU-B", "MIG-1", "MIG-2", "MIG-3::0", "MIG-3::1"}

MAPPING = [
    ("physical GPU reaches every replica", "GPU-A", None, None, {"GPU-A::0", "GPU-A::1", "GPU-A::2"}),
    ("whole GPU", "GPU-B", None, None, {"GPU-B"}),
    (
        "physical MIG GPU reaches all instances",
        "GPU-M",
        None,
        None,
        {"MIG-1", "MIG-2", "MIG-3::0", "MIG-3::1"},
    ),
    ("MIG instance reaches only it", "GPU-M", 1, 0, {"MIG-1"}),
    ("MIG instance reaches its replicas", "GPU-M", 3, 0, {"MIG-3::0", "MIG-3::1"}),
    ("GI without CI", "GPU-M", 2, NVML_NO_INSTANCE, {"MIG-2"}),
    (
        "NVML sentinels mean the whole GPU",
        "GPU-M",
        NVML_NO_INSTANCE,
        NVML_NO_INSTANCE,
        {"MIG-1", "MIG-2", "MIG-3::0", "MIG-3::1"},
    ),
    ("CI without GI means the whole GPU", "GPU-M", None, 0, {"MIG-1", "MIG-2", "MIG-3::0", "MIG-3::1"}),
    ("instance on a GPU advertised whole", "GPU-B", 1, 0, {"GPU-B"}),
    ("no such MIG instance", "GPU-M", 7, 0, set()),
    ("GPU backing no device", "GPU-Z", None, None, set()),
]


@pytest.mark.parametrize(("case", "gpu", "gi", "ci", "expected"), MAPPING, ids=[c[0] for c in MAPPING])
def test_event_mapping(case: str, gpu: str, gi: int | None, ci: int | None, expected: set[str]) -> None:
    """An XID marks exactly the allocatable devices backed by the hardware it names."""
    b = book()
    batch = b.apply_xid(gpu, 79, gi, ci, now=1.0)
    assert {c.device_id for c in batch} == expected, case
    assert unhealthy(b) == expected, case
    assert all(not c.healthy and "XID 79" in c.reason for c in batch)


def test_ignored_xid_changes_nothing() -> None:
    """A default-ignored XID yields an empty batch with action ignore and an unchanged seq."""
    b = book()
    batch = b.apply_xid("GPU-A", 13, now=1.0)
    assert not batch and batch.action is HealthAction.IGNORE and batch.seq == 0 and "ignored" in batch.cause
    assert unhealthy(b) == set()


@pytest.mark.parametrize("xid", [63, 92, 94, 154])
def test_xids_the_catalog_keeps_in_service_leave_every_device_healthy(xid: int) -> None:
    """XIDs 63, 92, 94 and 154 (NVIDIA's catalog: IGNORE, RESTART_APP, or the guidance of another
    XID) take no device out by default, on a whole GPU, a shared one or a MIG instance, and raise
    no condition that a tick or probe would have to clear."""
    b = book()
    batches = [
        b.apply_xid("GPU-A", xid, now=1.0),
        b.apply_xid("GPU-B", xid, now=1.0),
        b.apply_xid("GPU-M", xid, 1, 0, now=1.0),
    ]
    assert [(len(batch), batch.action, batch.raised) for batch in batches] == [
        (0, HealthAction.IGNORE, "")
    ] * 3
    assert unhealthy(b) == set() and b.conditions() == [] and b.seq == 0


@pytest.mark.parametrize("xid", [48, 64, 74, 79, 95, 119, 120])
def test_until_reset_xids_hold_through_quiet_time_and_probes_until_a_reset(xid: int) -> None:
    """Each default until-reset XID takes its GPU's devices out, and they stay out through a long
    quiet period and passing probes; only a reset brings them back."""
    b = book()
    assert {c.device_id for c in b.apply_xid("GPU-A", xid, now=1.0)} == {"GPU-A::0", "GPU-A::1", "GPU-A::2"}
    b.probe_result("GPU-A", True, "", now=2.0)
    assert not b.tick(100_000.0) and unhealthy(b) == {"GPU-A::0", "GPU-A::1", "GPU-A::2"}
    assert len(b.mark_reset("GPU-A", 100_001.0)) == 3 and unhealthy(b) == set()


def test_a_config_entry_still_maps_94_to_transient() -> None:
    """`xids: {"94": transient}` in the config makes XID 94 take the GPU out again, with its
    meaning in the reason, until the quiet period has passed and a probe passed."""
    b = book(xids={"94": "transient"})
    batch = b.apply_xid("GPU-B", 94, now=1.0)
    assert [(c.healthy, c.reason) for c in batch] == [(False, "XID 94: contained ECC error [transient]")]
    b.probe_result("GPU-B", True, "", now=2.0)
    assert [c.healthy for c in b.tick(1.0 + QUIET)] == [True]


def test_disabled_checks_ignore_everything() -> None:
    """With DP_DISABLE_HEALTHCHECKS=all no XID or ECC event marks a device."""
    b = book(disable="all")
    assert not b.apply_xid("GPU-A", 79, now=1.0)
    assert not b.apply_ecc("GPU-A", "double-bit", now=1.0)


def test_ecc_events() -> None:
    """Double-bit ECC is until-reset on the named hardware; single-bit is ignored."""
    b = book()
    assert not b.apply_ecc("GPU-B", "single-bit", now=1.0)
    batch = b.apply_ecc("GPU-M", "double-bit", 3, 0, now=1.0)
    assert {c.device_id for c in batch} == {"MIG-3::0", "MIG-3::1"}
    b.probe_result("GPU-M", True, "", now=1000.0)
    assert not b.tick(2000.0)
    assert {c.device_id for c in b.mark_reset("GPU-M", 2001.0)} == {"MIG-3::0", "MIG-3::1"}


def test_transient_needs_quiet_period_and_passing_probe() -> None:
    """A transient XID recovers only after the quiet period AND a probe that passed after the last event."""
    b = book(xids=AS_TRANSIENT)
    b.apply_xid("GPU-B", 94, now=0.0)
    assert not b.tick(QUIET + 100)  # quiet, but no probe yet
    b.apply_xid("GPU-B", 94, now=200.0)  # again: the quiet period starts over
    assert not b.probe_result("GPU-B", True, "", now=210.0)  # probe passed, not quiet yet
    assert not b.tick(200.0 + QUIET - 1)
    batch = b.tick(200.0 + QUIET)
    assert [(c.device_id, c.healthy, c.since) for c in batch] == [("GPU-B", True, 260.0)]
    assert "recovered" in batch.cause


def test_probe_before_event_does_not_count() -> None:
    """A probe that passed before the last event (even at the same timestamp) does not recover it."""
    b = book(xids=AS_TRANSIENT)
    b.probe_result("GPU-B", True, "", now=5.0)
    b.apply_xid("GPU-B", 94, now=5.0)
    assert not b.tick(1000.0)
    assert b.probe_result("GPU-B", True, "", now=1000.0)  # quiet already: the pass recovers at once
    assert unhealthy(b) == set()


def test_until_reset_only_on_reset() -> None:
    """An until-reset XID survives quiet time and passing probes; a reset clears it."""
    b = book()
    b.apply_xid("GPU-A", 48, now=0.0)
    b.probe_result("GPU-A", True, "", now=500.0)
    assert not b.tick(10_000.0)
    assert not b.mark_found("GPU-A", 10_001.0)  # not lost: being "found" proves nothing
    batch = b.mark_reset("GPU-A", 10_002.0)
    assert {c.device_id for c in batch} == {"GPU-A::0", "GPU-A::1", "GPU-A::2"}
    assert unhealthy(b) == set()


def test_lost_then_found() -> None:
    """A lost GPU is unhealthy until found; being found also ends its until-reset faults."""
    b = book()
    b.mark_lost("GPU-B", 1.0, "NVML: GPU is lost")
    b.apply_xid("GPU-B", 79, now=1.5)
    assert b.health_for(GPU)["GPU-B"][1] == "GPU lost: NVML: GPU is lost (+1 more)"
    reset = b.mark_reset("GPU-B", 2.0)  # ends XID 79, but the GPU is still lost
    assert [(c.healthy, c.reason) for c in reset] == [(False, "GPU lost: NVML: GPU is lost")]
    batch = b.mark_found("GPU-B", 3.0)
    assert [(c.device_id, c.healthy) for c in batch] == [("GPU-B", True)]


def test_several_conditions_must_all_end() -> None:
    """A device with a transient fault and a lost GPU is healthy only after both end."""
    b = book(xids=AS_TRANSIENT)
    b.apply_xid("GPU-B", 94, now=0.0)
    b.mark_lost("GPU-B", 1.0)
    assert b.health_for(GPU)["GPU-B"][1] == "GPU lost (+1 more)"  # most severe first
    b.mark_found("GPU-B", 2.0)
    assert b.health_for(GPU)["GPU-B"][0] is False  # the transient XID still holds
    b.probe_result("GPU-B", True, "", now=3.0)
    assert b.tick(QUIET + 1)
    assert unhealthy(b) == set()


def test_mig_and_physical_conditions_combine() -> None:
    """A MIG device stays unhealthy while either its own or its GPU's condition holds."""
    b = book(xids=AS_TRANSIENT)
    b.apply_xid("GPU-M", 95, 1, 0, now=0.0)  # until-reset, MIG-1 only
    b.apply_xid("GPU-M", 94, now=1.0)  # transient, whole GPU
    b.probe_result("GPU-M", True, "", now=2.0)
    batch = b.tick(100.0)
    assert {c.device_id for c in batch if c.healthy} == {"MIG-2", "MIG-3::0", "MIG-3::1"}
    assert unhealthy(b) == {"MIG-1"}


def test_failed_probe_until_a_probe_passes() -> None:
    """A failing probe marks the GPU's devices unhealthy until a probe passes."""
    b = book()
    batch = b.probe_result("GPU-A", False, "nvmlDeviceGetMemoryInfo: Unknown Error", now=1.0)
    assert len(batch) == 3 and "health probe failed: nvmlDeviceGetMemoryInfo" in batch.changes[0].reason
    assert not b.tick(1000.0)
    assert len(b.probe_result("GPU-A", True, "", now=1001.0)) == 3


def test_mark_all_unhealthy_then_recover() -> None:
    """An event-wait failure marks every device; each GPU recovers after quiet + a passing probe."""
    b = book()
    batch = b.mark_all_unhealthy("nvmlEventSetWait: Unknown Error", 1.0)
    assert {c.device_id for c in batch} == ALL_IDS
    b.probe_result("GPU-B", True, "", now=2.0)
    assert {c.device_id for c in b.tick(100.0)} == {"GPU-B"}


def test_seq_and_snapshot() -> None:
    """seq grows by one per non-empty batch; a snapshot pairs the seq with the full state."""
    b = book(xids=AS_TRANSIENT)
    assert b.snapshot(GPU) == (0, [b.snapshot(GPU)[1][0]])
    seqs = [
        b.apply_xid("GPU-B", 79, now=1.0).seq,
        b.apply_xid("GPU-B", 13, now=2.0).seq,  # ignored: no bump
        b.apply_xid("GPU-A", 94, now=3.0).seq,
        b.mark_reset("GPU-B", 4.0).seq,
    ]
    assert seqs == [1, 1, 2, 3]
    seq, records = b.snapshot(SHARED)
    assert seq == b.seq == 3
    assert [(r.device_id, r.healthy, r.since) for r in records] == [
        ("GPU-A::0", False, 3.0),
        ("GPU-A::1", False, 3.0),
        ("GPU-A::2", False, 3.0),
    ]
    with pytest.raises(KeyError, match=r"nvidia\.com/nope"):
        b.snapshot("nvidia.com/nope")


def test_same_fault_again_is_no_change_and_since_is_the_flip() -> None:
    """Repeating a fault changes nothing; a new reason is a change that keeps the flip time."""
    b = book(xids=AS_TRANSIENT)
    b.apply_xid("GPU-B", 94, now=1.0)
    assert not b.apply_xid("GPU-B", 94, now=2.0)
    batch = b.apply_xid("GPU-B", 79, now=3.0)
    assert [(c.healthy, c.since) for c in batch] == [(False, 1.0)]
    assert batch.changes[0].reason.startswith("XID 79")


def test_batch_record_and_delta() -> None:
    """A batch is one log record (device, resources, XID, action) and converts to a HealthDelta."""
    b = book()
    batch = b.apply_xid("GPU-M", 95, 3, 0, now=1.0)
    rec = batch.log_record()
    assert rec["xid"] == 95 and rec["action"] == "until-reset" and rec["gpu"] == "GPU-M"
    assert rec["resources"] == [MIG2] and {d["id"] for d in rec["devices"]} == {"MIG-3::0", "MIG-3::1"}
    delta = batch.to_delta("epoch-1")
    assert delta.seq == batch.seq and delta.epoch == "epoch-1" and len(delta.changes) == 2


def test_reload_keeps_state_of_surviving_devices() -> None:
    """set_plans keeps conditions on hardware that still backs devices and reports new devices."""
    b = book()
    b.apply_xid("GPU-A", 79, now=1.0)
    b.apply_xid("GPU-M", 95, 3, 0, now=1.0)
    seq = b.seq
    batch = b.set_plans(plans(shared_replicas=2, with_mig2=False), now=5.0)
    assert not batch and b.seq == seq  # nothing new, nothing flipped
    assert b.health_for(SHARED) == {
        "GPU-A::0": (False, b.health_for(SHARED)["GPU-A::0"][1], 1.0),
        "GPU-A::1": (False, b.health_for(SHARED)["GPU-A::1"][1], 1.0),
    }
    assert MIG2 not in b.resources
    assert [c.name for c in b.conditions()] == ["xid:79"]  # the MIG-3 condition went with MIG-3
    batch = b.set_plans(plans(shared_replicas=4), now=6.0)
    assert {(c.device_id, c.healthy) for c in batch} == {
        ("GPU-A::2", False),
        ("GPU-A::3", False),
        ("MIG-3::0", True),
        ("MIG-3::1", True),
    }
    assert b.seq == seq + 1


def test_external_condition_marks_every_device_of_its_gpus() -> None:
    """mark_external marks all devices of the named GPUs (skipping unknown ones) with its reason."""
    b = book()
    batch = b.mark_external(["GPU-A", "GPU-Z"], "mps:x", "daemon down", now=1.0)
    assert {c.device_id for c in batch} == {"GPU-A::0", "GPU-A::1", "GPU-A::2"}
    assert all(not c.healthy and c.reason == "daemon down" for c in batch)
    assert [(c.gpu_uuid, c.name, c.recovery.value) for c in b.conditions()] == [
        ("GPU-A", "mps:x", "external")
    ]
    assert not b.mark_external(["GPU-A"], "mps:x", "daemon down", now=2.0)  # again: no change


EXTERNAL_SURVIVES = [
    ("reset", lambda b: b.mark_reset("GPU-A", 10_000.0)),
    ("found", lambda b: b.mark_found("GPU-A", 10_000.0)),
    ("probe", lambda b: b.probe_result("GPU-A", True, "", 10_000.0)),
    ("tick", lambda b: b.tick(10_000.0)),
    ("other name", lambda b: b.clear_external("mps:y", 10_000.0)),
    ("reload", lambda b: b.set_plans(plans(), 10_000.0)),
]


@pytest.mark.parametrize(("case", "op"), EXTERNAL_SURVIVES, ids=[c[0] for c in EXTERNAL_SURVIVES])
def test_external_condition_ends_only_by_its_name(case: str, op: Callable[[HealthBook], ChangeBatch]) -> None:
    """Resets, found GPUs, probes, ticks, reloads and other names leave an external condition alone."""
    b = book()
    b.mark_external(["GPU-A"], "mps:x", "daemon down", now=1.0)
    op(b)
    assert unhealthy(b) == {"GPU-A::0", "GPU-A::1", "GPU-A::2"}, case


def test_clear_external_ends_it_and_keeps_other_conditions() -> None:
    """clear_external(name) heals what only it held; a device with another condition stays unhealthy."""
    b = book()
    b.mark_external(["GPU-A", "GPU-B"], "mps:x", "daemon down", now=1.0)
    b.apply_xid("GPU-B", 48, now=2.0)
    assert b.health_for(GPU)["GPU-B"][1].endswith("[until-reset] (+1 more)")  # until-reset explains best
    batch = b.clear_external("mps:x", now=3.0)
    assert {(c.device_id, c.healthy) for c in batch} == {
        ("GPU-A::0", True),
        ("GPU-A::1", True),
        ("GPU-A::2", True),
        ("GPU-B", False),
    }
    assert unhealthy(b) == {"GPU-B"} and "XID 48" in b.health_for(GPU)["GPU-B"][1]
    assert not b.clear_external("mps:x", now=4.0)


def test_clear_external_on_some_gpus_only() -> None:
    """clear_external with GPUs ends the condition there and leaves it on the others."""
    b = book()
    b.mark_external(["GPU-A", "GPU-B"], "mps:x", "daemon down", now=1.0)
    batch = b.clear_external("mps:x", now=2.0, gpu_uuids=["GPU-B"])
    assert [(c.device_id, c.healthy) for c in batch] == [("GPU-B", True)]
    assert unhealthy(b) == {"GPU-A::0", "GPU-A::1", "GPU-A::2"}


def test_bad_instance_id_is_an_error() -> None:
    """A negative or non-integer instance id is rejected with a clear error."""
    with pytest.raises(ValueError, match="GPU instance id"):
        book().apply_xid("GPU-M", 79, -1, 0, now=1.0)


_ops = st.lists(
    st.tuples(
        st.sampled_from(["xid", "lost", "found", "reset", "probe-ok", "probe-bad", "tick", "all"]),
        st.sampled_from(["GPU-A", "GPU-B", "GPU-M", "GPU-Z"]),
        st.sampled_from([13, 48, 63, 79, 94, 555]),
        st.sampled_from([None, 1, 3]),
        st.floats(min_value=0, max_value=100),
    ),
    max_size=30,
)


@settings(max_examples=150, deadline=None)
@given(_ops)
def test_random_operations_keep_invariants(ops: list[tuple[str, str, int, int | None, float]]) -> None:
    """Under any sequence of operations: seq grows by one per non-empty batch, snapshots agree
    with health_for, and a device is healthy exactly when no condition overlaps it."""
    b = book(xids=AS_TRANSIENT)
    now = 0.0
    for op, gpu, xid, gi, step in ops:
        now += step
        before = b.seq
        batch: ChangeBatch
        if op == "xid":
            batch = b.apply_xid(gpu, xid, gi, 0 if gi is not None else None, now=now)
        elif op == "lost":
            batch = b.mark_lost(gpu, now)
        elif op == "found":
            batch = b.mark_found(gpu, now)
        elif op == "reset":
            batch = b.mark_reset(gpu, now)
        elif op in ("probe-ok", "probe-bad"):
            batch = b.probe_result(gpu, op == "probe-ok", "x", now)
        elif op == "tick":
            batch = b.tick(now)
        else:
            batch = b.mark_all_unhealthy("x", now)
        assert b.seq == before + (1 if batch else 0)
        assert batch.seq == b.seq
    conds = b.conditions()
    for resource in b.resources:
        seq, records = b.snapshot(resource)
        assert seq == b.seq
        for r in records:
            device = next(d for d in plans()[resource].devices if d.id == r.device_id)
            held = [
                c
                for c in conds
                if c.gpu_uuid == device.gpu_uuid
                and (c.gi is None or device.mig_gi is None or c.gi == device.mig_gi)
            ]
            assert r.healthy == (not held)
            assert b.health_for(resource)[r.device_id] == (r.healthy, r.reason, r.since)
