"""Worker lifecycle: one OS process per resource, watched and restarted by the supervisor.

States (DESIGN.md): STARTING -> RUNNING (the worker reported its registration) -> BACKOFF ->
STARTING ..., STOPPING -> STOPPED, and FATAL after too many quick failures in a row or the
agreed config-error exit code. Every transition goes through `WorkerHandle.change_state()`,
which checks it against the table, logs it once and tells the listeners (metrics, status).

`WorkerSet.tick(now)` is the reconcile step: it starts what should run, restarts what died once
its backoff ran out, and kills a worker whose heartbeat went silent (a hang: SIGSTOP in the
tests). The clock is a parameter, so tests can drive it by hand. How a process is made is the
`Spawner`'s business (a plain exec of `python -m worker`, or a pre-imported zygote).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

log = logging.getLogger("gpuvisor.workers")

EXIT_CONFIG_ERROR = 78


class WState(Enum):
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    BACKOFF = "BACKOFF"
    STOPPING = "STOPPING"
    STOPPED = "STOPPED"
    FATAL = "FATAL"


_ALLOWED: dict[WState, frozenset[WState]] = {
    WState.STOPPED: frozenset({WState.STARTING}),
    WState.STARTING: frozenset({WState.RUNNING, WState.BACKOFF, WState.STOPPING, WState.FATAL}),
    WState.RUNNING: frozenset({WState.BACKOFF, WState.STOPPING, WState.STARTING}),
    WState.BACKOFF: frozenset({WState.STARTING, WState.STOPPING, WState.FATAL, WState.STOPPED}),
    WState.STOPPING: frozenset({WState.STOPPED}),
    WState.FATAL: frozenset({WState.STARTING, WState.STOPPED}),
}


class InvalidTransition(RuntimeError):
    pass


class Proc(Protocol):
    """What the supervisor needs of a worker process."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def send_signal(self, sig: int) -> None: ...


class Spawner(Protocol):
    def __call__(self, handle: WorkerHandle) -> Proc: ...


@dataclass
class Policy:
    start_seconds: float = 10.0  # a worker that dies sooner than this after start failed quickly
    start_retries: int = 5  # quick failures in a row before FATAL
    backoff_base: float = 0.25
    backoff_max: float = 30.0
    heartbeat_timeout: float = 5.0
    register_timeout: float = 60.0  # STARTING longer than this without a heartbeat: a hang
    stop_timeout: float = 3.0  # SIGTERM, then SIGKILL after this long


@dataclass
class WorkerHandle:
    resource: str
    plan_path: str
    state: WState = WState.STOPPED
    proc: Proc | None = None
    pid: int = 0
    started_at: float = 0.0
    last_heartbeat: float = 0.0
    registered: bool = False
    registered_since: float = 0.0
    socket_path: str = ""
    restarts: int = 0
    restart_causes: dict[str, int] = field(default_factory=dict)
    quick_failures: int = 0
    backoff_until: float = 0.0
    stop_deadline: float = 0.0
    last_exit: str = ""
    wanted: bool = True
    stats: dict[str, float] = field(default_factory=dict)  # the worker's figures, from heartbeats
    listeners: list[Callable[[WorkerHandle, WState, WState, str], None]] = field(default_factory=list)

    def change_state(self, new: WState, reason: str) -> None:
        """Check and make one transition, log it once and tell the listeners."""
        old = self.state
        if new is old:
            return
        if new not in _ALLOWED[old]:
            raise InvalidTransition(f"{self.resource}: {old.value} -> {new.value} ({reason})")
        self.state = new
        level = logging.WARNING if new in (WState.BACKOFF, WState.FATAL) else logging.INFO
        if new is WState.FATAL:
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


def describe_exit(status: int) -> str:
    if status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"killed by signal {-status}"
    return f"exited with status {status}"


