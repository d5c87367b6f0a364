"""The supervisor's control endpoint: the ZeroMQ ROUTER its workers and its CLI talk to.

It decodes each message, checks that a worker's message comes from the worker it claims to be,
and hands typed messages to typed handlers (`ControlHandlers`); it replies to commands
(`gpuvisor status`, `gpuvisor sim ...`). Nothing here decides what a message means.

Who may say what. A worker's first message on its DEALER is a `Hello` with the secret the
supervisor gave that spawn (`supervisor/workers/spawner.py`); `accept_hello` checks it, and the DEALER's
route is then bound to (resource, pid). A Heartbeat, StatusReport,
SnapshotRequest or ClaimRequest is taken only from a bound route, for the resource and pid bound to it. So a late
message of a replaced worker (its route was unbound when its successor was spawned), or a forged
one from any other process on the socket, is dropped and counted by reason; a Heartbeat from such
a route is answered with `Shutdown` (a worker nobody here started must not serve beside ours).
Commands come from the CLI, a fresh DEALER each time, and need no binding: who can open the
socket at all (mode 0600 in a 0700 run dir) is who may command.

Bounds: ZeroMQ drops a peer whose message exceeds `MAX_MESSAGE_BYTES`; one `drain()` handles at
most `DRAIN_BATCH` messages so that a flood cannot starve the rest of the loop. A handler that
raises is logged and counted; it never ends the loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import zmq

from common.messages import (
    MAX_MESSAGE_BYTES,
    Command,
    HealthSnapshot,
    Heartbeat,
    Hello,
    Json,
    Message,
    MessageError,
    Reply,
    SequenceCounter,
    Shutdown,
    SnapshotReply,
    SnapshotRequest,
    StatusReport,
    WorkerRequest,
    decode,
    encode,
    split_routed,
)

log = logging.getLogger("gpuvisor.control")

DRAIN_BATCH = 1000


@dataclass(frozen=True)
class Binding:
    """Who a route belongs to: the worker process `pid` spawned for `resource`."""

    resource: str
    pid: int


class ControlHandlers(Protocol):
    """What the supervisor does with each kind of worker message (all on the main loop;
    supervisor.workers.events.WorkerEvents)."""

    def accept_hello(self, hello: Hello) -> Binding | None:
        """The binding for a Hello whose secret is right for its resource's current spawn."""
        ...

    def on_bound(self, binding: Binding) -> None:
        """A worker's route is now known (e.g. send it a plan it has not seen)."""
        ...

    def on_heartbeat(self, beat: Heartbeat) -> None: ...

    def on_status_report(self, report: StatusReport) -> None: ...

    def snapshot_for(self, resource: str) -> HealthSnapshot | None:
        """The health snapshot for a worker's request, or None (the resource is going away)."""
        ...

    def on_claim_request(self, request: WorkerRequest) -> None:
        """The DRA worker asks for a ResourceClaim, an MPS claim's daemon or a MIG device made on
        demand; the answer goes back later (`tell`)."""
        ...


Answer = Callable[[Command], Reply]  # a CLI command's reply (supervisor.control.commands.reply_to)


