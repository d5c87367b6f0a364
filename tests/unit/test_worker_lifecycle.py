"""WorkerSet and WorkerHandle: the lifecycle rules, on a fake spawner and a hand-driven clock."""

from __future__ import annotations

import itertools
import logging
import signal
from dataclasses import dataclass, field

import pytest

from common.exitcodes import EXIT_CONFIG_ERROR
from supervisor.workers.lifecycle import (
    ALLOWED,
    InvalidTransition,
    Policy,
    WorkerHandle,
    WorkerSet,
    WState,
)

R = "nvidia.com/gpu"
S = WState

# The lifecycle as docs/architecture.md states it, written out independently of the module's table.
EXPECTED: set[tuple[WState, WState]] = {
    (S.STOPPED, S.STARTING),
    (S.STARTING, S.RUNNING),
    (S.STARTING, S.BACKOFF),
    (S.STARTING, S.STOPPING),
    (S.STARTING, S.FATAL),
    (S.RUNNING, S.BACKOFF),
    (S.RUNNING, S.STOPPING),
    (S.RUNNING, S.FATAL),
    (S.BACKOFF, S.STARTING),
    (S.BACKOFF, S.STOPPED),
    (S.BACKOFF, S.FATAL),
    (S.STOPPING, S.STOPPED),
    (S.FATAL, S.STARTING),
    (S.FATAL, S.STOPPED),
}


@dataclass
class FakeProc:
    pid: int
    status: int | None = None
    signals: list[int] = field(default_factory=list)
    obeys_term: bool = True
    killable: bool = True  # False: in uninterruptible sleep, SIGKILL does not end it yet

    def poll(self) -> int | None:
        return self.status

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)
        if (sig == signal.SIGKILL and self.killable) or (sig == signal.SIGTERM and self.obeys_term):
            self.status = -sig


class FakeSpawner:
    def __init__(self) -> None:
        self.procs: list[FakeProc] = []
        self._pids = itertools.count(1000)
        self.fail_next = 0

    def __call__(self, handle: WorkerHandle) -> FakeProc:
        if self.fail_next:
            self.fail_next -= 1
            raise OSError("no such file")
        proc = FakeProc(next(self._pids))
        self.procs.append(proc)
        return proc

    @property
    def last(self) -> FakeProc:
        return self.procs[-1]


def st(handle: WorkerHandle) -> WState:
    """The handle's state, read through a call so mypy does not keep an earlier narrowing."""
    return handle.state


def make(policy: Policy | None = None) -> tuple[WorkerSet, FakeSpawner, WorkerHandle]:
    spawner = FakeSpawner()
    ws = WorkerSet(
        spawner=spawner,
        policy=policy or Policy(start_seconds=10, start_retries=5, backoff_base=0.25, backoff_max=30),
    )
    handle = ws.want(R, "/plans/gpu.json")
    return ws, spawner, handle


def run_until_running(ws: WorkerSet, spawner: FakeSpawner, now: float) -> None:
    ws.tick(now)
    ws.heartbeat(R, spawner.last.pid, True, "/p/gpuvisor-gpu-1.sock", now)


@pytest.mark.parametrize(("old", "new"), list(itertools.product(WState, WState)))
def test_transition_table(old: WState, new: WState) -> None:
    """Every pair of states is allowed or refused exactly as the lifecycle says."""
    handle = WorkerHandle(R, "plan", state=old)
    if old is new:
        handle.change_state(new, "no-op")  # staying put is not a transition
        assert handle.state is old
    elif (old, new) in EXPECTED:
        handle.change_state(new, "test")
        assert handle.state is new
    else:
        with pytest.raises(InvalidTransition):
            handle.change_state(new, "test")
        assert handle.state is old


def test_module_table_matches_the_design() -> None:
    """The module's ALLOWED table holds exactly the designed transitions."""
    assert {(a, b) for a, targets in ALLOWED.items() for b in targets} == EXPECTED


