"""The worker's link to its supervisor: its two ZeroMQ sockets and the main loop that serves them.

Both kinds of worker (the device plugin, `worker.main`; the DRA kubelet plugin, `worker.dra.main`)
talk to the supervisor alike, so that part lives here once. A SUB socket takes the health fan-out;
a DEALER says hello with the spawn secret, asks for the health snapshot of the resource, beats and
reports, and takes the supervisor's commands. The worker side of the clone pattern is here too
(common.messages, worker.healthcopy): the snapshot is asked for at once, and again every
SNAPSHOT_RETRY_S while one is needed; deltas and beacons apply on top, and a gap asks for a fresh
snapshot. Only once the first snapshot is in does the worker start registering (`Peer.snapshot_in`),
so its first answer to the kubelet already knows which devices are unhealthy: snapshot, then
only newer deltas.

What differs between the two workers reaches the link through `Peer`, a few hooks. The main thread
owns the sockets and runs `Link.run`; other threads reach it only through the worker's mailbox,
whose fd the loop polls beside the two sockets.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from common.mailbox import Mailbox
from common.messages import (
    DeviceHealth,
    DraBeat,
    HealthBeacon,
    HealthDelta,
    HealthSnapshot,
    Heartbeat,
    Hello,
    Message,
    MessageError,
    PlanUpdate,
    Reregister,
    SequenceCounter,
    Shutdown,
    SnapshotReply,
    SnapshotRequest,
    StatusReport,
    decode,
    encode,
)
from common.model import ResourcePlan
from worker.healthcopy import ApplyOutcome, ApplyResult, HealthApplier
from worker.process import parent_ok
from worker.stats import Stats

if TYPE_CHECKING:
    import zmq

# The workers' logger: the link's lines read as the worker's own, as they did before it was split out.
log = logging.getLogger("gpuvisor.worker")

STATS_REFRESH_S = 60.0  # unchanged figures are still re-sent this often (a restarted supervisor)
SNAPSHOT_RETRY_S = 1.0


def plan_of_update(plan_json: str, resource: str) -> ResourcePlan | None:
    """A PlanUpdate's plan for this worker's `resource`; None, said in the log, when it does not
    parse or is another resource's (the worker keeps its plan)."""
    try:
        plan = ResourcePlan.from_json(plan_json)
    except (ValueError, KeyError, TypeError) as exc:
        log.error("refused a plan update that does not parse: %s", exc)
        return None
    if plan.resource != resource:
        log.error("refused a plan update for another resource (%s)", plan.resource)
        return None
    return plan


@dataclass(frozen=True)
class Beat:
    """What a heartbeat carries besides the resource, the pid and the worker's counters."""

    state: str  # the registration state, as the worker names it
    registered: bool
    socket_path: str
    gauges: Mapping[str, float] = field(default_factory=dict)  # `gauge:<name>` in the figures
    dra: DraBeat | None = None  # the DRA worker's drain and claims (sent in every beat)


class Peer(Protocol):
    """What the link asks of its worker; every hook is called on the main thread, from the loop."""

    def running(self) -> bool:
        """Loop on? False once the worker is stopping or its registration failed for good."""
        ...

    def stop(self) -> None:
        """The supervisor said Shutdown."""
        ...

    def health_applied(self, records: Iterable[DeviceHealth], replace: bool) -> None:
        """Health went into the copy: every device's (a snapshot, `replace`) or the changed ones."""
        ...

    def snapshot_in(self) -> None:
        """The first health snapshot is in: start registering."""
        ...

    def plan_update(self, message: PlanUpdate) -> None: ...

    def reregister(self, reason: str) -> None:
        """The supervisor saw the kubelet restart."""
        ...

    def other_message(self, message: Message) -> None:
        """Any other message the supervisor sent (a DRA worker's ClaimReply)."""
        ...

    def beat(self) -> Beat:
        """What the next heartbeat says."""
        ...

    def closing(self, started: bool) -> None:
        """The loop ended (`started`: registration was started); the sockets are still open."""
        ...


