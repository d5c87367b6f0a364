"""Unit tests of the supervisor's smaller parts, each with fakes of its neighbours and a fake
clock: health hub (supervisor/healthhub.py), CDI sync (cdisync.py), NVML link (discovery.py),
MPS wiring (mpswiring.py)."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from common.config import config_from_data
from common.model import ResourcePlan
from common.planning import plan_resources
from supervisor.cdi import CdiError
from supervisor.cdisync import TIMER, CdiSync
from supervisor.discovery import EXIT_NVML_ERROR, NvmlLink, StartupError
from supervisor.health_policy import HealthPolicy
from supervisor.healthbook import HealthBook
from supervisor.healthhub import HealthHub
from supervisor.metrics import Metrics
from supervisor.mpswiring import MpsWiring
from supervisor.scheduler import Scheduler
from tests import nodes
from tests.fakes import FakeClock, sim_config

GPU = "nvidia.com/gpu"


def policy() -> HealthPolicy:
    return HealthPolicy.from_settings(None, None, {}, 60.0)


def hub_with_book(node_factory: object = nodes.pcie_l4, data: object = None) -> tuple[HealthHub, FakeClock, Metrics]:
    clock = FakeClock()
    metrics = Metrics(version="test")
    hub = HealthHub("ipc:///nowhere", policy(), metrics, clock, "epoch1")
    node = node_factory()  # type: ignore[operator]
    plans = plan_resources(node, config_from_data(data))
    hub.book = HealthBook(plans, hub.policy, clock.time())
    return hub, clock, metrics


# ---------------------------------------------------------------------------------------- health hub


def test_hub_without_a_book_refuses_snapshots_and_publishes_nothing() -> None:
    """Before NVML is up there is no book: no snapshot, no beacon, no error."""
    hub = HealthHub("ipc:///nowhere", policy(), Metrics(version="test"), FakeClock(), "e")
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
    hub.apply(lambda book, now: [book.apply_xid(uuid, 48, now=now)])
    text = metrics.render().decode()
    assert 'gpuvisor_devices{health="unhealthy",resource="nvidia.com/gpu"} 1.0' in text
    assert 'gpuvisor_devices{health="healthy",resource="nvidia.com/gpu"} 3.0' in text


def test_hub_gpu_reset_of_a_mig_uuid_clears_its_parent_gpus_conditions() -> None:
    """A reset named by a MIG device's UUID clears the until-reset condition of its GPU."""
    hub, _clock, _m = hub_with_book(nodes.mig_a100, {"version": "v1", "flags": {"migStrategy": "mixed"}})
    node = nodes.mig_a100()
    gpu = next(g for g in node.gpus if g.mig_devices)
    hub.apply(lambda book, now: [book.apply_xid(gpu.uuid, 48, now=now)])
    assert any(c["gpu"] == gpu.uuid for c in hub.conditions_view() if isinstance(c, dict))
    hub.gpu_reset(gpu.mig_devices[0].uuid, node)
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
    assert isinstance(view, list) and sum(1 for d in view if isinstance(d, dict) and d["health"] == "Unhealthy") == 1


# ---------------------------------------------------------------------------------------- CDI sync


class FlakyWriter:
    spec_dir = "/var/run/cdi"
    source = ""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls: list[tuple[str, ...]] = []

    def sync(self, plans: Mapping[str, ResourcePlan]) -> str | None:
        self.calls.append(tuple(plans))
        if self.failures:
            self.failures -= 1
            raise CdiError("read-only file system")
        self.source = "gpuvisor"
        return "/var/run/cdi/k8s.device-plugin.nvidia.com-gpu.json"


def test_cdi_write_failure_is_not_ready_and_retried_with_backoff_until_it_works() -> None:
    """A spec that cannot be written is retried on the timer (growing delays) and clears once written."""
    clock = FakeClock()
    timers = Scheduler(clock)
    sync = CdiSync(sim_config(), timers)
    writer = FlakyWriter(failures=2)
    sync.writer = writer  # type: ignore[assignment]
    assert not sync.sync({"r": None})  # type: ignore[dict-item]
    assert sync.error == "read-only file system"
    first = timers.when(TIMER)
    assert first is not None and 0.5 <= first - clock.now <= 1.0
    clock.advance(1.0)
    timers.run_due()
    second = timers.when(TIMER)
    assert second is not None and second - clock.now > first - (clock.now - 1.0) - 1e-9
    clock.advance(2.0)
    timers.run_due()
    assert sync.error is None and timers.when(TIMER) is None and len(writer.calls) == 3