def test_change_state_logs_once_and_tells_listeners_once(caplog: pytest.LogCaptureFixture) -> None:
    """One transition is one log line and one listener call; a repeat of the same state is neither."""
    seen: list[tuple[WState, WState, str]] = []
    handle = WorkerHandle(R, "plan", listeners=[lambda h, o, n, r: seen.append((o, n, r))])
    with caplog.at_level(logging.INFO, logger="gpuvisor.workers"):
        handle.change_state(S.STARTING, "spawning")
        handle.change_state(S.STARTING, "spawning")
    assert seen == [(S.STOPPED, S.STARTING, "spawning")]
    assert [r.getMessage() for r in caplog.records] == [f"worker {R}: STOPPED -> STARTING: spawning"]


def test_registration_makes_running() -> None:
    """A worker is STARTING until it reports its registration, then RUNNING."""
    ws, spawner, handle = make()
    ws.tick(0.0)
    assert st(handle) is S.STARTING and len(spawner.procs) == 1
    ws.heartbeat(R, spawner.last.pid, False, "", 0.5)
    assert st(handle) is S.STARTING
    ws.heartbeat(R, spawner.last.pid, True, "/p/gpuvisor-gpu-1.sock", 0.6)
    assert st(handle) is S.RUNNING and handle.registered


def test_heartbeat_from_a_stranger_is_ignored() -> None:
    """A heartbeat with another PID (a dead predecessor's last word) changes nothing."""
    ws, spawner, handle = make()
    ws.tick(0.0)
    assert ws.heartbeat(R, spawner.last.pid + 1, True, "x", 0.5) is None
    assert ws.heartbeat("nvidia.com/other", spawner.last.pid, True, "x", 0.5) is None
    assert st(handle) is S.STARTING and handle.last_heartbeat == 0.0


@pytest.mark.parametrize(
    ("failures", "delay"),
    [(0, 0.0), (1, 0.0), (2, 0.25), (3, 0.5), (4, 1.0), (5, 2.0), (10, 30.0), (40, 30.0)],
)
def test_backoff_grows_exponentially_and_is_capped(failures: int, delay: float) -> None:
    """The first restart is immediate, then base * 2^(n-2), capped at backoff_max."""
    assert Policy(backoff_base=0.25, backoff_max=30).backoff(failures) == delay


def backoffs(ws: WorkerSet) -> list[float]:
    """Listen for BACKOFF transitions; the list gets each one's backoff_until."""
    until: list[float] = []
    ws.listeners.append(lambda h, o, n, r: until.append(h.backoff_until) if n is S.BACKOFF else None)
    return until


def test_quick_failures_back_off_then_fatal() -> None:
    """Quick deaths in a row restart after 0, 0.25, 0.5, 1, 2 s; one more than start_retries is FATAL."""
    ws, spawner, handle = make()
    until = backoffs(ws)
    now = 0.0
    ws.tick(now)
    delays = []
    while True:
        spawner.last.status = 1
        now += 0.1
        spawns = len(spawner.procs)
        ws.tick(now)
        if st(handle) is S.FATAL:
            break
        delays.append(round(until[-1] - now, 3))
        if until[-1] > now:
            assert st(handle) is S.BACKOFF
            ws.tick(until[-1] - 0.001)
            assert len(spawner.procs) == spawns, "restarted before its backoff ran out"
            now = until[-1]
            ws.tick(now)
        assert st(handle) is S.STARTING and len(spawner.procs) == spawns + 1
    assert delays == [0.0, 0.25, 0.5, 1.0, 2.0]
    assert handle.quick_failures == 6
    assert handle.backoff_until - now == pytest.approx(4.0) and "next try in 4.0s" in handle.reason
    assert handle.restart_causes == {"exited with status 1": 6}


