"""supervisor/observe/metrics.py: the gpuvisor_* series, read back through prometheus_client's parser."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from supervisor.observe.metrics import WORKER_STATES, Metrics, registration_trigger, restart_cause
from supervisor.workers.events import metered
from supervisor.workers.lifecycle import Policy, WorkerSet, WState
from worker.stats import BUCKETS, Stats

R = "nvidia.com/gpu"


def samples(m: Metrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(m: Metrics, name: str, **labels: str) -> float | None:
    return samples(m).get((name, frozenset(labels.items())))


def test_states_follow_the_worker_lifecycle_enum() -> None:
    """The one-hot state gauge knows exactly the states of supervisor.workers.lifecycle.WState."""
    assert set(WORKER_STATES) == {s.value for s in WState}


def test_worker_state_is_one_hot() -> None:
    """worker_state sets 1 on the current state and 0 on every other, per resource."""
    m = Metrics()
    m.worker_state(R, "STARTING")
    m.worker_state(R, "RUNNING")
    got = {s: value(m, "gpuvisor_worker_state", resource=R, state=s) for s in WORKER_STATES}
    assert got == {s: (1.0 if s == "RUNNING" else 0.0) for s in WORKER_STATES}


def test_up_ready_and_build_info() -> None:
    """gpuvisor_up is 1, gpuvisor_ready follows set_ready, build_info carries the version."""
    m = Metrics(version="9.9.9")
    assert value(m, "gpuvisor_up") == 1.0
    assert value(m, "gpuvisor_ready") == 0.0
    m.set_ready(True)
    assert value(m, "gpuvisor_ready") == 1.0
    info = [k for k in samples(m) if k[0] == "gpuvisor_build_info"]
    assert len(info) == 1 and ("version", "9.9.9") in info[0][1]


def test_every_series_is_gpuvisor_named_and_registries_are_private() -> None:
    """All exported names start with gpuvisor_, and two instances do not clash (own registry)."""
    a, b = Metrics(), Metrics()
    a.nvml_error("nvmlEventSetWait", 15)
    assert value(b, "gpuvisor_nvml_errors_total", function="nvmlEventSetWait", code="15") is None
    assert value(a, "gpuvisor_nvml_errors_total", function="nvmlEventSetWait", code="15") == 1.0
    assert all(name.startswith("gpuvisor_") for name, _ in samples(a))


def test_health_batch_counts_transitions_and_xids() -> None:
    """Each device change counts one transition by its new health; an XID counts once per batch."""
    m = Metrics()
    m.health_batch([(R, "GPU-a", False), (R, "GPU-b", False), ("nvidia.com/mig-1g.10gb", "MIG-c", False)], 79)
    m.health_batch([(R, "GPU-a", True)], None)
    m.health_batch([], 13)  # an ignored XID changes nothing but is still an XID event
    assert value(m, "gpuvisor_health_transitions_total", resource=R, to="unhealthy") == 2.0
    assert value(m, "gpuvisor_health_transitions_total", resource=R, to="healthy") == 1.0
    assert (
        value(m, "gpuvisor_health_transitions_total", resource="nvidia.com/mig-1g.10gb", to="unhealthy")
        == 1.0
    )
    assert value(m, "gpuvisor_xid_events_total", xid="79") == 1.0
    assert value(m, "gpuvisor_xid_events_total", xid="13") == 1.0


def test_devices_gauge() -> None:
    """set_devices exports healthy and unhealthy device counts per resource."""
    m = Metrics()
    m.set_devices(R, 6, 2)
    assert value(m, "gpuvisor_devices", resource=R, health="healthy") == 6.0
    assert value(m, "gpuvisor_devices", resource=R, health="unhealthy") == 2.0


@pytest.mark.parametrize(
    ("reason", "trigger"),
    [
        ("start", "start"),
        ("", "start"),
        ("kubelet.sock created", "kubelet-restart"),
        ("socket gpuvisor-gpu-ab12.sock deleted", "socket-deleted"),
        ("our socket file was deleted", "socket-deleted"),
        ("ListAndWatch stream cancelled by the kubelet", "stream-cancelled"),
        ("something new", "other"),
    ],
)
def test_registration_trigger_labels(reason: str, trigger: str) -> None:
    """A worker's free-text re-registration reason maps to a small fixed label set."""
    assert registration_trigger(reason) == trigger


def test_registration_report_counts_by_the_reason_that_started_it() -> None:
    """registering(reason) then retries then registered counts one registration under reason."""
    m = Metrics()
    m.registration_report(R, "registering", "start")
    m.registration_report(R, "registered", "endpoint a.sock")
    m.registration_report(R, "registering", "kubelet.sock created")
    m.registration_report(R, "retrying", "connection refused")
    m.registration_report(R, "registering", "retry")
    m.registration_report(R, "registered", "endpoint b.sock")
    assert value(m, "gpuvisor_registrations_total", resource=R, trigger="start") == 1.0
    assert value(m, "gpuvisor_registrations_total", resource=R, trigger="kubelet-restart") == 1.0


