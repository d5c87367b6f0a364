"""In-process tests of the NVML health thread (supervisor/health/monitor.py) against the simulator.

The supervisor's main loop is reduced to `Loop`: it applies the monitor's findings to a real
HealthBook under a lock and can tick the book, as the supervisor does every half second.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import psutil
import pytest

from common.model import Node, ResourcePlan
from supervisor.config import load_config
from supervisor.health import monitor as health
from supervisor.health.book import ChangeBatch, HealthBook
from supervisor.health.findings import Finding, apply_finding
from supervisor.health.monitor import HealthMonitor
from supervisor.health.policy import HealthPolicy
from supervisor.node.nvml import NVML_ERROR_GPU_IS_LOST, NVML_ERROR_UNKNOWN, Nvml
from supervisor.node.planning import plan_resources
from supervisor.sim.nvml import Simulator, load_simulator
from tests.helpers import wait_until

GPU = "nvidia.com/gpu"
FAST_PROBE_S = 0.1


class Loop:
    """The supervisor's main loop, reduced: one lock instead of one thread."""

    def __init__(self, book: HealthBook) -> None:
        self.book = book
        self.lock = threading.Lock()
        self.batches: list[ChangeBatch] = []

    def apply(self, finding: Finding) -> None:
        with self.lock:
            batch = apply_finding(self.book, finding, time.time())
            if batch:
                self.batches.append(batch)

    def tick(self) -> None:
        with self.lock:
            batch = self.book.tick(time.time())
            if batch:
                self.batches.append(batch)

    def unhealthy(self) -> set[str]:
        """IDs of every unhealthy device, across resources."""
        with self.lock:
            return {
                device_id
                for resource in self.book.resources
                for device_id, (healthy, _, _) in self.book.health_for(resource).items()
                if not healthy
            }

    def condition_names(self) -> set[str]:
        with self.lock:
            return {c.name for c in self.book.conditions()}


@dataclass
class Rig:
    sim: Simulator
    node: Node
    plans: dict[str, ResourcePlan]
    loop: Loop
    monitor: HealthMonitor

    def ids_on(self, gpu_uuid: str) -> set[str]:
        """Every allocatable device the GPU backs, across resources."""
        return {d.id for p in self.plans.values() for d in p.devices if d.gpu_uuid == gpu_uuid}

    def all_ids(self) -> set[str]:
        return {d.id for p in self.plans.values() for d in p.devices}


@contextmanager
def rig(
    profile: str = "dgx-h100",
    *,
    quiet: float = 60.0,
    probe_interval: float = 30.0,
    disable: str | None = None,
    xids: dict[str, str] | None = None,
    mig_strategy: str = "none",
) -> Iterator[Rig]:
    sim = load_simulator(profile)
    nvml = Nvml(sim)
    nvml.init()
    node = nvml.discover()
    plans = plan_resources(node, load_config({"mig_strategy": mig_strategy}, {}))
    policy = HealthPolicy.from_settings(disable, None, xids or {}, quiet)
    loop = Loop(HealthBook(plans, policy, time.time()))
    monitor = HealthMonitor(sim, node, policy, loop.apply, probe_interval=probe_interval)
    try:
        yield Rig(sim, node, plans, loop, monitor)
    finally:
        monitor.stop()
        if sim.initialized:
            nvml.shutdown()  # wakes an event wait at once, so the thread ends now
        assert monitor.stop(timeout=10), "the health thread did not end"


def test_xid_event_marks_every_device_of_its_gpu_in_the_book() -> None:
    """An XID 48 event makes the book mark that GPU's device unhealthy, with XID and action."""
    with rig() as r:
        gpu = r.node.gpus[2].uuid
        r.monitor.start()
        r.sim.inject_xid(gpu, 48)
        assert wait_until(lambda: r.loop.unhealthy() == r.ids_on(gpu), 10), r.loop.batches
        batch = r.loop.batches[-1]
        assert (batch.gpu_uuid, batch.xid, batch.action and batch.action.value) == (gpu, 48, "until-reset")


