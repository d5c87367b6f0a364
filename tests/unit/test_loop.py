"""Tests of the supervisor's loop (supervisor/main.py) built without starting it: no process, no
socket, a fake clock. The parts are its own; what is checked is the wiring the loop does."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest
import zmq

from supervisor.main import IDLE_TICK_S, TICK_S, Supervisor
from supervisor.workers.lifecycle import WState
from tests.fakes import FakeClock, FakeSpawner, sim_config

GPU = "nvidia.com/gpu"


@pytest.fixture
def sup() -> Iterator[Supervisor]:
    s = Supervisor(sim_config("pcie-l4"), environ={}, clock=FakeClock())
    s.workers.spawner = FakeSpawner()  # no process: the fake stands in for the zygote
    try:
        yield s
    finally:
        s.mailbox.close()


def housekeeping_errors(sup: Supervisor, step: str) -> float:
    return sup.metrics.registry.get_sample_value("gpuvisor_housekeeping_errors_total", {"step": step}) or 0.0


def test_signal_handlers_only_enqueue(sup: Supervisor) -> None:
    """The handler records the signal and does nothing else; the loop acts later."""
    sup._on_signal(signal.SIGTERM, None)
    assert sup.signals == [signal.SIGTERM] and not sup.stopping
    sup.handle_signals()
    assert sup.stopping and sup.signals == []


def test_a_turn_that_handles_sigterm_stops_without_waiting(
    sup: Supervisor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The turn in which a SIGTERM is handled polls with no timeout (nor at all): the stop starts at
    once, not a tick later. A turn without one still waits for its next event."""
    timeouts: list[object] = []

    def poll(self: zmq.Poller, timeout: object = None) -> list[object]:
        timeouts.append(timeout)
        return []

    monkeypatch.setattr(zmq.Poller, "poll", poll)
    sup.turn()
    assert len(timeouts) == 1 and isinstance(timeouts[0], int) and timeouts[0] > 0
    timeouts.clear()
    sup._on_signal(signal.SIGTERM, None)
    sup.turn()
    assert sup.stopping and [t for t in timeouts if t != 0] == []


def test_sighup_reloads_and_sigchld_only_wakes(sup: Supervisor, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGHUP becomes a reload; SIGCHLD does nothing but wake the loop (reconcile reaps)."""
    triggers: list[str] = []

    def reload(trigger: str) -> bool:
        triggers.append(trigger)
        return True

    monkeypatch.setattr(sup.replan, "reload", reload)
    sup.signals += [signal.SIGCHLD, signal.SIGHUP]
    sup.handle_signals()
    assert triggers == ["SIGHUP"] and not sup.stopping


def test_a_step_that_raises_is_counted_and_the_turn_goes_on(
    sup: Supervisor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A housekeeping step that raises never ends the loop: it is logged, counted, and the rest runs."""

    def broken() -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sup.hub, "tick", broken)
    ran: list[str] = []
    monkeypatch.setattr(sup, "check_ready", lambda: ran.append("readiness"))
    monkeypatch.setattr(sup, "wait", lambda: [])  # not the idle tick's real 10 s poll, twice
    sup.turn()
    sup.turn()
    assert housekeeping_errors(sup, "health") == 2.0 and ran == ["readiness", "readiness"]


def test_a_posted_call_that_raises_is_counted_and_the_next_still_runs(sup: Supervisor) -> None:
    """Work posted from other threads (health findings, control replies) that raises is logged,
    counted as housekeeping step "mailbox", and what was posted after it still runs."""
    ran: list[str] = []

    def broken() -> None:
        raise ValueError("a finding for a resource that left the plan")

    sup.mailbox.post(broken)
    sup.mailbox.post(lambda: ran.append("next"))
    sup.mailbox.drain()
    assert ran == ["next"] and housekeeping_errors(sup, "mailbox") == 1.0


def test_reconcile_wakes_the_loop_when_a_backoff_ends(sup: Supervisor) -> None:
    """A worker backing off puts its deadline on the scheduler; once it is started again the timer
    is its wait for a first heartbeat instead."""
    clock = sup.clock
    assert isinstance(clock, FakeClock)
    sup.workers.want(GPU, "/plans/gpu.json")
    sup.tend_workers()
    handle = sup.workers.workers[GPU]
    spawner = sup.workers.spawner
    assert isinstance(spawner, FakeSpawner)
    for _ in range(2):  # two quick deaths: the second backs off
        spawner.procs[handle.pid].die()
        sup.tend_workers()
        sup.tend_workers()
    assert handle.state.value == "BACKOFF"
    assert sup.timers.when("workers") == handle.backoff_until
    clock.advance(handle.backoff_until - clock.now)
    sup.timers.run_due()
    # the backoff's timer is gone; what is left is the new start's wait for its first heartbeat
    assert handle.state is WState.STARTING
    assert sup.timers.when("workers") == pytest.approx(
        handle.started_at + sup.workers.policy.register_timeout + 0.01
    )


def test_status_is_one_document_of_the_parts_views(sup: Supervisor) -> None:
    """Before NVML is up, status answers: not ready, NVML down, no resources, every key present."""
    doc = sup.status()
    assert doc["ready"] is False and "NVML is not up" in str(doc["ready_detail"])
    for key in (
        "nvml",
        "workers",
        "resources",
        "conditions",
        "mps",
        "cdi",
        "control",
        "reconcile",
        "reloads",
        "rediscoveries",
    ):
        assert key in doc


def test_an_idle_loop_sleeps_ten_seconds_and_two_while_health_has_something_due(
    sup: Supervisor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no health condition held and no event line waiting, nothing polled per turn comes due
    by time, so the loop's wait is IDLE_TICK_S (10 s) unless a timer or the systemd watchdog's
    next ping is sooner; while the hub has something due it is TICK_S (2 s)."""
    timeouts: list[object] = []

    def poll(self: zmq.Poller, timeout: object = None) -> list[object]:
        timeouts.append(timeout)
        return []

    monkeypatch.setattr(zmq.Poller, "poll", poll)
    assert sup.hub.quiet()
    sup.wait()
    monkeypatch.setattr(sup.notifier, "seconds_to_ping", lambda now: 3.0)
    sup.wait()
    monkeypatch.setattr(sup.hub, "quiet", lambda: False)
    sup.wait()
    # (the poller rounds up by a millisecond, so that a timer is due when it wakes)
    assert timeouts == [int(IDLE_TICK_S * 1000) + 1, 3001, int(TICK_S * 1000) + 1]
