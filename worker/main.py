"""The worker process: serves one resource plan to the kubelet.

`python -m worker --resource nvidia.com/gpu --plan PLAN.json --kubelet-socket PATH
[--control ipc://... --health ipc://... --supervisor-pid N]`

Started by the supervisor (spawn/exec, never a bare fork), it sets itself up here: logging,
signals, the parent-death signal, its ZeroMQ link to the supervisor (worker.link, shared with the
DRA worker). Before the first ListAndWatch can be answered it holds the current health snapshot of
its resource (the clone pattern, see common.messages): it starts serving at once
(worker.registration), registers once the link has the snapshot in its book, and applies health
deltas as they come. A plan update in place waits for the health snapshot of its devices, and both
go into the book as one change, so no new device is listed before its health is known.
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
from collections.abc import Callable, Iterable
from types import FrameType

from common import logs
from common.exitcodes import EXIT_CONFIG_ERROR, EXIT_FAILURE
from common.imex import ImexChannelMissing
from common.mailbox import Mailbox
from common.messages import DeviceHealth, HealthSnapshot, Message, PlanUpdate
from common.model import ResourcePlan
from common.procutil import set_parent_death_signal
from common.workerargs import HEARTBEAT_S, parse_args
from worker.devicebook import DeviceBook
from worker.healthboard import Health
from worker.healthcopy import HealthApplier
from worker.link import Beat, Link, plan_of_update
from worker.process import parent_ok, read_secret
from worker.registrar import Registrar, RegState
from worker.registration import SOCKET_CHECK_S, PluginRegistration
from worker.service import PluginService
from worker.stats import Stats

log = logging.getLogger("gpuvisor.worker")

# Alone, no supervisor tells the worker that kubelet.sock was re-created or that its socket went:
# it looks for itself this often (two stat calls), so it recovers within a fraction of a second.
STANDALONE_CHECK_S = 0.25


class Worker:
    def __init__(self, args: argparse.Namespace, plan: ResourcePlan, secret: str = "") -> None:
        self.args = args
        self.plan = plan
        self.stats = Stats()
        self.book = DeviceBook(plan)
        self.service = PluginService(self.book, observe=self.stats.observe, count=self.stats.count)
        self.service.on_streams_changed = self._on_streams_changed
        if args.socket_tag:
            self.service.socket_tag = args.socket_tag
        plugin_dir = os.path.dirname(os.path.abspath(args.kubelet_socket))
        self.registration = PluginRegistration(
            self.service,
            plugin_dir,
            args.kubelet_socket,
            check_interval=SOCKET_CHECK_S if args.control else STANDALONE_CHECK_S,
            count=self.stats.count,
        )
        self.registrar = Registrar(self.registration, on_state=self._on_reg_state)
        self.stopping = False
        self.mailbox = Mailbox(log)
        self.applier = HealthApplier(d.id for d in plan.devices)
        self.link = Link(self, args, plan.resource, secret, self.applier, self.stats, self.mailbox)
        # A plan update waiting for the health snapshot of its devices (see _update_plan).
        self._pending_plan: ResourcePlan | None = None

    # -------------------------------------------------------------- cross-thread plumbing
    def post(self, fn: Callable[[], None]) -> None:
        self.mailbox.post(fn)

    def _on_reg_state(self, state: RegState, detail: str) -> None:
        self.stats.count(f"registrations_{state.value}")

        def tell() -> None:
            self.link.report(state.value, detail)
            if state in (RegState.REGISTERED, RegState.STOPPED):
                # The supervisor learns of a registration (and our new socket) at once; the
                # passing states wait for the next beat, which keeps a node-wide re-registration
                # (a kubelet restart: every worker at once) light on the supervisor.
                self.link.beat_soon()

        self.post(tell)

    def _on_streams_changed(self) -> None:
        """From a gRPC thread: the kubelet's stream opened or closed; tell the supervisor now."""
        self.post(self.link.beat_soon)

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
        self.link.open()
        self.registrar.serve()  # the server starts while the snapshot is on its way; no Register yet
        self.link.run()
        return EXIT_FAILURE if self.registrar.failed is not None else 0

    def _loop_standalone(self) -> int:
        import select

        try:
            while self.running():
                if not parent_ok(self.args):
                    break
                select.select([self.mailbox.fileno()], [], [], HEARTBEAT_S)
                self.mailbox.drain()
        finally:
            self.registrar.stop()
        return EXIT_FAILURE if self.registrar.failed is not None else 0

    # -------------------------------------------------------------- the link's hooks (worker.link.Peer)
    def running(self) -> bool:
        return not self.stopping and self.registrar.failed is None

    def stop(self) -> None:
        self.stopping = True

    def snapshot_in(self) -> None:
        self.registrar.start()

    def reregister(self, reason: str) -> None:
        self.registrar.trigger(reason)

    def plan_update(self, message: PlanUpdate) -> None:
        self._update_plan(message.plan_json, message.snapshot)

    def other_message(self, message: Message) -> None:
        """Nothing else is meant for a device-plugin worker."""

    def closing(self, started: bool) -> None:
        self.registrar.stop()

    def health_applied(self, records: Iterable[DeviceHealth], replace: bool) -> None:
        items = [(r.device_id, Health(r.healthy, r.reason, r.since)) for r in records]
        plan = self._pending_plan if replace else None
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

    def beat(self) -> Beat:
        server = self.registration.server
        # The kubelet's streams on the live server: what the supervisor's readiness waits for.
        return Beat(
            state=self.registrar.state.value,
            registered=self.registrar.state is RegState.REGISTERED,
            socket_path=server.path if server else "",
            gauges={"streams": server.kubelet_streams if server is not None else 0},
        )

    # -------------------------------------------------------------- plan updates
    def _update_plan(self, plan_json: str, snapshot: HealthSnapshot | None) -> None:
        plan = plan_of_update(plan_json, self.plan.resource)
        if plan is None:
            return
        # The book keeps the old list until the health of the new devices is known: a new ID has
        # no health yet and would be listed Healthy by default, possibly wrongly. The supervisor
        # sends that health with the plan; the applier tracks the new IDs from now on, so the plan
        # and its snapshot go in as one change, and deltas that follow apply on top.
        self._pending_plan = plan
        self.link.follow((d.id for d in plan.devices), snapshot)


def main(
    argv: list[str] | None = None, secret: str | None = None, *, args: argparse.Namespace | None = None
) -> int:
    """Run a worker; a zygote that forked this process hands over `args` (parsed before the fork)
    and `secret` in memory."""
    if args is None:
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