@pytest.mark.parametrize(
    ("kind", "unhealthy"),
    [("double", True), ("single", False)],
)
def test_ecc_event_follows_the_default_policy(kind: str, unhealthy: bool) -> None:
    """A double-bit ECC event marks the GPU unhealthy; a single-bit one changes nothing."""
    with rig() as r:
        gpu, marker = r.node.gpus[1].uuid, r.node.gpus[5].uuid
        r.monitor.start()
        r.sim.inject_ecc(gpu, kind)
        # Events are handled in order: once the marker is in, the ECC event was handled too.
        r.sim.inject_xid(marker, 48)
        assert wait_until(lambda: r.ids_on(marker) <= r.loop.unhealthy(), 10)
        expected = r.ids_on(marker) | (r.ids_on(gpu) if unhealthy else set())
        assert r.loop.unhealthy() == expected
        assert r.monitor.events == 2


def test_failing_event_wait_marks_everything_once_without_spinning() -> None:
    """Event waits failing for good: every device unhealthy in one batch, the thread under 5 % of
    a core, waits retried with backoff, and no recovery (no flapping) while NVML keeps failing."""
    # Quiet 0 and fast probes: a probe pass recorded while waits fail would recover at once.
    with rig(quiet=0.0, probe_interval=FAST_PROBE_S) as r:
        r.sim.fail("nvmlEventSetWait_v2", NVML_ERROR_UNKNOWN)
        r.monitor.start()
        assert wait_until(lambda: r.loop.unhealthy() == r.all_ids(), 10)
        tid = r.monitor.thread_id

        def cpu() -> float:
            return next(t.user_time + t.system_time for t in psutil.Process().threads() if t.id == tid)

        cpu0, wall0, waits0 = cpu(), time.monotonic(), r.sim.call_count("nvmlEventSetWait_v2")
        deadline = wall0 + 3.0
        flapped = False
        while time.monotonic() < deadline:  # the supervisor ticks the book meanwhile
            r.loop.tick()
            flapped = flapped or r.loop.unhealthy() != r.all_ids()
            time.sleep(0.05)
        share = (cpu() - cpu0) / (time.monotonic() - wall0)
        assert share < 0.05, f"health thread used {share:.1%} of a core while NVML kept failing"
        assert r.sim.call_count("nvmlEventSetWait_v2") - waits0 <= 3  # backoff 1 s, 2 s, ...
        assert not flapped
        causes = [b.cause for b in r.loop.batches]
        assert len(causes) == 1 and "health events unavailable" in causes[0]
        assert r.monitor.failing


def test_devices_recover_once_event_waits_work_again() -> None:
    """After NVML event waits fail and then work again, every device recovers with no restart."""
    with rig(quiet=0.2, probe_interval=FAST_PROBE_S) as r:
        r.monitor.backoff_start_s = 0.05  # retry soon: this test is about recovery, not backoff
        r.sim.fail("nvmlEventSetWait_v2", NVML_ERROR_UNKNOWN)
        r.monitor.start()
        assert wait_until(lambda: r.loop.unhealthy() == r.all_ids(), 10)
        r.sim.clear_failures()
        assert wait_until(lambda: not r.monitor.failing, 10)

        def recovered() -> bool:
            r.loop.tick()
            return not r.loop.unhealthy()

        assert wait_until(recovered, 10)
        assert "event-wait" not in r.loop.condition_names()


def test_wait_error_explained_by_a_lost_gpu_marks_only_that_gpu() -> None:
    """A wait that fails with GPU_IS_LOST marks only the GPU the probes find lost, not all."""
    with rig(probe_interval=FAST_PROBE_S) as r:
        gpu = r.node.gpus[6].uuid
        r.monitor.start()
        r.sim.lose(gpu)
        r.sim.fail("nvmlEventSetWait_v2", NVML_ERROR_GPU_IS_LOST, count=1)
        assert wait_until(lambda: r.monitor.errors >= 1 and r.ids_on(gpu) <= r.loop.unhealthy(), 10)
        assert r.loop.unhealthy() == r.ids_on(gpu)
        assert "event-wait" not in r.loop.condition_names()
        assert not r.monitor.failing


