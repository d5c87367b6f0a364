"""Unit tests of the health hub (supervisor/health/hub.py): findings applied to the book and
published, snapshots, resets and outside conditions, on a fake clock with no socket."""

from __future__ import annotations

from supervisor.health.findings import Xid
from supervisor.health.hub import BEACON_IDLE_S, BEACON_S
from supervisor.observe.metrics import Metrics
from tests import nodes
from tests.fakes import FakeClock, bookless_hub, hub_with_book

GPU = "nvidia.com/gpu"


def test_hub_without_a_book_refuses_snapshots_and_publishes_nothing() -> None:
    """Before NVML is up there is no book: no snapshot, no beacon, no error."""
    hub = bookless_hub(Metrics(version="test"), FakeClock())
    assert hub.snapshot(GPU) is None
    hub.beacon()
    hub.tick()


def test_hub_snapshot_carries_the_epoch_and_every_device() -> None:
    """A worker's snapshot names this supervisor life and lists every device of its resource."""
    hub, _clock, _m = hub_with_book()
    snap = hub.snapshot(GPU)
    assert snap is not None and snap.epoch == "epoch1" and len(snap.devices) == 4
    assert hub.snapshot("nvidia.com/none") is None


def test_hub_publishes_an_xid_batch_and_the_gauges_follow() -> None:
    """An XID applied through the hub turns the device gauges: 3 healthy, 1 unhealthy."""
    hub, _clock, metrics = hub_with_book()
    uuid = nodes.pcie_l4().gpus[0].uuid
    hub.apply(Xid(uuid, 48))
    text = metrics.render().decode()
    assert 'gpuvisor_devices{health="unhealthy",resource="nvidia.com/gpu"} 1.0' in text
    assert 'gpuvisor_devices{health="healthy",resource="nvidia.com/gpu"} 3.0' in text


def test_hub_gpu_reset_of_a_mig_uuid_clears_its_parent_gpus_conditions() -> None:
    """A reset named by a MIG device's UUID clears the until-reset condition of its GPU."""
    hub, _clock, _m = hub_with_book(nodes.mig_a100, {"version": "v1", "flags": {"migStrategy": "mixed"}})
    node = nodes.mig_a100()
    gpu = next(g for g in node.gpus if g.mig_devices)
    hub.apply(Xid(gpu.uuid, 48))
    assert any(c["gpu"] == gpu.uuid for c in hub.conditions_view() if isinstance(c, dict))
    hub.gpu_reset(gpu.mig_devices[0].uuid)
    assert hub.conditions_view() == []


def test_hub_external_conditions_mark_and_clear_only_the_named_gpus() -> None:
    """An outside condition (MPS down) marks its GPUs; clearing a subset frees only those."""
    hub, _clock, _m = hub_with_book()
    uuids = [g.uuid for g in nodes.pcie_l4().gpus]
    hub.mark_external(set(uuids[:2]), "mps:x", "daemon down")
    assert hub.external_holders() == {"mps:x": set(uuids[:2])}
    hub.clear_external("mps:x", {uuids[0]})
    assert hub.external_holders() == {"mps:x": {uuids[1]}}
    view = hub.resources_view()[GPU]
    assert (
        isinstance(view, list)
        and sum(1 for d in view if isinstance(d, dict) and d["health"] == "Unhealthy") == 1
    )


def test_beacons_follow_a_change_at_two_seconds_and_space_out_while_nothing_changes() -> None:
    """The first beacon after a change comes BEACON_S later; while the sequence stays the same the
    gap doubles up to BEACON_IDLE_S (an idle node's workers are not woken every 2 s for the same
    number), and a delta brings it back to BEACON_S at once, through `on_change`."""
    hub, _clock, _m = hub_with_book()
    changes: list[int] = []
    hub.on_change = lambda: changes.append(1)
    gaps = [hub.beacon() for _ in range(7)]
    assert gaps[0] == BEACON_S
    assert gaps[1:] == [4.0, 8.0, 16.0, BEACON_IDLE_S, BEACON_IDLE_S, BEACON_IDLE_S]
    hub.apply(Xid(nodes.pcie_l4().gpus[0].uuid, 48))
    assert changes == [1]
    assert hub.next_beacon_within() == BEACON_S
    assert hub.beacon() == BEACON_S  # the sequence moved: the next one is 2 s away again
    assert hub.beacon() == 4.0
