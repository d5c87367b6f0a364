"""The registrar: the thread that keeps a worker registered with the kubelet, for either kind.

The mechanism is one: a lifecycle enum (`RegState`) whose every change is logged once and told
to the worker (`on_state`), one backoff for retries, triggers that make the thread look now (they
coalesce), waits that a stop or a trigger cut short, and a stop that ends the thread before the
sockets go. Both kinds serve first and register after: `serve()` starts the thread, which may
bring its server up at once; registering waits for `start()` (the worker has its health by then).

What registering means is a `Registration`, one per kind: a device plugin calls Register on
kubelet.sock and watches for the kubelet's ListAndWatch stream (worker.registration); a DRA plugin
serves its registration socket and hears the plugin watcher's NotifyRegistrationStatus
(worker.dra.sockets, which reports it through `notified`). The registration runs on the
registrar's thread and waits only through the registrar, so a stop reaches it wherever it is.
"""

from __future__ import annotations

import logging
import math
import os
import random
import threading
import time
from collections.abc import Callable
from enum import Enum
from typing import Protocol

from common.backoff import Backoff

log = logging.getLogger("gpuvisor.worker")

BACKOFF_START_S = 0.05
BACKOFF_MAX_S = 5.0
JOIN_S = 10.0  # how long a stop waits for the thread

FileId = tuple[int, int, int]


class RegState(Enum):
    STARTING = "starting"
    WAITING = "waiting"  # a device plugin's: for kubelet.sock (or the plugin dir) to exist
    REGISTERING = "registering"  # asked (or about to be), no answer yet
    REGISTERED = "registered"
    REFUSED = "refused"  # a DRA plugin's: the kubelet said why, and will try again itself
    RETRYING = "retrying"  # cannot serve or register: backing off
    STOPPED = "stopped"


def registration_backoff(rng: random.Random | None = None) -> Backoff:
    """The registrar's retry delays: doubling from 50 ms to 5 s, each 50-100% of its step."""
    return Backoff(BACKOFF_START_S, BACKOFF_MAX_S, jitter=0.5, rng=rng)


def kubelet_identity(path: str) -> FileId | None:
    """Which file `path` is right now (device, inode, ctime), or None when it does not exist:
    kubelet.sock re-created, or a socket of ours replaced, is another file even on the same inode."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns)


class Registration(Protocol):
    """What registering means for one kind of worker; a `Registrar` runs it."""

    what: str  # how the log names the plugin
    thread_name: str

    @property
    def endpoint(self) -> str:
        """What the kubelet is told to dial."""
        ...

    def run(self, registrar: Registrar) -> None:
        """The thread: serve, then (once `registrar.wait_allowed()`) register and keep the
        registration until the registrar stops; every wait is the registrar's."""
        ...

    def interrupt(self, registrar: Registrar) -> None:
        """A stop is under way (`registrar.stopping`): cut short a call in flight. Any thread."""
        ...

    def close(self) -> None:
        """The thread is over: stop serving and remove our sockets."""
        ...


