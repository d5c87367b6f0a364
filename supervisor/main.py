"""The supervisor process (`gpuvisor run`): discovery, plans, workers, health, watches.

One main loop owns every ZeroMQ socket and all mutable state. Other threads (the NVML event
loop, the watchdog observers, signal handlers) only enqueue a callable or set a flag and poke a
wake pipe; the loop runs them, reaps and reconciles the workers (`WorkerSet.tick`), ticks the
health book (transient recovery), publishes health, and runs what is due (NVML retry,
rediscovery, a debounced config-file check). So no lock guards the state: one thread touches it.

Start-up order matters for NVIDIA #170 (a failed NVML must not look like a healthy plugin that
advertises nothing): the run dir, the stale-socket sweep, the control socket and the watches
come up first, then NVML. With --fail-on-init-error (the default) an NVML failure ends the
process with exit status 3 and a text that says what to check; without it the loop runs
not-ready (`ready()` is false, `gpuvisor status` answers) and retries NVML with backoff.

Reload (SIGHUP, the config file changing, the `reload` command) re-reads the config and the
device set; rediscovery (every --rediscovery-interval seconds, and the simulator's `sim mig`)
re-reads the device set only. Both end in `apply_plans`, a diff per resource: unchanged plans
are not touched, changed ones go to the running worker as a PlanUpdate (same process, same
gRPC stream: allocatable never drops), added and removed resources start and stop workers.

Observability: one `Metrics` registry fed from the loop (worker transitions through a
`WorkerSet` listener, heartbeat figures, registration reports, every health batch, device
gauges), served with /healthz and /readyz by a `ProbeServer` thread (--metrics-address; port 0
picks a free port, shown in the log and in `status` as `metrics_url`). Readiness has one
definition, `_readiness()`: NVML up, every resource's worker registered and streaming, every MPS
control daemon up and the CDI spec written. Each tick hands it to the HTTP thread (a
`ReadinessCell`), the `gpuvisor_ready` gauge and systemd (`Notifier`: READY=1 once, STATUS= on
change, WATCHDOG=1 from this loop so a wedged loop stops the pings, STOPPING=1 at shutdown).

MPS and CDI: an MPS-shared resource's GPUs carry the external health condition `mps:<resource>`
(Unhealthy) from before its worker starts until its control daemon is up (`MpsDaemons`, on a
thread of its own; its up/down reports come back through `post`). With a CDI list strategy the
spec file is written before any worker can hand out a name, rewritten on every plan change
before the workers hear of it, retried while it fails (not ready meanwhile) and never removed.

Sockets in the run dir (mode 0700, the sockets 0600): `control.sock` (ROUTER: workers' hello,
heartbeat and snapshot requests; `gpuvisor status` and `gpuvisor sim`) and `health.sock` (PUB:
health deltas and beacons to every worker).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
import signal
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from types import FrameType
from typing import Any

import zmq

from common.config import Config, ConfigError, load_config
from common.kubeletapi import KUBELET_SOCKET_NAME
from common.messages import (
    Command,
    HealthBeacon,
    HealthSnapshot,
    Heartbeat,
    Hello,
    MessageError,
    PlanUpdate,
    Reply,
    Reregister,
    SequenceCounter,
    Shutdown,
    SnapshotReply,
    SnapshotRequest,
    StatusReport,
    decode,
    encode,
    split_routed,
)
from common.model import Node, ResourcePlan
from common.nvml import NvmlCallError
from common.planning import PlanningError, plan_resources
from common.procutil import Mailbox, unix_socket_listening
from supervisor.cdi import CdiError, CdiSpecWriter
from supervisor.commands import CommandError, run_command
from supervisor.health import Apply, HealthMonitor
from supervisor.health_policy import HealthPolicy, PolicyError
from supervisor.healthbook import ChangeBatch, HealthBook
from supervisor.httpserver import AddressError, ProbeServer, ReadinessCell, loop_liveness, worker_readiness
from supervisor.kubeletwatch import ConfigWatch, KubeletWatch
from supervisor.metrics import Metrics
from supervisor.mps import MpsDaemons, MpsError
from supervisor.sdnotify import Notifier
from supervisor.workers import EXIT_CONFIG_ERROR, Policy, Proc, WorkerHandle, WorkerSet, WState
from supervisor.zygote import Zygote, ZygoteProc, become_subreaper

log = logging.getLogger("gpuvisor.supervisor")

EXIT_NVML_ERROR = 3
EXIT_IN_USE = 1  # the run dir belongs to a running supervisor, or cannot be made
TICK_S = 1.0  # the idle loop's period; deadlines (backoff, beacons, rediscovery) wake it sooner
BEACON_S = 2.0
CONFIG_DEBOUNCE_S = 0.3  # a ConfigMap update is a burst of create/rename/delete events
NVML_RETRY_START_S = 1.0
NVML_RETRY_MAX_S = 60.0
SHUTDOWN_GRACE_S = 4.0  # SIGTERM to workers, then SIGKILL: the whole stop stays under 5 s
CDI_RETRY_S = 30.0  # a CDI spec that could not be written is tried again this often
SOCKET_PREFIX = "gpuvisor-"

# Test-only hook: with a simulated node, fail the first N nvmlInit calls with
# NVML_ERROR_LIBRARY_NOT_FOUND, as on a node without a driver. Ignored on real NVML.
SIM_FAIL_INIT_ENV = "GPUVISOR_SIM_FAIL_INIT"

# Settings a running supervisor cannot take over at a reload: a change is logged, not applied.
RESTART_ONLY = (
    "kubelet_socket",
    "run_dir",
    "simulate",
    "metrics_address",
    "log_format",
    "log_level",
    "fail_on_init_error",
)

# Settings that make up the health policy (applied live at a reload) and the MPS daemons'
# supervision (a change restarts the daemons).
HEALTH_SETTINGS = ("disable_healthchecks", "enable_healthchecks", "health")
MPS_SETTINGS = ("mps_control_binary", "mps_exclusive_process", "driver_root")
CDI_SETTINGS = ("cdi_spec_dir", "cdi_spec_format", "cdi_nvidia_ctk")


class StartupError(Exception):
    """A failure at start that ends the process with a clear message and an exit code."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def control_endpoint(run_dir: str) -> str:
    return f"ipc://{os.path.join(run_dir, 'control.sock')}"


def health_endpoint(run_dir: str) -> str:
    return f"ipc://{os.path.join(run_dir, 'health.sock')}"


