"""The worker process: serves one resource plan to the kubelet.

`python -m worker --resource nvidia.com/gpu --plan PLAN.json --kubelet-socket PATH
[--control ipc://... --health ipc://... --supervisor-pid N]`

Started by the supervisor (spawn/exec, never a bare fork), it sets itself up here: logging,
signals, the parent-death signal, its ZeroMQ link to the supervisor. Before the first
ListAndWatch can be answered it holds the current health snapshot of its resource (the clone
pattern, see common.messages): it starts serving at once (worker.registration), registers once
the snapshot is in its book, and applies health deltas as they come. A plan update in place waits for the health snapshot of its devices,
and both go into the book as one change, so no new device is listed before its health is known.
Without --control it runs alone (all devices healthy), which the tests of registration use.

Threads: the main thread owns every ZeroMQ socket (they are not thread-safe) and loops on a
poller; the registrar thread and gRPC's pool talk to it only through a queue plus a wake pipe.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from types import FrameType

from common import logs
from common.exitcodes import EXIT_CONFIG_ERROR, EXIT_FAILURE
from common.imex import ImexChannelMissing
from common.messages import (
    DeviceHealth,
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
from common.procutil import Mailbox, set_parent_death_signal
from worker.healthcopy import ApplyOutcome, ApplyResult, HealthApplier
from worker.process import HEARTBEAT_S, parent_ok, parse_args, read_secret
from worker.registration import SOCKET_CHECK_S, Registrar, RegState
from worker.server import DeviceBook, Health, PluginService
from worker.stats import Stats

log = logging.getLogger("gpuvisor.worker")

STATS_REFRESH_S = 60.0  # unchanged figures are still re-sent this often (a restarted supervisor)
SNAPSHOT_RETRY_S = 1.0
# Alone, no supervisor tells the worker that kubelet.sock was re-created or that its socket went:
# it looks for itself this often (two stat calls), so it recovers within a fraction of a second.
STANDALONE_CHECK_S = 0.25


class Worker:
    def __init__(self, args: argparse.Namespace, plan: ResourcePlan, secret: str = "") -> None:
        self.args = args
        self.plan = plan
        self.secret = secret
        self.stats = Stats()
        self.book = DeviceBook(plan)
        self.service = PluginService(self.book, observe=self.stats.observe, count=self.stats.count)
        self.service.on_streams_changed = self._on_streams_changed
        if args.socket_tag:
            self.service.socket_tag = args.socket_tag
        plugin_dir = os.path.dirname(os.path.abspath(args.kubelet_socket))
        self.registrar = Registrar(
            self.service,
            plugin_dir,
            args.kubelet_socket,
            on_state=self._on_reg_state,
            check_interval=SOCKET_CHECK_S if args.control else STANDALONE_CHECK_S,
            count=self.stats.count,
        )
        self.pid = os.getpid()
        self.stopping = False
        self.mailbox = Mailbox(log)
        self.applier = HealthApplier(d.id for d in plan.devices)
        # A plan update waiting for the health snapshot of its devices (see _update_plan).
        self._pending_plan: ResourcePlan | None = None
        self._seq = SequenceCounter()
        self._snapshot_asked = 0.0
        self._next_heartbeat = 0.0
        self._last_stats: dict[str, float] = {}
        self._stats_refresh_at = 0.0

    # -------------------------------------------------------------- cross-thread plumbing
    def post(self, fn: Callable[[], None]) -> None:
        self.mailbox.post(fn)

    def _on_reg_state(self, state: RegState, detail: str) -> None:
        self.stats.count(f"registrations_{state.value}")

        def tell() -> None:
            self._report(state.value, detail)
            if state in (RegState.REGISTERED, RegState.STOPPED):
                # The supervisor learns of a registration (and our new socket) at once; the
                # passing states wait for the next beat, which keeps a node-wide re-registration
                # (a kubelet restart: every worker at once) light on the supervisor.
                self._next_heartbeat = 0.0

        self.post(tell)

    def _on_streams_changed(self) -> None:
        """From a gRPC thread: the kubelet's stream opened or closed; tell the supervisor now."""

        def beat_now() -> None:
            self._next_heartbeat = 0.0

        self.post(beat_now)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True

    # -------------------------------------------------------------- run
    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGQUIT, self._on_signal)
        # Under a supervisor, Ctrl-C in a terminal reaches the whole process group: the
        # supervisor decides when its workers stop.
        signal.signal(signal.SIGINT, signal.SIG_IGN if self.args.supervisor_pid else self._on_signal)
        signal.set_wakeup_fd(self.mailbox.wakeup_fd, warn_on_full_buffer=False)
        if not self.args.control:
            self.registrar.start()
            return self._loop_standalone()
        import zmq

        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"health")
        self.sub.connect(self.args.health)
        self.dealer = ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.connect(self.args.control)
        self._send(Hello(resource=self.plan.resource, pid=self.pid, secret=self.secret))
        self._ask_snapshot()
        self.registrar.serve()  # the server starts while the snapshot is on its way; no Register yet
        poller = zmq.Poller()
        poller.register(self.sub, zmq.POLLIN)
        poller.register(self.dealer, zmq.POLLIN)
        poller.register(self.mailbox.fileno(), zmq.POLLIN)
        started = False
        try:
            while not self.stopping and self.registrar.failed is None:
                now = time.monotonic()
                if not parent_ok(self.args):
                    log.warning("supervisor (pid %d) is gone: exiting", self.args.supervisor_pid)
                    break
                if now >= self._next_heartbeat:
                    self._heartbeat()
                    self._next_heartbeat = now + self.args.heartbeat_interval
                if self.applier.needs_snapshot and now - self._snapshot_asked >= SNAPSHOT_RETRY_S:
                    self._ask_snapshot()
                timeout_ms = max(0, int((self._next_heartbeat - time.monotonic()) * 1000)) + 1
                events = dict(poller.poll(timeout_ms))
                if self.mailbox.fileno() in events:
                    self.mailbox.drain()
                if self.sub in events:
                    self._drain(self.sub)
                if self.dealer in events:
                    self._drain(self.dealer)
                if not started and self.applier.seq is not None:
                    started = True  # register only once the health snapshot is in the book
                    self.registrar.start()
        finally:
            self.registrar.stop()
            self.sub.close(0)
            self.dealer.close(0)
        return EXIT_FAILURE if self.registrar.failed is not None else 0

    def _loop_standalone(self) -> int:
        import select

        try:
            while not self.stopping and self.registrar.failed is None:
                if not parent_ok(self.args):
                    break
                select.select([self.mailbox.fileno()], [], [], HEARTBEAT_S)
                self.mailbox.drain()
        finally:
            self.registrar.stop()
        return EXIT_FAILURE if self.registrar.failed is not None else 0

    def _drain(self, sock: object) -> None:
        import zmq

        assert isinstance(sock, zmq.Socket)
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
            self._handle(envelope.message)

    # -------------------------------------------------------------- messages
    def _handle(self, message: Message) -> None:
        if isinstance(message, HealthDelta):
            self._apply_result(self.applier.apply_delta(message))
        elif isinstance(message, HealthBeacon):
            self._apply_result(self.applier.apply_beacon(message))
        elif isinstance(message, SnapshotReply):
            if message.snapshot.resource == self.plan.resource:
                result = self.applier.apply_snapshot(message.snapshot)
                if result.outcome is ApplyOutcome.APPLIED:
                    self._sync_book(replace=True, plan=self._pending_plan)
        elif isinstance(message, Reregister):
            self.registrar.trigger(message.reason)
        elif isinstance(message, Shutdown):
            self.stopping = True
        elif isinstance(message, PlanUpdate):
            self._update_plan(message.plan_json, message.snapshot)

    def _apply_result(self, result: ApplyResult) -> None:
        if result.outcome is ApplyOutcome.APPLIED:
            self._sync_book(replace=False, changed=result.changed)
        elif result.outcome is ApplyOutcome.GAP:
            self.stats.count("health_gaps")
            log.warning("health sequence gap: asking the supervisor for a fresh snapshot")
            self._ask_snapshot()

    def _sync_book(
        self, replace: bool, changed: tuple[DeviceHealth, ...] = (), plan: ResourcePlan | None = None
    ) -> None:
        records = self.applier.state.values() if replace else changed
        items = [(r.device_id, Health(r.healthy, r.reason, r.since)) for r in records]
        if plan is not None:
            # The pending plan and the snapshot that covers its devices go in as one change.
            self.book.set_plan(plan, health=items)
            self.plan = plan
            self._pending_plan = None
            bad = sorted(d for d, h in items if not h.healthy)
            log.info(
                "plan updated in place: %d devices; unhealthy now: %s",
                len(plan.devices),
                ", ".join(bad) or "none",
            )
        elif self.book.set_health(items, replace=replace):
            bad = sorted(d for d, h in items if not h.healthy)
            log.info("device health changed; unhealthy now: %s", ", ".join(bad) or "none")

    def _update_plan(self, plan_json: str, snapshot: HealthSnapshot | None) -> None:
        try:
            plan = ResourcePlan.from_json(plan_json)
        except (ValueError, KeyError, TypeError) as exc:
            log.error("refused a plan update that does not parse: %s", exc)
            return
        if plan.resource != self.plan.resource:
            log.error("refused a plan update for another resource (%s)", plan.resource)
            return
        # The book keeps the old list until the health of the new devices is known: a new ID has
        # no health yet and would be listed Healthy by default, possibly wrongly. The supervisor
        # sends that health with the plan; the applier tracks the new IDs from now on, so the plan
        # and its snapshot go in as one change, and deltas that follow apply on top.
        self._pending_plan = plan
        self.applier.set_device_ids(d.id for d in plan.devices)
        if snapshot is not None and snapshot.resource == plan.resource:
            result = self.applier.apply_snapshot(snapshot)
            if result.outcome is ApplyOutcome.APPLIED:
                self._sync_book(replace=True, plan=plan)
                return
        # No snapshot came with it (the supervisor had no health book): ask for one.
        self._ask_snapshot()
        log.info("plan update received (%d devices): waiting for their health snapshot", len(plan.devices))

    def _send(self, message: Message) -> None:
        self.dealer.send_multipart(encode(message, seq=self._seq.next()))

    def _ask_snapshot(self) -> None:
        self._snapshot_asked = time.monotonic()
        self._send(SnapshotRequest(resource=self.plan.resource))

    def _report(self, event: str, detail: str) -> None:
        if self.args.control:
            self._send(StatusReport(resource=self.plan.resource, event=event, detail=detail))

    def _heartbeat(self) -> None:
        server = self.registrar.server
        # The figures travel only when they changed (they are cumulative: the supervisor keeps
        # the last ones it got); an idle worker's heartbeat stays a few dozen bytes.
        # The kubelet's streams on the live server: what the supervisor's readiness waits for.
        stats = self.stats.snapshot(
            streams=server.kubelet_streams if server is not None else 0,
        )
        if stats == self._last_stats and time.monotonic() < self._stats_refresh_at:
            stats = {}
        else:
            self._last_stats = stats
            self._stats_refresh_at = time.monotonic() + STATS_REFRESH_S
        self._send(
            Heartbeat(
                resource=self.plan.resource,
                pid=self.pid,
                state=self.registrar.state.value,
                registered=self.registrar.state is RegState.REGISTERED,
                socket_path=server.path if server else "",
                stats=stats,
            )
        )


