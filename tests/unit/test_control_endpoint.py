"""Tests of the control endpoint (supervisor/control/endpoint.py): decoding, the sender check, typed
dispatch, replies. Messages are fed to `receive` as the ROUTER would deliver them; replies go
to a fake socket."""

from __future__ import annotations

from typing import Any, cast

import zmq

from common.messages import (
    ClaimRequest,
    Command,
    HealthSnapshot,
    Heartbeat,
    Hello,
    Message,
    PlanUpdate,
    Reply,
    Shutdown,
    SnapshotReply,
    SnapshotRequest,
    StatusReport,
    WorkerRequest,
    decode,
    encode,
)
from supervisor.control.endpoint import DRAIN_BATCH, Binding, ControlEndpoint

GPU = "nvidia.com/gpu"
ROUTE_A = b"\x00route-a"
ROUTE_B = b"\x00route-b"


class FakeSocket:
    def __init__(self) -> None:
        self.sent: list[tuple[bytes, Message]] = []
        self.inbox: list[list[bytes]] = []

    def send_multipart(self, frames: list[bytes], flags: int = 0) -> None:
        self.sent.append((frames[0], decode(frames[1:]).message))

    def recv_multipart(self, flags: int = 0) -> list[bytes]:
        if not self.inbox:
            raise zmq.Again()
        return self.inbox.pop(0)


class Handlers:
    """Fake supervisor side: accepts a Hello whose secret is `good` for pid 42."""

    def __init__(self) -> None:
        self.beats: list[Heartbeat] = []
        self.reports: list[StatusReport] = []
        self.bound: list[Binding] = []
        self.claims: list[WorkerRequest] = []
        self.fail_on_beat = False

    def accept_hello(self, hello: Hello) -> Binding | None:
        ok = hello.secret == "good" and hello.pid == 42
        return Binding(hello.resource, hello.pid) if ok else None

    def on_bound(self, binding: Binding) -> None:
        self.bound.append(binding)

    def on_heartbeat(self, beat: Heartbeat) -> None:
        if self.fail_on_beat:
            raise RuntimeError("bug")
        self.beats.append(beat)

    def on_status_report(self, report: StatusReport) -> None:
        self.reports.append(report)

    def snapshot_for(self, resource: str) -> HealthSnapshot | None:
        return HealthSnapshot(seq=3, resource=resource, devices=(), epoch="e") if resource == GPU else None

    def on_claim_request(self, request: WorkerRequest) -> None:
        self.claims.append(request)

    def on_command(self, command: Command) -> Reply:
        return Reply(ok=True, error="", data={"echo": command.name})


def endpoint() -> tuple[ControlEndpoint, Handlers, FakeSocket, list[str]]:
    handlers = Handlers()
    counted: list[str] = []
    ep = ControlEndpoint(endpoint="ipc:///nowhere", count=counted.append)
    sock = FakeSocket()
    ep.sock = cast(Any, sock)
    return ep, handlers, sock, counted


def frames(route: bytes, message: Message) -> list[bytes]:
    return [route, *encode(message, seq=1)]


def beat(pid: int = 42, resource: str = GPU) -> Heartbeat:
    return Heartbeat(resource=resource, pid=pid, state="registered", registered=True, socket_path="/p/x.sock")


def hello(secret: str = "good", pid: int = 42) -> Hello:
    return Hello(resource=GPU, pid=pid, secret=secret)


def test_a_hello_with_the_right_secret_binds_its_route() -> None:
    """After a good Hello, that route's heartbeats reach the handler and the route is the resource's."""
    ep, h, _sock, counted = endpoint()
    ep.receive(frames(ROUTE_A, hello()), h, h.on_command)
    ep.receive(frames(ROUTE_A, beat()), h, h.on_command)
    assert h.bound == [Binding(GPU, 42)] and len(h.beats) == 1
    assert ep.route_of(GPU) == ROUTE_A and counted == []


def test_a_hello_with_a_wrong_secret_binds_nothing_and_is_counted() -> None:
    """A forged Hello (wrong secret) is dropped and counted; the route stays unbound."""
    ep, h, _sock, counted = endpoint()
    ep.receive(frames(ROUTE_A, hello(secret="guess")), h, h.on_command)
    assert h.bound == [] and ep.route_of(GPU) is None
    assert counted == ["hello refused"]


def test_a_heartbeat_from_an_unbound_route_is_dropped_and_told_to_stop() -> None:
    """A worker nobody here spawned (no hello with our secret) is told to shut down; nothing applies."""
    ep, h, sock, counted = endpoint()
    ep.receive(frames(ROUTE_B, beat(pid=999)), h, h.on_command)
    assert h.beats == []
    assert sock.sent == [(ROUTE_B, Shutdown())]
    assert counted == ["unbound sender"]


