"""Worker lifecycle: one OS process per resource, watched and restarted by the supervisor.

States (docs/architecture.md, "Worker lifecycle"): STARTING -> RUNNING (the worker reported its registration) -> BACKOFF ->
STARTING ..., STOPPING -> STOPPED, and FATAL after too many quick failures in a row or the
agreed config-error exit code. Every transition goes through `WorkerHandle.change_state()`,
which checks it against `ALLOWED`, logs it once and tells the listeners (metrics, status).

`WorkerSet.tick(now)` is the reconcile step: it reaps what died, starts what should run,
restarts what died once its backoff ran out, and kills a worker whose heartbeat went silent (a
hang: SIGSTOP in the tests). The clock is a parameter, so tests drive it by hand. How a
process is made is the `Spawner`'s business.

Restart rules with memory (supervisord's startsecs/startretries, the kubelet's CrashLoopBackOff):
- a worker that served the kubelet (its ListAndWatch stream opened: `WorkerSet.served`) or
  stayed registered for `registered_grace` proved itself: however it dies (an OOM kill, a chaos
  tool, a kill storm right after each recovery), it is restarted at once and its failure streak
  is cleared;
- a death before registration within `start_seconds` of the start, or after registering but
  before serving and within `registered_grace` (a crash loop that gets as far as Register),
  is a *quick* failure; quick
  failures in a row grow the delay (0 for the first, then base, doubling, capped at
  `backoff_max`: `common.backoff.Backoff` of the streak's length); a death before registration
  after a longer life restarts at once;
- more than `start_retries` quick failures in a row, or exit status 78 (the worker could not
  use its plan), make the worker FATAL. FATAL is never final for a wanted resource: it is tried
  again when its backoff runs out (capped, never sooner than `fatal_min_retry`), each try logged
  once and shown in status with its next retry, and at once when a reload changes its plan.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Protocol

from common.backoff import Backoff
from common.exitcodes import EXIT_CONFIG_ERROR
from common.messages import DraBeat, Json
from common.socketnames import new_tag

log = logging.getLogger("gpuvisor.workers")


class WState(Enum):
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    BACKOFF = "BACKOFF"
    STOPPING = "STOPPING"
    STOPPED = "STOPPED"
    FATAL = "FATAL"


ALLOWED: dict[WState, frozenset[WState]] = {
    WState.STOPPED: frozenset({WState.STARTING}),
    WState.STARTING: frozenset({WState.RUNNING, WState.BACKOFF, WState.STOPPING, WState.FATAL}),
    WState.RUNNING: frozenset({WState.BACKOFF, WState.STOPPING, WState.FATAL}),
    WState.BACKOFF: frozenset({WState.STARTING, WState.STOPPED, WState.FATAL}),
    WState.STOPPING: frozenset({WState.STOPPED}),
    WState.FATAL: frozenset({WState.STARTING, WState.STOPPED}),
}

StateListener = Callable[["WorkerHandle", WState, WState, str], None]


class InvalidTransition(RuntimeError):
    """A state change the lifecycle does not allow: a bug in the supervisor, never user input."""


class Proc(Protocol):
    """What the supervisor needs of a worker process (subprocess.Popen has it)."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def send_signal(self, sig: int) -> None: ...


class Spawner(Protocol):
    def __call__(self, handle: WorkerHandle) -> Proc: ...


@dataclass
class Policy:
    start_seconds: float = 10.0  # a worker that dies sooner than this after its start failed quickly
    start_retries: int = 5  # quick failures in a row tolerated; one more is FATAL
    backoff_base: float = 0.25
    backoff_max: float = 30.0
    heartbeat_timeout: float = 5.0
    registered_grace: float = 0.5  # registered this long and then died: proved itself, no failure
    fatal_min_retry: float = 1.0  # a FATAL worker waits at least this long before its next try

    register_timeout: float = 60.0  # STARTING this long without a first heartbeat: a hang
    stop_timeout: float = 3.0  # SIGTERM, then SIGKILL after this long

    def beat_interval(self) -> float:
        """How often a worker started now beats: 4 beats per timeout, at most every 2.5 s."""
        return max(0.05, min(2.5, self.heartbeat_timeout / 4))

    def backoff(self, quick_failures: int) -> float:
        """The delay before restart number `quick_failures` of a quick-failure streak: the first is
        free, then base doubling to the cap (common.backoff, the project's one backoff)."""
        return Backoff(self.backoff_base, self.backoff_max, free=1).step(quick_failures)


