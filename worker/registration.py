"""A device plugin's registration, which never gives up: serve first, then register; re-register
in-process. This is the device plugin's `Registration`: the registrar (worker.registrar) runs it
on its thread, with its backoff, its triggers and its states.

`PluginRegistration` owns the resource's `PluginServer`. It starts a server on a fresh socket
(the registrar's `serve()`: as soon as the worker starts, while it still waits for its health
snapshot), then, once allowed (`start()`: the snapshot is in the book), calls Register on
kubelet.sock (the kubelet dials back and calls GetDevicePluginOptions inside that call, which
our server answers from its own thread pool). A failed Register backs off exponentially with
jitter, up to a bound, forever; a missing kubelet.sock is waited for by polling its path (a few
milliseconds at first, then up to the check period).

Re-registration is decided from what the registrar can see, not from who asked: it registers
again when the kubelet ended a stream of the live server, when our socket file is gone, or when
kubelet.sock is a different file than the one we registered with (a kubelet restart: compared by
device, inode and ctime, since a re-created file often gets the same inode back). `trigger(reason)`
(the supervisor saw kubelet.sock created or our socket deleted; the kubelet ended our stream)
only makes the registrar look *now* instead of at its next periodic check. So several triggers
for one kubelet restart coalesce into one re-registration, and a late trigger for an event that
was already handled costs nothing.

A registration is only good once the kubelet's ListAndWatch stream opens: the kubelet can drop
a freshly registered endpoint before its stream starts (its `runClient` disconnects whatever
client is current when an older stream ends), and then nothing would ever tell the worker. So a
registration that has no stream within `STREAM_DEADLINE_S` counts as lost and is made again;
each further registration in a row without a stream waits twice as long (up to
`STREAM_DEADLINE_MAX_S`), so a kubelet that is merely slow to open streams (a loaded node) gets
the time it needs instead of a re-registration every 2 s.
When the same kubelet (kubelet.sock unchanged) keeps dropping registrations soon after they
were made (no stream, or a stream ended within `STABLE_S`), each further attempt first waits
out the backoff, cut short only by a new kubelet.sock: a kubelet that processes an old stream's
end late (the race above) would otherwise drop every new registration in turn.

A re-registration stops the old server first (its streams end before the new Register:
kubernetes#121994), then starts a new server on a new socket name, in-process. While a Register
is in flight the registrar keeps checking that our socket is still there and that kubelet.sock
did not change: if either fails, the Register is cancelled at once instead of waiting out the
kubelet's 10 s dial of a socket that no longer exists.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent import futures
from enum import Enum

import grpc

from common.backoff import Backoff
from common.kubeletapi import VERSION, pb
from common.kubeletapi.rpc import RegistrationClient, unix_target
from worker.registrar import FileId, Registrar, RegState, kubelet_identity
from worker.server import RPC_THREADS, PluginServer
from worker.service import OPTIONS, PluginService

log = logging.getLogger("gpuvisor.worker")

REGISTER_TIMEOUT_S = 15.0  # the kubelet's dial-back alone may take 10 s
SOCKET_CHECK_S = 2.0  # default period of the self-check (our socket, kubelet.sock's identity)
INFLIGHT_CHECK_S = 0.02  # how often an in-flight Register re-checks our socket and kubelet.sock
KUBELET_POLL_START_S = 0.005  # first poll for a missing kubelet.sock; doubles up to the check period
STREAM_DEADLINE_S = 2.0  # registered, and no ListAndWatch stream from the kubelet by then: lost
STREAM_DEADLINE_MAX_S = 30.0  # the deadline after several registrations in a row without a stream
STABLE_S = 5.0  # a registration whose stream lasted this long was no drop of the kubelet's
NO_STREAM = "no ListAndWatch stream from the kubelet"


class _Outcome(Enum):
    OK = "ok"
    FAILED = "failed"  # the kubelet said no, or could not be reached: back off
    ABANDONED = "abandoned"  # we cancelled it (our socket went, kubelet.sock changed, stopping)


class PluginRegistration:
    """Keeps one resource registered with the kubelet: the device plugin's `Registration`."""

    what = "device plugin"
    thread_name = "registrar"

    def __init__(
        self,
        service: PluginService,
        plugin_dir: str,
        kubelet_socket: str,
        check_interval: float = SOCKET_CHECK_S,
        count: Callable[[str], None] | None = None,
    ) -> None:
        self.service = service
        self.plugin_dir = plugin_dir
        self.kubelet_socket = kubelet_socket
        self.check_interval = check_interval
        self.server: PluginServer | None = None
        self.registrations = 0
        self._count = count or (lambda name: None)  # an event, counted in the worker's figures
        # How long a registration may go without the kubelet's stream: doubled for each
        # registration in a row that had none (its attempts), reset when a stream opens.
        self._stream_deadline = Backoff(STREAM_DEADLINE_S, STREAM_DEADLINE_MAX_S)
        self._registered_mono = 0.0
        self._drop_streak = 0  # registrations the same kubelet dropped soon after, in a row
        self._inflight: grpc.Future[pb.Empty] | None = None  # under the registrar's lock
        self._registered_with: FileId | None = None
        self._executor = futures.ThreadPoolExecutor(max_workers=RPC_THREADS, thread_name_prefix="rpc")

    @property
    def current_stream_deadline(self) -> float:
        """How long the live registration may go without the kubelet's stream."""
        return self._stream_deadline.step(self._stream_deadline.attempts + 1)

    @property
    def resource(self) -> str:
        return self.service.book.plan.resource

    @property
    def endpoint(self) -> str:
        return self.server.name if self.server is not None else "?"

    # ------------------------------------------------------------------ the Registration
    def run(self, registrar: Registrar) -> None:
        """Serve at once (a failure here is retried by the loop), register once allowed."""

        def cancelled(server: PluginServer) -> None:  # from a gRPC thread
            if server is self.server:
                registrar.trigger("the kubelet ended our ListAndWatch stream")

        self.service.on_stream_cancelled = cancelled
        if not registrar.allowed:
            self._ensure_server(registrar)
        if registrar.wait_allowed():
            self._loop(registrar)

    def interrupt(self, registrar: Registrar) -> None:
        with registrar.cond:
            inflight = self._inflight
        if inflight is not None:
            inflight.cancel()

    def close(self) -> None:
        """End our streams and remove our socket."""
        if self.server is not None:
            self.server.stop()
            self.server.wait_closed()  # the clients read the end of their streams before we exit
            self.server = None
        self._executor.shutdown(wait=False)

    # ------------------------------------------------------------------ the thread
    def _loop(self, registrar: Registrar) -> None:
        poll = KUBELET_POLL_START_S
        while True:
            stopping, hint = registrar.take_hint()
            if stopping:
                return
            if registrar.state is RegState.REGISTERED:
                problem = self._problem()
                if not problem:
                    if hint:
                        log.debug("still registered, nothing to do (%s)", hint)
                    registrar.wait(self._next_check())
                    continue
                dropped = self._dropped(problem)
                dropped_by, self._registered_with = self._registered_with, None
                registrar.change_state(RegState.REGISTERING, problem)
                if problem.startswith(NO_STREAM):
                    self._count("no_stream_reregistrations")
                    self._stream_deadline.attempts += 1
                if dropped and self._drop_streak > 1:  # the same kubelet keeps dropping us: wait
                    delay = registrar.backoff.next()
                    log.info(
                        "the kubelet dropped %d registrations in a row: registering again in %.2fs",
                        self._drop_streak,
                        delay,
                    )
                    # Cut short only by a new kubelet.sock, not by our own triggers: the kubelet
                    # ending our stream is what got us here. (It is the same kubelet: not None.)
                    changed = self._kubelet_other_than(dropped_by)
                    registrar.back_off(delay, hints=False, changed=changed, poll=self.check_interval)
            if not self._ensure_server(registrar):
                continue
            kid = kubelet_identity(self.kubelet_socket)
            if kid is None:
                registrar.change_state(RegState.WAITING, f"{self.kubelet_socket} does not exist yet")
                registrar.wait(poll)
                poll = min(poll * 2, self.check_interval)
                continue
            poll = KUBELET_POLL_START_S
            if registrar.state in (RegState.STARTING, RegState.WAITING):
                registrar.change_state(
                    RegState.REGISTERING, f"kubelet.sock is there; endpoint {self.endpoint}"
                )
            outcome, detail = self._register(registrar, kid)
            if outcome is _Outcome.OK:
                self._registered_with = kid
                self._registered_mono = time.monotonic()
                self.registrations += 1
                if not self._drop_streak:
                    registrar.backoff.reset()
                registrar.change_state(RegState.REGISTERED, f"endpoint {self.endpoint}")
            elif outcome is _Outcome.FAILED:
                if registrar.retry(detail, changed=self._kubelet_other_than(kid), poll=self.check_interval):
                    registrar.backoff.reset()
            else:
                log.debug("Register abandoned: %s", detail)

    def _kubelet_other_than(self, kid: FileId | None) -> Callable[[], bool] | None:
        """A test for a backoff: is kubelet.sock now a file other than `kid` (None: no test)?"""
        if kid is None:
            return None
        return lambda: kubelet_identity(self.kubelet_socket) not in (kid, None)

    def _dropped(self, problem: str) -> bool:
        """Was the live registration dropped soon after it was made by the same kubelet? Counts it."""
        lost = problem.startswith(NO_STREAM) or problem.startswith("the kubelet ended our")
        same_kubelet = kubelet_identity(self.kubelet_socket) == self._registered_with
        if (
            lost
            and same_kubelet
            and time.monotonic() - self._registered_mono < STABLE_S + self.current_stream_deadline
        ):
            self._drop_streak += 1
            return True
        self._drop_streak = 0
        return False

    def _next_check(self) -> float:
        """How long to wait for the next look: sooner while the kubelet's stream is awaited."""
        server = self.server
        if server is not None and not server.had_stream:
            left = self._registered_mono + self.current_stream_deadline - time.monotonic()
            return max(0.01, min(self.check_interval, left))
        return self.check_interval

    def _problem(self) -> str:
        """Why the live registration is no longer good, or "" when it is."""
        server = self.server
        if server is None:
            return "no server"
        if server.cancelled:
            return "the kubelet ended our ListAndWatch stream"
        if server.had_stream:
            self._stream_deadline.reset()
            if self._drop_streak and time.monotonic() - self._registered_mono >= STABLE_S:
                self._drop_streak = 0  # it held: whatever dropped us before has settled
        else:
            deadline = self.current_stream_deadline
            if time.monotonic() - self._registered_mono >= deadline:
                return f"{NO_STREAM} within {deadline:g}s of registering"
        if not server.socket_present():
            return f"our socket {server.name} was deleted"
        kid = kubelet_identity(self.kubelet_socket)
        # kubelet.sock merely missing is no reason: a kubelet that dies ends our stream, and one
        # that comes back makes a new kubelet.sock, which is.
        if kid is not None and kid != self._registered_with:
            return "kubelet.sock was re-created (kubelet restart)"
        return ""

    def _ensure_server(self, registrar: Registrar) -> bool:
        """A fresh, serving server whose socket is in place; False (after a wait) if none can start."""
        server = self.server
        if server is not None and not (server.offered or server.cancelled or not server.socket_present()):
            return True
        if server is not None:
            server.stop()  # its streams end before any successor registers (kubernetes#121994)
            self.server = None
        fresh = PluginServer(self.service, self.plugin_dir, self._executor)
        try:
            fresh.start()
        except (OSError, RuntimeError) as exc:
            fresh.stop()
            if not os.path.isdir(self.plugin_dir):
                registrar.retry(f"plugin dir {self.plugin_dir} does not exist yet", state=RegState.WAITING)
            else:
                registrar.retry(f"cannot serve on {fresh.path}: {exc}")
            return False
        self.server = fresh
        log.debug("serving on %s", fresh.path)
        return True

    def _register(self, registrar: Registrar, kid: FileId) -> tuple[_Outcome, str]:
        """One Register call, abandoned early if it can no longer succeed."""
        server = self.server
        assert server is not None
        request = pb.RegisterRequest(
            version=VERSION, endpoint=server.name, resource_name=self.resource, options=OPTIONS
        )
        channel = grpc.insecure_channel(unix_target(self.kubelet_socket))
        # The kubelet may open its stream before Register returns: from here on the next stream
        # is its own, and whatever happens to this Register, the next one gets a fresh server.
        server.offer()
        try:
            future: grpc.Future[pb.Empty] = RegistrationClient(channel).Register.future(
                request, timeout=REGISTER_TIMEOUT_S
            )
            with registrar.cond:  # a stop sees the future, or we see the stop (interrupt())
                self._inflight = future
                stopping = registrar.stopping
            future.add_done_callback(lambda _future: registrar.wake())
            why = "stopping" if stopping else ""
            while not why and not future.done():
                if registrar.wait(INFLIGHT_CHECK_S, hints=False, ready=future.done):
                    why = "stopping"
                if why or future.done():
                    break
                if not server.socket_present():
                    why = f"our socket {server.name} vanished"
                elif kubelet_identity(self.kubelet_socket) != kid:
                    why = "kubelet.sock changed"
            if why:
                future.cancel()
                return _Outcome.ABANDONED, why
            try:
                future.result()
            except grpc.RpcError as exc:
                return _Outcome.FAILED, f"Register: {exc.details() or exc.code().name}"
            except grpc.FutureCancelledError:
                return _Outcome.ABANDONED, "cancelled"
            return _Outcome.OK, ""
        finally:
            with registrar.cond:
                self._inflight = None
            channel.close()
