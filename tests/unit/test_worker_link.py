"""Tests of the worker's link to its supervisor (worker/link.py), which both kinds of worker run on.

The message handling is fed through a fake socket; the loop runs on real ZeroMQ sockets over
inproc (in a thread of this process: no process is started), with this test as the supervisor.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import pytest
import zmq

from common.mailbox import Mailbox
from common.messages import (
    ClaimReply,
    DeviceHealth,
    DraBeat,
    HealthBeacon,
    HealthDelta,
    HealthSnapshot,
    Heartbeat,
    Hello,
    Message,
    PlanUpdate,
    Reregister,
    Shutdown,
    SnapshotReply,
    SnapshotRequest,
    StatusReport,
    decode,
    encode,
)
from common.workerargs import parse_args
from supervisor.config import config_from_data
from supervisor.node.planning import plan_resources
from tests import nodes
from tests.helpers import wait_until
from worker import link as link_module
from worker.healthcopy import HealthApplier
from worker.link import Beat, Link, plan_of_update
from worker.stats import Stats

GPU = "nvidia.com/gpu"
DEVICES = ("gpu-0", "gpu-1")


def h(device: str, healthy: bool, reason: str = "") -> DeviceHealth:
    return DeviceHealth(device_id=device, healthy=healthy, reason=reason, since=1.0)


def snapshot(seq: int, *devices: DeviceHealth, resource: str = GPU) -> HealthSnapshot:
    return HealthSnapshot(seq=seq, resource=resource, devices=devices, epoch="e")


def delta(seq: int, *changes: DeviceHealth) -> HealthDelta:
    return HealthDelta(seq=seq, changes=changes, epoch="e")


@dataclass
class FakePeer:
    """A worker as the link sees it: records each hook call."""

    calls: list[tuple[Any, ...]] = field(default_factory=list)
    go: bool = True
    beat_says: Beat = field(default_factory=lambda: Beat("registered", True, "/p/gpu.sock", {"streams": 1}))
    started: threading.Event = field(default_factory=threading.Event)

    def running(self) -> bool:
        return self.go

    def stop(self) -> None:
        self.calls.append(("stop",))
        self.go = False

    def health_applied(self, records: Iterable[DeviceHealth], replace: bool) -> None:
        self.calls.append(("health", tuple(records), replace))

    def snapshot_in(self) -> None:
        self.calls.append(("snapshot_in",))
        self.started.set()

    def plan_update(self, message: PlanUpdate) -> None:
        self.calls.append(("plan", message))

    def reregister(self, reason: str) -> None:
        self.calls.append(("reregister", reason))

    def other_message(self, message: Message) -> None:
        self.calls.append(("other", message))

    def beat(self) -> Beat:
        return self.beat_says

    def closing(self, started: bool) -> None:
        self.calls.append(("closing", started))

    def health(self) -> list[tuple[Any, ...]]:
        return [c for c in self.calls if c[0] == "health"]


class FakeSocket:
    """The DEALER (what the link sends) and a receiving socket (what `drain` reads)."""

    def __init__(self, *inbox: list[bytes]) -> None:
        self.inbox = list(inbox)
        self.sent: list[Message] = []

    def send_multipart(self, frames: list[bytes], flags: int = 0) -> None:
        self.sent.append(decode(frames).message)

    def recv_multipart(self, flags: int = 0) -> list[bytes]:
        if not self.inbox:
            raise zmq.Again()
        return self.inbox.pop(0)


def make_link(peer: FakePeer, *extra: str, supervisor: Supervisor | None = None, alone: bool = False) -> Link:
    """A link as a worker makes it; `supervisor` the one it connects to, `alone` none (no --control)."""
    argv = ["--resource", GPU, "--plan", "unused", "--heartbeat-interval", "0.05", *extra]
    if supervisor is not None:
        argv += ["--control", supervisor.control_at, "--health", supervisor.health_at]
    elif not alone:
        argv += ["--control", "inproc://unused-control", "--health", "inproc://unused-health"]
    return Link(
        peer,
        parse_args(argv),
        GPU,
        "s3cret",
        HealthApplier(DEVICES),
        Stats(),
        Mailbox(logging.getLogger("test.link")),
    )


@pytest.fixture
def fed() -> Iterator[tuple[Link, FakePeer, FakeSocket]]:
    """A link whose DEALER is a fake socket; messages are fed through `feed`."""
    peer = FakePeer()
    link = make_link(peer)
    dealer = FakeSocket()
    link.dealer = cast("zmq.Socket[bytes]", dealer)
    yield link, peer, dealer
    link.mailbox.close()


def feed(link: Link, *messages: Message | list[bytes]) -> None:
    frames = [m if isinstance(m, list) else encode(m, seq=n) for n, m in enumerate(messages, 1)]
    link.drain(cast("zmq.Socket[bytes]", FakeSocket(*frames)))


# --------------------------------------------------------------------------- messages in


def test_a_malformed_message_is_logged_counted_and_dropped(
    fed: tuple[Link, FakePeer, FakeSocket], caplog: pytest.LogCaptureFixture
) -> None:
    """Two bad messages are dropped with a warning and a count; the good one after them applies."""
    link, _, _ = fed
    with caplog.at_level(logging.WARNING, logger="gpuvisor.worker"):
        feed(link, [b"health", b"\xff\xfe"], [b"health", b'{"v":1,"seq":1}'], SnapshotReply(snapshot(7)))
    assert link.stats.snapshot()["count:malformed_messages"] == 2
    assert caplog.text.count("dropped a malformed message") == 2
    assert link.applier.seq == 7


def test_health_is_the_snapshot_then_only_newer_deltas(fed: tuple[Link, FakePeer, FakeSocket]) -> None:
    """A delta before the snapshot waits for it; the snapshot goes in whole (replace), and later
    deltas go in as their changes; one at or before the snapshot's seq is dropped."""
    link, peer, _ = fed
    feed(link, delta(4, h("gpu-1", False, "early")))
    assert peer.health() == []  # nothing applied before the snapshot
    feed(link, SnapshotReply(snapshot(3, h("gpu-0", True), h("gpu-1", True))))
    [(_, records, replace)] = peer.health()
    assert replace and {r.device_id: r.healthy for r in records} == {"gpu-0": True, "gpu-1": False}
    feed(link, delta(4, h("gpu-0", False, "stale")), delta(5, h("gpu-0", False, "XID 48")))
    assert peer.health()[-1] == ("health", (h("gpu-0", False, "XID 48"),), False)
    assert len(peer.health()) == 2
    assert link.applier.health_of("gpu-0") == h("gpu-0", False, "XID 48")