def test_fatal_is_retried_at_a_capped_interval_forever() -> None:
    """A FATAL worker is tried again when its backoff ends, the waits capped at backoff_max, never given up."""
    ws, spawner, handle = make()
    now = 0.0
    ws.tick(now)
    waits: list[float] = []
    for _ in range(14):
        spawner.last.status = 1
        now += 0.1
        ws.tick(now)
        if st(handle) is S.FATAL:
            waits.append(handle.backoff_until - now)
            ws.tick(handle.backoff_until - 0.001)
            assert st(handle) is S.FATAL, "tried before its wait ran out"
        now = max(now, handle.backoff_until)
        ws.tick(now)
        assert st(handle) is S.STARTING
    assert waits == pytest.approx([4.0, 8.0, 16.0, 30.0, 30.0, 30.0, 30.0, 30.0, 30.0])
    # left: only the last start's wait for its first heartbeat (the register timeout)
    assert ws.deadlines() == [pytest.approx(handle.started_at + ws.policy.register_timeout + 0.01)]
    assert len(spawner.procs) == 15


def test_first_failure_restarts_in_the_same_tick() -> None:
    """A crash of a healthy worker is replaced by the very tick that reaps it (no backoff)."""
    ws, spawner, handle = make()
    run_until_running(ws, spawner, 0.0)
    spawner.last.status = -signal.SIGKILL
    ws.tick(0.5)
    assert st(handle) is S.STARTING and len(spawner.procs) == 2 and handle.restarts == 1
    assert handle.restart_causes == {"killed by SIGKILL": 1}


def test_a_crash_right_after_registering_still_counts_as_quick() -> None:
    """Register-then-crash within registered_grace is a crash loop: it still backs off."""
    ws, spawner, handle = make()
    until = backoffs(ws)
    now = 0.0
    ws.tick(now)
    for expected in (0.0, 0.25, 0.5):
        ws.heartbeat(R, spawner.last.pid, True, "s", now)
        assert st(handle) is S.RUNNING
        spawner.last.status = -signal.SIGSEGV
        now += 0.1
        ws.tick(now)
        assert until[-1] - now == pytest.approx(expected)
        now = until[-1]
        ws.tick(now)
        assert st(handle) is S.STARTING


def test_a_kill_storm_of_a_registered_worker_restarts_at_once_every_time() -> None:
    """Killed 1 s after each registration, 50 times: every restart is immediate, never a streak, never FATAL."""
    ws, spawner, handle = make()
    now = 0.0
    ws.tick(now)
    for _ in range(50):
        ws.heartbeat(R, spawner.last.pid, True, "s", now)
        now += 1.0
        spawner.last.status = -signal.SIGKILL
        spawns = len(spawner.procs)
        ws.tick(now)
        assert st(handle) is S.STARTING and len(spawner.procs) == spawns + 1, "not restarted in the same tick"
        assert handle.quick_failures == 0
    assert handle.restart_causes == {"killed by SIGKILL": 50}


def test_a_long_life_clears_the_streak() -> None:
    """A death after start_seconds restarts at once and resets the quick-failure count."""
    ws, spawner, handle = make()
    until = backoffs(ws)
    ws.tick(0.0)
    for t in (0.5, 1.0, 1.5):
        spawner.last.status = 1
        ws.tick(t)
        ws.tick(until[-1])
    assert handle.quick_failures == 3
    run_until_running(ws, spawner, 2.0)
    spawner.last.status = -signal.SIGKILL
    ws.tick(100.0)
    assert handle.quick_failures == 0 and until[-1] == 100.0
    assert st(handle) is S.STARTING and handle.restarts == 4


@pytest.mark.parametrize("registered", [False, True])
def test_config_error_exit_is_fatal_and_retried_later(registered: bool) -> None:
    """Exit status 78 (the worker cannot use its plan) is FATAL at once, retried after fatal_min_retry."""
    ws, spawner, handle = make()
    if registered:
        run_until_running(ws, spawner, 0.0)
    else:
        ws.tick(0.0)
    spawner.last.status = EXIT_CONFIG_ERROR
    ws.tick(20.0)
    assert st(handle) is S.FATAL and handle.backoff_until == 21.0
    ws.tick(20.5)
    assert len(spawner.procs) == 1
    ws.tick(21.0)
    assert st(handle) is S.STARTING and len(spawner.procs) == 2


