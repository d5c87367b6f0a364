"""Registration that never gives up: serve first, then register; re-register in-process.

One `Registrar` thread owns the resource's `PluginServer`. It starts a server on a fresh socket
(`serve()`: as soon as the worker starts, while it still waits for its health snapshot), then,
once allowed (`start()`: the snapshot is in the book), calls Register on kubelet.sock (the kubelet dials back and calls GetDevicePluginOptions
inside that call, which our server answers from its own thread pool). A failed Register backs off
exponentially with jitter, up to a bound, forever; a missing kubelet.sock is waited for by
polling its path (a few milliseconds at first, then up to the check period). The state is an enum
and is logged once per change of state, never once per try.

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
import random
import threading
import time
from collections.abc import Callable
from concurrent import futures
from enum import Enum

import grpc

from common.backoff import Backoff
from common.kubeletapi import VERSION, pb
from common.kubeletapi.rpc import RegistrationClient, unix_target
from worker.server import RPC_THREADS, PluginServer
from worker.service import OPTIONS, PluginService

log = logging.getLogger("gpuvisor.worker")

REGISTER_TIMEOUT_S = 15.0  # the kubelet's dial-back alone may take 10 s
BACKOFF_START_S = 0.05
BACKOFF_MAX_S = 5.0
SOCKET_CHECK_S = 2.0  # default period of the self-check (our socket, kubelet.sock's identity)
INFLIGHT_CHECK_S = 0.02  # how often an in-flight Register re-checks our socket and kubelet.sock
KUBELET_POLL_START_S = 0.005  # first poll for a missing kubelet.sock; doubles up to the check period
STREAM_DEADLINE_S = 2.0  # registered, and no ListAndWatch stream from the kubelet by then: lost
STREAM_DEADLINE_MAX_S = 30.0  # the deadline after several registrations in a row without a stream
STABLE_S = 5.0  # a registration whose stream lasted this long was no drop of the kubelet's
NO_STREAM = "no ListAndWatch stream from the kubelet"

KubeletId = tuple[int, int, int]


def kubelet_identity(path: str) -> KubeletId | None:
    """Which file `path` is right now (device, inode, ctime), or None when it does not exist."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns)


class RegState(Enum):
    STARTING = "starting"
    WAITING = "waiting"  # for kubelet.sock (or the plugin dir) to exist
    REGISTERING = "registering"
    REGISTERED = "registered"
    RETRYING = "retrying"
    STOPPED = "stopped"


def registration_backoff(rng: random.Random | None = None) -> Backoff:
    """The registrar's retry delays: doubling from 50 ms to 5 s, each 50-100% of its step."""
    return Backoff(BACKOFF_START_S, BACKOFF_MAX_S, jitter=0.5, rng=rng)


class _Outcome(Enum):
    OK = "ok"
    FAILED = "failed"  # the kubelet said no, or could not be reached: back off
    ABANDONED = "abandoned"  # we cancelled it (our socket went, kubelet.sock changed, stopping)