def test_a_gap_counts_and_asks_for_a_fresh_snapshot(
    fed: tuple[Link, FakePeer, FakeSocket], caplog: pytest.LogCaptureFixture
) -> None:
    """A delta that skips one, or a beacon ahead of the copy (a lost last delta), is a gap."""
    link, peer, dealer = fed
    feed(link, SnapshotReply(snapshot(1, h("gpu-0", True))))
    with caplog.at_level(logging.WARNING, logger="gpuvisor.worker"):
        feed(link, delta(3, h("gpu-0", False)))  # 2 was lost
        assert dealer.sent == [SnapshotRequest(resource=GPU)] and link.applier.needs_snapshot
        feed(link, SnapshotReply(snapshot(3, h("gpu-0", False))))
        feed(link, HealthBeacon(seq=9, epoch="e"))
    assert link.stats.snapshot()["count:health_gaps"] == 2
    assert caplog.text.count("health sequence gap: asking the supervisor for a fresh snapshot") == 2
    assert dealer.sent == [SnapshotRequest(resource=GPU)] * 2
    assert link.applier.needs_snapshot and [c[2] for c in peer.health()] == [True, True]


def test_a_snapshot_of_another_resource_is_not_taken(fed: tuple[Link, FakePeer, FakeSocket]) -> None:
    """A snapshot naming another resource is not this worker's health: nothing applies."""
    link, peer, _ = fed
    feed(link, SnapshotReply(snapshot(1, h("gpu-0", False), resource="nvidia.com/other")))
    assert link.applier.seq is None and peer.health() == []


def test_the_supervisors_commands_reach_their_hooks(fed: tuple[Link, FakePeer, FakeSocket]) -> None:
    """Reregister, PlanUpdate, Shutdown and any other command each reach the worker's own hook, in order."""
    link, peer, _ = fed
    update = PlanUpdate('{"resource": "x"}')
    reply = ClaimReply(request_id="r1", error="no")
    feed(link, Reregister(reason="kubelet restarted"), update, reply, Shutdown())
    assert peer.calls == [("reregister", "kubelet restarted"), ("plan", update), ("other", reply), ("stop",)]


def test_a_plan_update_with_its_snapshot_goes_in_without_asking(
    fed: tuple[Link, FakePeer, FakeSocket],
) -> None:
    """A plan update that brings its devices' health replaces the copy without asking for a snapshot."""
    link, peer, dealer = fed
    feed(link, SnapshotReply(snapshot(1, h("gpu-0", True), h("gpu-1", True))))
    assert link.follow(["gpu-0", "gpu-2"], snapshot(2, h("gpu-0", True), h("gpu-2", False)))
    assert peer.health()[-1] == ("health", (h("gpu-0", True), h("gpu-2", False)), True)
    assert dealer.sent == [] and not link.applier.needs_snapshot