def test_cdi_configure_makes_a_new_writer_only_when_its_settings_change() -> None:
    """A reload that leaves the CDI settings alone keeps the writer (and its last spec)."""
    sync = CdiSync(sim_config(), Scheduler(FakeClock()))
    writer = sync.writer
    assert not sync.configure(sim_config())
    assert sync.writer is writer
    assert sync.configure(sim_config(CDI_SPEC_DIR="/elsewhere"))
    assert sync.writer.spec_dir == "/elsewhere"


# ---------------------------------------------------------------------------------------- NVML link


def test_nvml_link_retries_with_growing_delays_then_comes_up() -> None:
    """Without --fail-on-init-error, failed inits give growing retry delays, then the node."""
    link = NvmlLink(sim_config(), {"GPUVISOR_SIM_FAIL_INIT": "2"})
    node, delay1 = link.attempt(fail_on_init_error=False)
    assert node is None and delay1 == 1.0 and not link.up and "Not Found" in link.error
    node, delay2 = link.attempt(fail_on_init_error=False)
    assert node is None and delay2 == 2.0
    node, delay3 = link.attempt(fail_on_init_error=False)
    assert node is not None and len(node.gpus) == 4 and delay3 == 0.0
    assert link.status() == {"up": True, "error": "", "attempts": 3}


def test_nvml_link_gives_up_with_exit_3_when_told_to_fail_on_init_error() -> None:
    """With --fail-on-init-error the first failure ends the start, saying what to check."""
    link = NvmlLink(sim_config(), {"GPUVISOR_SIM_FAIL_INIT": "1"})
    with pytest.raises(StartupError, match="NVIDIA driver is loaded") as info:
        link.attempt(fail_on_init_error=True)
    assert info.value.code == EXIT_NVML_ERROR


def test_nvml_link_rediscovery_keeps_a_lost_gpu_listed() -> None:
    """A GPU that rediscovery no longer sees stays in the node, so its devices stay advertised."""
    link = NvmlLink(sim_config(), {})
    node, _ = link.attempt(fail_on_init_error=True)
    assert node is not None
    lost = node.gpus[1].uuid
    assert link.simulator is not None
    link.simulator.lose(lost)
    again = link.rediscover(node)
    assert lost in {g.uuid for g in again.gpus} and link.kept_gpus == (lost,)


# ---------------------------------------------------------------------------------------- MPS wiring


def test_mps_wiring_drops_a_replaced_daemon_supervisors_late_reports() -> None:
    """A report posted by daemons a reload replaced never clears the successor's condition."""
    hub, _clock, _m = hub_with_book()
    posted: list[object] = []
    config = sim_config(MPS_ROOT="/run/nvidia/mps")
    wiring = MpsWiring(config, {}, None, hub, posted.append)
    plan = plan_resources(nodes.pcie_l4(), config_from_data(
        {"version": "v1", "flags": {"mpsRoot": "/run/nvidia/mps"}, "sharing": {"mps": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2}]}}}
    ))
    wiring.plans = dict(plan)
    hub.mark_external({d.gpu_uuid for d in plan[GPU].devices}, f"mps:{GPU}", "not up")
    wiring._on_change(GPU, True, "up", generation=wiring.generation - 1)  # an old instance's report
    assert f"mps:{GPU}" in hub.external_holders()
    wiring.adopt(sim_config(MPS_ROOT="/run/nvidia/mps", GPUVISOR_MPS_CONTROL="/opt/mps-control"))
    assert wiring.generation == 2 and not wiring.started


# ---------------------------------------------------------------------------------------- config watch


def test_config_watch_reports_the_file_and_configmap_swaps_but_not_its_neighbours() -> None:
    """Writes to the config file, a rename onto it and ConfigMap `..data` swaps count; a log file
    written beside it does not (a steady stream of those must not hold the check back)."""
    from watchdog.events import FileClosedEvent, FileModifiedEvent, FileMovedEvent, FileOpenedEvent

    from supervisor.kubeletwatch import _ConfigEventHandler

    seen: list[int] = []
    handler = _ConfigEventHandler("config.yaml", lambda: seen.append(1))
    handler.on_any_event(FileModifiedEvent("/etc/gv/supervisor.log"))
    handler.on_any_event(FileOpenedEvent("/etc/gv/config.yaml"))
    assert seen == []
    handler.on_any_event(FileModifiedEvent("/etc/gv/config.yaml"))
    handler.on_any_event(FileMovedEvent("/etc/gv/.config.yaml.swp", "/etc/gv/config.yaml"))
    handler.on_any_event(FileMovedEvent("/etc/gv/..data_tmp", "/etc/gv/..data"))
    handler.on_any_event(FileClosedEvent("/etc/gv/config.yaml"))
    assert len(seen) == 4
