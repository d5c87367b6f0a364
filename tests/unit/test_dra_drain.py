"""`DraDrain`: what planning in device-plugin mode may hand out while the DRA worker drains
(supervisor/dra/drain.py), with a real WorkerSet over fake processes and a real checkpoint file."""

from __future__ import annotations

from pathlib import Path

from common.dracheckpoint import Checkpoint, PreparedClaim, PreparedDevice
from common.messages import DraBeat
from common.model import ResourcePlan
from supervisor.config import Config, config_from_data
from supervisor.dra.drain import DraDrain
from supervisor.dra.earlier import EarlierPool
from supervisor.node.draplan import DRIVER, DraHold, dra_plan
from supervisor.node.planning import NO_HOLD
from supervisor.scheduler import Scheduler
from supervisor.workers.lifecycle import WorkerHandle, WorkerSet
from tests import nodes
from tests.fakes import FakeClock, FakeSpawner

GPU = "nvidia.com/gpu"


class Plans:
    def __init__(self) -> None:
        self.plans: dict[str, ResourcePlan] = {}


class Setup:
    def __init__(self, tmp_path: Path) -> None:
        self.plugins_dir = tmp_path
        self.dra_mode = self.config("dra")
        self.device_plugin_mode = self.config("device-plugin")
        self.reconciler = Plans()
        self.workers = WorkerSet(spawner=FakeSpawner())
        self.replans: list[str] = []
        clock = FakeClock()
        self.drain = DraDrain(
            workers=self.workers,
            reconciler=self.reconciler,
            # No node name: no earlier pool is looked for, so there is none to wait for.
            earlier=EarlierPool(
                node_name="",
                plugins_dir=str(tmp_path),
                connect=lambda: None,
                timers=Scheduler(clock),
                post=lambda fn: None,
                on_done=self.replans.append,
            ),
            rediscover=self.replans.append,
        )

    def config(self, mode: str) -> Config:
        return config_from_data(
            {"version": "v1", "gpuvisor": {"mode": mode}},
            flags={"node_name": "n1", "kubelet_plugins_dir": str(self.plugins_dir)},
            source="t",
        )

    def plan_dra(self, *, drain: bool) -> None:
        self.reconciler.plans = {DRIVER: dra_plan(nodes.pcie_l4(), self.dra_mode, drain=drain)}

    def start_dra_worker(self) -> WorkerHandle:
        handle = self.workers.want(DRIVER, "/plans/dra.json")
        self.workers.tick(0.0)
        return handle

    def prepared(self, *devices: str) -> None:
        """The DRA worker's checkpoint lists one claim per device."""
        directory = self.plugins_dir / DRIVER
        directory.mkdir(exist_ok=True)
        Checkpoint(str(directory)).put(
            PreparedClaim(
                uid=f"uid-{d}",
                namespace="default",
                name=f"claim-{d}",
                devices=(PreparedDevice(requests=("gpu",), pool="n1", device=d, cdi_device_ids=()),),
                prepared_at=1.0,
            )
            for d in devices
        )


def test_in_dra_mode_nothing_is_held(tmp_path: Path) -> None:
    """Planning in mode dra gets no hold: the DRA worker serves the claims itself."""
    s = Setup(tmp_path)
    s.prepared("gpu-0")
    s.start_dra_worker()
    assert s.drain.hold(s.dra_mode) == NO_HOLD


def test_a_running_dra_worker_that_has_not_confirmed_the_drain_leaves_the_hold_unsettled(
    tmp_path: Path,
) -> None:
    """While a DRA worker runs that has not said it drains (no beat yet, a beat that does not
    drain, or a drain not planned), the device plugin may be given nothing yet."""
    s = Setup(tmp_path)
    s.prepared("gpu-0")
    handle = s.start_dra_worker()
    s.plan_dra(drain=True)
    assert s.drain.hold(s.device_plugin_mode) == DraHold(settled=False)  # no beat yet
    handle.dra = DraBeat(draining=False, prepared_claims=1, claims_changes=1)
    assert s.drain.hold(s.device_plugin_mode) == DraHold(settled=False)
    s.plan_dra(drain=False)
    handle.dra = DraBeat(draining=True, prepared_claims=1, claims_changes=1)
    assert s.drain.hold(s.device_plugin_mode) == DraHold(settled=False)


def test_a_confirmed_drain_holds_the_devices_of_the_checkpoint(tmp_path: Path) -> None:
    """Once the worker confirms the planned drain, the hold is settled on the devices its
    checkpoint lists; with no DRA worker running, the same."""
    s = Setup(tmp_path)
    s.prepared("gpu-0", "gpu-1")
    handle = s.start_dra_worker()
    s.plan_dra(drain=True)
    handle.dra = DraBeat(draining=True, prepared_claims=2, claims_changes=2)
    assert s.drain.hold(s.device_plugin_mode) == DraHold(devices=frozenset({"gpu-0", "gpu-1"}))
    s.workers.unwant(DRIVER, 0.0)
    s.workers.tick(0.0)
    assert s.workers.running(DRIVER) is None
    s.prepared("gpu-1")
    assert s.drain.hold(s.device_plugin_mode) == DraHold(devices=frozenset({"gpu-1"}))


def test_an_unreadable_checkpoint_holds_nothing(tmp_path: Path) -> None:
    """A checkpoint that cannot be read holds no device (the DRA worker moves it aside and starts
    empty), and says so in the log rather than failing planning."""
    s = Setup(tmp_path)
    (tmp_path / DRIVER).mkdir()
    (tmp_path / DRIVER / "checkpoint.json").write_text("{not json")
    assert s.drain.hold(s.device_plugin_mode) == DraHold()


def test_the_drain_confirmation_and_each_unprepare_plan_again_once(tmp_path: Path) -> None:
    """The draining worker's beats plan again when it confirms the drain and whenever its
    prepared claims change; a beat with the same count (a claims change alone), a beat that
    does not drain, or a drain not planned asks nothing. After the drain ended, the next
    confirmation plans again even with the same count."""
    s = Setup(tmp_path)
    s.plan_dra(drain=True)
    s.drain.worker_beat(DraBeat(draining=False, prepared_claims=2, claims_changes=4))
    assert s.replans == []
    s.drain.worker_beat(DraBeat(draining=True, prepared_claims=2, claims_changes=4))
    s.drain.worker_beat(DraBeat(draining=True, prepared_claims=2, claims_changes=5))
    assert s.replans == ["the draining DRA worker holds 2 prepared claim(s)"]
    s.drain.worker_beat(DraBeat(draining=True, prepared_claims=1, claims_changes=6))
    assert s.replans[-1] == "the draining DRA worker holds 1 prepared claim(s)" and len(s.replans) == 2
    s.plan_dra(drain=False)
    s.drain.worker_beat(DraBeat(draining=True, prepared_claims=1, claims_changes=6))
    assert len(s.replans) == 2
    s.plan_dra(drain=True)
    s.drain.worker_beat(DraBeat(draining=True, prepared_claims=1, claims_changes=6))
    assert len(s.replans) == 3