def test_a_bound_route_cannot_speak_for_another_pid_or_resource() -> None:
    """A message claiming another pid or resource than its route's binding is a forgery: dropped."""
    ep, h, _sock, counted = endpoint()
    ep.receive(frames(ROUTE_A, hello()), h, h.on_command)
    ep.receive(frames(ROUTE_A, beat(pid=43)), h, h.on_command)
    ep.receive(
        frames(ROUTE_A, StatusReport(resource="nvidia.com/mig-1g.10gb", event="registered")), h, h.on_command
    )
    assert h.beats == [] and h.reports == []
    assert counted == ["unbound sender", "unbound sender"]


def test_unbind_makes_a_replaced_workers_late_messages_count_as_strangers() -> None:
    """After the resource's worker is replaced (unbind), its old route's messages are dropped."""
    ep, h, _sock, counted = endpoint()
    ep.receive(frames(ROUTE_A, hello()), h, h.on_command)
    ep.unbind(GPU)
    ep.receive(frames(ROUTE_A, StatusReport(resource=GPU, event="registered")), h, h.on_command)
    assert h.reports == [] and counted == ["unbound sender"]


def test_a_new_binding_replaces_the_old_route_of_the_resource() -> None:
    """The successor's hello takes the resource over: messages go to its route, the old one is unbound."""
    ep, h, sock, _counted = endpoint()
    ep.receive(frames(ROUTE_A, hello()), h, h.on_command)
    ep.receive(frames(ROUTE_B, hello()), h, h.on_command)
    assert ep.route_of(GPU) == ROUTE_B
    assert ep.tell(GPU, PlanUpdate(plan_json="{}"))
    assert sock.sent == [(ROUTE_B, PlanUpdate(plan_json="{}"))]
    ep.receive(frames(ROUTE_A, beat()), h, h.on_command)
    assert sock.sent[1:] == [(ROUTE_A, Shutdown())]


def test_a_snapshot_request_from_a_bound_worker_is_answered() -> None:
    """The worker gets the snapshot of its resource on its own route."""
    ep, h, sock, _counted = endpoint()
    ep.receive(frames(ROUTE_A, hello()), h, h.on_command)
    ep.receive(frames(ROUTE_A, SnapshotRequest(resource=GPU)), h, h.on_command)
    route, message = sock.sent[-1]
    assert route == ROUTE_A and isinstance(message, SnapshotReply) and message.snapshot.seq == 3


def test_a_claim_request_reaches_the_handler_only_from_its_bound_worker() -> None:
    """The DRA worker's ClaimRequest is handed over from its own bound route; from an unbound route,
    or naming another resource, it is dropped and counted (no one else may make the supervisor
    fetch claims)."""
    ep, h, _sock, counted = endpoint()
    request = ClaimRequest(resource=GPU, request_id="1", namespace="default", name="c1")
    ep.receive(frames(ROUTE_B, request), h, h.on_command)
    ep.receive(frames(ROUTE_A, hello()), h, h.on_command)
    ep.receive(frames(ROUTE_A, request), h, h.on_command)
    ep.receive(frames(ROUTE_A, ClaimRequest("nvidia.com/other", "2", "default", "c2")), h, h.on_command)
    assert h.claims == [request]
    assert counted == ["unbound sender", "unbound sender"]


def test_commands_need_no_binding_and_get_a_reply() -> None:
    """The CLI's command (a fresh DEALER) is answered on its route."""
    ep, h, sock, _counted = endpoint()
    ep.receive(frames(ROUTE_B, Command(name="status", args={})), h, h.on_command)
    assert sock.sent == [(ROUTE_B, Reply(ok=True, error="", data={"echo": "status"}))]


def test_malformed_frames_and_wrong_kinds_are_dropped_and_counted() -> None:
    """Bad bytes, and kinds the supervisor never receives, are dropped without an exception."""
    ep, h, sock, counted = endpoint()
    ep.receive([ROUTE_A, b"control", b"{not json"], h, h.on_command)
    ep.receive([b"control"], h, h.on_command)
    ep.receive(frames(ROUTE_A, Shutdown()), h, h.on_command)
    assert sock.sent == []
    assert counted == ["malformed", "malformed", "shutdown is not for the supervisor"]


def test_a_handler_that_raises_does_not_escape() -> None:
    """A bug in a handler is logged and counted; receive() returns normally."""
    ep, h, _sock, counted = endpoint()
    ep.receive(frames(ROUTE_A, hello()), h, h.on_command)
    h.fail_on_beat = True
    ep.receive(frames(ROUTE_A, beat()), h, h.on_command)
    assert counted == ["handler failed"]
    assert ep.status() == {"handled": 1, "dropped": {"handler failed": 1}}


def test_drain_takes_at_most_a_batch_per_call() -> None:
    """A flood is handled a batch at a time, so the loop's other steps still run between batches."""
    ep, h, sock, _counted = endpoint()
    sock.inbox = [frames(ROUTE_B, Command(name="status", args={}))] * (DRAIN_BATCH + 5)
    assert ep.drain(h, h.on_command) == DRAIN_BATCH
    assert ep.drain(h, h.on_command) == 5
    assert ep.drain(h, h.on_command) == 0
