"""Tests of what worker messages and kubelet-dir events mean (supervisor/workers/events.py), with a
real WorkerSet over fake processes, a fake control endpoint and a fake clock."""

from __future__ import annotations

from common.messages import DraBeat, Heartbeat, Hello, Message, Reregister, StatusReport
from common.model import ResourcePlan
from supervisor.control.endpoint import Binding
from supervisor.observe.metrics import Metrics
from supervisor.workers.events import WorkerEvents
from supervisor.workers.lifecycle import WorkerHandle, WorkerSet, WState
from tests.fakes import FakeClock, FakeSpawner, bookless_hub

GPU = "nvidia.com/gpu"
MIG = "nvidia.com/mig-1g.10gb"


class FakeControl:
    def __init__(self) -> None:
        self.told: list[tuple[str, Message]] = []
        self.unbound: list[str] = []

    def tell(self, resource: str, message: Message) -> bool:
        self.told.append((resource, message))
        return True

    def unbind(self, resource: str) -> None:
        self.unbound.append(resource)


class FakeReconciler:
    """A reconciler with no plans: every resource here is on its way out."""

    def __init__(self) -> None:
        self.plans: dict[str, ResourcePlan] = {}
        self.started: list[str] = []
        self.caught_up: list[str] = []

    def worker_started(self, resource: str) -> None:
        self.started.append(resource)

    def catch_up(self, resource: str) -> None:
        self.caught_up.append(resource)


class Setup:
    def __init__(self) -> None:
        self.clock = FakeClock()
        self.metrics = Metrics(version="test")
        self.spawner = FakeSpawner()
        self.control = FakeControl()
        self.workers = WorkerSet(spawner=self.spawner, listeners=(self.on_state,))
        hub = bookless_hub(self.metrics, self.clock)
        self.dra_told: list[DraBeat] = []
        self.swept: list[tuple[str, str]] = []
        self.events = WorkerEvents(
            workers=self.workers,
            reconciler=FakeReconciler(),
            control=self.control,
            hub=hub,
            metrics=self.metrics,
            clock=self.clock,
            sockets=self,
            on_dra=(self.dra_told.append,),
        )
        for resource in (GPU, MIG):
            self.workers.want(resource, f"/plans/{resource}.json")
        self.workers.tick(self.clock.now)

    def on_state(self, handle: WorkerHandle, old: WState, new: WState, reason: str) -> None:
        self.events.on_worker_state(handle, old, new, reason)

    def worker_gone(self, resource: str, tag: str) -> None:
        self.swept.append((resource, tag))

    def handle(self, resource: str = GPU) -> WorkerHandle:
        return self.workers.workers[resource]

    def registrations(self, trigger: str, resource: str = GPU) -> float:
        value = self.metrics.registry.get_sample_value(
            "gpuvisor_registrations_total", {"resource": resource, "trigger": trigger}
        )
        return value or 0.0


def test_a_hello_is_accepted_only_with_this_spawns_secret_and_pid() -> None:
    """The right secret and pid give the binding; a wrong secret or another pid give none."""
    s = Setup()
    h = s.handle()
    binding = s.events.accept_hello(Hello(resource=GPU, pid=h.pid, secret=h.secret))
    assert binding == Binding(GPU, h.pid)
    assert s.events.accept_hello(Hello(resource=GPU, pid=h.pid, secret="0" * 32)) is None
    assert s.events.accept_hello(Hello(resource=GPU, pid=h.pid + 1000, secret=h.secret)) is None
    assert s.events.accept_hello(Hello(resource="nvidia.com/other", pid=h.pid, secret=h.secret)) is None


def test_a_restarted_workers_old_secret_no_longer_works() -> None:
    """After a death and restart, the previous spawn's secret is refused: each spawn has its own."""
    s = Setup()
    old = s.handle()
    old_secret, old_pid = old.secret, old.pid
    s.spawner.procs[old_pid].die()
    s.workers.tick(s.clock.now)
    s.workers.tick(s.clock.now)
    new = s.handle()
    assert new.pid != old_pid and new.secret != old_secret
    assert s.events.accept_hello(Hello(resource=GPU, pid=new.pid, secret=old_secret)) is None
    assert GPU in s.control.unbound  # the dead one's route was let go