@pytest.mark.parametrize(
    ("profile", "gpu_index", "mig_strategy"),
    [("dgx-h100", 3, "none"), ("mig-a100", 0, "mixed")],
)
def test_lost_gpu_marks_only_its_devices_and_recovers_when_restored(
    profile: str, gpu_index: int, mig_strategy: str
) -> None:
    """A lost GPU marks exactly the devices it backs (all its MIG devices too), and they
    recover when NVML sees it again; its events are registered again."""
    with rig(profile, probe_interval=FAST_PROBE_S, mig_strategy=mig_strategy) as r:
        gpu = r.node.gpus[gpu_index].uuid
        assert len(r.ids_on(gpu)) >= 1
        r.monitor.start()
        assert wait_until(lambda: r.sim.call_count("nvmlEventSetCreate") == 1, 10)
        r.sim.lose(gpu)
        assert wait_until(lambda: "lost" in r.loop.condition_names(), 10)
        assert r.loop.unhealthy() == r.ids_on(gpu)
        assert r.monitor.lost == {gpu}
        r.sim.restore(gpu)
        assert wait_until(lambda: not r.loop.unhealthy(), 10), r.loop.batches[-1].log_record()
        assert wait_until(lambda: r.sim.call_count("nvmlEventSetCreate") == 2, 10)


def test_xid_79_from_a_lost_gpu_marks_it_lost_at_once() -> None:
    """The XID 79 of a GPU that fell off the bus is followed by a probe, so the book knows it is
    lost (and recovers when found) without waiting for the periodic probe."""
    with rig(probe_interval=30.0) as r:
        gpu = r.node.gpus[2].uuid
        r.monitor.start()
        r.sim.lose(gpu)
        assert wait_until(lambda: {"xid:79", "lost"} <= r.loop.condition_names(), 10)
        assert r.loop.unhealthy() == r.ids_on(gpu)


def test_instance_ids_on_an_event_of_a_gpu_not_in_mig_mode_are_ignored() -> None:
    """An XID on a GPU not in MIG mode is a whole-GPU condition even when the event carries instance
    ids: NVIDIA's mock libnvidia-ml sends GI/CI 0/0 there (a driver sends 0xFFFFFFFF), and NVIDIA's
    plugin reads the ids only for MIG devices (internal/rm/health.go:160 at v0.20.0)."""
    with rig() as r:
        gpu = r.node.gpus[1].uuid
        r.monitor.start()
        r.sim.inject_xid(gpu, 48, gpu_instance=0, compute_instance=0)
        assert wait_until(lambda: "xid:48" in r.loop.condition_names(), 10), r.loop.batches
        with r.loop.lock:
            (cond,) = r.loop.book.conditions()
        assert (cond.gpu_uuid, cond.gi, cond.ci) == (gpu, None, None)
        assert r.loop.batches[-1].cause == f"XID 48 on {gpu}: until-reset"


@pytest.mark.parametrize("fault", ["pending_retirement", "remapped_rows_pending"])
def test_gpu_bad_at_start_is_unhealthy_from_the_initial_probe(fault: str) -> None:
    """A GPU with a memory repair pending at start is unhealthy before any worker starts."""
    with rig() as r:
        gpu = r.node.gpus[4].uuid
        getattr(r.sim, f"set_{fault}")(gpu)
        for finding in r.monitor.initial_probe():
            r.loop.apply(finding)
        assert {c.device_id for b in r.loop.batches for c in b if not c.healthy} == r.ids_on(gpu)
        assert r.loop.unhealthy() == r.ids_on(gpu)


@pytest.mark.parametrize("fault", ["lost", "pending_retirement"])
def test_periodic_probe_catches_a_fault_that_sent_no_event(fault: str) -> None:
    """A GPU that is lost, or gets retired pages pending, without any event is caught by the
    periodic probe (NVIDIA #267)."""
    with rig(probe_interval=FAST_PROBE_S) as r:
        gpu = r.node.gpus[7].uuid
        if fault == "lost":
            r.sim.lose(gpu)  # before the monitor's event set exists: no event reaches it
        r.monitor.start()
        if fault == "pending_retirement":
            r.sim.set_pending_retirement(gpu)
        assert wait_until(lambda: r.loop.unhealthy() == r.ids_on(gpu), 10)
        assert r.monitor.events == 0