class Registrar:
    """Keeps a worker registered with the kubelet for as long as it lives."""

    def __init__(
        self, registration: Registration, on_state: Callable[[RegState, str], None] | None = None
    ) -> None:
        self.registration = registration
        self.state = RegState.STARTING
        self.failed: BaseException | None = None  # the thread died of a bug: the worker exits
        self.backoff = registration_backoff()
        # Every wait of the thread is on this condition, so a stop or a trigger cuts each short.
        self.cond = threading.Condition()
        self._on_state = on_state or (lambda state, detail: None)
        self._stop = False
        self._allowed = False  # start() was called: register (serve() alone only serves)
        self._hint: str | None = None  # why a trigger asked to look now; None: none pending
        self._thread = threading.Thread(target=self._run, name=registration.thread_name, daemon=True)

    # ------------------------------------------------------------------ API (any thread)
    def serve(self) -> None:
        """Start the thread: it serves now and registers only after `start()`. The server's start
        (gRPC's first in this process) then overlaps what the worker waits for meanwhile."""
        if not self._thread.is_alive():
            self._thread.start()

    def start(self) -> None:
        """Serve (if `serve()` did not yet) and register, and keep the worker registered."""
        with self.cond:
            self._allowed = True
            self.cond.notify_all()
        self.serve()

    def trigger(self, reason: str = "asked to look") -> None:
        """Look again now; triggers coalesce, and what to do is decided from what is seen."""
        with self.cond:
            if self._stop:
                return
            self._hint = reason
            self.cond.notify_all()

    def notified(self, registered: bool, error: str) -> None:
        """The kubelet's word on our registration, from another thread (the plugin watcher's
        NotifyRegistrationStatus); none counts once stopping."""
        with self.cond:
            if self._stop:
                return
            if registered:
                self.change_state(RegState.REGISTERED, f"the kubelet registered {self.registration.endpoint}")
            else:
                self.change_state(RegState.REFUSED, f"the kubelet refused the registration: {error}")

    def stop(self) -> None:
        """End the thread (cutting short a call in flight), then take the sockets down."""
        with self.cond:
            self._stop = True
            self.cond.notify_all()
        self.registration.interrupt(self)
        if self._thread.is_alive():
            self._thread.join(timeout=JOIN_S)
        self.registration.close()
        self.change_state(RegState.STOPPED, "worker stopping")

    # ------------------------------------------------------------------ for the registration
    @property
    def stopping(self) -> bool:
        with self.cond:
            return self._stop

    @property
    def allowed(self) -> bool:
        with self.cond:
            return self._allowed

    def wait_allowed(self) -> bool:
        """Wait for `start()`; False when stopped first."""
        with self.cond:
            while not (self._allowed or self._stop):
                self.cond.wait()
            return not self._stop

    def change_state(self, state: RegState, detail: str) -> None:
        """Change state, log it once and tell the worker (the same state again: a debug line)."""
        with self.cond:
            what = self.registration.what
            if state is self.state:
                log.debug("%s %s (%s)", what, state.value, detail)
                return
            self.state = state
            level = logging.WARNING if state in (RegState.RETRYING, RegState.REFUSED) else logging.INFO
            log.log(level, "%s %s (%s)", what, state.value, detail, extra={"state": state.value})
            self._on_state(state, detail)

    def take_hint(self) -> tuple[bool, str]:
        """(stopping, the reason of the trigger since the last call or "")."""
        with self.cond:
            hint, self._hint = self._hint, None
            return self._stop, hint or ""

    def wait(self, timeout: float, *, hints: bool = True, ready: Callable[[], bool] = lambda: False) -> bool:
        """Sleep up to `timeout`, cut short by a stop, a trigger (unless `hints` is false) or
        `ready()`, tested under the lock (whoever makes it true then calls `wake()`). True when
        stopping."""
        with self.cond:
            if not (self._stop or (hints and self._hint is not None) or ready()):
                self.cond.wait(timeout)
            return self._stop

    def wake(self) -> None:
        """Wake a `wait` to test its `ready()` again."""
        with self.cond:
            self.cond.notify_all()

    def back_off(
        self,
        delay: float,
        *,
        hints: bool = True,
        changed: Callable[[], bool] | None = None,
        poll: float = math.inf,
    ) -> bool:
        """Wait out `delay`, cut short by a stop or a trigger (unless `hints` is false), and by
        `changed()`, polled every `poll` seconds: True when that cut it short."""
        deadline = time.monotonic() + delay
        while True:
            with self.cond:
                if (hints and self._hint is not None) or self._stop:
                    return False
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(min(left, poll))
            if changed is not None and changed():
                return True

    def retry(
        self,
        detail: str,
        *,
        state: RegState = RegState.RETRYING,
        changed: Callable[[], bool] | None = None,
        poll: float = math.inf,
    ) -> bool:
        """Say why we cannot go on (`state`), then back off by the next delay (as `back_off`)."""
        self.change_state(state, detail)
        return self.back_off(self.backoff.next(), changed=changed, poll=poll)

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        try:
            self.registration.run(self)
        except BaseException as exc:  # a bug: make it visible and let the worker exit for a restart
            log.exception("%s registration thread failed", self.registration.what)
            self.failed = exc
            self._on_state(RegState.STOPPED, f"registration thread failed: {exc}")
