"""Fakes of the supervisor parts' neighbours, for unit tests without a process, socket or real clock."""

from __future__ import annotations

import signal
from collections.abc import Callable, Mapping

from common.model import ResourcePlan
from supervisor.config import Config, config_from_data, load_config
from supervisor.health.book import HealthBook
from supervisor.health.hub import HealthHub
from supervisor.health.policy import HealthPolicy
from supervisor.node.planning import plan_resources
from supervisor.observe.metrics import Metrics
from supervisor.workers.lifecycle import WorkerHandle
from tests import nodes


class FakeClock:
    """A clock that moves only when the test says so."""

    def __init__(self, start: float = 1000.0, wall: float = 1_700_000_000.0) -> None:
        self.now = start
        self.wall = wall

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.wall + self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeProc:
    """A worker process as WorkerSet sees it: a pid, poll() and signals, under the test's control."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.signals: list[int] = []

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)
        if sig in (signal.SIGTERM, signal.SIGKILL) and self.returncode is None:
            self.returncode = -sig

    def die(self, code: int = -signal.SIGKILL) -> None:
        self.returncode = code


class FakeSpawner:
    """Hands out FakeProcs with increasing pids; `fail` makes the next spawns raise OSError."""

    def __init__(self) -> None:
        self.next_pid = 100
        self.procs: dict[int, FakeProc] = {}
        self.spawned: list[tuple[str, str]] = []  # (resource, secret) per spawn
        self.fail = 0

    def __call__(self, handle: WorkerHandle) -> FakeProc:
        if self.fail:
            self.fail -= 1
            raise OSError("no more processes")
        self.next_pid += 1
        proc = FakeProc(self.next_pid)
        self.procs[proc.pid] = proc
        self.spawned.append((handle.resource, handle.secret))
        return proc


class FakeRunDir:
    """The run dir's plan writes, in memory; `broken` makes every write fail like a full disk."""

    def __init__(self) -> None:
        self.plans_dir = "/run/gpuvisor/plans"
        self.files: dict[str, str] = {}
        self.broken = False
        self.writes = 0

    def plan_path(self, resource: str) -> str:
        return f"{self.plans_dir}/{resource.replace('/', '_')}.json"

    def write_plans(self, texts: Mapping[str, str]) -> None:
        if self.broken:
            raise OSError(28, "No space left on device", self.plans_dir)
        for resource, text in texts.items():
            self.writes += 1
            self.files[self.plan_path(resource)] = text


def sim_config(profile: str = "pcie-l4", **env: str) -> Config:
    """A config as `gpuvisor run --simulate PROFILE` with these env vars would load it."""
    return load_config(None, {"GPUVISOR_SIMULATE": profile, **env})


def plan_json(plans: Mapping[str, ResourcePlan]) -> dict[str, str]:
    return {r: p.to_json() for r, p in plans.items()}


def no_post(fn: Callable[[], None]) -> None:
    raise AssertionError("no monitor thread runs here: nothing is posted")


def policy() -> HealthPolicy:
    return HealthPolicy.from_settings(None, None, {}, 60.0)


def bookless_hub(metrics: Metrics, clock: FakeClock) -> HealthHub:
    """A health hub as it is before NVML is up: no book, no socket, no monitor thread."""
    return HealthHub(
        endpoint="ipc:///nowhere", policy=policy(), metrics=metrics, clock=clock, epoch="epoch1", post=no_post
    )


def hub_with_book(
    node_factory: object = nodes.pcie_l4, data: object = None
) -> tuple[HealthHub, FakeClock, Metrics]:
    """A health hub with a book for the node's default plans (as after NVML came up), no socket."""
    clock = FakeClock()
    metrics = Metrics(version="test")
    hub = bookless_hub(metrics, clock)
    node = node_factory()  # type: ignore[operator]
    plans = plan_resources(node, config_from_data(data))
    hub.node = node
    hub.book = HealthBook(plans, hub.policy, clock.time())
    return hub, clock, metrics