def test_a_heartbeat_saying_registered_makes_the_worker_running() -> None:
    """A registered heartbeat turns STARTING into RUNNING and keeps its figures."""
    s = Setup()
    h = s.handle()
    s.events.on_heartbeat(
        Heartbeat(GPU, h.pid, "registered", True, "/p/gpuvisor-gpu-1.sock", {"gauge:streams": 1.0})
    )
    assert (
        h.state is WState.RUNNING
        and h.stats == {"gauge:streams": 1.0}
        and h.socket_path.endswith("gpu-1.sock")
    )


def test_a_dead_workers_sockets_are_swept_once_it_is_gone() -> None:
    """A worker's death (BACKOFF) and its stop (STOPPED) sweep the sockets of that spawn's tag;
    a start or a registration sweeps nothing."""
    s = Setup()
    h = s.handle()
    s.events.on_heartbeat(Heartbeat(GPU, h.pid, "registered", True, "/p/x.sock", {}))
    assert h.state is WState.RUNNING and s.swept == []
    first_tag = h.socket_tag
    s.spawner.procs[h.pid].die()
    s.workers.tick(s.clock.now)
    assert s.swept == [(GPU, first_tag)]
    s.workers.unwant(GPU, s.clock.now)
    s.workers.tick(s.clock.now)
    assert s.handle().state is WState.STOPPED and s.swept[-1] == (GPU, h.socket_tag)


def test_a_change_of_the_dra_part_is_told_once() -> None:
    """The DRA part of a live worker's heartbeat is kept on its handle and told to the listeners
    when it changed; the same part again tells nothing, a beat without one nothing either, and
    a stranger's beat is not kept."""
    s = Setup()
    h = s.handle()
    part = DraBeat(draining=True, prepared_claims=1, claims_changes=2)
    for _ in range(2):
        s.events.on_heartbeat(Heartbeat(GPU, h.pid, "registered", True, "/p/x.sock", {}, dra=part))
    assert h.dra == part and s.dra_told == [part]
    s.events.on_heartbeat(Heartbeat(GPU, h.pid, "registered", True, "/p/x.sock", {}))
    assert h.dra is None and s.dra_told == [part]
    s.events.on_heartbeat(Heartbeat(MIG, 1, "registered", True, "/p/y.sock", {}, dra=part))
    assert s.handle(MIG).dra is None and s.dra_told == [part]


def test_registration_metrics_name_the_trigger_the_supervisor_saw() -> None:
    """A first registration counts as start; after kubelet.sock was deleted, as a kubelet restart."""
    s = Setup()
    h = s.handle()
    s.events.on_status_report(StatusReport(GPU, "registering", "kubelet.sock is there"))
    s.events.on_status_report(StatusReport(GPU, "registered", "endpoint x"))
    assert s.registrations("start") == 1.0
    s.events.file_deleted("kubelet.sock")
    s.events.on_status_report(StatusReport(GPU, "registering", "the kubelet ended our ListAndWatch stream"))
    s.events.on_status_report(StatusReport(GPU, "registered", "endpoint y"))
    assert s.registrations("kubelet-restart") == 1.0
    assert h.state is WState.RUNNING


def test_kubelet_sock_created_tells_every_worker_to_register_again() -> None:
    """A new kubelet.sock: each resource's worker is told to re-register."""
    s = Setup()
    s.events.kubelet_created()
    assert sorted(r for r, m in s.control.told if isinstance(m, Reregister)) == [GPU, MIG]


def test_a_deleted_worker_socket_tells_only_its_worker() -> None:
    """Our socket deleted: that worker re-registers; another file's deletion tells nobody."""
    s = Setup()
    h = s.handle()
    s.events.on_heartbeat(Heartbeat(GPU, h.pid, "registered", True, "/p/gpuvisor-gpu-0a1b2c3d.sock", {}))
    s.events.file_deleted("gpuvisor-gpu-0a1b2c3d.sock")
    s.events.file_deleted("something-else.sock")
    assert s.control.told == [(GPU, Reregister(reason="socket gpuvisor-gpu-0a1b2c3d.sock deleted"))]


def test_a_snapshot_is_refused_for_a_resource_no_longer_planned() -> None:
    """A removed resource's worker (being stopped) gets no snapshot."""
    s = Setup()
    assert s.events.snapshot_for(GPU) is None