@dataclass
class WorkerHandle:
    resource: str
    plan_path: str
    state: WState = WState.STOPPED
    reason: str = ""  # why it is in its state (the text of the last transition)
    proc: Proc | None = None
    pid: int = 0
    started_at: float = 0.0
    last_heartbeat: float = 0.0
    heartbeats: int = 0  # since this process started
    registered: bool = False
    registered_since: float = 0.0  # wall clock, for status
    registered_at: float | None = None  # the WorkerSet clock when this process first registered
    served: bool = False  # this process's stream to the kubelet opened: it did its job
    socket_path: str = ""
    registration: str = ""  # the worker's last registration report: "<state> (<why>)"
    secret: str = ""  # this spawn's proof of identity on the control socket (see spawner.py)
    socket_tag: str = ""  # 6 hex digits in this spawn's socket names (supervisor/host/rundir.py)
    restarts: int = 0
    restart_causes: dict[str, int] = field(default_factory=dict)
    quick_failures: int = 0  # the streak: its length alone sets the next delay (Policy.backoff)
    backoff_until: float = 0.0  # when a BACKOFF or FATAL worker is tried again
    stop_deadline: float = 0.0
    kill_cause: str = ""  # set when the supervisor killed it (a hang): the cause, not "SIGKILL"
    last_exit: str = ""
    wanted: bool = True
    retry_fatal: bool = False
    stats: dict[str, float] = field(default_factory=dict)  # the worker's figures, from heartbeats
    dra: DraBeat | None = None  # the DRA worker's drain and claims, from its last heartbeat
    beat_interval: float = 0.0  # the heartbeat interval this worker process was started with
    listeners: list[StateListener] = field(default_factory=list)

    def change_state(self, new: WState, reason: str) -> None:
        """Check and make one transition, log it once and tell the listeners."""
        old = self.state
        if new is old:
            return
        if new not in ALLOWED[old]:
            raise InvalidTransition(f"{self.resource}: {old.value} -> {new.value} ({reason})")
        self.state = new
        self.reason = reason
        # The level follows the cause: a death is a warning, giving up is an error.
        level = logging.INFO
        if new is WState.BACKOFF:
            level = logging.WARNING
        elif new is WState.FATAL:
            level = logging.ERROR
        log.log(
            level,
            "worker %s: %s -> %s: %s",
            self.resource,
            old.value,
            new.value,
            reason,
            extra={"resource": self.resource, "worker": self.pid or None, "state": new.value},
        )
        for listener in self.listeners:
            listener(self, old, new, reason)

    def view(self, now: float) -> dict[str, Json]:
        """This worker as `gpuvisor status` shows it (`now` on the WorkerSet clock)."""
        return {
            "resource": self.resource,
            "state": self.state.value,
            "pid": self.pid if self.proc is not None else None,
            "restarts": self.restarts,
            "restart_causes": dict(self.restart_causes),
            "last_exit": self.last_exit,
            "socket": self.socket_path,
            "registered": self.registered,
            "registered_since": self.registered_since or None,
            "streams": int(self.stats.get("gauge:streams", 0)),
            "registration": self.registration,
            "no_stream_reregistrations": int(self.stats.get("count:no_stream_reregistrations", 0)),
            "reason": self.reason,
            "next_retry_in": round(max(0.0, self.backoff_until - now), 2)
            if self.backoff_until > now
            else None,
        }


def describe_exit(status: int) -> str:
    if status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"killed by signal {-status}"
    return f"exited with status {status}"


