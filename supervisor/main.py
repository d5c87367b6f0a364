"""The supervisor process (`gpuvisor run`): a small loop that wires the parts.

The loop owns every ZeroMQ socket and all mutable state; other threads (the NVML monitor, the
watchdog observers, the MPS thread) and signal handlers only enqueue (a callable on the
mailbox, a signal number on a list) and wake it. Each turn reads as what it does, as gunicorn's
`Arbiter.run`: `handle_signals()`, `reconcile()` (reap and restart workers), `run_timers()`
(one scheduler holds every deadline: backoffs, beacons, rediscovery, NVML and reload retries),
`publish_health()`, `check_ready()`, then `wait()` for the next event and `drain_mailbox()`,
`drain_control()`. A step that raises is logged with its cause and counted
(`gpuvisor_housekeeping_errors_total`); it never ends the loop, which would take every
resource of the node away.

The parts, each a module with one job: the run dir (`rundir`), NVML bring-up and rediscovery
(`discovery`), reload and rediscovery (`replan`), the plan reconciler with pending reloads
(`reconcile`), the control endpoint
(`control`) and what worker messages mean (`workerevents`), health publishing (`healthhub`),
MPS daemons and CDI spec (`mpswiring`, `cdisync`), and the status document (`status`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import uuid
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING

import psutil
import zmq

from common.config import Config
from common.messages import Command, Json, PlanUpdate, Reply
from common.model import Node
from common.planning import PlanningError, plan_resources
from common.procutil import Mailbox
from supervisor import status
from supervisor.cdisync import CdiSync
from supervisor.commands import reply_to
from supervisor.control import ControlEndpoint
from supervisor.discovery import EXIT_IN_USE, NvmlLink, StartupError
from supervisor.health_policy import PolicyError
from supervisor.healthhub import HealthHub
from supervisor.httpserver import AddressError, ProbeServer, ReadinessCell, loop_liveness
from supervisor.kubeletwatch import Watches
from supervisor.metrics import Metrics
from supervisor.mps import MpsError
from supervisor.mpswiring import MpsWiring
from supervisor.nodelabels import NodeLabels
from supervisor.reconcile import Desired, Reconciler
from supervisor.replan import Replanner, health_policy_for
from supervisor.rundir import RunDir, RunDirError, RunDirUntrusted, WorkerSockets
from supervisor.scheduler import Clock, Scheduler, SystemClock
from supervisor.sdnotify import Notifier
from supervisor.spawner import WorkerSpawner
from supervisor.workerevents import WorkerEvents
from supervisor.workers import EXIT_CONFIG_ERROR, Policy, WorkerHandle, WorkerSet, WState
from supervisor.zygote import become_subreaper

if TYPE_CHECKING:
    from common.simulator import Simulator

__all__ = ["StartupError", "Supervisor"]

log = logging.getLogger("gpuvisor.supervisor")

TICK_S = 1.0  # the longest the loop sleeps; timers wake it sooner
BEACON_S = 2.0
SHUTDOWN_GRACE_S = 4.0  # SIGTERM to workers, then SIGKILL: the whole stop stays under 5 s
HEALTH_SETTINGS = ("disable_healthchecks", "enable_healthchecks", "health")


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


class Supervisor:
    def __init__(
        self,
        config: Config,
        argv_flags: argparse.Namespace | None = None,
        environ: dict[str, str] | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.config = config
        self.environ = dict(os.environ) if environ is None else environ
        self.clock = clock or SystemClock()
        self.metrics = Metrics()
        self.timers = Scheduler(self.clock, on_error=self.metrics.housekeeping_error)
        self.rundir = RunDir(config.run_dir)
        self.plugin_dir = os.path.dirname(os.path.abspath(config.kubelet_socket))
        self.sockets = WorkerSockets(self.plugin_dir, self.rundir.sockets_record)
        self.mailbox = Mailbox(log, on_error=lambda: self.metrics.housekeeping_error("mailbox"))
        self.signals: list[int] = []  # filled by the handlers, emptied by handle_signals()
        self.stopping = False
        self.started_at = self.clock.time()
        self.last_loop = self.clock.monotonic()
        self.nvml = NvmlLink(config, self.environ, on_error=self.metrics.nvml_error)
        try:
            policy = health_policy_for(config)
        except PolicyError as exc:
            raise StartupError(f"config error: gpuvisor.health: {exc}", EXIT_CONFIG_ERROR) from None
        self.hub = HealthHub(
            self.rundir.health_endpoint, policy, self.metrics, self.clock, uuid.uuid4().hex[:12]
        )
        self.spawner = WorkerSpawner(config, self.rundir, self.sockets.add)
        self.workers = WorkerSet(self.spawner, self._worker_policy(config))
        self.mps = MpsWiring(config, self.environ, self.nvml.module, self.hub, self.mailbox.post)
        self.cdi = CdiSync(config, self.timers)
        self.labels = NodeLabels(self.nvml.module, self.nvml.simulator is not None, self.timers)
        self.reconciler = Reconciler(
            self.rundir,
            self.workers,
            self._tell_plan,
            self,
            self.timers,
            self.metrics.set_pending_reload,
            self.metrics.housekeeping_error,
        )
        self.events = WorkerEvents(
            self.workers, self.metrics, self.hub, self.reconciler, self.clock, self._command
        )
        self.control = ControlEndpoint(
            self.rundir.control_endpoint, self.events, count=self.metrics.control_message_dropped
        )
        self.events.control = self.control
        # The metrics listener goes first: it sees a transition before the others forget routes.
        self.workers.listeners += [
            self.metrics.worker_listener(),
            self.events.on_worker_state,
            self._on_worker_state,
        ]
        self.readiness = ReadinessCell()
        self.notifier = Notifier(self.environ)
        self.http: ProbeServer | None = None
        self.watches = Watches(self.plugin_dir, config.config_file)
        self.node: Node | None = None
        self.replan = Replanner(
            argv_flags,
            self.environ,
            self.nvml,
            self.reconciler,
            self.mps,
            self.metrics,
            self.timers,
            lambda: (self.config, self.node),
            self._adopt_config,
        )
        self._was_ready = False
        self.exit_error: StartupError | None = None  # a start-up failure found later (NVML came up)
        self._poller: zmq.Poller | None = None
        self._watched: tuple[object, int] = (None, -1)

    @property
    def simulator(self) -> Simulator | None:
        return self.nvml.simulator

    @staticmethod
    def _worker_policy(config: Config) -> Policy:
        return Policy(**{k: getattr(config, k) for k in ("heartbeat_timeout", "start_retries", "start_seconds")})

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

    def prepare(self) -> None:
        """The run dir, and the sockets an earlier life of gpuvisor left in the plugin dir."""
        try:
            self.rundir.check_socket_paths()
        except RunDirError as exc:
            raise StartupError(f"config error: {exc}", EXIT_CONFIG_ERROR) from None
        try:
            self.rundir.prepare()
        except RunDirUntrusted as exc:
            raise StartupError(f"config error: {exc}", EXIT_CONFIG_ERROR) from None
        except RunDirError as exc:  # in use by a live supervisor, or cannot be made
            raise StartupError(str(exc), EXIT_IN_USE) from None
        os.makedirs(self.plugin_dir, exist_ok=True)
        self.sockets.load_earlier()
        self._end_stale_workers()
        removed = self.sockets.sweep_all()
        if removed:
            log.info("removed %d stale socket(s) of an earlier run: %s", len(removed), ", ".join(removed))

    def _end_stale_workers(self) -> None:
        """Workers of an earlier life that never noticed their supervisor died (stopped, hung):
        SIGKILL them by PID (their recorded tag on their command line says they are ours) before
        new workers register, so their streams end first."""
        stale = self.sockets.stale_workers()
        for pid in stale:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if stale:
            log.warning("ended %d worker(s) an earlier run left behind: pids %s", len(stale), stale)
            psutil.wait_procs([p for p in (_process(pid) for pid in stale) if p is not None], timeout=2)

    def start(self) -> None:
        """HTTP, sockets and watches first (status answers even if NVML fails), then NVML."""
        become_subreaper()  # adopt the workers of a zygote that dies: they keep serving
        self._start_http()
        self.control.open()
        self.hub.open()
        self.rundir.secure_sockets()
        post = self.mailbox.post
        self.watches.start(
            lambda: post(self.events.kubelet_created),
            lambda name: post(lambda: self.events.file_deleted(name)),
            lambda: post(self.replan.config_event),
        )
        self.spawner.start()
        self.timers.call_later("beacon", 0.0, self.beacon)
        self.try_nvml()

    def turn(self) -> None:
        """One turn of the loop."""
        now = self.clock.monotonic()
        self.last_loop = now
        self.notifier.ping_if_due(now)
        self._step("signals", self.handle_signals)
        self._step("reconcile", self.reconcile)
        self._step("timers", self.timers.run_due)
        self._step("health", self.publish_health)
        self._step("readiness", self.check_ready)
        ready = self.wait()
        if self.mailbox.fileno() in ready:
            self._step("mailbox", self.mailbox.drain)
        if self.control.sock in ready:
            self._step("control", self.control.drain)
        if self.spawner.fileno() in ready:
            self._step("zygote", self.spawner.pump)

    def _step(self, name: str, fn: Callable[[], object]) -> object:
        try:
            return fn()
        except Exception:  # housekeeping never ends the loop: log the cause, count it, go on
            log.exception("supervisor step %s failed; it runs again on the next turn", name)
            self.metrics.housekeeping_error(name)
            return None

    def wait(self) -> list[object]:
        """Sleep until an event or the next timer; the sockets and fds that are ready."""
        # The same poller every turn, made again only when what it watches changes (the control
        # socket opens, the zygote is replaced).
        watched = (self.control.sock, self.spawner.fileno())
        if self._poller is None or watched != self._watched:
            poller = zmq.Poller()
            poller.register(self.mailbox.fileno(), zmq.POLLIN)
            if self.control.sock is not None:
                poller.register(self.control.sock, zmq.POLLIN)
            if self.spawner.fileno() >= 0:  # a worker forked by the zygote ends: its report wakes us
                poller.register(self.spawner.fileno(), zmq.POLLIN)
            self._poller, self._watched = poller, watched
        timeout_ms = int(self.timers.wait_seconds(TICK_S) * 1000) + 1
        try:
            return [sock for sock, _event in self._poller.poll(timeout_ms)]
        except zmq.ZMQError as exc:  # EINTR and the like: just go round again
            log.debug("poll interrupted: %s", exc)
            return []

    # ------------------------------------------------------------------ the verbs
    def handle_signals(self) -> None:
        while self.signals:
            signum = self.signals.pop(0)
            if signum == signal.SIGHUP:
                self.reload("SIGHUP")
            elif signum != signal.SIGCHLD:  # SIGCHLD only woke us: reconcile() reaps
                self.stopping = True

    def reconcile(self) -> None:
        """Reap what died, start what should run, kill what hangs; wake again at the next deadline."""
        self.workers.tick(self.clock.monotonic())
        deadlines = self.workers.deadlines()
        if deadlines:
            self.timers.call_at("workers", min(deadlines), self.reconcile)
        else:
            self.timers.cancel("workers")

    def publish_health(self) -> None:
        self.hub.tick()

    def beacon(self) -> None:
        self.timers.call_later("beacon", BEACON_S, self.beacon)
        self.hub.beacon()

    def check_ready(self) -> None:
        answer = self._readiness()
        self.readiness.set((answer.ready, answer.detail))
        self.metrics.set_ready(answer.ready)
        self.notifier.update(answer.ready, answer.detail)
        if answer.ready != self._was_ready:
            self._was_ready = answer.ready
            log.info(
                "ready" if answer.ready else "not ready",
                extra={"state": "ready" if answer.ready else "not-ready"},
            )

    def _readiness(self) -> status.Readiness:
        pending = self.reconciler.pending_error  # "" unless a reload is pending
        return status.readiness(
            self.nvml.up,
            self.nvml.error,
            self.reconciler.plans,
            self.workers.workers,
            self.mps.not_ready(),
            self.cdi.error,
            pending,
        )

    # ------------------------------------------------------------------ NVML, plans
    def try_nvml(self) -> None:
        node, delay = self.nvml.attempt(self.config.fail_on_init_error)
        if node is None:
            self.timers.call_later("nvml-retry", delay, self._retry_nvml)
            return
        try:
            plans = plan_resources(node, self.config)
            self.mps.validate(self.config, plans)
        except (PlanningError, MpsError) as exc:
            raise StartupError(f"config error: {exc}", EXIT_CONFIG_ERROR) from None
        log.info(
            "discovered %d GPUs; resources: %s",
            len(node.gpus),
            ", ".join(f"{r} ({len(p.devices)})" for r, p in plans.items()) or "none",
        )
        self.reconciler.want(Desired(self.config, node, plans, "start"))
        self.replan.schedule_rediscovery(self.config)

    def _retry_nvml(self) -> None:
        """A later try: NVML may come up to a config that cannot be planned. That ends the process
        as it would at start (exit 78), rather than leaving it up with nothing planned."""
        try:
            self.try_nvml()
        except StartupError as exc:
            self.exit_error = exc
            self.stopping = True

    def adopt(self, desired: Desired) -> None:
        """ReconcileHooks: the plan files are written; config, health, CDI and MPS follow first."""
        first = not self.mps.started  # the last step of bringing health and MPS up
        self._adopt_config(desired.config)
        if desired.node != self.node:
            self.node = desired.node
            self.hub.set_node(desired.node)
        if first:
            self.hub.start(
                self.nvml.module, desired.node, desired.plans, self.mailbox.post, self.config.probe_interval
            )
            self.mps.start(desired.plans)
        else:
            self.hub.set_plans(desired.plans)
        self.cdi.sync(desired.plans)  # before the workers: none may hand out a CDI name the spec lacks
        if not first:
            self.mps.apply(desired.plans)
        self.hub.update_gauges()
        self.labels.refresh(desired.config)  # the node labels follow what is advertised, at once

    def _adopt_config(self, config: Config) -> None:
        old, self.config = self.config, config
        if any(getattr(config, n) != getattr(old, n) for n in HEALTH_SETTINGS):
            try:
                self.hub.set_policy(health_policy_for(config))
            except PolicyError as exc:  # checked when the reload was read: only a bug gets here
                log.error("health policy unchanged: %s", exc)
        self.hub.set_probe_interval(config.probe_interval)
        self.cdi.configure(config)
        self.mps.adopt(config)
        self.spawner.config = config
        self.workers.policy = self._worker_policy(config)
        self.replan.schedule_rediscovery(config)

    def reload(self, trigger: str) -> bool:
        return self.replan.reload(trigger)

    def rediscover(self, trigger: str) -> bool:
        return self.replan.rediscover(trigger)

    # ------------------------------------------------------------------ the outside
    def _start_http(self) -> None:
        if not self.config.metrics_address:
            return
        server = ProbeServer(
            self.config.metrics_address,
            self.metrics.render,
            loop_liveness(lambda: self.last_loop),
            self.readiness,
        )
        try:
            server.start()
        except AddressError as exc:
            raise StartupError(f"config error: {exc}", EXIT_CONFIG_ERROR) from None
        self.http = server

    def _on_worker_state(self, handle: WorkerHandle, old: WState, new: WState, reason: str) -> None:
        if new in (WState.BACKOFF, WState.STOPPED, WState.FATAL):
            removed = self.sockets.sweep(handle.resource, handle.socket_tag)  # SIGKILL leaves a worker's socket
            if removed:
                log.info(
                    "removed the socket(s) a dead worker of %s left: %s", handle.resource, ", ".join(removed)
                )

    def _tell_plan(self, resource: str, update: PlanUpdate) -> bool:
        return self.control.tell(resource, update)

    def _command(self, command: Command) -> Reply:
        return reply_to(self, command)

    # ------------------------------------------------------------------ CommandTarget
    def planned_resources(self) -> list[str]:
        return sorted(self.reconciler.plans)

    def gpu_reset(self, uuid: str) -> None:
        self.hub.gpu_reset(uuid, self.node)

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
                "metrics_url": self.http.url if self.http is not None else None,
                "nvml": self.nvml.status(),
                "health_policy": self.hub.policy.describe(),
                "reconcile": self.reconciler.status(),
                "workers": status.workers_view(self.workers.workers, self.clock.monotonic()),
                "resources": self.hub.resources_view(),
                "conditions": self.hub.conditions_view(),
                "mps": self.mps.status(),
                "cdi": self.cdi.status(),
                "labels": self.labels.status(),
                "control": self.control.status(),
            },
            self.replan.status(),
        )

    # ------------------------------------------------------------------ stop
    def shutdown(self) -> None:
        self.notifier.stopping()
        log.info("stopping: %d workers", sum(1 for h in self.workers.workers.values() if h.proc is not None))
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