class WorkerSpawner:
    """Starts a worker: forked from the zygote (supervisor/zygote.py) when enabled, else by exec
    of `python -m worker` (never a bare fork of this process: it holds gRPC and ZeroMQ state)."""

    def __init__(self, config: Config, run_dir: str) -> None:
        self.config = config
        self.run_dir = run_dir
        self.zygote: Zygote | None = Zygote() if config.zygote else None

    def start(self) -> None:
        """Start the zygote early: its imports overlap NVML start-up and discovery."""
        if self.zygote is not None:
            try:
                self.zygote.start()
            except OSError as exc:
                log.warning("cannot start the worker zygote (%s): workers start by exec", exc)
                self.zygote = None

    def fileno(self) -> int:
        """The zygote's socket (its exit reports wake the main loop), or -1."""
        z = self.zygote
        return z.sock.fileno() if z is not None and z.sock is not None else -1

    def pump(self) -> None:
        if self.zygote is not None:
            self.zygote.pump()

    def worker_args(self, handle: WorkerHandle) -> list[str]:
        return [
            "--resource", handle.resource,
            "--plan", handle.plan_path,
            "--kubelet-socket", self.config.kubelet_socket,
            "--control", control_endpoint(self.run_dir),
            "--health", health_endpoint(self.run_dir),
            "--supervisor-pid", str(os.getpid()),
            "--log-format", self.config.log_format,
            "--log-level", self.config.log_level,
            "--heartbeat-interval", f"{handle.beat_interval or Policy(heartbeat_timeout=self.config.heartbeat_timeout).beat_interval():g}",
        ]  # fmt: skip

    def __call__(self, handle: WorkerHandle) -> Proc:
        args = self.worker_args(handle)
        if self.zygote is not None:
            try:
                return ZygoteProc(self.zygote.spawn(args), self.zygote)
            except OSError as exc:
                log.warning("zygote spawn of %s failed (%s): starting it by exec", handle.resource, exc)
        return subprocess.Popen([sys.executable, "-m", "worker", *args], close_fds=True, stdin=subprocess.DEVNULL)

    def stop(self) -> None:
        if self.zygote is not None:
            self.zygote.stop()


def open_nvml(config: Config, environ: dict[str, str] | None = None) -> tuple[Any, Any]:
    """The pynvml module to use (the real one, or the simulator) and the simulator or None."""
    if config.simulate:
        from common.simulator import load_simulator

        try:
            sim = load_simulator(config.simulate)
        except (ValueError, OSError) as exc:  # SimulatorConfigError is a ValueError naming file, key, why
            raise StartupError(f"config error: --simulate: {exc}", EXIT_CONFIG_ERROR) from None
        fail_init = (environ if environ is not None else dict(os.environ)).get(SIM_FAIL_INIT_ENV, "").strip()
        if fail_init:
            import pynvml

            if not fail_init.isdigit() or int(fail_init) < 1:
                raise StartupError(f"config error: env {SIM_FAIL_INIT_ENV}: {fail_init!r} is not a count >= 1", EXIT_CONFIG_ERROR)
            sim.fail("nvmlInit", pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, count=int(fail_init))
        return sim, sim
    import pynvml

    return pynvml, None


def keep_vanished_gpus(old: Node | None, new: Node) -> tuple[Node, tuple[str, ...]]:
    """`new`, plus the GPUs of `old` that rediscovery no longer sees (and whose index is free).

    Discovery leaves a lost GPU out (it cannot be described). A rediscovery must not turn that
    into a shrinking device list: a lost GPU stays advertised, and the health pipeline (probes,
    XID 79) marks it Unhealthy and brings it back. Returns the node and the UUIDs kept.
    """
    if old is None:
        return new, ()
    uuids = {g.uuid for g in new.gpus}
    indexes = {g.index for g in new.gpus}
    kept = [g for g in old.gpus if g.uuid not in uuids and g.index not in indexes]
    if not kept:
        return new, ()
    kept_indexes = {g.index for g in kept}
    links = new.links + tuple(link for link in old.links if link.a in kept_indexes or link.b in kept_indexes)
    merged = dataclasses.replace(
        new,
        gpus=tuple(sorted(new.gpus + tuple(kept), key=lambda g: g.index)),
        links=tuple(sorted(links, key=lambda link: (link.a, link.b))),
    )
    return merged, tuple(g.uuid for g in kept)


def health_policy_for(config: Config) -> HealthPolicy:
    """The health policy a config asks for; raises PolicyError for what the policy refuses."""
    return HealthPolicy.from_settings(
        disable_env=",".join(config.disable_healthchecks) or None,
        enable_env=",".join(config.enable_healthchecks) or None,
        xid_actions=config.health.xid_actions(),
        quiet_seconds=config.health.transient_quiet_seconds,
    )


def _settings_of(config: Config, names: tuple[str, ...]) -> tuple[Any, ...]:
    return tuple(getattr(config, name) for name in names)


def file_fingerprint(path: str) -> str:
    """What the config file holds now (through any symlinks), cheap to compare."""
    try:
        with open(path, "rb") as fh:
            return hashlib.sha256(fh.read()).hexdigest()
    except OSError as exc:
        return f"unreadable: {exc.strerror}"


