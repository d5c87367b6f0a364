"""Tests of the plan reconciler (supervisor/desired/reconcile.py): the pure diff, and applying a desired
state with a fake run dir, real WorkerSet bookkeeping over fake processes, and a fake clock."""

from __future__ import annotations

import logging

import pytest

from common.messages import DeviceHealth, HealthSnapshot, PlanUpdate
from common.model import Node
from supervisor.config import Config, config_from_data
from supervisor.desired.reconcile import (
    ActionKind,
    Deferred,
    Desired,
    PlanAction,
    Reconciler,
    Refusal,
    Unchanged,
    plan_actions,
)
from supervisor.node.planning import plan_resources
from supervisor.scheduler import Scheduler
from supervisor.workers.lifecycle import WorkerSet, WState
from tests import nodes
from tests.fakes import FakeClock, FakeRunDir, FakeSpawner

GPU = "nvidia.com/gpu"
SHARED = "nvidia.com/gpu.shared"


def desired(node: Node, data: object = None, trigger: str = "test") -> Desired:
    config = config_from_data(data)
    return Desired(config, node, plan_resources(node, config), trigger)


def sliced(replicas: int, rename: bool = False) -> dict[str, object]:
    return {
        "version": "v1",
        "sharing": {
            "timeSlicing": {
                "renameByDefault": rename,
                "resources": [{"name": "nvidia.com/gpu", "replicas": replicas}],
            }
        },
    }


class Hooks:
    """The followers: records what they were told."""

    def __init__(self) -> None:
        self.adopted: list[str] = []
        self.configs: list[Config] = []
        self.fail = 0

    def take_config(self, old: Config, new: Config) -> None:
        self.configs.append(new)

    def take_plans(self, d: Desired) -> None:
        if self.fail:
            self.fail -= 1
            raise RuntimeError("can't start new thread")
        self.adopted.append(d.trigger)


class Setup:
    def __init__(self) -> None:
        self.clock = FakeClock()
        self.timers = Scheduler(self.clock)
        self.rundir = FakeRunDir()
        self.spawner = FakeSpawner()
        self.workers = WorkerSet(spawner=self.spawner)
        self.told: list[tuple[str, PlanUpdate]] = []
        self.reachable: set[str] = set()
        self.hooks = Hooks()
        self.pending_flags: list[bool] = []
        self.rec = Reconciler(
            config=config_from_data(None),
            plan_files=self.rundir,
            workers=self.workers,
            tell=self.tell,
            snapshot=self.snapshot,
            follow=self.hooks,
            timers=self.timers,
            on_pending=self.pending_flags.append,
        )

    def snapshot(self, resource: str) -> HealthSnapshot:
        """The health hub's answer: every device of the current plan, one of them Unhealthy."""
        ids = [d.id for d in self.rec.plans[resource].devices]
        devices = tuple(DeviceHealth(i, n != 0, "" if n else "XID 48", 1.0) for n, i in enumerate(ids))
        return HealthSnapshot(seq=7, resource=resource, devices=devices, epoch="e")

    def tell(self, resource: str, update: PlanUpdate) -> bool:
        if resource not in self.reachable:
            return False
        self.told.append((resource, update))
        return True


def test_plan_actions_stops_first_then_starts_updates_and_keeps() -> None:
    """The diff names every resource once: removed ones stop (first), new start, changed update."""
    current = {"a": "1", "b": "2", "c": "3"}
    wanted = {"b": "2", "c": "changed", "d": "4"}
    assert plan_actions(current, wanted) == [
        PlanAction(ActionKind.STOP, "a"),
        PlanAction(ActionKind.KEEP, "b"),
        PlanAction(ActionKind.UPDATE, "c"),
        PlanAction(ActionKind.START, "d"),
    ]


def test_plan_actions_of_equal_sides_only_keeps() -> None:
    """Same plans: nothing starts, stops or updates."""
    same = {"x": "p", "y": "q"}
    assert {a.kind for a in plan_actions(same, dict(same))} == {ActionKind.KEEP}


