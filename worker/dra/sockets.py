"""The DRA worker's two sockets, kept up for as long as it lives: serve first, then register.

The service socket `<plugins dir>/<driver>/dra.sock` serves DRAPlugin v1 and v1beta1 and the
health stream; the registration socket `<registry dir>/<driver>-reg.sock` serves the plugin
watcher's Registration. The kubelet learns of the plugin when the registration socket appears,
so it is made only once the service socket answers (the kubeletplugin helper's order), and a
kubelet that restarts finds it there and registers it again by itself.

Names are fixed (the kubelet and NVIDIA's driver use these), so a start first removes what an
earlier life left at those paths: only a unix socket nobody accepts on (never a directory, a
regular file or a live server: another instance serving there is waited for, not robbed; gRPC
itself would unlink a live socket at the path before binding, so this check must come first). A
stop removes our sockets. gRPC's own shutdown unlinks whatever socket is at the path by then, so
a socket another process put over ours (after unlinking ours) would go too: gpuvisor's own
instances never do that, since they wait for a live socket to go. `Registrar` is the thread
that brings both up, retries with the one backoff while it cannot, looks after them every
`CHECK_S` (a deleted socket is made again, the service one first) and tells the worker its state.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from enum import Enum
from typing import Any

import grpc

from common.procutil import unix_socket_listening
from worker.registration import kubelet_identity, registration_backoff

log = logging.getLogger("gpuvisor.worker")

RPC_THREADS = 8  # health streams take at most 3; prepares and registration keep the rest
MAX_RPCS = 64
STOP_GRACE_S = 0.5
CHECK_S = 1.0  # how often the sockets are looked after (two stat calls)


class SocketBusy(OSError):
    """Something serves on the path already (an instance not gone yet): wait, do not take it."""


def clear_stale(path: str) -> None:
    """Remove a socket an earlier life left at `path`. Raises SocketBusy when it is served,
    OSError when something else is there (it is not ours to remove)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise OSError(f"{path} exists and is not a socket: not removing it")
    if unix_socket_listening(path):
        raise SocketBusy(f"something serves on {path} already (an earlier instance still stopping?)")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class Endpoint:
    """One gRPC server on one socket path."""

    def __init__(
        self,
        path: str,
        handlers: Sequence[grpc.GenericRpcHandler[Any, Any]],
        executor: futures.ThreadPoolExecutor,
    ) -> None:
        self.path = path
        self._handlers = handlers
        self._executor = executor
        self._server: grpc.Server | None = None
        self._identity: tuple[int, int, int] | None = None

    def start(self) -> None:
        """Serve on the path (a stale socket there removed first). Raises OSError."""
        os.makedirs(os.path.dirname(self.path), mode=0o750, exist_ok=True)
        clear_stale(self.path)
        server = grpc.server(
            self._executor, options=[("grpc.so_reuseport", 0)], maximum_concurrent_rpcs=MAX_RPCS
        )
        server.add_generic_rpc_handlers(tuple(self._handlers))
        try:
            server.add_insecure_port(f"unix://{self.path}")
        except RuntimeError as exc:
            raise OSError(f"cannot serve on {self.path}: {exc}") from None
        server.start()
        self._server = server
        self._identity = kubelet_identity(self.path)  # which file: the same test as for kubelet.sock

    @property
    def serving(self) -> bool:
        return self._server is not None

    def present(self) -> bool:
        """Is our socket file still there (the file we made, not a new one on a reused inode)?"""
        return self._identity is not None and kubelet_identity(self.path) == self._identity

    def stop(self) -> None:
        """Stop serving and remove our socket (only if it is still ours)."""
        if self._server is not None:
            self._server.stop(STOP_GRACE_S).wait(STOP_GRACE_S + 1.0)
            self._server = None
        if self.present():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        self._identity = None


class RegState(Enum):
    STARTING = "starting"
    REGISTERING = "registering"  # both sockets up, the kubelet's plugin watcher has not answered
    REGISTERED = "registered"  # NotifyRegistrationStatus(true)
    REFUSED = "refused"  # NotifyRegistrationStatus(false): the kubelet says why, and tries again
    RETRYING = "retrying"  # a socket cannot be served: backing off
    STOPPED = "stopped"


class Registrar:
    """Keeps the service and registration sockets up; the kubelet's answers come in `notified`."""

    def __init__(
        self,
        service: Endpoint,
        registration: Endpoint,
        on_state: Callable[[RegState, str], None] = lambda state, detail: None,
        check_interval: float = CHECK_S,
    ) -> None:
        self.service = service
        self.registration = registration
        self.state = RegState.STARTING
        self.failed: BaseException | None = None  # the thread died of a bug: the worker exits
        self._on_state = on_state
        self._check = check_interval
        self._backoff = registration_backoff()
        self._cond = threading.Condition()
        self._stop = False
        self._hint = False
        self._thread = threading.Thread(target=self._run, name="dra-registrar", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def trigger(self) -> None:
        """Look at the sockets now."""
        with self._cond:
            self._hint = True
            self._cond.notify_all()

    def notified(self, registered: bool, error: str) -> None:
        """The kubelet's NotifyRegistrationStatus (from a gRPC thread)."""
        with self._cond:
            if self._stop:
                return
            if registered:
                self._set(RegState.REGISTERED, f"the kubelet registered {self.service.path}")
            else:
                self._set(RegState.REFUSED, f"the kubelet refused the registration: {error}")

    def stop(self) -> None:
        """Registration socket first (the kubelet drops the plugin), then the service socket."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self.registration.stop()
        self.service.stop()
        with self._cond:
            self._set(RegState.STOPPED, "worker stopping")

    # ------------------------------------------------------------------ the thread
    def _set(self, state: RegState, detail: str) -> None:
        """Change state, log once, tell the worker (call with the lock held)."""
        if state is self.state:
            return
        self.state = state
        level = logging.WARNING if state in (RegState.RETRYING, RegState.REFUSED) else logging.INFO
        log.log(level, "DRA plugin %s (%s)", state.value, detail, extra={"state": state.value})
        self._on_state(state, detail)

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # a bug: visible, and the worker exits for a restart
            log.exception("DRA registration thread failed")
            self.failed = exc
            self._on_state(RegState.STOPPED, f"registration thread failed: {exc}")

    def _wait(self, timeout: float) -> bool:
        """Sleep up to `timeout`, cut short by trigger or stop; True when stopping."""
        with self._cond:
            if not self._stop and not self._hint:
                self._cond.wait(timeout)
            self._hint = False
            return self._stop

    def _loop(self) -> None:
        while True:
            with self._cond:
                if self._stop:
                    return
            problem = self._ensure()
            if problem:
                with self._cond:
                    self._set(RegState.RETRYING, problem)
                if self._wait(self._backoff.next()):
                    return
                continue
            self._backoff.reset()
            if self._wait(self._check):
                return

    def _ensure(self) -> str:
        """Both sockets up and ours, the service one first; why not, or ""."""
        service_ok = self.service.serving and self.service.present()
        if not service_ok:
            # Whoever registered must not keep a dead endpoint: the registration socket is made
            # again after the service socket, so the kubelet validates the new one.
            self.registration.stop()
            self.service.stop()
            try:
                self.service.start()
            except OSError as exc:
                self.service.stop()
                return str(exc)
        if not (self.registration.serving and self.registration.present()):
            self.registration.stop()
            with self._cond:  # before the socket exists: the kubelet's answer may come at once
                self._set(RegState.REGISTERING, f"waiting for the kubelet at {self.registration.path}")
            try:
                self.registration.start()
            except OSError as exc:
                self.registration.stop()
                return str(exc)
        return ""