class Supervisor:
    def __init__(self, config: Config, argv_flags: Any = None, environ: dict[str, str] | None = None) -> None:
        self.config = config
        self.argv_flags = argv_flags
        self.environ = dict(os.environ) if environ is None else environ
        self.run_dir = os.path.abspath(config.run_dir)
        self.plugin_dir = os.path.dirname(os.path.abspath(config.kubelet_socket))
        self.plans_dir = os.path.join(self.run_dir, "plans")
        self.epoch = uuid.uuid4().hex[:12]
        self.stopping = False
        self.reload_requested = False
        self.started_at = time.time()
        self.last_loop = time.monotonic()
        self.mailbox = Mailbox(log)
        self.nvml_module, self.simulator = open_nvml(config, self.environ)
        # NVML state: not up until init and the first discovery worked.
        self.nvml_up = False
        self.nvml_error = ""
        self.nvml_attempts = 0
        self._nvml_retry_at = 0.0
        self._nvml_delay = NVML_RETRY_START_S
        self.node: Node | None = None
        self.plans: dict[str, ResourcePlan] = {}
        self.plan_json: dict[str, str] = {}
        self.kept_gpus: tuple[str, ...] = ()
        try:
            self.health_policy = health_policy_for(config)
        except PolicyError as exc:
            raise StartupError(f"config error: gpuvisor.health: {exc}", EXIT_CONFIG_ERROR) from None
        self.book: HealthBook | None = None
        self.monitor: HealthMonitor | None = None
        self.watch: KubeletWatch | None = None
        self.config_watch: ConfigWatch | None = None
        self.spawner = WorkerSpawner(config, self.run_dir)
        self.workers = WorkerSet(
            self.spawner,
            Policy(
                heartbeat_timeout=config.heartbeat_timeout,
                start_retries=config.start_retries,
                start_seconds=config.start_seconds,
            ),
        )
        # Observability. The metrics listener goes first: it sees a transition before the
        # supervisor's own hook forgets routes and sockets.
        self.metrics = Metrics()
        self.readiness = ReadinessCell()
        self.notifier = Notifier(self.environ)
        self.http: ProbeServer | None = None
        self.workers.listeners.insert(0, self.metrics.worker_listener())
        self.workers.listeners.append(self._on_worker_state)
        self._registered_life: dict[str, int] = {}  # resource -> pid of the worker life that registered
        self._kubelet_restarted: set[str] = set()  # resources whose next registration follows a kubelet restart
        # MPS control daemons and the CDI spec file.
        self._mps_generation = 0  # bumped by each _make_mps: reports of a replaced instance are dropped
        self.mps = self._make_mps(config)
        self.cdi = self._make_cdi(config)
        self.cdi_error: str | None = None
        self._next_cdi_retry = 0.0
        self.routes: dict[str, bytes] = {}  # resource -> ROUTER identity of its current worker
        self.worker_plan: dict[str, str] = {}  # resource -> plan JSON its current worker has
        self.out_seq = SequenceCounter()
        self.health_changes = 0
        self.rediscoveries = 0
        self.reloads = 0
        self._was_ready = False
        self._next_beacon = 0.0
        self._next_rediscovery = 0.0
        self._config_check_at = 0.0
        self._config_fp = file_fingerprint(config.config_file) if config.config_file else ""
        self._last_refusal = ""

    # ------------------------------------------------------------------ plumbing
    def post(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the main loop (callable from any thread)."""
        self.mailbox.post(fn)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only flags: the loop (woken by the wakeup fd) does the work.
        if signum == signal.SIGHUP:
            self.reload_requested = True
        elif signum != signal.SIGCHLD:
            self.stopping = True

    def _make_mps(self, config: Config) -> MpsDaemons:
        # Each MpsDaemons instance reports under its own generation: a report that a replaced
        # instance posted before it stopped must not clear the condition its successor holds.
        self._mps_generation += 1
        generation = self._mps_generation

        def report(resource: str, up: bool, reason: str) -> None:
            self._on_mps_change(resource, up, reason, generation)

        return MpsDaemons(
            report,
            binary=config.mps_control_binary,
            driver_root=config.driver_root,
            environ=self.environ,
            nvml_module=self.nvml_module,
            exclusive_process=config.mps_exclusive_process,
        )

    @staticmethod
    def _make_cdi(config: Config) -> CdiSpecWriter:
        return CdiSpecWriter(config.cdi_spec_dir, fmt=config.cdi_spec_format, use_nvidia_ctk=config.cdi_nvidia_ctk)

    # ------------------------------------------------------------------ start
    def _start_http(self) -> None:
        if not self.config.metrics_address:
            return
        server = ProbeServer(
            self.config.metrics_address, self.metrics.render, loop_liveness(lambda: self.last_loop), self.readiness
        )
        try:
            server.start()
        except AddressError as exc:
            raise StartupError(f"config error: {exc}", EXIT_CONFIG_ERROR) from None
        self.http = server

    def prepare_dirs(self) -> None:
        control = os.path.join(self.run_dir, "control.sock")
        if unix_socket_listening(control):
            # Removing a live supervisor's sockets would cut it off from its workers.
            raise StartupError(
                f"another gpuvisor is running with run dir {self.run_dir} (its control socket answers): "
                "stop it first, or give this one another --run-dir",
                EXIT_IN_USE,
            )
        try:
            os.makedirs(self.run_dir, mode=0o700, exist_ok=True)
            os.chmod(self.run_dir, 0o700)
            os.makedirs(self.plans_dir, mode=0o700, exist_ok=True)
            os.makedirs(self.plugin_dir, exist_ok=True)
            for name in ("control.sock", "health.sock"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.run_dir, name))
        except OSError as exc:
            raise StartupError(f"cannot prepare {exc.filename or self.run_dir}: {exc.strerror}", EXIT_IN_USE) from None
        self.remove_stale_sockets()

    def remove_stale_sockets(self) -> list[str]:
        """Remove sockets an earlier life of gpuvisor left: ours by name, and nobody listening."""
        removed: list[str] = []
        try:
            entries = list(os.scandir(self.plugin_dir))
        except FileNotFoundError:
            return removed
        for entry in entries:
            if not (entry.name.startswith(SOCKET_PREFIX) and entry.name.endswith(".sock")):
                continue
            try:
                if not stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
                    continue
            except FileNotFoundError:
                continue
            if unix_socket_listening(entry.path):
                continue  # a live server (another gpuvisor?) owns it: not ours to remove
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
            removed.append(entry.name)
        if removed:
            log.info("removed %d stale socket(s) of an earlier run: %s", len(removed), ", ".join(removed))
        return removed

    def remove_dead_sockets(self, resource: str) -> list[str]:
        """A worker died: remove the sockets it left (SIGKILL leaves them), by its exact name pattern.

        Only `gpuvisor-<name>-<8 hex>.sock` of this resource that nobody accepts on: the dead
        worker's, never another resource's nor a live server's.
        """
        pattern = re.compile(rf"{re.escape(SOCKET_PREFIX + resource.split('/', 1)[-1])}-[0-9a-f]{{8}}\.sock")
        removed: list[str] = []
        try:
            names = [n for n in os.listdir(self.plugin_dir) if pattern.fullmatch(n)]
        except FileNotFoundError:
            return removed
        for name in names:
            path = os.path.join(self.plugin_dir, name)
            if unix_socket_listening(path):
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed.append(name)
        if removed:
            log.info("removed the socket(s) a dead worker of %s left: %s", resource, ", ".join(removed))
        return removed

    def _open_sockets(self) -> None:
        longest = os.path.join(self.run_dir, "control.sock")
        if len(longest.encode()) > 107:
            raise StartupError(
                f"config error: --run-dir {self.run_dir} is too long: {longest} must fit a unix socket path "
                f"(at most 107 bytes, it has {len(longest.encode())})",
                EXIT_CONFIG_ERROR,
            )
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.router.bind(control_endpoint(self.run_dir))
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 100_000)
        self.pub.bind(health_endpoint(self.run_dir))
        for name in ("control.sock", "health.sock"):
            os.chmod(os.path.join(self.run_dir, name), 0o600)

    def _start_watches(self) -> None:
        try:
            self.watch = KubeletWatch(self.plugin_dir, self._kubelet_created, self._file_deleted)
            self.watch.start()
        except OSError as exc:  # e.g. the node's inotify instance limit (fs.inotify.max_user_instances)
            self.watch = None
            log.warning(
                "cannot watch %s (%s): workers still notice a kubelet restart themselves, within their "
                "2 s socket check instead of at once",
                self.plugin_dir,
                exc,
            )
        if self.config.config_file:
            try:
                self.config_watch = ConfigWatch(self.config.config_file, self._config_event)
                self.config_watch.start()
            except OSError as exc:
                self.config_watch = None
                log.warning("cannot watch the config file %s (%s): reload with SIGHUP", self.config.config_file, exc)

    def discover(self) -> Node:
        from common.nvml import Nvml

        return Nvml(self.nvml_module).discover()

    def _try_nvml(self) -> None:
        """One attempt at NVML init and first discovery (NVIDIA #170 for what follows a failure)."""
        from common.nvml import Nvml

        self.nvml_attempts += 1
        try:
            Nvml(self.nvml_module).init()
            node = self.discover()
        except Exception as exc:  # any NVML failure at start: the message says what to check
            if isinstance(exc, NvmlCallError):
                self.metrics.nvml_error(exc.function, exc.code)
            text = nvml_init_help(exc)
            if self.config.fail_on_init_error:
                raise StartupError(text, EXIT_NVML_ERROR) from None
            delay = self._nvml_delay
            if self.nvml_attempts == 1:
                log.error("%s. Not ready; retrying with backoff (--fail-on-init-error=false)", text)
            else:
                log.warning("NVML still unavailable (attempt %d): %s; next try in %.0fs", self.nvml_attempts, exc, delay)
            self.nvml_error = str(exc)
            self._nvml_retry_at = time.monotonic() + delay
            self._nvml_delay = min(delay * 2, NVML_RETRY_MAX_S)
            return
        if self.nvml_attempts > 1:
            log.info("NVML is up after %d attempts", self.nvml_attempts)
        self.nvml_up = True
        self.nvml_error = ""
        self._bring_up(node)

    def _bring_up(self, node: Node) -> None:
        """NVML works: plan, health book and monitor, then one worker per resource."""
        try:
            plans = plan_resources(node, self.config)
        except PlanningError as exc:
            raise StartupError(f"config error: {exc}", EXIT_CONFIG_ERROR) from None
        self.node = node
        self.plans = plans
        log.info(
            "discovered %d GPUs; resources: %s",
            len(node.gpus),
            ", ".join(f"{r} ({len(p.devices)})" for r, p in plans.items()) or "none",
        )
        self.book = HealthBook(plans, self.health_policy, time.time())
        self.monitor = HealthMonitor(
            self.nvml_module,
            node,
            self.health_policy,
            self.post,
            self._on_health_event,
            probe_interval=self.config.probe_interval,
            on_error=self.metrics.nvml_error,
        )
        for batch in self.monitor.initial_probe(self.book):
            self._publish(batch)
        self.monitor.start()
        try:
            self.mps.set_plans(plans)
        except MpsError as exc:
            raise StartupError(f"config error: {exc}", EXIT_CONFIG_ERROR) from None
        # Before any worker starts, so its first snapshot already has these devices Unhealthy.
        for resource, plan in plans.items():
            if plan.sharing == "mps":
                self._mark_mps_down(resource, plan, "MPS control daemon not started yet")
        self.mps.start_thread()
        self._sync_cdi()  # before the workers: none may hand out a CDI name the spec lacks
        self._update_device_gauges()
        for resource, plan in plans.items():
            self.workers.want(resource, self.write_plan(plan))
        self._schedule_rediscovery(time.monotonic())

    # ------------------------------------------------------------------ MPS and CDI
    def _mark_mps_down(self, resource: str, plan: ResourcePlan, reason: str) -> None:
        assert self.book is not None
        self._publish(self.book.mark_external({d.gpu_uuid for d in plan.devices}, f"mps:{resource}", reason, time.time()))

    def _on_mps_change(self, resource: str, up: bool, reason: str, generation: int) -> None:
        """From the MPS thread: a daemon came up or went down; the book changes on the main loop."""

        def apply() -> None:
            if self.book is None:
                return
            if generation != self._mps_generation:
                return  # from an MpsDaemons that a reload replaced
            if up and not self.mps.is_up(resource):
                return  # stale: the daemon went down again since
            if up:
                self._publish(self.book.clear_external(f"mps:{resource}", time.time()))
            else:
                plan = self.plans.get(resource)
                if plan is not None and plan.sharing == "mps":
                    text = reason if "MPS control daemon" in reason else f"MPS control daemon down: {reason}"
                    self._mark_mps_down(resource, plan, text)

        self.post(apply)

    def _apply_mps(self, old: dict[str, ResourcePlan], plans: dict[str, ResourcePlan]) -> None:
        """New plans for the MPS daemons, and the `mps:<resource>` conditions to match them."""
        assert self.book is not None
        try:
            self.mps.set_plans(plans)
        except MpsError as exc:  # validated before the reload was taken: only a race gets here
            log.error("MPS daemons keep their old plans: %s", exc)
        now = time.time()
        holding: dict[str, set[str]] = {}
        for cond in self.book.conditions():
            holding.setdefault(cond.name, set()).add(cond.gpu_uuid)
        for resource in sorted({r for r, p in old.items() if p.sharing == "mps"} - set(plans)):
            self._publish(self.book.clear_external(f"mps:{resource}", now))
        for resource, plan in sorted(plans.items()):
            name = f"mps:{resource}"
            if plan.sharing != "mps":
                self._publish(self.book.clear_external(name, now))
                continue
            gpus = {d.gpu_uuid for d in plan.devices}
            if not self.mps.is_up(resource):
                # Mark the new GPUs first, then let go of the ones that left: no device flaps.
                self._publish(self.book.mark_external(gpus, name, "MPS control daemon not up yet", now))
            left = holding.get(name, set()) - gpus
            if left:
                self._publish(self.book.clear_external(name, now, left))

    def _sync_cdi(self) -> None:
        """Write the CDI spec for the current plans; on failure not ready, retried every 30 s."""
        try:
            self.cdi.sync(self.plans)
        except (CdiError, OSError) as exc:
            text = str(exc)
            if text != self.cdi_error:
                log.error("the CDI spec could not be written (not ready; retrying every %gs): %s", CDI_RETRY_S, text)
            self.cdi_error = text
            self._next_cdi_retry = time.monotonic() + CDI_RETRY_S
            return
        if self.cdi_error is not None:
            log.info("the CDI spec is written again")
        self.cdi_error = None

    def _update_device_gauges(self, resources: tuple[str, ...] | None = None) -> None:
        if self.book is None:
            return
        for resource in self.plans if resources is None else resources:
            if resource not in self.plans:
                continue
            _seq, devices = self.book.snapshot(resource)
            healthy = sum(1 for d in devices if d.healthy)
            self.metrics.set_devices(resource, healthy, len(devices) - healthy)

    def write_plan(self, plan: ResourcePlan) -> str:
        text = plan.to_json()
        safe = plan.resource.replace("/", "_")
        path = os.path.join(self.plans_dir, f"{safe}.json")
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
        self.plan_json[plan.resource] = text
        return path

    # ------------------------------------------------------------------ run
    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, self._on_signal)
        signal.set_wakeup_fd(self.mailbox.wakeup_fd, warn_on_full_buffer=False)
        log.info("gpuvisor starting (pid %d): %s", os.getpid(), json.dumps(self.config.describe(), sort_keys=True))
        if self.config.unknown_keys:
            log.warning("config file keys ignored (unknown): %s", ", ".join(self.config.unknown_keys))
        self.prepare_dirs()
        # Adopt the workers of a zygote that dies, so they keep serving and are reaped here.
        become_subreaper()
        try:
            self._start_http()
            self._open_sockets()
            self._start_watches()
            self.spawner.start()
            self._try_nvml()
            self._loop()
        finally:
            self._shutdown()
        return 0

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.mailbox.fileno(), zmq.POLLIN)
        zygote_fd = -1
        while not self.stopping:
            fd = self.spawner.fileno()
            if fd != zygote_fd:  # a worker forked by the zygote ends: the zygote's report wakes us
                if zygote_fd >= 0:
                    with contextlib.suppress(KeyError):
                        poller.unregister(zygote_fd)
                if fd >= 0:
                    poller.register(fd, zmq.POLLIN)
                zygote_fd = fd
            now = time.monotonic()
            self.last_loop = now
            self.notifier.ping_if_due(now)
            self.workers.tick(now)
            self._run_due(now)
            self._check_ready()
            events = dict(poller.poll(self._poll_ms(now)))
            if self.mailbox.fileno() in events:
                self.mailbox.drain()
            if self.router in events:
                self._drain_router()
            if zygote_fd >= 0 and zygote_fd in events:
                self.spawner.pump()

    def _run_due(self, now: float) -> None:
        """Everything with a deadline or a flag; each is cheap when it has nothing to do."""
        if not self.nvml_up and now >= self._nvml_retry_at:
            self._try_nvml()
        if self.book is not None:
            self._publish(self.book.tick(time.time()))
        if now >= self._next_beacon:
            self._beacon()
            self._next_beacon = now + BEACON_S
        if self.reload_requested:
            self.reload_requested = False
            self.reload("SIGHUP")
        if self._config_check_at and now >= self._config_check_at:
            self._config_check_at = 0.0
            self._check_config_file()
        if self._next_rediscovery and now >= self._next_rediscovery:
            self.rediscover("periodic rediscovery")
        if self.cdi_error is not None and now >= self._next_cdi_retry:
            self._sync_cdi()

    def _poll_ms(self, now: float) -> int:
        deadlines = [now + TICK_S, self._next_beacon, *self.workers.deadlines()]
        if self._config_check_at:
            deadlines.append(self._config_check_at)
        if self._next_rediscovery:
            deadlines.append(self._next_rediscovery)
        return max(1, int((min(deadlines) - now) * 1000) + 1)

    # ------------------------------------------------------------------ control socket
    def _drain_router(self) -> None:
        while True:
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                route, body = split_routed(frames)
                envelope = decode(body)
            except MessageError as exc:
                log.warning("dropped a malformed control message: %s", exc)
                continue
            try:
                self._handle(route, envelope.message)
            except Exception:  # one message must never end the loop (and with it every resource)
                log.exception("handling a %s control message failed; dropped", envelope.kind)

    def _send(self, route: list[bytes], message: Any) -> None:
        self.router.send_multipart([*route, *encode(message, seq=self.out_seq.next())])

    def _handle(self, route: list[bytes], message: Any) -> None:
        now = time.monotonic()
        if isinstance(message, Hello):
            handle = self.workers.workers.get(message.resource)
            if handle is not None and handle.proc is not None and handle.pid == message.pid:
                self.routes[message.resource] = route[0]
                self._catch_up_plan(message.resource)
        elif isinstance(message, Heartbeat):
            beat = self.workers.heartbeat(message.resource, message.pid, message.registered, message.socket_path, now)
            if beat is None and not any(h.pid == message.pid for h in self.workers.workers.values()):
                # A worker nobody here started (a late duplicate, or one of an earlier supervisor
                # life that reconnected to this socket): it must not serve beside ours.
                log.warning("heartbeat from an unknown worker (pid %d, %s): telling it to stop", message.pid, message.resource)
                self._send(route, Shutdown())
            if beat is not None:
                self.routes[message.resource] = route[0]
                if message.stats:  # empty: unchanged since the worker's last report
                    beat.stats = dict(message.stats)
                    self.metrics.worker_stats(message.resource, message.stats, pid=message.pid)
        elif isinstance(message, SnapshotRequest):
            # A resource a reload just removed has no snapshot: its worker is being stopped.
            if self.book is not None and message.resource in self.plans:
                self._send(route, SnapshotReply(self._snapshot(message.resource)))
        elif isinstance(message, StatusReport):
            log.debug("worker %s: %s (%s)", message.resource, message.event, message.detail)
            handle = self.workers.workers.get(message.resource)
            if handle is not None and handle.proc is not None:
                self._count_registration(handle, message.event, message.detail)
            if message.event == "registered" and handle is not None and handle.proc is not None:
                self.workers.heartbeat(message.resource, handle.pid, True, handle.socket_path, now)
                self._on_registered(handle, message.detail)
        elif isinstance(message, Command):
            try:
                data = self.command(message.name, dict(message.args))
                self._send(route, Reply(ok=True, error="", data=data))
            except CommandError as exc:
                self._send(route, Reply(ok=False, error=str(exc), data={}))

    def _snapshot(self, resource: str) -> HealthSnapshot:
        assert self.book is not None
        seq, devices = self.book.snapshot(resource)
        return HealthSnapshot(seq=seq, resource=resource, devices=tuple(devices), epoch=self.epoch)

    # ------------------------------------------------------------------ worker events (hooks)
    def _on_worker_state(self, handle: WorkerHandle, old: WState, new: WState, reason: str) -> None:
        """Every worker lifecycle transition (already logged by change_state)."""
        if new is WState.STARTING:
            # A new process: its route is unknown until it says hello, and it reads the plan
            # file as it is now.
            self.routes.pop(handle.resource, None)
            self.worker_plan[handle.resource] = self.plan_json.get(handle.resource, "")
        elif new in (WState.BACKOFF, WState.STOPPED, WState.FATAL):
            self.routes.pop(handle.resource, None)  # nobody is there to talk to
            self.remove_dead_sockets(handle.resource)

    def _count_registration(self, handle: WorkerHandle, event: str, detail: str) -> None:
        """Feed a worker's registration report to the metrics with the trigger the supervisor knows.

        The worker's own words do not say it all: its first registration ("kubelet.sock is
        there") is a start, and after a kubelet restart it may first report its cancelled stream.
        The supervisor saw the kubelet restart (kubelet.sock deleted / created) and knows which
        worker life has registered before, so it names the trigger.
        """
        resource = handle.resource
        first = self._registered_life.get(resource) != handle.pid
        if event == "registering":
            if first:
                detail = "start"
            elif resource in self._kubelet_restarted:
                detail = "kubelet restart"
        elif event == "registered":
            if not first and resource in self._kubelet_restarted:
                self.metrics.registration_report(resource, "registering", "kubelet restart")
            self._kubelet_restarted.discard(resource)
            self._registered_life[resource] = handle.pid
        self.metrics.registration_report(resource, event, detail)

    def _on_registered(self, handle: WorkerHandle, detail: str) -> None:
        """A worker reported a (re-)registration with the kubelet."""

    def _on_ready_changed(self, ready: bool) -> None:
        """The node became ready (every worker registered) or stopped being ready."""
        log.info("ready" if ready else "not ready", extra={"state": "ready" if ready else "not-ready"})

    def _readiness(self) -> tuple[bool, str]:
        """Ready, and the one-line reason: the single definition behind /readyz, status and systemd."""
        if not self.nvml_up:
            return False, f"not ready: NVML is not up ({self.nvml_error or 'starting'})"
        answer = worker_readiness(self.plans, self.workers.workers)
        if not answer[0]:
            return answer
        if not self.mps.all_up():
            down = [f"{r}: {s.reason}" for r, s in sorted(self.mps.status().items()) if not s.up]
            return False, "not ready: MPS control daemon not up: " + ("; ".join(down) or "starting")
        if self.cdi_error is not None:
            return False, f"not ready: the CDI spec is not written: {self.cdi_error}"
        return answer

    def _check_ready(self) -> None:
        answer = self._readiness()
        self.readiness.set(answer)
        self.metrics.set_ready(answer[0])
        self.notifier.update(*answer)
        ready = answer[0]
        if ready != self._was_ready:
            self._was_ready = ready
            self._on_ready_changed(ready)

    # ------------------------------------------------------------------ health
    def _on_health_event(self, apply: Apply) -> None:
        """From the health thread: apply one finding to the book on the main loop, publish."""

        def run() -> None:
            if self.book is None:
                return
            try:
                for batch in apply(self.book, time.time()):
                    self._publish(batch)
            except Exception:  # one bad finding must never end the main loop
                log.exception("applying a health finding failed")

        self.post(run)

    def _publish(self, batch: ChangeBatch) -> None:
        """Log one change batch as one line, count it, and publish it to the workers."""
        # Ignored XIDs count too (an empty batch that names its XID).
        self.metrics.health_batch(((c.resource, c.device_id, c.healthy) for c in batch.changes), batch.xid)
        if not batch:
            return
        record = batch.log_record()
        healthy = all(c.healthy for c in batch.changes)
        log.log(
            logging.INFO if healthy else logging.WARNING,
            "health %s: %s on %s -> %d device(s) %s in %s%s",
            record["cause"],
            f"XID {batch.xid}" if batch.xid is not None else "condition",
            batch.gpu_uuid or "all GPUs",
            len(batch.changes),
            "Healthy" if healthy else "Unhealthy",
            ", ".join(batch.resources),
            f" (action {batch.action.value})" if batch.action is not None else "",
            extra={"device": batch.gpu_uuid, "xid": batch.xid, "action": batch.action.value if batch.action else None},
        )
        self.health_changes += len(batch.changes)
        if hasattr(self, "pub"):
            self.pub.send_multipart(encode(batch.to_delta(self.epoch), seq=batch.seq))
        self._update_device_gauges(batch.resources)

    def _beacon(self) -> None:
        if self.book is not None:
            self.pub.send_multipart(encode(HealthBeacon(seq=self.book.seq, epoch=self.epoch), seq=self.book.seq))

    def gpu_reset(self, uuid: str) -> None:
        """A GPU was reset: clear its until-reset conditions (MIG UUIDs map to their GPU)."""
        if self.book is None or self.node is None:
            return
        gpu_uuid = uuid
        for gpu in self.node.gpus:
            if any(m.uuid == uuid for m in gpu.mig_devices):
                gpu_uuid = gpu.uuid
        self._publish(self.book.mark_reset(gpu_uuid, time.time()))

    # ------------------------------------------------------------------ kubelet
    def _kubelet_created(self) -> None:
        def run() -> None:
            self._kubelet_restarted.update(self.workers.workers)
            self._reregister_all("kubelet.sock created")

        self.post(run)

    def _file_deleted(self, name: str) -> None:
        if name == KUBELET_SOCKET_NAME:
            # The kubelet is going (or restarting): the registrations that follow are its doing.
            self.post(lambda: self._kubelet_restarted.update(self.workers.workers))
            return

        def check() -> None:
            for resource, handle in self.workers.workers.items():
                if handle.socket_path and os.path.basename(handle.socket_path) == name:
                    self._tell(resource, Reregister(reason=f"socket {name} deleted"))

        if name.startswith(SOCKET_PREFIX):
            self.post(check)

    def _reregister_all(self, reason: str) -> None:
        log.info("kubelet restarted (%s): every worker re-registers", reason, extra={"trigger": "kubelet-restart"})
        for resource in self.workers.workers:
            self._tell(resource, Reregister(reason=reason))

    def _tell(self, resource: str, message: Any) -> bool:
        route = self.routes.get(resource)
        if route is None:
            return False
        self._send([route], message)
        return True

    # ------------------------------------------------------------------ reload and rediscovery
    def _config_event(self) -> None:
        """From the watchdog thread: something changed beside the config file. Debounced."""

        def arm() -> None:
            self._config_check_at = time.monotonic() + CONFIG_DEBOUNCE_S

        self.post(arm)

    def _check_config_file(self) -> None:
        fingerprint = file_fingerprint(self.config.config_file)
        if fingerprint == self._config_fp:
            return  # an event that changed nothing we read (or a burst that ended where it began)
        self._config_fp = fingerprint
        self.reload("config file changed")

    def _refuse(self, trigger: str, what: str, exc: BaseException) -> None:
        """One clear line per refusal; the same refusal repeated (a periodic trigger) logs once."""
        text = f"{what} ({trigger}) refused, keeping the running config: {exc}"
        key = f"{what}: {exc}"
        if trigger == "periodic rediscovery" and key == self._last_refusal:
            return
        self._last_refusal = key
        log.error("%s", text, extra={"trigger": trigger})

    def reload(self, trigger: str) -> bool:
        """Re-read the config and the device set; apply what changed. False if refused."""
        self.reloads += 1
        if self.config.config_file:
            # What is read now has been seen, taken or refused: the file watch need not repeat it.
            self._config_fp = file_fingerprint(self.config.config_file)
        try:
            config = load_config(self.argv_flags, self.environ)
            health_policy_for(config)  # refused here, not half-applied later
        except (ConfigError, PolicyError) as exc:
            self._refuse(trigger, "reload", exc)
            return False
        if not self.nvml_up:
            config = self._live_part(config)
            if _settings_of(config, MPS_SETTINGS) != _settings_of(self.config, MPS_SETTINGS):
                self.mps = self._make_mps(config)  # not started before NVML is up: just replace it
            self._adopt_config(config)
            log.info("reload (%s): config taken; it applies once NVML is up", trigger)
            return True
        return self._replan(config, trigger, "reload")

    def rediscover(self, trigger: str) -> bool:
        """Re-read the device set with the running config; cheap and silent when nothing changed."""
        if not self.nvml_up:
            return False
        return self._replan(self.config, trigger, "rediscovery")

    def _replan(self, config: Config, trigger: str, what: str) -> bool:
        self.rediscoveries += 1
        self._schedule_rediscovery(time.monotonic())
        config = self._live_part(config)
        try:
            node, kept = keep_vanished_gpus(self.node, self.discover())
        except Exception as exc:  # NVML trouble during rediscovery: keep what runs
            self._refuse(trigger, what, RuntimeError(f"discovery failed: {exc}"))
            return False
        if node == self.node and config == self.config:
            return True  # the common case of a periodic rediscovery: nothing to do
        try:
            plans = plan_resources(node, config)
        except PlanningError as exc:
            self._refuse(trigger, what, ConfigError("planning", "", str(exc)))
            return False
        # MPS plans need a control binary and a root: check with the settings being loaded.
        mps = self._make_mps(config) if _settings_of(config, MPS_SETTINGS) != _settings_of(self.config, MPS_SETTINGS) else self.mps
        try:
            mps.validate(plans)
        except MpsError as exc:
            self._refuse(trigger, what, exc)
            return False
        self._last_refusal = ""
        if kept != self.kept_gpus:
            if kept:
                log.warning("rediscovery did not see GPU(s) %s; they stay advertised (health decides)", ", ".join(kept))
            self.kept_gpus = kept
        self._adopt_config(config)
        if mps is not self.mps:
            log.info("MPS settings changed: restarting the MPS control daemons")
            self.mps.shutdown()
            self.mps = mps
            self.mps.start_thread()
        if node != self.node:
            self.node = node
            if self.monitor is not None:
                self.monitor.set_node(node)
        self.apply_plans(plans, trigger)
        return True

    def _live_part(self, config: Config) -> Config:
        """`config` with the settings a running supervisor cannot change held at their values."""
        held = {name: getattr(self.config, name) for name in RESTART_ONLY if getattr(config, name) != getattr(self.config, name)}
        for name in held:
            log.warning("setting %s changed; it takes effect at the next restart", name)
        return dataclasses.replace(config, **held) if held else config

    def _adopt_config(self, config: Config) -> None:
        old = self.config
        self.config = config
        if _settings_of(config, HEALTH_SETTINGS) != _settings_of(old, HEALTH_SETTINGS):
            try:
                self._set_health_policy(health_policy_for(config))
            except PolicyError as exc:  # checked when the reload was read: only a bug gets here
                log.error("health policy unchanged: %s", exc)
        if self.monitor is not None:
            self.monitor.probe_interval = config.probe_interval
        if _settings_of(config, CDI_SETTINGS) != _settings_of(old, CDI_SETTINGS):
            self.cdi = self._make_cdi(config)
            if self.book is not None:
                self._sync_cdi()
        self.spawner.config = config
        self.workers.policy.heartbeat_timeout = config.heartbeat_timeout
        self.workers.policy.start_retries = config.start_retries
        self.workers.policy.start_seconds = config.start_seconds
        self._schedule_rediscovery(time.monotonic())

    def _set_health_policy(self, policy: HealthPolicy) -> None:
        """A reloaded `gpuvisor.health` (or DP_*_HEALTHCHECKS): new events and recoveries follow it."""
        self.health_policy = policy
        if self.book is not None:
            self.book.set_policy(policy)
        if self.monitor is not None:
            self.monitor.policy = policy
            if policy.checks_enabled and not self.monitor.running:
                with contextlib.suppress(RuntimeError):  # a thread runs once; it was never started
                    self.monitor.start()
        log.info("health policy changed: %s", policy.describe())

    def _schedule_rediscovery(self, now: float) -> None:
        interval = self.config.rediscovery_interval
        self._next_rediscovery = now + interval if interval > 0 and self.nvml_up else 0.0

    def apply_plans(self, plans: dict[str, ResourcePlan], trigger: str) -> bool:
        """The diff: unchanged plans untouched, changed ones updated in place, others start/stop.

        The plan files are written first: if that fails (a full disk, a run dir gone), nothing
        changes and the running plans stay.
        """
        old = self.plans
        changed = [r for r, p in plans.items() if r not in old or p.to_json() != self.plan_json.get(r)]
        before = dict(self.plan_json)
        try:
            paths = {r: self.write_plan(plans[r]) for r in changed}
        except OSError as exc:
            log.error("%s refused, keeping the running plans: cannot write %s: %s", trigger, self.plans_dir, exc)
            for resource in changed:  # put back what was written, best effort
                if resource in old and before.get(resource) != self.plan_json.get(resource):
                    with contextlib.suppress(OSError):
                        self.write_plan(old[resource])
            self.plan_json = before
            return False
        self.plans = plans
        if self.book is not None:
            self._publish(self.book.set_plans(plans, time.time()))
            # The spec first, so that no worker hands out a CDI name the spec lacks.
            self._sync_cdi()
            self._apply_mps(old, plans)
            self._update_device_gauges()
        now = time.monotonic()
        for resource in sorted(set(old) - set(plans)):
            log.info("%s: resource %s removed", trigger, resource)
            self.workers.unwant(resource, now)
            self._registered_life.pop(resource, None)
            self._kubelet_restarted.discard(resource)
        for resource in changed:
            plan = plans[resource]
            if resource not in old:
                log.info("%s: resource %s added (%d devices)", trigger, resource, len(plan.devices))
                self.workers.want(resource, paths[resource], plan_changed=True)
            else:
                log.info("%s: resource %s updated in place (%d devices)", trigger, resource, len(plan.devices))
                self.workers.want(resource, paths[resource], plan_changed=True)
                self._catch_up_plan(resource)
        return True

    def _catch_up_plan(self, resource: str) -> None:
        """Send the current plan to the resource's worker if it has an older one."""
        text = self.plan_json.get(resource, "")
        if text and self.worker_plan.get(resource) != text and self._tell(resource, PlanUpdate(plan_json=text)):
            self.worker_plan[resource] = text

    # ------------------------------------------------------------------ commands
    def command(self, name: str, args: dict[str, Any]) -> dict[str, Any]:
        return run_command(self, name, args)

    def status(self) -> dict[str, Any]:
        workers = []
        for resource, h in sorted(self.workers.workers.items()):
            workers.append(
                {
                    "resource": resource,
                    "state": h.state.value,
                    "pid": h.pid if h.proc is not None else None,
                    "restarts": h.restarts,
                    "restart_causes": dict(h.restart_causes),
                    "last_exit": h.last_exit,
                    "socket": h.socket_path,
                    "registered": h.registered,
                    "registered_since": h.registered_since or None,
                }
            )
        resources = {}
        for resource in self.plans:
            _seq, devices = self.book.snapshot(resource) if self.book else (0, [])
            resources[resource] = [
                {"id": d.device_id, "health": "Healthy" if d.healthy else "Unhealthy", "reason": d.reason, "since": d.since}
                for d in devices
            ]
        conditions = [
            {
                "gpu": c.gpu_uuid,
                "gpu_instance": c.gi,
                "compute_instance": c.ci,
                "name": c.name,
                "recovery": c.recovery.value,
                "reason": c.reason,
                "since": c.since,
                "last_event": c.last_event,
            }
            for c in (self.book.conditions() if self.book else [])
        ]
        ready, ready_detail = self._readiness()
        return {
            "pid": os.getpid(),
            "simulated": self.simulator is not None,
            "started_at": self.started_at,
            "ready": ready,
            "ready_detail": ready_detail,
            "plugin_dir": self.plugin_dir,
            "metrics_url": self.http.url if self.http is not None else None,
            "nvml": {"up": self.nvml_up, "error": self.nvml_error, "attempts": self.nvml_attempts},
            "health_policy": self.health_policy.describe(),
            "rediscoveries": self.rediscoveries,
            "reloads": self.reloads,
            "workers": workers,
            "resources": resources,
            "conditions": conditions,
            "mps": {r: dataclasses.asdict(st) for r, st in sorted(self.mps.status().items())},
            "cdi": {"spec_dir": self.cdi.spec_dir, "source": self.cdi.source, "error": self.cdi_error},
        }

    def ready(self) -> bool:
        """NVML up, every resource registered and streaming, MPS daemons up, CDI spec written."""
        return self._readiness()[0]

    # ------------------------------------------------------------------ stop
    def _shutdown(self) -> None:
        self.notifier.stopping()
        log.info("stopping: %d workers", sum(1 for h in self.workers.workers.values() if h.proc is not None))
        now = time.monotonic()
        self.workers.stop_all(now, "supervisor stopping")
        deadline = now + SHUTDOWN_GRACE_S
        while not self.workers.all_stopped() and time.monotonic() < deadline:
            self.workers.tick(time.monotonic())
            time.sleep(0.02)
        if not self.workers.all_stopped():
            self.workers.kill_all()
            kill_deadline = time.monotonic() + 0.5
            while not self.workers.all_stopped() and time.monotonic() < kill_deadline:
                self.workers.tick(time.monotonic())
                time.sleep(0.01)
        self.spawner.stop()
        # After the workers: no container is handed an MPS pipe whose daemon is gone. The CDI spec
        # stays (containers that restart while gpuvisor is down still resolve their devices).
        self.mps.shutdown()
        if self.monitor is not None:
            self.monitor.stop()
        for watch in (self.watch, self.config_watch):
            if watch is not None:
                with contextlib.suppress(Exception):
                    watch.stop()
        for name in ("router", "pub"):
            sock = getattr(self, name, None)
            if sock is not None:
                sock.close(0)
        for name in ("control.sock", "health.sock"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.run_dir, name))
        if self.http is not None:
            self.http.stop()
        log.info("stopped")
        self.notifier.close()


def nvml_init_help(exc: BaseException) -> str:
    return (
        f"NVML could not be initialised ({exc}). Check that the NVIDIA driver is loaded "
        "(nvidia-smi works on the host), that libnvidia-ml.so.1 is on the library path "
        "(LD_LIBRARY_PATH, --driver-root), and, in a container, that the NVIDIA container runtime "
        "is the runtime of this pod (runtimeClassName: nvidia) so the driver is mounted in"
    )