def test_the_first_desired_state_writes_plans_adopts_then_starts_workers() -> None:
    """Start: each plan file is written, the hooks adopt, and a worker is wanted per resource."""
    s = Setup()
    assert s.rec.want(desired(nodes.pcie_l4(), trigger="start"))
    assert list(s.rundir.files) == [s.rundir.plan_path(GPU)]
    assert s.hooks.adopted == ["start"]
    s.workers.tick(s.clock.now)
    assert s.workers.workers[GPU].state is WState.STARTING
    assert s.rec.pending is None and s.pending_flags == []


def test_a_changed_plan_is_updated_in_place_in_the_running_worker() -> None:
    """Same resource, new plan: no new process; the running worker is sent the new plan."""
    s = Setup()
    node = nodes.pcie_l4()
    s.rec.want(desired(node, sliced(2)))
    s.workers.tick(s.clock.now)
    pid = s.workers.workers[GPU].pid
    s.reachable.add(GPU)
    assert s.rec.want(desired(node, sliced(3)))
    s.workers.tick(s.clock.now)
    assert s.workers.workers[GPU].pid == pid
    assert [r for r, _u in s.told] == [GPU]
    assert '"::2"' not in s.told[0][1].plan_json and "::2" in s.told[0][1].plan_json


def test_a_removed_resource_is_stopped_and_an_added_one_started() -> None:
    """Renaming the shared resource stops nvidia.com/gpu's worker and starts gpu.shared's."""
    s = Setup()
    node = nodes.pcie_l4()
    s.rec.want(desired(node))
    s.workers.tick(s.clock.now)
    assert s.rec.want(desired(node, sliced(2, rename=True)))
    s.workers.tick(s.clock.now)
    assert not s.workers.workers[GPU].wanted  # asked to stop (the fake process obeys at once)
    assert s.workers.workers[GPU].state is WState.STOPPED
    assert s.workers.workers[SHARED].state is WState.STARTING


def test_plans_that_cannot_be_written_stay_pending_and_are_retried_with_backoff() -> None:
    """A full run dir: nothing changes and the state is pending; once writes work, a retry applies it."""
    s = Setup()
    node = nodes.pcie_l4()
    s.rec.want(desired(node))
    s.rundir.broken = True
    assert not s.rec.want(desired(node, sliced(2), trigger="SIGHUP"))
    assert s.rec.pending is not None and "No space left" in s.rec.pending_error
    assert len(s.hooks.adopted) == 1 and "::" not in s.rec.plan_json[GPU]
    status = s.rec.status()["pending"]
    assert isinstance(status, dict) and status["trigger"] == "SIGHUP" and status["next_retry_in"] is not None
    s.clock.advance(60)
    s.timers.run_due()  # still broken: retried, still pending, next retry later
    assert s.rec.pending is not None and s.rec.backoff.attempts == 2
    s.rundir.broken = False
    s.clock.advance(60)
    s.timers.run_due()
    assert s.rec.pending is None and "::1" in s.rec.plan_json[GPU]
    assert s.pending_flags == [True, True, False]


def test_a_newer_desired_state_replaces_a_pending_one() -> None:
    """While pending, a newer reload wins: the retry applies the latest, not the first."""
    s = Setup()
    node = nodes.pcie_l4()
    s.rec.want(desired(node))
    s.rundir.broken = True
    s.rec.want(desired(node, sliced(2), trigger="first"))
    s.rec.want(desired(node, sliced(4), trigger="second"))
    s.rundir.broken = False
    assert s.rec.retry()
    assert s.hooks.adopted[-1] == "second" and "::3" in s.rec.plan_json[GPU]


def test_a_refusal_is_kept_for_status_until_a_valid_config_arrives() -> None:
    """An invalid config is not pending (retrying cannot help); status names it until a reload
    reads a valid config, even one that changes nothing."""
    s = Setup()
    assert not s.rec.take(Refusal("reload", "bad key", "SIGHUP"))
    assert s.rec.status() == {"pending": None, "refused": "reload refused: bad key (SIGHUP)", "refusals": 1}
    assert s.rec.take(Unchanged("rediscovery", "periodic rediscovery"))  # not an answer to a reload's refusal
    assert s.rec.refusal is not None
    assert s.rec.take(Unchanged("reload", "SIGHUP"))
    assert s.rec.refusal is None and s.rec.refused == 1