def test_heartbeat_timeout_kills_once_and_records_the_cause(caplog: pytest.LogCaptureFixture) -> None:
    """A silent worker gets one SIGKILL; its restart cause is the hang, not the signal."""
    ws, spawner, handle = make(Policy(heartbeat_timeout=2.0))
    run_until_running(ws, spawner, 0.0)
    hung = spawner.last
    hung.status = None
    ws.tick(1.9)
    assert hung.signals == []
    # A stopped process does not die of SIGKILL until the kernel gets to it: model one tick of that.
    hung.send_signal = lambda sig: hung.signals.append(sig)  # type: ignore[method-assign]
    with caplog.at_level(logging.ERROR, logger="gpuvisor.workers"):
        ws.tick(2.1)
        ws.tick(2.6)
    assert hung.signals == [signal.SIGKILL], "one kill per silence"
    assert sum("no heartbeat" in r.getMessage() for r in caplog.records) == 1
    hung.status = -signal.SIGKILL
    ws.tick(2.7)
    assert handle.restart_causes == {"heartbeat timeout": 1}
    assert st(handle) is S.STARTING and spawner.last is not hung


def test_a_beating_worker_is_not_killed() -> None:
    """Heartbeats within the timeout keep a worker alive indefinitely."""
    ws, spawner, handle = make(Policy(heartbeat_timeout=2.0))
    run_until_running(ws, spawner, 0.0)
    for t in range(1, 30):
        ws.heartbeat(R, spawner.last.pid, True, "s", float(t))
        ws.tick(t + 0.5)
    assert spawner.last.signals == [] and st(handle) is S.RUNNING


def test_a_silent_workers_limit_is_a_deadline_of_the_loop() -> None:
    """The moment a worker's silence passes its limit is among the deadlines, so a loop that sleeps
    long while idle (up to 10 s) still kills a hung worker at its limit: before the first heartbeat
    the register timeout from its start, then the heartbeat timeout from its last beat."""
    ws, spawner, _ = make(Policy(heartbeat_timeout=2.0, register_timeout=20.0))
    ws.tick(0.0)
    assert ws.deadlines() == [pytest.approx(20.01)]
    ws.heartbeat(R, spawner.last.pid, True, "/p/gpuvisor-gpu-1.sock", 3.0)
    assert ws.deadlines() == [pytest.approx(5.01)]
    ws.tick(5.01)
    assert spawner.last.signals == [signal.SIGKILL]
    assert ws.deadlines() == []  # the kill is under way: no heartbeat is watched until the restart


def test_first_heartbeat_gets_the_register_timeout() -> None:
    """Before its first heartbeat a worker has register_timeout (imports take a while), not heartbeat_timeout."""
    ws, spawner, _ = make(Policy(heartbeat_timeout=2.0, register_timeout=20.0))
    ws.tick(0.0)
    ws.tick(19.0)
    assert spawner.last.signals == []
    ws.tick(20.5)
    assert spawner.last.signals == [signal.SIGKILL]


def test_a_changed_plan_retries_a_fatal_worker_at_once() -> None:
    """want() with the same plan leaves a FATAL worker to its timer; a changed plan starts it now."""
    ws, spawner, handle = make()
    ws.tick(0.0)
    spawner.last.status = EXIT_CONFIG_ERROR
    ws.tick(0.1)
    assert st(handle) is S.FATAL
    ws.want(R, "/plans/gpu.json")
    ws.tick(0.2)
    assert st(handle) is S.FATAL and len(spawner.procs) == 1
    ws.want(R, "/plans/gpu.json", plan_changed=True)
    ws.tick(0.3)
    assert st(handle) is S.STARTING and len(spawner.procs) == 2 and handle.restarts == 1
    assert handle.quick_failures == 0