class WorkerSet:
    """All workers of the node, reconciled against the wanted set on every tick."""

    def __init__(self, spawner: Spawner, policy: Policy | None = None) -> None:
        self.spawner = spawner
        self.policy = policy or Policy()
        self.workers: dict[str, WorkerHandle] = {}
        self.listeners: list[Callable[[WorkerHandle, WState, WState, str], None]] = []

    # ------------------------------------------------------------------ desired state
    def want(self, resource: str, plan_path: str) -> WorkerHandle:
        handle = self.workers.get(resource)
        if handle is None:
            handle = WorkerHandle(resource, plan_path)
            handle.listeners = self.listeners
            self.workers[resource] = handle
        handle.plan_path = plan_path
        handle.wanted = True
        return handle

    def unwant(self, resource: str, now: float) -> None:
        handle = self.workers.get(resource)
        if handle is not None:
            handle.wanted = False
            self._stop(handle, now, "resource removed")

    def stop_all(self, now: float, reason: str) -> None:
        for handle in self.workers.values():
            handle.wanted = False
            self._stop(handle, now, reason)

    def all_stopped(self) -> bool:
        return all(h.state in (WState.STOPPED, WState.FATAL) and h.proc is None for h in self.workers.values())

    # ------------------------------------------------------------------ events from workers
    def heartbeat(self, resource: str, pid: int, registered: bool, socket_path: str, now: float) -> None:
        handle = self.workers.get(resource)
        if handle is None or handle.pid != pid:
            return  # a stranger, or a dying predecessor's last word
        handle.last_heartbeat = now
        handle.socket_path = socket_path
        if registered and not handle.registered:
            handle.registered_since = time.time()
        handle.registered = registered
        if registered and handle.state is WState.STARTING:
            handle.quick_failures = 0
            handle.change_state(WState.RUNNING, "registered with the kubelet")

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
        if handle.state is WState.STOPPING:
            handle.change_state(WState.STOPPED, handle.last_exit)
            return
        if status == EXIT_CONFIG_ERROR:
            handle.change_state(WState.FATAL, f"{handle.last_exit}: configuration error, not retried")
            return
        quick = handle.state is WState.STARTING or now - handle.started_at < self.policy.start_seconds
        self._count(handle, handle.last_exit)
        if quick:
            handle.quick_failures += 1
        if handle.quick_failures > self.policy.start_retries:
            handle.change_state(
                WState.FATAL, f"{handle.last_exit}; {handle.quick_failures} quick failures in a row"
            )
            return
        # The first failure restarts at once (a crash should cost a resource well under a
        # second); quick failures in a row back off exponentially.
        delay = 0.0
        if handle.quick_failures > 1:
            delay = min(self.policy.backoff_base * 2 ** (handle.quick_failures - 2), self.policy.backoff_max)
        handle.backoff_until = now + delay
        handle.change_state(WState.BACKOFF, f"{handle.last_exit}; restart in {delay:.2f}s")

    @staticmethod
    def _count(handle: WorkerHandle, cause: str) -> None:
        key = cause.split(";")[0]
        handle.restart_causes[key] = handle.restart_causes.get(key, 0) + 1

    def _reconcile(self, handle: WorkerHandle, now: float) -> None:
        state = handle.state
        if not handle.wanted:
            if state is WState.STOPPING and handle.proc is not None and now >= handle.stop_deadline:
                handle.proc.send_signal(signal.SIGKILL)
            return
        if state is WState.STOPPED or (state is WState.BACKOFF and now >= handle.backoff_until):
            self._spawn(handle, now)
        elif state in (WState.STARTING, WState.RUNNING) and handle.proc is not None:
            silent = now - max(handle.last_heartbeat, handle.started_at)
            limit = self.policy.heartbeat_timeout
            if state is WState.STARTING and handle.last_heartbeat == 0.0:
                limit = max(limit, self.policy.register_timeout)
            if silent > limit:
                log.error(
                    "worker %s (pid %d): no heartbeat for %.1fs, killing it",
                    handle.resource,
                    handle.pid,
                    silent,
                    extra={"resource": handle.resource, "worker": handle.pid},
                )
                self._count(handle, "heartbeat timeout")
                handle.proc.send_signal(signal.SIGKILL)
                handle.last_heartbeat = now  # one kill per silence; the reaper takes it from here
                handle.started_at = now

    def _spawn(self, handle: WorkerHandle, now: float) -> None:
        was = handle.state
        handle.change_state(WState.STARTING, "spawning" if was is WState.STOPPED else "restarting")
        try:
            proc = self.spawner(handle)
        except OSError as exc:
            handle.quick_failures += 1
            handle.backoff_until = now + self.policy.backoff_base * 2 ** handle.quick_failures
            handle.change_state(WState.BACKOFF, f"spawn failed: {exc}")
            return
        if was is not WState.STOPPED:
            handle.restarts += 1
        handle.proc = proc
        handle.pid = proc.pid
        handle.started_at = now
        handle.last_heartbeat = 0.0
        handle.registered = False

    def _stop(self, handle: WorkerHandle, now: float, reason: str) -> None:
        if handle.state in (WState.STOPPING, WState.STOPPED):
            return
        if handle.proc is None:  # BACKOFF or FATAL: nothing runs, nothing to wait for
            handle.change_state(WState.STOPPED, reason)
            return
        handle.change_state(WState.STOPPING, reason)
        handle.stop_deadline = now + self.policy.stop_timeout
        with contextlib.suppress(ProcessLookupError):
            handle.proc.send_signal(signal.SIGTERM)