def _stats(observations: list[tuple[str, float]], **counts: float) -> dict[str, float]:
    s = Stats()
    for method, seconds in observations:
        s.observe(method, seconds)
    for name, by in counts.items():
        s.count(name, by)
    return s.snapshot(streams=1)


def test_worker_figures_become_a_histogram() -> None:
    """Heartbeat figures become gpuvisor_rpc_duration_seconds with every bucket, _count and _sum."""
    m = Metrics()
    m.worker_stats(R, _stats([("Allocate", 0.0003), ("Allocate", 0.002), ("Allocate", 5.0)]), pid=10)
    got = samples(m)
    base = {("resource", R), ("method", "Allocate")}

    def bucket(le: str) -> float:
        return got[("gpuvisor_rpc_duration_seconds_bucket", frozenset({*base, ("le", le)}))]

    assert bucket("0.00025") == 0.0
    assert bucket("0.0005") == 1.0
    assert bucket("0.0025") == 2.0
    assert bucket("1.0") == 2.0
    assert bucket("+Inf") == 3.0
    les = {dict(k[1])["le"] for k in got if k[0] == "gpuvisor_rpc_duration_seconds_bucket"}
    assert les == {repr(b) for b in BUCKETS} | {"+Inf"}
    assert got[("gpuvisor_rpc_duration_seconds_count", frozenset(base))] == 3.0
    assert got[("gpuvisor_rpc_duration_seconds_sum", frozenset(base))] == pytest.approx(5.0023)
    assert got[("gpuvisor_worker_streams", frozenset({("resource", R)}))] == 1.0


@pytest.mark.parametrize("with_pid", [True, False])
def test_worker_restart_keeps_counters_monotonic(with_pid: bool) -> None:
    """A restarted worker's figures add to the earlier life's (new pid, or a figure going down)."""
    m = Metrics()
    life1 = _stats([("Allocate", 0.001)] * 5, health_gaps=2)
    m.worker_stats(R, life1, pid=10 if with_pid else None)
    m.worker_stats(R, life1, pid=10 if with_pid else None)  # the same figures again: no change
    life2 = _stats([("Allocate", 0.001)] * 2)
    m.worker_stats(R, life2, pid=11 if with_pid else None)
    labels = {"resource": R, "method": "Allocate"}
    assert value(m, "gpuvisor_rpc_duration_seconds_count", **labels) == 7.0
    assert value(m, "gpuvisor_rpc_duration_seconds_bucket", le="+Inf", **labels) == 7.0
    assert value(m, "gpuvisor_worker_events_total", resource=R, event="health_gaps") == 2.0


def test_worker_gauges_go_away_when_the_worker_is_down() -> None:
    """A worker's gauges (open streams) are dropped when it leaves RUNNING for BACKOFF."""
    m = Metrics()
    m.worker_stats(R, _stats([]), pid=10)
    assert value(m, "gpuvisor_worker_streams", resource=R) == 1.0
    m.worker_state(R, "BACKOFF")
    assert value(m, "gpuvisor_worker_streams", resource=R) is None


def test_forget_resource_drops_its_gauges() -> None:
    """A resource removed by a reload loses its state and device gauges."""
    m = Metrics()
    m.worker_state(R, "RUNNING")
    m.set_devices(R, 1, 0)
    m.forget_resource(R)
    assert not [
        k
        for k in samples(m)
        if ("resource", R) in k[1] and k[0] in ("gpuvisor_worker_state", "gpuvisor_devices")
    ]


class _Proc:
    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.status: int | None = None

    def poll(self) -> int | None:
        return self.status

    def send_signal(self, sig: int) -> None:
        self.status = -sig


def test_metered_listener_counts_restarts_by_cause() -> None:
    """Wired to WorkerSet's listeners (supervisor.workers.events.metered): state gauge on every change, one restart per death by cause."""
    m = Metrics()
    procs: list[_Proc] = []

    def spawn(handle: object) -> _Proc:
        procs.append(_Proc(100 + len(procs)))
        return procs[-1]

    ws = WorkerSet(spawner=spawn, policy=Policy(heartbeat_timeout=5.0), listeners=(metered(m),))
    h = ws.want(R, "/plan.json")
    ws.tick(0.0)
    ws.heartbeat(R, 100, True, "/s.sock", 1.0)
    assert value(m, "gpuvisor_worker_state", resource=R, state="RUNNING") == 1.0
    procs[-1].status = 1  # crash
    ws.tick(20.0)
    assert value(m, "gpuvisor_worker_restarts_total", resource=R, cause="exited with status 1") == 1.0
    ws.tick(20.0)  # restarted at once
    ws.heartbeat(R, 101, True, "/s.sock", 21.0)
    ws.tick(40.0)  # silent for 19 s: killed as a hang
    ws.tick(40.0)
    assert h.restart_causes.get("heartbeat timeout") == 1
    exported = {
        dict(k[1])["cause"]: v for k, v in samples(m).items() if k[0] == "gpuvisor_worker_restarts_total"
    }
    assert exported == {cause: float(n) for cause, n in h.restart_causes.items()}