def test_stop_terms_then_kills_after_the_timeout() -> None:
    """unwant: SIGTERM and STOPPING; SIGKILL once stop_timeout passes; STOPPED when reaped; no restart."""
    ws, spawner, handle = make(Policy(stop_timeout=3.0))
    run_until_running(ws, spawner, 0.0)
    proc = spawner.last
    proc.obeys_term = False
    ws.unwant(R, 1.0)
    assert st(handle) is S.STOPPING and proc.signals == [signal.SIGTERM]
    ws.tick(3.9)
    assert proc.signals == [signal.SIGTERM]
    ws.tick(4.1)
    assert proc.signals == [signal.SIGTERM, signal.SIGKILL]
    ws.tick(4.2)
    assert st(handle) is S.STOPPED and ws.all_stopped()
    ws.tick(100.0)
    assert len(spawner.procs) == 1
    assert handle.restart_causes == {}, "a requested stop is not a restart cause"


def test_a_process_that_outlives_sigkill_is_killed_again_at_an_interval_not_every_turn() -> None:
    """A stopping worker stuck in uninterruptible sleep keeps its STOPPING state; SIGKILL is sent
    again at most once a second (stop_timeout, at least 1 s), not on every turn of the loop, and the
    next tick wakes at that time rather than at once."""
    ws, spawner, handle = make(Policy(stop_timeout=0.5))
    run_until_running(ws, spawner, 0.0)
    proc = spawner.last
    proc.obeys_term = False
    ws.unwant(R, 1.0)
    proc.killable = False
    for i in range(100):
        ws.tick(1.6 + i * 0.01)  # a busy loop for one second
    assert proc.signals.count(signal.SIGKILL) == 1 and st(handle) is S.STOPPING
    assert min(ws.deadlines()) >= 2.5
    ws.tick(2.7)
    assert proc.signals.count(signal.SIGKILL) == 2
    proc.status = -signal.SIGKILL
    ws.tick(2.8)
    assert st(handle) is S.STOPPED


@pytest.mark.parametrize("state", [S.BACKOFF, S.FATAL])
def test_stopping_a_worker_without_a_process_is_immediate(state: WState) -> None:
    """A BACKOFF or FATAL worker has nothing to wait for: unwant makes it STOPPED at once."""
    ws, spawner, handle = make()
    ws.tick(0.0)
    spawner.last.status = EXIT_CONFIG_ERROR if state is S.FATAL else 1
    handle.quick_failures = 1  # so a plain failure waits in BACKOFF instead of restarting at once
    ws.tick(0.1)
    assert st(handle) is state
    ws.unwant(R, 0.2)
    assert st(handle) is S.STOPPED
    ws.tick(100.0)
    assert len(spawner.procs) == 1


def test_wanted_again_while_stopping_restarts_after_exit() -> None:
    """A resource removed and added back before its worker exited gets a new worker."""
    ws, spawner, handle = make()
    run_until_running(ws, spawner, 0.0)
    spawner.last.obeys_term = False
    ws.unwant(R, 1.0)
    ws.want(R, "/plans/gpu.json", plan_changed=True)
    ws.tick(1.1)
    assert st(handle) is S.STOPPING and len(spawner.procs) == 1
    spawner.last.status = 0
    ws.tick(1.2)
    ws.tick(1.2)
    assert st(handle) is S.STARTING and len(spawner.procs) == 2


def test_spawn_failure_backs_off_and_retries() -> None:
    """An OSError from the spawner is a quick failure: BACKOFF, then another try."""
    ws, spawner, handle = make()
    spawner.fail_next = 1
    ws.tick(0.0)
    assert st(handle) is S.BACKOFF and handle.proc is None
    assert handle.restart_causes == {"spawn failed": 1}
    ws.tick(handle.backoff_until)
    assert st(handle) is S.STARTING and len(spawner.procs) == 1