def test_a_rediscovery_refusal_ends_with_a_rediscovery_that_goes_through_and_logs_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """NVML trouble at each periodic rediscovery is one line, not one per period; the first
    rediscovery that works clears it."""
    s = Setup()
    refusal = Refusal("rediscovery", "discovery failed: Unknown Error", "periodic rediscovery")
    with caplog.at_level(logging.ERROR, logger="gpuvisor.supervisor"):
        for _ in range(3):
            assert not s.rec.take(refusal)
    assert len(caplog.records) == 1 and s.rec.refused == 3
    assert s.rec.take(Unchanged("rediscovery", "periodic rediscovery"))
    assert s.rec.refusal is None


def test_a_config_taken_before_nvml_is_up_runs_and_the_followers_hear_of_it() -> None:
    """A reload while NVML is down: the config becomes the running one at once (planned later)."""
    s = Setup()
    config = config_from_data(sliced(2))
    assert s.rec.take(Deferred(config, "SIGHUP"))
    assert s.rec.config is config and s.hooks.configs == [config] and s.rec.plans == {}


def test_a_refused_reload_drops_a_pending_one() -> None:
    """A reload still pending (its plans could not be written) is dropped by a newer refused one:
    the user has moved on from it."""
    s = Setup()
    node = nodes.pcie_l4()
    s.rec.want(desired(node))
    s.rundir.broken = True
    assert not s.rec.take(desired(node, sliced(2), trigger="SIGHUP"))
    assert s.rec.pending is not None
    assert not s.rec.take(Refusal("reload", "bad key", "SIGHUP"))
    assert s.rec.pending is None and s.timers.when("pending-reload") is None and s.pending_flags[-1] is False


def test_a_worker_that_said_hello_late_catches_up_on_the_plan() -> None:
    """A worker started before an update (and unreachable then) gets the plan once reachable."""
    s = Setup()
    node = nodes.pcie_l4()
    s.rec.want(desired(node))
    s.workers.tick(s.clock.now)
    s.rec.worker_started(GPU)
    s.rec.want(desired(node, sliced(2)))
    assert s.told == []
    s.reachable.add(GPU)
    s.rec.catch_up(GPU)
    s.rec.catch_up(GPU)  # only once: the worker has it now
    assert len(s.told) == 1


def test_a_plan_update_carries_the_health_of_its_devices() -> None:
    """The worker gets the new plan and the health snapshot of exactly its devices in one message,
    so it never asks for the snapshot the supervisor already holds."""
    s = Setup()
    node = nodes.pcie_l4()
    s.rec.want(desired(node))
    s.workers.tick(s.clock.now)
    s.rec.worker_started(GPU)
    s.reachable.add(GPU)
    s.rec.want(desired(node, sliced(2)))
    ((resource, update),) = s.told
    assert resource == GPU and update.snapshot is not None
    assert [d.device_id for d in update.snapshot.devices] == [d.id for d in s.rec.plans[GPU].devices]
    assert update.plan_json == s.rec.plan_json[GPU]


def test_a_failed_adopt_still_starts_the_workers_and_is_retried() -> None:
    """The hooks raising (a thread that cannot start) neither loses the new resource's worker nor
    leaves the supervisor half in step: the workers follow the plans, and adopt is tried again."""
    s = Setup()
    s.hooks.fail = 1
    errors: list[str] = []
    s.rec.on_error = errors.append
    assert s.rec.want(desired(nodes.pcie_l4(), trigger="start"))
    s.workers.tick(s.clock.now)
    assert s.workers.workers[GPU].state is WState.STARTING and s.hooks.adopted == [] and errors == ["adopt"]
    s.clock.advance(60)
    s.timers.run_due()
    assert s.hooks.adopted == ["start"] and s.timers.when("adopt-retry") is None