def main(argv: list[str] | None = None, secret: str | None = None) -> int:
    """Run a worker; `secret` is handed over in memory by the zygote that forked this process."""
    args = parse_args(argv)
    if secret is None:
        secret = read_secret(args.secret_fd) if args.secret_fd >= 0 else ""
    logs.setup(args.log_format, args.log_level, role="worker", resource=args.resource)
    if args.supervisor_pid and not args.zygote_pid:
        # Exec'd by the supervisor: die with it. (A zygote's child relies on parent_ok() instead,
        # so that a zygote crash does not take the workers down with it.)
        set_parent_death_signal(signal.SIGTERM)
    if not parent_ok(args):  # the parent died before we got here
        return 0
    try:
        with open(args.plan, encoding="utf-8") as fh:
            plan = ResourcePlan.from_json(fh.read())
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.error("cannot load the resource plan %s: %s", args.plan, exc)
        return EXIT_CONFIG_ERROR
    if plan.resource != args.resource:
        log.error("plan %s is for %s, not %s", args.plan, plan.resource, args.resource)
        return EXIT_CONFIG_ERROR
    if plan.dra is not None:  # a DRA kubelet plugin: a device-plugin worker never loads it
        from worker.dra.main import run_dra

        return run_dra(args, plan, secret)
    try:
        worker = Worker(args, plan, secret)
    except ImexChannelMissing as exc:
        # NVIDIA fails its start here (internal/imex/imex.go:53-56); so does this worker.
        log.error("cannot serve %s: %s (imex.required is set)", plan.resource, exc)
        return EXIT_CONFIG_ERROR
    return worker.run()


if __name__ == "__main__":
    sys.exit(main())
