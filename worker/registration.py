"""Registration that never gives up: serve first, then register; re-register in-process.

One `Registrar` thread owns the resource's `PluginServer`. It starts a server on a fresh socket,
then calls Register on kubelet.sock (the kubelet dials back and calls GetDevicePluginOptions
inside that call, which our server answers from its own thread pool). A failure backs off
exponentially with jitter, forever, and is logged once per change of state, not once per try.

Anything that means "the kubelet lost us" calls `trigger(reason)`: the supervisor saw a new
kubelet.sock, our socket file vanished, or the kubelet cancelled our ListAndWatch stream. The
registrar then stops the old server (its streams end first: kubernetes#121994), starts a new one
on a new socket name and registers again, with no process restart. Triggers that arrive
together coalesce into one re-registration.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable
from enum import Enum

import grpc

from common.kubeletapi import VERSION, pb
from common.kubeletapi.rpc import RegistrationClient, unix_target
from worker.server import OPTIONS, PluginServer, PluginService

log = logging.getLogger("gpuvisor.worker")

REGISTER_TIMEOUT_S = 15.0
BACKOFF_START_S = 0.05
BACKOFF_MAX_S = 5.0
SOCKET_CHECK_S = 2.0  # fallback check of our own socket file, in case no watcher told us


class RegState(Enum):
    STARTING = "starting"
    REGISTERING = "registering"
    REGISTERED = "registered"
    RETRYING = "retrying"
    STOPPED = "stopped"


class Registrar:
    """Keeps one resource registered with the kubelet for as long as the worker lives."""

    def __init__(
        self,
        service: PluginService,
        plugin_dir: str,
        kubelet_socket: str,
        on_state: Callable[[RegState, str], None] | None = None,
    ) -> None:
        self.service = service
        self.plugin_dir = plugin_dir
        self.kubelet_socket = kubelet_socket
        self.server: PluginServer | None = None
        self.state = RegState.STARTING
        self.registered_at = 0.0
        self.registrations = 0
        self._on_state = on_state or (lambda state, detail: None)
        self._cond = threading.Condition()
        self._pending: str | None = "start"
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="registrar", daemon=True)
        self._random = random.Random()

    @property
    def resource(self) -> str:
        return self.service.book.plan.resource

    def start(self) -> None:
        self.service_on_cancel()
        self._thread.start()

    def service_on_cancel(self) -> None:
        # A stream the kubelet cancels (not one we end ourselves) means: register again.
        def cancelled(server: PluginServer) -> None:
            if server is self.server:
                self.trigger("ListAndWatch stream cancelled by the kubelet")

        self.service._on_stream_cancelled = cancelled

    def trigger(self, reason: str) -> None:
        """Ask for a re-registration on a fresh server; coalesces with one already pending."""
        with self._cond:
            if self._stop:
                return
            if self._pending is None:
                self._pending = reason
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        if self.server is not None:
            self.server.stop()
            self.server = None
        self._set(RegState.STOPPED, "worker stopping")

    def _set(self, state: RegState, detail: str) -> None:
        if state is not self.state:
            self.state = state
            if state is RegState.RETRYING:
                log.warning("%s: registration failing, retrying with backoff: %s", self.resource, detail)
            else:
                log.info("%s: %s (%s)", self.resource, state.value, detail)
            self._on_state(state, detail)

    def _run(self) -> None:
        backoff = BACKOFF_START_S
        while True:
            with self._cond:
                while self._pending is None and not self._stop:
                    self._cond.wait(SOCKET_CHECK_S)
                    if self._pending is None and self.server is not None and not self.server.socket_present():
                        self._pending = "our socket file was deleted"
                if self._stop:
                    return
                reason = self._pending
                self._pending = None
            if reason != "retry":
                self._restart_server(reason)
            self._set(RegState.REGISTERING, reason or "")
            error = self._register()
            if not error:
                backoff = BACKOFF_START_S
                self.registered_at = time.time()
                self.registrations += 1
                self._set(RegState.REGISTERED, f"endpoint {self.server.name if self.server else '?'}")
                continue
            self._set(RegState.RETRYING, error)
            delay = backoff * (0.5 + self._random.random())  # jitter: 0.5x to 1.5x
            backoff = min(backoff * 2, BACKOFF_MAX_S)
            with self._cond:
                if self._pending is None and not self._stop:
                    self._cond.wait(delay)
                if self._pending is None:
                    self._pending = "retry"
                elif self._pending != "retry":
                    backoff = BACKOFF_START_S  # a new trigger (e.g. new kubelet.sock): try now

    def _restart_server(self, reason: str | None) -> None:
        old = self.server
        if old is not None:
            old.stop()
        server = PluginServer(self.service, self.plugin_dir)
        server.start()
        self.server = server
        if old is not None:
            log.info("%s: new server on %s (%s)", self.resource, server.name, reason)

    def _register(self) -> str:
        """One Register call; returns "" on success or the error text."""
        server = self.server
        if server is None:
            return "no server"
        if not os.path.exists(self.kubelet_socket):
            return f"{self.kubelet_socket} does not exist"
        channel = grpc.insecure_channel(unix_target(self.kubelet_socket))
        try:
            request = pb.RegisterRequest(
                version=VERSION, endpoint=server.name, resource_name=self.resource, options=OPTIONS
            )
            RegistrationClient(channel).Register(request, timeout=REGISTER_TIMEOUT_S, wait_for_ready=False)
            return ""
        except grpc.RpcError as exc:
            details = exc.details() if hasattr(exc, "details") else str(exc)
            return f"Register: {details}"
        finally:
            channel.close()