class Link:
    """One worker's sockets to its supervisor, the health copy they keep current, and the loop."""

    def __init__(
        self,
        peer: Peer,
        args: argparse.Namespace,
        resource: str,
        secret: str,
        applier: HealthApplier,
        stats: Stats,
        mailbox: Mailbox,
    ) -> None:
        self.peer = peer
        self.args = args
        self.resource = resource  # a plan update never changes it (the workers refuse one that would)
        self.secret = secret
        self.applier = applier
        self.stats = stats
        self.mailbox = mailbox
        self.pid = os.getpid()
        self.sub: zmq.Socket[bytes] | None = None
        self.dealer: zmq.Socket[bytes] | None = None
        self.started = False  # snapshot_in was called: registration started
        self._seq = SequenceCounter()
        self._snapshot_asked = 0.0
        self._next_heartbeat = 0.0
        self._last_stats: dict[str, float] = {}
        self._stats_refresh_at = 0.0

    # -------------------------------------------------------------- the loop
    def open(self) -> None:
        """Connect both sockets, say hello and ask for the health snapshot (before serving)."""
        import zmq  # the zygote preloads it; a worker without --control never needs it

        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"health")
        self.sub.connect(self.args.health)
        self.dealer = ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.connect(self.args.control)
        self.send(Hello(resource=self.resource, pid=self.pid, secret=self.secret))
        self.ask_snapshot()

    def run(self) -> None:
        """Poll the two sockets and the mailbox until `Peer.running` turns false or the supervisor
        is gone; beat on time; then `Peer.closing`, and the sockets close."""
        import zmq

        sub, dealer = self.sub, self.dealer
        assert sub is not None and dealer is not None, "open() comes first"
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(dealer, zmq.POLLIN)
        poller.register(self.mailbox.fileno(), zmq.POLLIN)
        try:
            while self.peer.running():
                now = time.monotonic()
                if not parent_ok(self.args):
                    log.warning("supervisor (pid %d) is gone: exiting", self.args.supervisor_pid)
                    break
                if now >= self._next_heartbeat:
                    self.heartbeat()
                    self._next_heartbeat = now + self.args.heartbeat_interval
                if self.applier.needs_snapshot and now - self._snapshot_asked >= SNAPSHOT_RETRY_S:
                    self.ask_snapshot()
                timeout_ms = max(0, int((self._next_heartbeat - time.monotonic()) * 1000)) + 1
                events = dict(poller.poll(timeout_ms))
                if self.mailbox.fileno() in events:
                    self.mailbox.drain()
                for sock in (sub, dealer):
                    if sock in events:
                        self.drain(sock)
                if not self.started and self.applier.seq is not None:
                    self.started = True  # register only once the health snapshot is in
                    self.peer.snapshot_in()
        finally:
            self.peer.closing(self.started)
            sub.close(0)
            dealer.close(0)

    def drain(self, sock: zmq.Socket[bytes]) -> None:
        """Handle every message waiting on `sock`; a malformed one is logged, counted and dropped."""
        import zmq

        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                envelope = decode(frames)
            except MessageError as exc:
                log.warning("dropped a malformed message: %s", exc)
                self.stats.count("malformed_messages")
                continue
            self.handle(envelope.message)

    # -------------------------------------------------------------- messages in
    def handle(self, message: Message) -> None:
        if isinstance(message, HealthDelta):
            self._apply_result(self.applier.apply_delta(message))
        elif isinstance(message, HealthBeacon):
            self._apply_result(self.applier.apply_beacon(message))
        elif isinstance(message, SnapshotReply):
            if message.snapshot.resource == self.resource:
                self._apply_snapshot(message.snapshot)
        elif isinstance(message, Reregister):
            self.peer.reregister(message.reason)
        elif isinstance(message, Shutdown):
            self.peer.stop()
        elif isinstance(message, PlanUpdate):
            self.peer.plan_update(message)
        else:
            self.peer.other_message(message)

    def follow(self, device_ids: Iterable[str], snapshot: HealthSnapshot | None = None) -> bool:
        """A plan update's devices: keep their health from now on. Their `snapshot`, when it came
        with the plan, goes in at once (True: the worker's health_applied took the plan and its
        health as one change); otherwise a SnapshotRequest asks for it (False)."""
        ids = list(device_ids)
        self.applier.set_device_ids(ids)
        if snapshot is not None and snapshot.resource == self.resource and self._apply_snapshot(snapshot):
            return True
        log.info("plan update received (%d devices): waiting for their health snapshot", len(ids))
        self.ask_snapshot()
        return False

    def _apply_snapshot(self, snapshot: HealthSnapshot) -> bool:
        if self.applier.apply_snapshot(snapshot).outcome is not ApplyOutcome.APPLIED:
            return False
        self.peer.health_applied(self.applier.state.values(), replace=True)
        return True

    def _apply_result(self, result: ApplyResult) -> None:
        if result.outcome is ApplyOutcome.APPLIED:
            self.peer.health_applied(result.changed, replace=False)
        elif result.outcome is ApplyOutcome.GAP:
            self.stats.count("health_gaps")
            log.warning("health sequence gap: asking the supervisor for a fresh snapshot")
            self.ask_snapshot()

    # -------------------------------------------------------------- messages out
    def send(self, message: Message) -> None:
        assert self.dealer is not None, "open() comes first"
        self.dealer.send_multipart(encode(message, seq=self._seq.next()))

    def ask_snapshot(self) -> None:
        self._snapshot_asked = time.monotonic()
        self.send(SnapshotRequest(resource=self.resource))

    def report(self, event: str, detail: str) -> None:
        """A StatusReport; nothing when the worker runs alone (no --control)."""
        if self.args.control:
            self.send(StatusReport(resource=self.resource, event=event, detail=detail))

    def beat_soon(self) -> None:
        """Beat on the loop's next turn: the supervisor's view follows a change at once."""
        self._next_heartbeat = 0.0

    def heartbeat(self) -> None:
        """Send a heartbeat now; its figures only when they changed (or went unsent too long)."""
        beat = self.peer.beat()
        stats = self.stats.snapshot(**beat.gauges)
        # The figures travel only when they changed (they are cumulative: the supervisor keeps
        # the last ones it got); an idle worker's heartbeat stays a few dozen bytes.
        if stats == self._last_stats and time.monotonic() < self._stats_refresh_at:
            stats = {}
        else:
            self._last_stats = stats
            self._stats_refresh_at = time.monotonic() + STATS_REFRESH_S
        self.send(
            Heartbeat(
                resource=self.resource,
                pid=self.pid,
                state=beat.state,
                registered=beat.registered,
                socket_path=beat.socket_path,
                stats=stats,
                dra=beat.dra,
            )
        )