def test_a_plan_update_without_a_snapshot_asks_for_one(fed: tuple[Link, FakePeer, FakeSocket]) -> None:
    """Its devices' health is not known yet: nothing applies until the asked-for snapshot."""
    link, peer, dealer = fed
    feed(link, SnapshotReply(snapshot(1, h("gpu-0", True))))
    assert not link.follow(["gpu-0", "gpu-2"])
    assert not link.follow(["gpu-2"], snapshot(2, h("gpu-2", True), resource="nvidia.com/other"))
    assert dealer.sent == [SnapshotRequest(resource=GPU)] * 2
    assert link.applier.needs_snapshot and len(peer.health()) == 1


def test_a_plan_update_is_taken_only_for_this_resource_and_when_it_parses(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """plan_of_update: the plan of a PlanUpdate for this worker's resource; one that does not
    parse, or is another resource's, is refused with a log line that says which (None)."""
    plan = plan_resources(nodes.pcie_l4(), config_from_data(None))[GPU]
    assert plan_of_update(plan.to_json(), GPU) == plan
    with caplog.at_level(logging.ERROR, logger="gpuvisor.worker"):
        assert plan_of_update("{not json", GPU) is None
        assert plan_of_update(plan.to_json(), "nvidia.com/mig-1g.10gb") is None
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "refused a plan update that does not parse",
        f"refused a plan update for another resource ({GPU})",
    ]


# --------------------------------------------------------------------------- messages out


def test_a_heartbeat_carries_the_figures_only_when_they_changed(
    fed: tuple[Link, FakePeer, FakeSocket],
) -> None:
    """The first beat carries the figures; a beat with none changed carries none; a change sends all."""
    link, _, dealer = fed
    link.heartbeat()
    link.heartbeat()
    link.stats.count("something")
    link.heartbeat()
    first, second, third = cast(list[Heartbeat], dealer.sent)
    assert (first.resource, first.pid, first.state, first.registered) == (
        GPU,
        os.getpid(),
        "registered",
        True,
    )
    assert first.socket_path == "/p/gpu.sock" and first.stats == {"gauge:streams": 1.0}
    assert second.stats == {}  # unchanged: the supervisor keeps the last figures it got
    assert third.stats == {"gauge:streams": 1.0, "count:something": 1.0}


def test_the_dra_part_goes_in_every_beat(fed: tuple[Link, FakePeer, FakeSocket]) -> None:
    """The DRA part of a beat travels in each heartbeat, unchanged figures or not (the supervisor
    plans on it); a device-plugin worker's beat has none."""
    link, peer, dealer = fed
    link.heartbeat()
    part = DraBeat(draining=True, prepared_claims=1, claims_changes=3)
    peer.beat_says = dataclasses.replace(peer.beat_says, dra=part)
    link.heartbeat()
    link.heartbeat()
    first, second, third = cast(list[Heartbeat], dealer.sent)
    assert first.dra is None and second.dra == third.dra == part
    assert third.stats == {}  # the figures did not change: they stay at home


def test_a_status_report_goes_out_only_under_a_supervisor(fed: tuple[Link, FakePeer, FakeSocket]) -> None:
    """A status report goes to the supervisor; a worker run alone has no one to send it to and
    does not fail."""
    link, _, dealer = fed
    link.report("registered", "endpoint x")
    assert dealer.sent == [StatusReport(GPU, "registered", "endpoint x")]
    alone = make_link(FakePeer(), alone=True)
    try:
        alone.report("registered", "endpoint x")  # no DEALER, and nothing to send it to
    finally:
        alone.mailbox.close()


# --------------------------------------------------------------------------- the loop