class ControlEndpoint:
    """The bound ROUTER socket plus the route bindings of the current workers.

    The handlers are passed to `drain` by the loop, not held: the worker events need this
    endpoint (to unbind a replaced worker's route, to tell a worker to re-register), and this
    endpoint needs nothing of them between two drains.
    """

    def __init__(self, *, endpoint: str, count: Callable[[str], None] | None = None) -> None:
        self.endpoint = endpoint
        self._count = count or (lambda reason: None)
        self.sock: zmq.Socket[bytes] | None = None
        self._routes: dict[bytes, Binding] = {}  # route -> binding
        self._route_of: dict[str, bytes] = {}  # resource -> route of its current worker
        self._seq = SequenceCounter()
        self.dropped: dict[str, int] = {}
        self.handled = 0

    # ------------------------------------------------------------------ socket
    def open(self) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.bind(self.endpoint)
        self.sock = sock

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(0)
            self.sock = None

    # ------------------------------------------------------------------ bindings
    def route_of(self, resource: str) -> bytes | None:
        return self._route_of.get(resource)

    def unbind(self, resource: str) -> None:
        """The resource's worker is gone or replaced: its route speaks for nobody any more."""
        route = self._route_of.pop(resource, None)
        if route is not None:
            self._routes.pop(route, None)

    def _bind(self, route: bytes, binding: Binding) -> None:
        self.unbind(binding.resource)
        old = self._routes.pop(route, None)
        if old is not None:
            self._route_of.pop(old.resource, None)
        self._routes[route] = binding
        self._route_of[binding.resource] = route

    # ------------------------------------------------------------------ sending
    def send(self, route: list[bytes], message: Message) -> None:
        if self.sock is None:
            return
        try:
            self.sock.send_multipart([*route, *encode(message, seq=self._seq.next())], zmq.NOBLOCK)
        except zmq.Again:
            self._drop("peer not taking messages")  # its queue is full; never block the loop on it

    def tell(self, resource: str, message: Message) -> bool:
        """Send to the resource's current worker; False when it has not said hello yet."""
        route = self._route_of.get(resource)
        if route is None:
            return False
        self.send([route], message)
        return True

    # ------------------------------------------------------------------ receiving
    def drain(self, handlers: ControlHandlers, answer: Answer) -> int:
        """Handle the messages waiting on the socket (at most DRAIN_BATCH); returns how many."""
        if self.sock is None:
            return 0
        n = 0
        while n < DRAIN_BATCH:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            n += 1
            self.receive(frames, handlers, answer)
        return n

    def receive(self, frames: list[bytes], handlers: ControlHandlers, answer: Answer) -> None:
        """One multipart message as the ROUTER delivered it (routing frames first)."""
        try:
            route, body = split_routed(frames)
            message = decode(body).message
        except MessageError as exc:
            log.warning("dropped a malformed control message: %s", exc)
            self._drop("malformed")
            return
        try:
            self._dispatch(route, message, handlers, answer)
            self.handled += 1
        except Exception:  # one message must never end the loop (and with it every resource)
            log.exception("handling a %s control message failed; dropped", message.KIND)
            self._drop("handler failed")

    def _dispatch(
        self, route: list[bytes], message: Message, handlers: ControlHandlers, answer: Answer
    ) -> None:
        if isinstance(message, Command):
            self.send(route, answer(message))
            return
        if isinstance(message, Hello):
            binding = handlers.accept_hello(message)
            if binding is None or len(route) != 1:
                log.warning(
                    "refused a hello from pid %d for %s: not the worker spawned for it",
                    message.pid,
                    message.resource,
                )
                self._drop("hello refused")
                return
            self._bind(route[0], binding)
            handlers.on_bound(binding)
            return
        if not isinstance(message, Heartbeat | StatusReport | SnapshotRequest | WorkerRequest):
            self._drop(f"{message.KIND} is not for the supervisor")
            return
        binding = self._routes.get(route[0]) if len(route) == 1 else None
        pid = message.pid if isinstance(message, Heartbeat) else None
        if (
            binding is None
            or binding.resource != message.resource
            or (pid is not None and pid != binding.pid)
        ):
            self._drop("unbound sender")
            if isinstance(message, Heartbeat):
                log.warning(
                    "a %s worker this supervisor did not start (pid %d) beats: telling it to stop",
                    message.resource,
                    message.pid,
                )
                self.send(route, Shutdown())
            return
        if isinstance(message, Heartbeat):
            handlers.on_heartbeat(message)
        elif isinstance(message, StatusReport):
            handlers.on_status_report(message)
        elif isinstance(message, WorkerRequest):
            handlers.on_claim_request(message)
        else:
            snapshot = handlers.snapshot_for(message.resource)
            if snapshot is not None:
                self.send(route, SnapshotReply(snapshot))

    def _drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        self._count(reason)

    def status(self) -> dict[str, Json]:
        """The control endpoint's own view for `gpuvisor status`."""
        return {"handled": self.handled, "dropped": dict(sorted(self.dropped.items()))}