def test_transient_xid_recovers_after_quiet_period_and_a_passing_probe() -> None:
    """XID 94 mapped to transient makes the GPU unhealthy, then healthy again with no restart."""
    with rig(quiet=0.2, probe_interval=FAST_PROBE_S, xids={"94": "transient"}) as r:
        gpu = r.node.gpus[0].uuid
        r.monitor.start()
        r.sim.inject_xid(gpu, 94)
        assert wait_until(lambda: r.loop.unhealthy() == r.ids_on(gpu), 10)

        def recovered() -> bool:
            r.loop.tick()
            return not r.loop.unhealthy()

        assert wait_until(recovered, 10)


def test_a_gpu_found_by_rediscovery_is_watched_at_once_without_a_rebuild() -> None:
    """set_node adding a GPU (lost when the set was opened) registers its events into the set the
    thread is waiting on, at once: an XID right after set_node returns is delivered, and the set is
    not rebuilt (a rebuild waits for the wait in progress, up to 5 s of missed XIDs)."""
    with rig("pcie-l4") as r:
        late = r.node.gpus[3].uuid
        r.sim.lose(late)  # not there when the event set is opened
        r.monitor.set_node(dataclasses.replace(r.node, gpus=r.node.gpus[:3]))
        r.monitor.start()
        assert wait_until(lambda: r.sim.call_count("nvmlDeviceRegisterEvents") == 3, 10)
        assert wait_until(lambda: r.sim.call_count("nvmlEventSetWait_v2") >= 1, 10)
        r.sim.restore(late)
        r.monitor.set_node(r.node)  # rediscovery finds it
        assert r.sim.call_count("nvmlDeviceRegisterEvents") == 4
        r.sim.inject_xid(late, 48)
        assert wait_until(lambda: r.loop.unhealthy() == r.ids_on(late), 10)
        assert r.sim.call_count("nvmlEventSetCreate") == 1


def test_a_gpu_removed_by_rediscovery_rebuilds_the_event_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """set_node with a GPU gone rebuilds the event set after the wait in progress; the same set of
    GPUs again changes nothing."""
    monkeypatch.setattr(health, "WAIT_MS", 100)  # the rebuild happens between waits: keep them short
    with rig("pcie-l4") as r:
        r.monitor.start()
        assert wait_until(lambda: r.sim.call_count("nvmlDeviceRegisterEvents") == 4, 10)
        r.monitor.set_node(dataclasses.replace(r.node, gpus=r.node.gpus[:3]))
        assert wait_until(lambda: r.sim.call_count("nvmlEventSetCreate") == 2, 10)
        assert wait_until(lambda: r.sim.call_count("nvmlDeviceRegisterEvents") == 4 + 4, 10)
        r.monitor.set_node(dataclasses.replace(r.node, gpus=r.node.gpus[:3]))  # same GPUs: nothing to do
        # Each handled event proves the thread went round its loop (past the rebuild check).
        r.sim.inject_xid(r.node.gpus[0].uuid, 48)
        assert wait_until(lambda: r.monitor.events == 1, 10)
        r.sim.inject_xid(r.node.gpus[1].uuid, 48)
        assert wait_until(lambda: r.monitor.events == 2, 10)
        assert r.sim.call_count("nvmlEventSetCreate") == 2


def test_one_gpu_failing_event_registration_leaves_the_others_watched() -> None:
    """A registration error on one GPU skips that GPU: no device is marked unhealthy for it and
    the other GPUs' XIDs still arrive."""
    with rig("pcie-l4") as r:
        r.sim.fail("nvmlDeviceRegisterEvents", NVML_ERROR_UNKNOWN, count=1)
        r.monitor.start()
        assert wait_until(lambda: r.sim.call_count("nvmlDeviceRegisterEvents") >= 4, 10)
        gpu = r.node.gpus[2].uuid
        r.sim.inject_xid(gpu, 48)
        assert wait_until(lambda: r.monitor.events == 1, 10)
        assert r.loop.unhealthy() == r.ids_on(gpu)
        assert not r.monitor.failing and r.monitor.errors == 0


def test_disabled_health_checks_start_no_thread() -> None:
    """DP_DISABLE_HEALTHCHECKS=all: the monitor starts no thread and NVML is not watched."""
    with rig(disable="all") as r:
        r.monitor.start()
        assert r.monitor.thread_id is None
        assert r.sim.call_count("nvmlEventSetCreate") == 0
