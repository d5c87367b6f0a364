"""Tests of the worker's copy of its resource's health (worker/healthcopy.py): the snapshot,
then only newer deltas, gaps and their healing."""

from __future__ import annotations

from common.messages import DeviceHealth, HealthBeacon, HealthDelta, HealthSnapshot
from worker.healthcopy import ApplyOutcome, HealthApplier


def h(device: str, healthy: bool, reason: str = "") -> DeviceHealth:
    return DeviceHealth(device, healthy, reason, 0.0)


def snap(seq: int, *devices: DeviceHealth, epoch: str = "e") -> HealthSnapshot:
    return HealthSnapshot(seq=seq, resource="r", devices=devices, epoch=epoch)


def delta(seq: int, *changes: DeviceHealth, epoch: str = "e") -> HealthDelta:
    return HealthDelta(seq=seq, changes=changes, epoch=epoch)


def test_applier_applies_only_newer_deltas() -> None:
    """After a snapshot at S, deltas <= S are stale and S+1 is applied."""
    app = HealthApplier()
    app.apply_snapshot(snap(5, h("a", True), h("b", True)))
    assert app.apply_delta(delta(5, h("a", False, "old"))).outcome is ApplyOutcome.STALE
    assert app.health_of("a") == h("a", True)
    result = app.apply_delta(delta(6, h("a", False, "XID 94")))
    assert result.outcome is ApplyOutcome.APPLIED
    assert result.changed == (h("a", False, "XID 94"),)
    assert app.seq == 6 and not app.needs_snapshot


def test_applier_reports_gap_and_recovers_with_new_snapshot() -> None:
    """A skipped seq is a gap: a snapshot is needed; the new snapshot plus buffered deltas heal it."""
    app = HealthApplier()
    app.apply_snapshot(snap(1, h("a", True)))
    assert app.apply_delta(delta(3, h("a", False, "x"))).outcome is ApplyOutcome.GAP
    assert app.needs_snapshot
    assert app.health_of("a") == h("a", True)  # last known state stays while waiting
    assert app.apply_delta(delta(4, h("a", True))).outcome is ApplyOutcome.BUFFERED
    result = app.apply_snapshot(snap(3, h("a", False, "x")))
    assert result.outcome is ApplyOutcome.APPLIED
    assert app.seq == 4 and not app.needs_snapshot
    assert app.health_of("a") == h("a", True)


def test_applier_buffers_deltas_before_first_snapshot() -> None:
    """Deltas that arrive before the first snapshot are replayed if newer than it, dropped if not."""
    app = HealthApplier()
    assert app.seq is None and app.needs_snapshot
    app.apply_delta(delta(2, h("a", False, "old")))
    app.apply_delta(delta(3, h("b", False, "new")))
    app.apply_snapshot(snap(2, h("a", False, "old"), h("b", True)))
    assert app.seq == 3
    assert app.health_of("b") == h("b", False, "new")


def test_applier_epoch_change_is_a_gap() -> None:
    """A delta or beacon from another supervisor life is a gap, never applied."""
    app = HealthApplier()
    app.apply_snapshot(snap(10, h("a", True), epoch="old"))
    assert app.apply_delta(delta(1, h("a", False), epoch="new")).outcome is ApplyOutcome.GAP
    app2 = HealthApplier()
    app2.apply_snapshot(snap(10, h("a", True), epoch="old"))
    assert app2.apply_beacon(HealthBeacon(seq=1, epoch="new")).outcome is ApplyOutcome.GAP


def test_applier_beacon_reveals_lost_last_delta() -> None:
    """A beacon ahead of the applied seq is a gap; one at the applied seq is nothing."""
    app = HealthApplier()
    app.apply_snapshot(snap(4, h("a", True)))
    assert app.apply_beacon(HealthBeacon(seq=4, epoch="e")).outcome is ApplyOutcome.STALE
    assert app.apply_beacon(HealthBeacon(seq=5, epoch="e")).outcome is ApplyOutcome.GAP
    assert app.needs_snapshot


def test_applier_filters_foreign_devices() -> None:
    """With a device list, records for other resources' devices are ignored."""
    app = HealthApplier(device_ids=["a"])
    app.apply_snapshot(snap(0, h("a", True)))
    result = app.apply_delta(delta(1, h("a", False, "x"), h("zzz", False, "y")))
    assert result.changed == (h("a", False, "x"),)
    assert app.health_of("zzz") is None
    app.set_device_ids(["a", "b"])
    assert app.needs_snapshot


def test_applier_unchanged_record_is_not_a_change() -> None:
    """A delta repeating a device's current state applies but reports no change."""
    app = HealthApplier()
    app.apply_snapshot(snap(0, h("a", False, "x")))
    result = app.apply_delta(delta(1, h("a", False, "x")))
    assert result.outcome is ApplyOutcome.APPLIED and result.changed == ()