def test_stop_all_and_kill_all() -> None:
    """stop_all stops every worker; kill_all SIGKILLs what ignored SIGTERM."""
    ws, spawner, _ = make()
    ws.want("nvidia.com/mig-1g.10gb", "/plans/mig.json")
    ws.tick(0.0)
    for proc in spawner.procs:
        proc.obeys_term = False
    ws.stop_all(1.0, "supervisor stopping")
    assert all(st(h) is S.STOPPING for h in ws.workers.values())
    ws.kill_all()
    ws.tick(1.1)
    assert ws.all_stopped() and all(st(h) is S.STOPPED for h in ws.workers.values())


def test_the_set_answers_which_workers_run_and_whether_one_registered() -> None:
    """`running` gives a resource's handle only while its process runs, `live` the handles with
    a process, `any_registered` whether one is registered now; `by_resource` reads every handle
    and cannot change the set."""
    ws, _spawner, handle = make()
    other = "nvidia.com/mig-1g.10gb"
    ws.want(other, "/plans/mig.json")
    assert ws.running(R) is None and ws.live() == [] and not ws.any_registered()
    ws.tick(0.0)
    assert ws.running(R) is handle and [h.resource for h in ws.live()] == [R, other]
    ws.heartbeat(R, handle.pid, True, "/p/gpuvisor-gpu-1.sock", 0.1)
    assert ws.any_registered()
    ws.unwant(other, 0.2)  # the other one is stopped (the fake obeys SIGTERM at once)
    ws.tick(0.2)
    assert ws.running(other) is None and ws.live() == [handle] and ws.running("nvidia.com/none") is None
    view = ws.by_resource()
    assert set(view) == {R, other} and view[R] is handle
    with pytest.raises(TypeError):
        view["x"] = handle  # type: ignore[index]


def test_lowered_heartbeat_timeout_spares_a_worker_beating_at_its_start_interval() -> None:
    """A reload that lowers the heartbeat timeout does not kill a worker still beating at the (slower) interval it was started with."""
    ws, spawner, handle = make(Policy(heartbeat_timeout=10.0))
    run_until_running(ws, spawner, 0.0)
    assert handle.beat_interval == 2.5
    ws.policy.heartbeat_timeout = 2.0  # the reload
    ws.tick(4.0)  # 4 s of silence: over the new timeout, under two of the worker's own beats
    assert st(handle) is WState.RUNNING and signal.SIGKILL not in spawner.last.signals
    ws.tick(6.0)  # 6 s of silence: more than two of its beats missed
    assert signal.SIGKILL in spawner.procs[0].signals


def test_a_worker_that_served_is_restarted_at_once_even_killed_right_away() -> None:
    """Killed milliseconds after its stream opened, over and over: served means proved, never a streak."""
    ws, spawner, handle = make()
    now = 0.0
    ws.tick(now)
    for _ in range(20):
        ws.heartbeat(R, spawner.last.pid, True, "s", now)
        ws.served(R, spawner.last.pid)
        now += 0.01
        spawner.last.status = -signal.SIGKILL
        ws.tick(now)
        assert st(handle) is S.STARTING and handle.quick_failures == 0


def test_served_is_only_taken_from_the_current_registered_process() -> None:
    """A stale pid, or a process not registered yet, cannot mark the worker as having served."""
    ws, spawner, handle = make()
    ws.tick(0.0)
    ws.served(R, spawner.last.pid)  # not registered yet
    ws.heartbeat(R, spawner.last.pid, True, "s", 0.0)
    ws.served(R, spawner.last.pid + 1)
    assert not handle.served
    spawner.last.status = -signal.SIGKILL
    ws.tick(0.1)
    assert handle.quick_failures == 1


def test_workers_view_shows_state_reason_and_next_retry() -> None:
    """A worker backing off shows its state, why, and when it is tried again."""
    h = WorkerHandle(R, "/p.json")
    h.state, h.reason, h.backoff_until = WState.BACKOFF, "killed by SIGKILL; restart in 2.00s", 12.0
    view = h.view(now=10.0)
    assert isinstance(view, dict)
    assert view["state"] == "BACKOFF" and view["next_retry_in"] == 2.0 and "SIGKILL" in str(view["reason"])
