"""The supervisor process (`gpuvisor run`): a small loop that wires the parts.

The loop owns every ZeroMQ socket and all mutable state; other threads (the NVML monitor, the
watchdog observers, the MPS thread) and signal handlers only enqueue (a callable on the
mailbox, a signal number on a list) and wake it. Each turn (`turn()`) reads as what it does, as
gunicorn's `Arbiter.run`: `handle_signals()`, `tend_workers()` (reap and restart workers),
`timers.run_due()` (one scheduler holds every deadline: backoffs, beacons, rediscovery, NVML and
reload retries), `hub.tick()` (health recoveries), `check_ready()`, then `wait()` for the next
event and, for what woke it, `mailbox.drain()`, `drain_control()` and `spawner.pump()`; a turn
that decides to stop ends there, without waiting. A step that raises is logged with its cause and counted (`gpuvisor_housekeeping_errors_total`); it
never ends the loop, which would take every resource of the node away.

`Supervisor.__init__` is the list of parts (supervisor/__init__.py says what each package
owns) in four groups, each built once with its neighbours by keyword; none is patched
afterwards. The cluster side (the node's config label, health on the Node, the DRA driver's
ResourceSlices and claims) starts from the loop once the kubelet path is up, and loads the
API-server layer only then.

A switch between the device plugin and DRA is a reload like any other; what keeps a device from
being handed out twice is planned (supervisor/node/planning.py): from DRA, the DRA worker drains
first and the device plugin gets only what no prepared claim holds (supervisor/dra/drain.py: the
DRA worker's checkpoint, once its heartbeat confirms the drain); to DRA, the slices leave out what
the device plugin's containers hold and go out only once its workers are gone (supervisor/dra/side.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
from collections.abc import Callable
from functools import partial
from types import FrameType

from common.exitcodes import EXIT_CONFIG_ERROR, EXIT_FAILURE
from common.mailbox import Mailbox
from common.messages import Json
from supervisor.cdi.sync import CdiSync
from supervisor.cluster.side import ClusterSide, ProcessLimiter, api_client
from supervisor.config import Config
from supervisor.control.commands import CommandTarget, reply_to
from supervisor.control.endpoint import ControlEndpoint
from supervisor.desired.discovery import NvmlSession, StartupError
from supervisor.desired.follow import Follow, worker_policy
from supervisor.desired.reconcile import Reconciler
from supervisor.desired.replan import Replanner
from supervisor.dra.side import DraSide
from supervisor.health.book import ChangeBatch
from supervisor.health.hub import BEACON_S, HealthHub
from supervisor.health.policy import HealthPolicy, PolicyError
from supervisor.host.rundir import RunDir, RunDirError, WorkerSockets
from supervisor.host.sdnotify import Notifier
from supervisor.host.watches import Watches
from supervisor.labels.sync import NodeLabels
from supervisor.mps.wiring import MpsWiring
from supervisor.observe import status
from supervisor.observe.http import AddressError, ProbeServer, loop_liveness
from supervisor.observe.metrics import Metrics
from supervisor.scheduler import Clock, Poller, Scheduler, SystemClock
from supervisor.workers.events import WorkerEvents
from supervisor.workers.lifecycle import WorkerHandle, WorkerSet, WState
from supervisor.workers.spawner import WorkerSpawner
from supervisor.workers.zygote import become_subreaper

__all__ = ["StartupError", "Supervisor"]

log = logging.getLogger("gpuvisor.supervisor")

# The longest the loop sleeps (timers and events wake it sooner): the beacon's first period. What
# is polled per turn (transient recoveries, held event lines, the systemd watchdog ping, liveness)
# takes seconds to be due.
TICK_S = BEACON_S
# While no health condition is held and no event line waits to be summarised, nothing polled per
# turn can come due by time alone: the loop sleeps up to this long (its own events, the workers'
# heartbeats and every timer still wake it at once; the systemd watchdog's ping is waited for).
IDLE_TICK_S = 10.0
SHUTDOWN_GRACE_S = 4.0  # SIGTERM to workers, then SIGKILL: the whole stop stays under 5 s


def startup_policy(config: Config) -> HealthPolicy:
    """The health policy to start with; a bad one is a config error at start (exit 78)."""
    try:
        return HealthPolicy.from_config(config)
    except PolicyError as exc:
        raise StartupError(f"config error: gpuvisor.health: {exc}", EXIT_CONFIG_ERROR) from None


class Supervisor:
    """The loop and its parts. The constructor reads as the list of parts, built in four groups
    (each its own method below, in the order the parts need each other): the loop's own tools,
    the node (NVML and health), the workers and the parts that follow the plans, and the desired
    state with everything that asks for a change or looks in from outside."""

    def __init__(
        self,
        config: Config,
        *,
        argv_flags: argparse.Namespace | None = None,
        environ: dict[str, str] | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.environ = dict(os.environ) if environ is None else environ
        self.clock = clock or SystemClock()
        self._build_loop_tools(config)
        self._build_node(config)
        follow = self._build_workers(config)
        self._build_desired_state(config, follow, argv_flags)
        self._build_outside(config)
        # The loop's own state.
        self.signals: list[int] = []  # filled by the handlers, emptied by handle_signals()
        self.stopping = False
        self.started_at = self.clock.time()
        self.last_loop = self.clock.monotonic()
        self.exit_error: StartupError | None = None  # a start-up failure found later (NVML came up)
        self.poller = Poller(lambda: (self.mailbox.fileno(), self.control.sock, self.spawner.fileno()))

    def _build_loop_tools(self, config: Config) -> None:
        """Metrics, the one scheduler, the mailbox other threads post to, the run dir and the
        record of the sockets our workers may leave."""
        self.metrics = Metrics()
        self.timers = Scheduler(self.clock, on_error=self.metrics.housekeeping_error)
        self.mailbox = Mailbox(log, on_error=partial(self.metrics.housekeeping_error, "mailbox"))
        self.rundir = RunDir(config.run_dir)
        self.plugin_dir = os.path.dirname(os.path.abspath(config.kubelet_socket))
        self.sockets = WorkerSockets(self.plugin_dir, self.rundir.sockets_record)

    def _build_node(self, config: Config) -> None:
        """NVML (or the simulator) and the health hub that owns the health book and its PUB socket."""
        self.nvml = NvmlSession(config, self.environ, on_error=self.metrics.nvml_error)
        self.hub = HealthHub(
            endpoint=self.rundir.health_endpoint,
            policy=startup_policy(config),
            metrics=self.metrics,
            clock=self.clock,
            epoch=os.urandom(6).hex(),
            post=self.mailbox.post,
            listeners=(self.on_health_decision,),
        )
        self.hub.on_change = self.beacon_soon

    def _build_workers(self, config: Config) -> Follow:
        """The control socket, the worker processes and the parts that follow each plan: MPS
        daemons, the CDI spec, the node labels file. Returns the followers, for the reconciler."""
        self.control = ControlEndpoint(
            endpoint=self.rundir.control_endpoint, count=self.metrics.control_message_dropped
        )
        self.spawner = WorkerSpawner(config=config, rundir=self.rundir, record_tag=self.sockets.add)
        self.workers = WorkerSet(
            spawner=self.spawner, policy=worker_policy(config), listeners=(self.on_worker_state,)
        )
        self.mps = MpsWiring(
            config=config,
            environ=self.environ,
            nvml_module=self.nvml.module,
            hub=self.hub,
            post=self.mailbox.post,
        )
        self.cdi = CdiSync(config=config, timers=self.timers)
        self.labels = NodeLabels(
            nvml_module=self.nvml.module, simulated=self.nvml.simulator is not None, timers=self.timers
        )
        return Follow(
            nvml_module=self.nvml.module,
            hub=self.hub,
            mps=self.mps,
            cdi=self.cdi,
            labels=self.labels,
            spawner=self.spawner,
            workers=self.workers,
            metrics=self.metrics,
            after_plans=(self.on_plans_applied,),
        )

    def _build_desired_state(
        self, config: Config, follow: Follow, argv_flags: argparse.Namespace | None
    ) -> None:
        """The reconciler (the one owner of the running config and plans) and the replanner that
        turns a start, a reload or a rediscovery into what it should take."""
        self.reconciler = Reconciler(
            config=config,
            plan_files=self.rundir,
            workers=self.workers,
            tell=self.control.tell,
            snapshot=self.hub.snapshot,
            follow=follow,
            timers=self.timers,
            on_pending=self.metrics.set_pending_reload,
            on_refused=self.metrics.reload_refused,
            on_error=self.metrics.housekeeping_error,
        )
        self.replan = Replanner(
            argv_flags=argv_flags,
            environ=self.environ,
            nvml=self.nvml,
            reconciler=self.reconciler,
            mps=self.mps,
            timers=self.timers,
            on_fatal=self.stop_with,
            remember_label=self.rundir.remember_node_label,
            recalled_label=self.rundir.recall_node_label,
            # The DRA side is built below, with the replanner it plans again through.
            dra_hold=lambda config: self.dra.hold(config),
        )

    def _build_outside(self, config: Config) -> None:
        """What reaches the supervisor from outside, or looks in: worker messages and CLI commands,
        the file watches, the cluster side (the node's label, health on the Node), the probes."""
        limiter = ProcessLimiter(config.kube_api_qps, config.kube_api_burst)  # one for the process
        self.dra = DraSide(
            node_name=config.node_name,
            plugin_dir=self.plugin_dir,
            pod_resources_socket=config.pod_resources_socket,
            metrics=self.metrics,
            # From the claim fetcher's threads: the loop sends (a worker gone meanwhile asks again).
            reply=lambda resource, reply: self.mailbox.post(partial(self.control.tell, resource, reply)),
            workers=self.workers,
            reconciler=self.reconciler,
            connect=partial(api_client, config.kubeconfig, self.environ, self.metrics, limiter),
            timers=self.timers,
            post=self.mailbox.post,
            rediscover=self.replan.rediscover,
            kubelet_plugins_dir=config.kubelet_plugins_dir,
            mps=self.mps,  # an MPS claim's daemon runs as the MPS resources' daemons do
            mig_maker=self.nvml.mig_maker,  # MIG devices made on demand, through the one NVML
        )
        self.events = WorkerEvents(
            workers=self.workers,
            reconciler=self.reconciler,
            control=self.control,
            hub=self.hub,
            metrics=self.metrics,
            clock=self.clock,
            sockets=self.sockets,
            claims=self.dra.request_claim,
            on_dra=(self.dra.worker_beat,),
        )
        self.commands = CommandTarget(
            status=self.status,
            replan=self.replan,
            reconciler=self.reconciler,
            health=self.hub,
            faults=self.nvml.simulator,
        )
        self.watches = Watches(
            plugin_dir=self.plugin_dir,
            config_file=config.config_file,
            config_dir=config.config_file_srcdir,
            post=self.mailbox.post,
            on_kubelet=self.kubelet_created,
            on_deleted=self.events.file_deleted,
            on_config=self.replan.config_event,
        )
        self.cluster = ClusterSide(
            config=config,
            environ=self.environ,
            hub=self.hub,
            metrics=self.metrics,
            timers=self.timers,
            post=self.mailbox.post,
            on_label=self.replan.node_label,
            parts={"dra": self.dra},
            limiter=limiter,
        )
        self.metrics.set_config(config.config_name, config.config_source)
        self.notifier = Notifier(self.environ)
        self.readiness = status.ReadinessCell(
            lambda ready, detail: self.metrics.set_ready(ready), self.notifier.update
        )
        self.http: ProbeServer | None = None
        if config.metrics_address:
            self.http = ProbeServer(
                address=config.metrics_address,
                render=self.metrics.render,
                liveness=loop_liveness(lambda: self.last_loop),
                readiness=self.readiness,
            )

    @property
    def config(self) -> Config:
        """The running config (the reconciler owns it)."""
        return self.reconciler.config

    # ------------------------------------------------------------------ run
    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, self._on_signal)
        signal.set_wakeup_fd(self.mailbox.wakeup_fd, warn_on_full_buffer=False)
        log.info(
            "gpuvisor starting (pid %d): %s", os.getpid(), json.dumps(self.config.describe(), sort_keys=True)
        )
        if self.config.unknown_keys:
            log.warning("config file keys ignored (unknown): %s", ", ".join(self.config.unknown_keys))
        self.prepare()  # refused here, nothing of another supervisor's run dir is touched
        try:
            self.start()
            while not self.stopping:
                self.turn()
        finally:
            self.shutdown()
        if self.exit_error is not None:
            raise self.exit_error
        return 0

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signals.append(signum)  # only enqueue: the loop, woken by the wakeup fd, acts

    def stop_with(self, exc: StartupError) -> None:
        """A start-up failure found later (NVML came up to a config it cannot plan) ends the run."""
        self.exit_error, self.stopping = exc, True

    def prepare(self) -> None:
        """The run dir, and the sockets an earlier life of gpuvisor left in the plugin dir."""
        try:
            self.rundir.check_socket_paths()
            self.rundir.prepare()
        except RunDirError as exc:  # a setting that cannot work, a live supervisor's, or not made
            if exc.config_error:
                raise StartupError(f"config error: {exc}", EXIT_CONFIG_ERROR) from None
            raise StartupError(str(exc), EXIT_FAILURE) from None
        os.makedirs(self.plugin_dir, exist_ok=True)
        self.sockets.take_over_earlier()
        self.replan.recall_label()

    def start(self) -> None:
        """HTTP, sockets and watches first (status answers even if NVML fails), then NVML."""
        become_subreaper()  # adopt the workers of a zygote that dies: they keep serving
        if self.http is not None:
            try:
                self.http.start()
            except AddressError as exc:
                raise StartupError(f"config error: {exc}", EXIT_CONFIG_ERROR) from None
        self.control.open()
        self.hub.open()
        self.rundir.secure_sockets()
        self.watches.start()
        self.spawner.start()
        self.dra.earlier.look()  # before the first plans: an earlier DRA life's pool on this node?
        self.timers.call_later("beacon", 0.0, self.beacon)
        self.replan.begin()  # NVML, then the first plans (tried again until NVML answers)

    def turn(self) -> None:
        """One turn of the loop."""
        self.last_loop = now = self.clock.monotonic()
        self.notifier.ping_if_due(now)
        self._step("signals", self.handle_signals)
        if self.stopping:
            # A stop starts now: the wake-up byte of its signal was read on the turn before, so a
            # wait here would sleep out a whole tick before run() saw it. No housekeeping either.
            return
        self._step("workers", self.tend_workers)
        self._step("timers", self.timers.run_due)
        self._step("health", self.hub.tick)
        self._step("readiness", self.check_ready)
        self._step("cluster", self.start_cluster)
        if self.stopping:  # a timer ended the run (NVML came up to a config it cannot plan)
            return
        ready = self.wait()
        if self.mailbox.fileno() in ready:
            self._step("mailbox", self.mailbox.drain)
        if self.control.sock in ready:
            self._step("control", self.drain_control)
        if self.spawner.fileno() in ready:
            self._step("zygote", self.spawner.pump)

    def _step(self, name: str, fn: Callable[[], object]) -> None:
        try:
            fn()
        except Exception:  # housekeeping never ends the loop: log the cause, count it, go on
            log.exception("supervisor step %s failed; it runs again on the next turn", name)
            self.metrics.housekeeping_error(name)

    def wait(self) -> list[object]:
        """Sleep until an event or the next timer: a posted call, a control message, or the
        zygote's report of a worker that ended. The sockets and fds that are ready."""
        tick = TICK_S
        if self.hub.quiet():
            tick = min(IDLE_TICK_S, self.notifier.seconds_to_ping(self.clock.monotonic()))
        return self.poller.poll(self.timers.wait_seconds(max(tick, 0.0)))

    # ------------------------------------------------------------------ the verbs
    def handle_signals(self) -> None:
        while self.signals:
            signum = self.signals.pop(0)
            if signum == signal.SIGHUP:
                self.replan.reload("SIGHUP")
            elif signum != signal.SIGCHLD:  # SIGCHLD only woke us: tend_workers() reaps
                self.stopping = True

    def tend_workers(self) -> None:
        """Reap what died, start what should run, kill what hangs; wake again at the next deadline."""
        self.workers.tick(self.clock.monotonic())
        deadlines = self.workers.deadlines()
        if deadlines:
            self.timers.call_at("workers", min(deadlines), self.tend_workers)
        else:
            self.timers.cancel("workers")

    def beacon(self) -> None:
        self.timers.call_later("beacon", self.hub.beacon(), self.beacon)

    def beacon_soon(self) -> None:
        """A delta went out: a beacon within BEACON_S, whatever the idle gap had grown to."""
        within = self.hub.next_beacon_within()
        due = self.timers.when("beacon")
        if due is not None and due > self.clock.monotonic() + within:
            self.timers.call_later("beacon", within, self.beacon)

    def check_ready(self) -> None:
        self.readiness.publish(self._readiness())

    def start_cluster(self) -> None:
        """The cluster side starts once the kubelet path is up (see supervisor/cluster/side.py)."""
        self.dra.turn()
        self.cluster.start_when(
            registered=self.workers.any_registered(),
            nothing_to_register=self.reconciler.node is not None and not self.reconciler.plans,
            awaiting_label=bool(self.config.awaiting_label),
        )

    def on_health_decision(self, batch: ChangeBatch, line: str) -> None:
        """The health hub decided a change of devices: the Node hears (when asked to), the taints follow."""
        self.cluster.health_changed(batch, line)
        self.dra.health_changed(self.hub.book)

    def on_plans_applied(self) -> None:
        """New plans are in place: the Node's condition counts their devices, the DRA pool shows
        them (or is withdrawn), and a DRA node knows which device-plugin resources it may tidy."""
        self.cluster.plans_changed()
        self.dra.plans_applied(self.hub.book)

    def kubelet_created(self) -> None:
        """kubelet.sock appeared: the workers register again, the DRA side rereads the Node."""
        self.events.kubelet_created()
        self.dra.kubelet_restarted()

    def drain_control(self) -> None:
        self.control.drain(self.events, partial(reply_to, self.commands))

    def _readiness(self) -> status.Readiness:
        return status.readiness(
            nvml_up=self.nvml.up,
            nvml_error=self.nvml.error,
            planned=self.reconciler.plans,
            workers=self.workers.by_resource(),
            mps_not_ready=self.mps.not_ready(),
            cdi_error=self.cdi.error,
            pending_reload=self.reconciler.pending_error,  # "" unless a reload is pending
            waiting=self.replan.planned_hold.waiting if self.replan.planned_hold else "",
            no_config=self.config.awaiting_label,
        )

    def on_worker_state(self, handle: WorkerHandle, old: WState, new: WState, reason: str) -> None:
        """Every worker lifecycle transition: what it means (the worker set is built first)."""
        self.events.on_worker_state(handle, old, new, reason)

    # ------------------------------------------------------------------ status
    def status(self) -> dict[str, Json]:
        answer = self._readiness()
        return status.document(
            {
                "pid": os.getpid(),
                "simulated": self.nvml.simulator is not None,
                "started_at": self.started_at,
                "ready": answer.ready,
                "ready_detail": answer.detail,
                "plugin_dir": self.plugin_dir,
                "metrics_url": self.http.url if self.http is not None and self.http.serving else None,
                "nvml": self.nvml.status(),
                "reconcile": self.reconciler.status(),
                "workers": self.workers.view(self.clock.monotonic()),
                "mps": self.mps.status(),
                "cdi": self.cdi.status(),
                "labels": self.labels.status(),
                "control": self.control.status(),
                "cluster": self.cluster.status(),
                "earlier_dra_pool": self.dra.earlier.status(),
            },
            self.hub.status(),
            self.replan.status(),
        )

    # ------------------------------------------------------------------ stop
    def shutdown(self) -> None:
        self.notifier.stopping()
        self._step("stop cluster side", self.cluster.stop)  # API calls in flight end now
        self._step("stop DRA side", self.dra.close)
        log.info("stopping: %d workers", len(self.workers.live()))
        self.workers.stop_and_wait("supervisor stopping", SHUTDOWN_GRACE_S)
        self.spawner.stop()
        # After the workers: no container is handed an MPS pipe whose daemon is gone. The CDI spec
        # stays (containers that restart while gpuvisor is down still resolve their devices).
        self.mps.shutdown()
        self.hub.stop()
        self._step("stop watches", self.watches.stop)
        self.control.close()
        self.rundir.remove_sockets()
        if self.http is not None:
            self.http.stop()
        log.info("stopped")
        self.notifier.close()