class Supervisor:
    """This test as the supervisor: a ROUTER for control and a PUB for health, over inproc."""

    def __init__(self, name: str) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.control_at, self.health_at = f"inproc://link-{name}-control", f"inproc://link-{name}-health"
        self.router = ctx.socket(zmq.ROUTER)
        self.router.bind(self.control_at)
        self.pub = ctx.socket(zmq.PUB)
        self.pub.bind(self.health_at)
        self.route = b""

    def receive(self, timeout_s: float = 10.0) -> Message:
        assert self.router.poll(int(timeout_s * 1000)), "the worker sent nothing"
        route, *frames = self.router.recv_multipart()
        self.route = route
        return decode(frames).message

    def receive_a(self, kind: type[Message], timeout_s: float = 10.0) -> Message:
        """The next message of `kind`, past heartbeats, within `timeout_s` in all."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            message = self.receive(left)
            if isinstance(message, kind):
                return message
            assert isinstance(message, Heartbeat), message
        raise AssertionError(f"no {kind.__name__} within {timeout_s} s, only heartbeats")

    def send(self, message: Message) -> None:
        self.router.send_multipart([self.route, *encode(message, seq=1)])

    def close(self) -> None:
        self.router.close(0)
        self.pub.close(0)


@pytest.fixture
def supervisor(request: pytest.FixtureRequest) -> Iterator[Supervisor]:
    sup = Supervisor(request.node.name)
    yield sup
    sup.close()


def run_in_thread(link: Link) -> threading.Thread:
    """The link's loop in a thread that owns its sockets, as the worker's main thread does."""

    def main() -> None:
        link.open()
        link.run()

    thread = threading.Thread(target=main, name="link-loop", daemon=True)
    thread.start()
    return thread


def test_the_loop_says_hello_and_starts_registration_once_the_snapshot_is_in(supervisor: Supervisor) -> None:
    """Hello, a snapshot request and a beat go out at once; registration starts only once the
    snapshot is in; deltas on the PUB then apply; Shutdown ends the loop, closing once."""
    peer = FakePeer()
    link = make_link(peer, supervisor=supervisor)
    thread = run_in_thread(link)
    try:
        assert supervisor.receive() == Hello(resource=GPU, pid=os.getpid(), secret="s3cret")
        assert supervisor.receive() == SnapshotRequest(resource=GPU)
        assert isinstance(supervisor.receive(), Heartbeat)  # the first beat goes at once
        assert not peer.started.is_set()  # no registration before the snapshot
        supervisor.send(SnapshotReply(snapshot(5, h("gpu-0", True), h("gpu-1", True))))
        assert peer.started.wait(10)

        def published() -> bool:  # the SUB's subscription reaches the PUB when it does: resend
            supervisor.pub.send_multipart(encode(delta(6, h("gpu-1", False, "XID 79")), seq=2))
            return link.applier.seq == 6

        assert wait_until(published, 10)
        supervisor.send(Shutdown())
        thread.join(10)
        assert not thread.is_alive()
        assert peer.calls.count(("snapshot_in",)) == 1
        assert peer.calls[-1] == ("closing", True)
        assert link.applier.health_of("gpu-1") == h("gpu-1", False, "XID 79")
    finally:
        peer.go = False
        link.mailbox.post(lambda: None)  # wake the loop, should the test have failed before
        thread.join(10)
        link.mailbox.close()


def test_the_loop_asks_again_while_no_snapshot_comes(
    supervisor: Supervisor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While no snapshot comes, the loop asks again at the retry interval and does not register."""
    monkeypatch.setattr(link_module, "SNAPSHOT_RETRY_S", 0.05)
    peer = FakePeer()
    link = make_link(peer, supervisor=supervisor)
    thread = run_in_thread(link)
    try:
        assert isinstance(supervisor.receive(), Hello)
        assert supervisor.receive_a(SnapshotRequest) == SnapshotRequest(resource=GPU)
        assert supervisor.receive_a(SnapshotRequest) == SnapshotRequest(resource=GPU)  # asked again
        assert not peer.started.is_set()
    finally:
        peer.go = False
        link.mailbox.post(lambda: None)
        thread.join(10)
        link.mailbox.close()
    assert not thread.is_alive() and peer.calls[-1] == ("closing", False)


def test_the_loop_ends_when_the_supervisor_is_gone(
    supervisor: Supervisor, caplog: pytest.LogCaptureFixture
) -> None:
    """A parent that is not the supervisor any more (here: a pid that never was our parent)."""
    peer = FakePeer()
    gone = str(os.getpid())  # our own pid is never our parent
    link = make_link(peer, "--supervisor-pid", gone, supervisor=supervisor)
    with caplog.at_level(logging.WARNING, logger="gpuvisor.worker"):
        thread = run_in_thread(link)
        try:
            thread.join(10)
            assert not thread.is_alive(), "the loop went on without its supervisor"
        finally:
            peer.go = False
            link.mailbox.post(lambda: None)  # wake the loop, should the test have failed before
            thread.join(10)
            link.mailbox.close()
    assert f"supervisor (pid {gone}) is gone: exiting" in caplog.text
    assert peer.calls == [("closing", False)]