class WorkerSet:
    """All workers of the node, reconciled against the wanted set on every tick.

    Call it from one thread only (the supervisor's main loop). The spawner must run on that
    same thread for the whole life of the process: Linux sends a child's parent-death signal
    when the *thread* that forked it exits, not only the process.
    """

    def __init__(
        self, *, spawner: Spawner, policy: Policy | None = None, listeners: tuple[StateListener, ...] = ()
    ) -> None:
        self.spawner = spawner
        self.policy = policy or Policy()
        self.workers: dict[str, WorkerHandle] = {}
        self.listeners: list[StateListener] = list(listeners)

    def set_policy(self, policy: Policy) -> None:
        """New restart rules (a reload): they apply from the next decision on."""
        self.policy = policy

    def view(self, now: float) -> list[Json]:
        """Every worker as `gpuvisor status` shows it, by resource name."""
        return [handle.view(now) for _resource, handle in sorted(self.workers.items())]

    # ------------------------------------------------------------------ what the loop asks
    def by_resource(self) -> Mapping[str, WorkerHandle]:
        """Every handle by its resource, read-only (readiness reads the planned ones)."""
        return MappingProxyType(self.workers)

    def running(self, resource: str) -> WorkerHandle | None:
        """The resource's handle while a process of it runs; None when none does."""
        handle = self.workers.get(resource)
        return handle if handle is not None and handle.proc is not None else None

    def live(self) -> list[WorkerHandle]:
        """The handles whose process runs (STARTING, RUNNING, STOPPING), by resource name."""
        return [h for _resource, h in sorted(self.workers.items()) if h.proc is not None]

    def any_registered(self) -> bool:
        """A worker's process is registered with the kubelet now (the kubelet path is up)."""
        return any(h.registered for h in self.workers.values())

    # ------------------------------------------------------------------ desired state
    def want(self, resource: str, plan_path: str, *, plan_changed: bool = False) -> WorkerHandle:
        """This resource should have a running worker (started at the next tick).

        `plan_changed` says its plan differs from the one the current or last process got:
        only that brings a FATAL worker back (see the module docstring).
        """
        handle = self.workers.get(resource)
        if handle is None:
            handle = WorkerHandle(resource, plan_path)
            handle.listeners = self.listeners
            self.workers[resource] = handle
        handle.plan_path = plan_path
        if handle.state is WState.FATAL and plan_changed:
            handle.retry_fatal = True
            self._clear_streak(handle)
        handle.wanted = True
        return handle

    def unwant(self, resource: str, now: float, reason: str = "resource removed") -> None:
        handle = self.workers.get(resource)
        if handle is not None:
            handle.wanted = False
            self._stop(handle, now, reason)

    def stop_all(self, now: float, reason: str) -> None:
        for handle in self.workers.values():
            handle.wanted = False
            self._stop(handle, now, reason)

    def stop_and_wait(self, reason: str, grace: float, kill_grace: float = 0.5) -> None:
        """At exit: SIGTERM every worker, reap them for up to `grace` seconds, then SIGKILL the rest."""
        now = time.monotonic()
        self.stop_all(now, reason)
        for limit, kill in ((now + grace, False), (now + grace + kill_grace, True)):
            if kill and not self.all_stopped():
                self.kill_all()
            while not self.all_stopped() and time.monotonic() < limit:
                self.tick(time.monotonic())
                time.sleep(0.01)

    def all_stopped(self) -> bool:
        return all(h.proc is None for h in self.workers.values())

    def kill_all(self) -> None:
        """Last resort at exit: SIGKILL whatever still runs."""
        for handle in self.workers.values():
            if handle.proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    handle.proc.send_signal(signal.SIGKILL)

    # ------------------------------------------------------------------ events from workers
    def heartbeat(
        self, resource: str, pid: int, registered: bool, socket_path: str, now: float
    ) -> WorkerHandle | None:
        """Record a worker's heartbeat; returns its handle, or None for a stranger or a dead one."""
        handle = self.workers.get(resource)
        if handle is None or handle.proc is None or handle.pid != pid:
            return None  # a stranger, or a dying predecessor's last word
        handle.last_heartbeat = now
        handle.heartbeats += 1
        handle.socket_path = socket_path
        if registered and not handle.registered:
            handle.registered_since = time.time()
            if handle.registered_at is None:
                handle.registered_at = now
        handle.registered = registered
        if registered and handle.state is WState.STARTING:
            handle.change_state(WState.RUNNING, "registered with the kubelet")
        return handle

    def deadlines(self) -> list[float]:
        """When a tick has something to do without any event: a backoff ends, a worker is killed."""
        out = [
            h.backoff_until
            for h in self.workers.values()
            if h.state in (WState.BACKOFF, WState.FATAL) and h.wanted
        ]
        out += [
            h.stop_deadline
            for h in self.workers.values()
            if h.state is WState.STOPPING and h.proc is not None
        ]
        # A worker that goes silent must be found at its limit even on a loop that sleeps long.
        out += [
            self._heard(h) + self._silence_limit(h) + 0.01 for h in self.workers.values() if self._watched(h)
        ]
        return out

    @staticmethod
    def _watched(handle: WorkerHandle) -> bool:
        """Is this worker's heartbeat watched now (a live process, no kill under way)?"""
        return (
            handle.wanted
            and handle.state in (WState.STARTING, WState.RUNNING)
            and handle.proc is not None
            and not handle.kill_cause
        )

    @staticmethod
    def _heard(handle: WorkerHandle) -> float:
        """When the worker was last heard from: its last heartbeat, or its start."""
        return handle.last_heartbeat if handle.heartbeats else handle.started_at

    def _silence_limit(self, handle: WorkerHandle) -> float:
        """How long the worker may stay silent. It beats at the interval it was started with: a
        timeout lowered by a reload must not declare an older worker hung for beating as told."""
        limit = max(self.policy.heartbeat_timeout, 2.0 * handle.beat_interval)
        if not handle.heartbeats:
            limit = max(limit, self.policy.register_timeout)  # imports and first connect take a while
        return limit

    # ------------------------------------------------------------------ reconcile
    def tick(self, now: float) -> None:
        for handle in list(self.workers.values()):
            self._reap(handle, now)
            self._reconcile(handle, now)

    def _reap(self, handle: WorkerHandle, now: float) -> None:
        proc = handle.proc
        if proc is None:
            return
        status = proc.poll()
        if status is None:
            return
        handle.proc = None
        handle.registered = False
        handle.last_exit = describe_exit(status)
        cause = handle.kill_cause or handle.last_exit
        handle.kill_cause = ""
        if handle.state is WState.STOPPING:
            handle.change_state(WState.STOPPED, handle.last_exit)
            return
        self._count(handle, cause)
        if status == EXIT_CONFIG_ERROR:
            self._fail(handle, now, f"{cause}: it could not use its plan (config error)", fatal=True)
        elif self._proved(handle, now):
            self._clear_streak(handle)  # it served: this death starts no streak
            handle.backoff_until = now
            handle.change_state(WState.BACKOFF, f"{cause}; it had registered and served: restarting at once")
        elif now - handle.started_at >= self.policy.start_seconds and handle.registered_at is None:
            self._clear_streak(handle)  # a long life before registering: no crash loop
            handle.backoff_until = now
            handle.change_state(WState.BACKOFF, f"{cause}; restarting at once")
        else:
            self._fail(handle, now, cause)

    def _proved(self, handle: WorkerHandle, now: float) -> bool:
        """Served the kubelet, or registered for a moment: a death now is no failure of its own."""
        if handle.served:
            return True
        return handle.registered_at is not None and now - handle.registered_at >= self.policy.registered_grace

    def served(self, resource: str, pid: int) -> None:
        """The kubelet's ListAndWatch stream opened on this worker process: it proved itself."""
        handle = self.workers.get(resource)
        if handle is not None and handle.proc is not None and handle.pid == pid and handle.registered:
            handle.served = True

    def _fail(
        self, handle: WorkerHandle, now: float, cause: str, fatal: bool = False, floor: float = 0.0
    ) -> None:
        """A quick failure: back off, or FATAL past start_retries (retried when the backoff ends)."""
        handle.quick_failures += 1
        delay = max(self.policy.backoff(handle.quick_failures), floor)
        if fatal or handle.quick_failures > self.policy.start_retries:
            delay = max(delay, self.policy.fatal_min_retry)
            handle.backoff_until = now + delay
            streak = f"{handle.quick_failures} quick failure(s) in a row"
            handle.change_state(
                WState.FATAL, f"{cause}; {streak}; next try in {delay:.1f}s (retried until it serves)"
            )
            return
        handle.backoff_until = now + delay
        handle.change_state(WState.BACKOFF, f"{cause}; restart in {delay:.2f}s")

    @staticmethod
    def _clear_streak(handle: WorkerHandle) -> None:
        handle.quick_failures = 0

    @staticmethod
    def _count(handle: WorkerHandle, cause: str) -> None:
        handle.restart_causes[cause] = handle.restart_causes.get(cause, 0) + 1

    def _reconcile(self, handle: WorkerHandle, now: float) -> None:
        state = handle.state
        if state is WState.STOPPING:
            if handle.proc is not None and now >= handle.stop_deadline:
                with contextlib.suppress(ProcessLookupError):
                    handle.proc.send_signal(signal.SIGKILL)
                # Not again on every turn: a process in uninterruptible sleep outlives SIGKILL.
                handle.stop_deadline = now + max(1.0, self.policy.stop_timeout)
            return
        if not handle.wanted:
            return
        if (
            state is WState.STOPPED
            or (state is WState.BACKOFF and now >= handle.backoff_until)
            or (state is WState.FATAL and (handle.retry_fatal or now >= handle.backoff_until))
        ):
            self._spawn(handle, now)
        elif self._watched(handle):
            self._check_heartbeat(handle, now)

    def _check_heartbeat(self, handle: WorkerHandle, now: float) -> None:
        assert handle.proc is not None
        silent = now - self._heard(handle)
        limit = self._silence_limit(handle)
        if silent <= limit:
            return
        # One kill per silence (kill_cause is set until the reaper sees the death); the reaper
        # records the hang, not the SIGKILL, as the cause of the restart.
        handle.kill_cause = "heartbeat timeout"
        log.error(
            "worker %s (pid %d): no heartbeat for %.1fs, killing it",
            handle.resource,
            handle.pid,
            silent,
            extra={"resource": handle.resource, "worker": handle.pid},
        )
        with contextlib.suppress(ProcessLookupError):
            handle.proc.send_signal(signal.SIGKILL)

    def _spawn(self, handle: WorkerHandle, now: float) -> None:
        was = handle.state
        reason = {WState.STOPPED: "spawning", WState.BACKOFF: "restarting"}.get(was, "")
        if was is WState.FATAL:
            why = "plan changed" if handle.retry_fatal else f"after {handle.quick_failures} quick failure(s)"
            reason = f"trying again ({why})"
        handle.retry_fatal = False
        handle.started_at = now
        handle.last_heartbeat = 0.0
        handle.heartbeats = 0
        handle.registered = False
        handle.registered_at = None
        handle.served = False
        handle.stats = {}  # the figures of the previous process are not this one's
        handle.dra = None
        handle.beat_interval = self.policy.beat_interval()
        handle.socket_path = ""
        handle.registration = ""
        handle.kill_cause = ""
        # What secrets.token_hex(16) is, without the OpenSSL that importing secrets loads.
        handle.secret = os.urandom(16).hex()
        handle.socket_tag = new_tag()
        try:
            proc = self.spawner(handle)
        except OSError as exc:
            handle.pid = 0
            handle.change_state(WState.STARTING, reason)
            self._count(handle, "spawn failed")
            # Not even at once: a spawn that failed (no memory, no pids) needs a moment.
            self._fail(handle, now, f"spawn failed: {exc}", floor=self.policy.backoff_base)
            return
        if was is not WState.STOPPED:
            handle.restarts += 1
        handle.proc = proc
        handle.pid = proc.pid
        # Logged once the process exists, so the line carries its pid.
        handle.change_state(WState.STARTING, f"{reason} (pid {proc.pid})")

    def _stop(self, handle: WorkerHandle, now: float, reason: str) -> None:
        if handle.state in (WState.STOPPING, WState.STOPPED):
            return
        if handle.proc is None:  # BACKOFF or FATAL: nothing runs, nothing to wait for
            handle.retry_fatal = False
            handle.change_state(WState.STOPPED, reason)
            return
        handle.change_state(WState.STOPPING, reason)
        handle.stop_deadline = now + self.policy.stop_timeout
        with contextlib.suppress(ProcessLookupError):
            handle.proc.send_signal(signal.SIGTERM)