class Registrar:
    """Keeps one resource registered with the kubelet for as long as the worker lives."""

    def __init__(
        self,
        service: PluginService,
        plugin_dir: str,
        kubelet_socket: str,
        on_state: Callable[[RegState, str], None] | None = None,
        check_interval: float = SOCKET_CHECK_S,
        count: Callable[[str], None] | None = None,
    ) -> None:
        self.service = service
        self.plugin_dir = plugin_dir
        self.kubelet_socket = kubelet_socket
        self.check_interval = check_interval
        self.server: PluginServer | None = None
        self.state = RegState.STARTING
        self.registrations = 0
        self._count = count or (lambda name: None)  # an event, counted in the worker's figures
        # How long a registration may go without the kubelet's stream: doubled for each
        # registration in a row that had none (its attempts), reset when a stream opens.
        self._stream_deadline = Backoff(STREAM_DEADLINE_S, STREAM_DEADLINE_MAX_S)
        self._registered_mono = 0.0
        self._drop_streak = 0  # registrations the same kubelet dropped soon after, in a row
        self.failed: BaseException | None = None  # set if the thread died of a bug
        self._on_state = on_state or (lambda state, detail: None)
        self._cond = threading.Condition()
        self._hint: str | None = None
        self._stop = False
        self._allowed = False  # start() was called: register (serve() alone only serves)
        self._inflight: grpc.Future[pb.Empty] | None = None
        self._registered_with: KubeletId | None = None
        self._thread = threading.Thread(target=self._run, name="registrar", daemon=True)
        self._backoff = registration_backoff()
        self._executor = futures.ThreadPoolExecutor(max_workers=RPC_THREADS, thread_name_prefix="rpc")
        service.on_stream_cancelled = self._stream_cancelled

    @property
    def current_stream_deadline(self) -> float:
        """How long the live registration may go without the kubelet's stream."""
        return self._stream_deadline.step(self._stream_deadline.attempts + 1)

    @property
    def resource(self) -> str:
        return self.service.book.plan.resource

    # ------------------------------------------------------------------ API (any thread)
    def serve(self) -> None:
        """Start the thread and a server now; register only after `start()`. The server's start
        (gRPC's first in this process) then overlaps what the worker waits for meanwhile."""
        if not self._thread.is_alive():
            self._thread.start()

    def start(self) -> None:
        """Serve (if `serve()` did not yet) and register, and keep the resource registered."""
        with self._cond:
            self._allowed = True
            self._cond.notify_all()
        self.serve()

    def trigger(self, reason: str) -> None:
        """Look again now: re-register if the kubelet lost us; triggers coalesce."""
        with self._cond:
            if self._stop:
                return
            self._hint = reason
            self._cond.notify_all()

    def stop(self) -> None:
        """Stop registering, end our streams and remove our socket."""
        with self._cond:
            self._stop = True
            inflight = self._inflight
            self._cond.notify_all()
        if inflight is not None:
            inflight.cancel()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        if self.server is not None:
            self.server.stop()
            self.server.wait_closed()  # the clients read the end of their streams before we exit
            self.server = None
        self._executor.shutdown(wait=False)
        self._set(RegState.STOPPED, "worker stopping")

    def _stream_cancelled(self, server: PluginServer) -> None:
        if server is self.server:
            self.trigger("the kubelet ended our ListAndWatch stream")

    # ------------------------------------------------------------------ the thread
    def _set(self, state: RegState, detail: str) -> None:
        if state is self.state:
            log.debug("%s (%s)", state.value, detail)
            return
        self.state = state
        if state is RegState.RETRYING:
            log.warning(
                "registration failing, retrying with backoff: %s", detail, extra={"state": state.value}
            )
        else:
            log.info("%s (%s)", state.value, detail, extra={"state": state.value})
        self._on_state(state, detail)

    def _run(self) -> None:
        try:
            if self._serve_until_allowed():
                self._loop()
        except BaseException as exc:  # a bug: make it visible and let the worker exit for a restart
            log.exception("registration thread failed")
            self.failed = exc
            self._on_state(RegState.STOPPED, f"registration thread failed: {exc}")

    def _serve_until_allowed(self) -> bool:
        """Serve (a failure here is retried by the loop), then wait for `start()`; False if stopped first."""
        with self._cond:
            allowed = self._allowed
        if not allowed:
            self._ensure_server()
        with self._cond:
            while not (self._allowed or self._stop):
                self._cond.wait()
            return not self._stop

    def _take_hint(self) -> tuple[bool, str]:
        with self._cond:
            hint, self._hint = self._hint, None
            return self._stop, hint or ""

    def _wait(self, timeout: float) -> None:
        """Sleep up to `timeout`, cut short by a trigger or stop."""
        with self._cond:
            if self._hint is None and not self._stop:
                self._cond.wait(timeout)

    def _loop(self) -> None:
        poll = KUBELET_POLL_START_S
        while True:
            stopping, hint = self._take_hint()
            if stopping:
                return
            if self.state is RegState.REGISTERED:
                problem = self._problem()
                if not problem:
                    if hint:
                        log.debug("still registered, nothing to do (%s)", hint)
                    self._wait(self._next_check())
                    continue
                dropped = self._dropped(problem)
                dropped_by, self._registered_with = self._registered_with, None
                self._set(RegState.REGISTERING, problem)
                if problem.startswith(NO_STREAM):
                    self._count("no_stream_reregistrations")
                    self._stream_deadline.attempts += 1
                if dropped and self._drop_streak > 1:  # the same kubelet keeps dropping us: wait
                    delay = self._backoff.next()
                    log.info(
                        "the kubelet dropped %d registrations in a row: registering again in %.2fs",
                        self._drop_streak,
                        delay,
                    )
                    # Cut short only by a new kubelet.sock, not by our own triggers: the kubelet
                    # ending our stream is what got us here. (It is the same kubelet: not None.)
                    self._wait_backoff(delay, dropped_by, hints=False)
            if not self._ensure_server():
                continue
            kid = kubelet_identity(self.kubelet_socket)
            if kid is None:
                self._set(RegState.WAITING, f"{self.kubelet_socket} does not exist yet")
                self._wait(poll)
                poll = min(poll * 2, self.check_interval)
                continue
            poll = KUBELET_POLL_START_S
            if self.state in (RegState.STARTING, RegState.WAITING):
                self._set(RegState.REGISTERING, f"kubelet.sock is there; endpoint {self._server_name()}")
            outcome, detail = self._register(kid)
            if outcome is _Outcome.OK:
                self._registered_with = kid
                self._registered_mono = time.monotonic()
                self.registrations += 1
                if not self._drop_streak:
                    self._backoff.reset()
                self._set(RegState.REGISTERED, f"endpoint {self._server_name()}")
            elif outcome is _Outcome.FAILED:
                self._set(RegState.RETRYING, detail)
                if self._wait_backoff(self._backoff.next(), kid):
                    self._backoff.reset()
            else:
                log.debug("Register abandoned: %s", detail)

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

    def _server_name(self) -> str:
        return self.server.name if self.server is not None else "?"

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

    def _ensure_server(self) -> bool:
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
                self._set(RegState.WAITING, f"plugin dir {self.plugin_dir} does not exist yet")
            else:
                self._set(RegState.RETRYING, f"cannot serve on {fresh.path}: {exc}")
            self._wait_backoff(self._backoff.next(), None)
            return False
        self.server = fresh
        log.debug("serving on %s", fresh.path)
        return True

    def _wait_backoff(self, delay: float, kid: KubeletId | None, *, hints: bool = True) -> bool:
        """Back off for `delay`; cut short by stop, a trigger (unless `hints` is false) or a
        kubelet.sock other than `kid` (returns True then; `kid` None: never)."""
        deadline = time.monotonic() + delay
        while True:
            with self._cond:
                if (hints and self._hint is not None) or self._stop:
                    return False
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, self.check_interval))
            if kid is not None and kubelet_identity(self.kubelet_socket) not in (kid, None):
                return True

    def _register(self, kid: KubeletId) -> tuple[_Outcome, str]:
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
            with self._cond:
                self._inflight = future
                stopping = self._stop
            future.add_done_callback(self._wake)
            why = "stopping" if stopping else ""
            while not why and not future.done():
                with self._cond:
                    if not future.done() and not self._stop:
                        self._cond.wait(INFLIGHT_CHECK_S)
                    if self._stop:
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
            with self._cond:
                self._inflight = None
            channel.close()

    def _wake(self, _future: object) -> None:
        with self._cond:
            self._cond.notify_all()