def test_a_death_that_makes_a_worker_fatal_counts_as_a_restart() -> None:
    """FATAL is retried (at a capped interval), so the death that leads to it is counted in
    gpuvisor_worker_restarts_total like any other, once, and the retry's next death again."""
    m = Metrics()
    procs: list[_Proc] = []

    def spawn(handle: object) -> _Proc:
        procs.append(_Proc(100 + len(procs)))
        return procs[-1]

    ws = WorkerSet(spawner=spawn, policy=Policy(start_retries=2, start_seconds=10.0), listeners=(metered(m),))
    h = ws.want(R, "/plan.json")
    now = 0.0
    ws.tick(now)
    while h.state.value != "FATAL" and now < 100:
        if procs[-1].status is None:
            procs[-1].status = 1  # dies before registering: a quick failure
        now += 0.3
        ws.tick(now)
    deaths = len(procs)
    assert h.state.value == "FATAL" and deaths == 3
    assert value(m, "gpuvisor_worker_restarts_total", resource=R, cause="exited with status 1") == 3.0
    ws.tick(now + 60)  # the FATAL retry
    assert len(procs) == 4
    procs[-1].status = 1
    ws.tick(now + 60.3)
    assert h.state.value == "FATAL"
    assert value(m, "gpuvisor_worker_restarts_total", resource=R, cause="exited with status 1") == 4.0


@pytest.mark.parametrize(
    ("reason", "cause"),
    [
        ("killed by SIGKILL; restart in 0.00s", "killed by SIGKILL"),
        ("spawn failed: [Errno 12] Cannot allocate memory", "spawn failed"),
        ("", "unknown"),
    ],
)
def test_restart_cause_label(reason: str, cause: str) -> None:
    """A transition reason gives a bounded cause label (no errno text, no delays)."""
    assert restart_cause(reason) == cause


def test_metered_listener_drops_a_removed_resource() -> None:
    """A worker stopped because its resource was removed leaves no state series behind."""
    m = Metrics()
    procs: list[_Proc] = []

    def spawn(handle: object) -> _Proc:
        procs.append(_Proc(200 + len(procs)))
        return procs[-1]

    ws = WorkerSet(spawner=spawn, listeners=(metered(m),))
    ws.want(R, "/plan.json")
    ws.tick(0.0)
    m.set_devices(R, 8, 0)
    ws.unwant(R, 1.0)
    assert value(m, "gpuvisor_worker_state", resource=R, state="STOPPING") == 1.0
    procs[-1].status = 0
    ws.tick(2.0)
    assert not [
        k
        for k in samples(m)
        if ("resource", R) in k[1] and k[0] in ("gpuvisor_worker_state", "gpuvisor_devices")
    ]


def test_fatal_workers_gauge_counts_resources_in_fatal() -> None:
    """gpuvisor_workers_fatal is the number of resources whose worker is FATAL now."""
    m = Metrics()
    m.worker_state(R, "FATAL")
    m.worker_state("nvidia.com/mig-1g.10gb", "FATAL")
    assert value(m, "gpuvisor_workers_fatal") == 2.0
    m.worker_state(R, "STARTING")
    assert value(m, "gpuvisor_workers_fatal") == 1.0
    m.forget_resource("nvidia.com/mig-1g.10gb")
    assert value(m, "gpuvisor_workers_fatal") == 0.0


def test_the_loops_own_troubles_are_counted() -> None:
    """Failed loop steps, refused reloads, a pending reload and dropped control messages have series."""
    m = Metrics()
    m.housekeeping_error("reconcile")
    m.reload_refused("reload")
    m.set_pending_reload(True)
    m.control_message_dropped("unbound sender")
    assert value(m, "gpuvisor_housekeeping_errors_total", step="reconcile") == 1.0
    assert value(m, "gpuvisor_reloads_refused_total", kind="reload") == 1.0
    assert value(m, "gpuvisor_reload_pending") == 1.0
    assert value(m, "gpuvisor_control_messages_dropped_total", reason="unbound sender") == 1.0


def test_the_version_is_the_installed_packages() -> None:
    """gpuvisor_build_info and --version say supervisor/config/version.py's VERSION, which
    pyproject.toml builds the package's metadata from: the installed distribution says the same."""
    import importlib.metadata

    from supervisor.config.flags import installed_version
    from supervisor.config.version import VERSION

    assert importlib.metadata.version("gpuvisor") == VERSION == installed_version()
    m = Metrics()
    info = [k for k in samples(m) if k[0] == "gpuvisor_build_info"]
    assert info and dict(info[0][1])["version"] == VERSION
