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
instances never do that, since they wait for a live socket to go. `WatcherRegistration` is what
the registrar's thread (worker.registrar) runs: it brings both up, retries with the registrar's
backoff while it cannot, and looks after them every `CHECK_S` (a deleted socket is made again,
the service one first); the registrar tells the worker its state.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Sequence
from concurrent import futures
from typing import Any

import grpc

from common.procutil import unix_socket_listening
from worker.registrar import Registrar, RegState, kubelet_identity
from worker.rpcserver import RpcServer

RPC_THREADS = 8  # health streams take at most 3; prepares and registration keep the rest
MAX_RPCS = 64
STOP_GRACE_S = 0.5
CHECK_S = (
    2.0  # how often the sockets are looked after (two stat calls), as the device plugin's SOCKET_CHECK_S
)


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
        self._server: RpcServer | None = None
        self._identity: tuple[int, int, int] | None = None

    def start(self) -> None:
        """Serve on the path (a stale socket there removed first). Raises OSError."""
        os.makedirs(os.path.dirname(self.path), mode=0o750, exist_ok=True)
        clear_stale(self.path)
        server = RpcServer(self._handlers, self._executor, MAX_RPCS)
        try:
            server.start(f"unix://{self.path}")
        except RuntimeError as exc:
            raise OSError(f"cannot serve on {self.path}: {exc}") from None
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
            self._server.stop(STOP_GRACE_S)
            self._server = None
        if self.present():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        self._identity = None


class WatcherRegistration:
    """The DRA plugin's `Registration`: keeps the service and registration sockets up, the
    service one first; the kubelet's answers reach the registrar's `notified`."""

    what = "DRA plugin"
    thread_name = "dra-registrar"

    def __init__(self, service: Endpoint, registration: Endpoint, check_interval: float = CHECK_S) -> None:
        self.service = service
        self.registration = registration
        self._check = check_interval

    @property
    def endpoint(self) -> str:
        return self.service.path

    def run(self, registrar: Registrar) -> None:
        if registrar.wait_allowed():
            self._loop(registrar)

    def interrupt(self, registrar: Registrar) -> None:
        """Nothing to cut short: the kubelet calls us, we never wait on it."""

    def close(self) -> None:
        """Registration socket first (the kubelet drops the plugin), then the service socket."""
        self.registration.stop()
        self.service.stop()

    def _loop(self, registrar: Registrar) -> None:
        while True:
            stopping, _hint = registrar.take_hint()  # a trigger only means: look now
            if stopping:
                return
            problem = self._ensure(registrar)
            if problem:
                registrar.retry(problem)
                continue
            registrar.backoff.reset()
            registrar.wait(self._check)

    def _ensure(self, registrar: Registrar) -> str:
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
            # Before the socket exists: the kubelet's answer may come at once.
            registrar.change_state(
                RegState.REGISTERING, f"waiting for the kubelet at {self.registration.path}"
            )
            try:
                self.registration.start()
            except OSError as exc:
                self.registration.stop()
                return str(exc)
        return ""
