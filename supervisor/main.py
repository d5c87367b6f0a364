"""The supervisor process (`gpuvisor run`): discovery, plans, workers, health, kubelet watch.

One main loop owns every ZeroMQ socket and all mutable state. Other threads (the NVML event
loop, the watchdog observer, signal handlers) only enqueue a callable and poke a wake pipe;
the loop runs them, reaps and reconciles the workers (`WorkerSet.tick`), ticks the health book
(transient recovery) and publishes health. So no lock guards the state: one thread touches it.

Sockets in the run dir (mode 0700, the sockets 0600): `control.sock` (ROUTER: workers' hello,
heartbeat and snapshot requests; `gpuvisor status` and `gpuvisor sim`) and `health.sock` (PUB:
health deltas and beacons to every worker).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
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
    SnapshotReply,
    SnapshotRequest,
    StatusReport,
    decode,
    encode,
    split_routed,
)
from common.model import Node, ResourcePlan
from common.planning import PlanningError, plan_resources
from common.procutil import unix_socket_listening
from supervisor.commands import CommandError, run_command
from supervisor.health import Apply, HealthMonitor
from supervisor.health_policy import HealthPolicy
from supervisor.healthbook import ChangeBatch, HealthBook
from supervisor.workers import EXIT_CONFIG_ERROR, Policy, WorkerHandle, WorkerSet, WState

log = logging.getLogger("gpuvisor.supervisor")

EXIT_NVML_ERROR = 3
TICK_S = 0.5
BEACON_S = 2.0
SOCKET_PREFIX = "gpuvisor-"


class StartupError(Exception):
    """A failure at start that ends the process with a clear message and an exit code."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def control_endpoint(run_dir: str) -> str:
    return f"ipc://{os.path.join(run_dir, 'control.sock')}"


def health_endpoint(run_dir: str) -> str:
    return f"ipc://{os.path.join(run_dir, 'health.sock')}"


class SubprocessSpawner:
    """Starts a worker by exec of `python -m worker` (no fork of a process holding gRPC state)."""

    def __init__(self, config: Config, run_dir: str) -> None:
        self.config = config
        self.run_dir = run_dir

    def __call__(self, handle: WorkerHandle) -> subprocess.Popen[bytes]:
        argv = [
            sys.executable,
            "-m",
            "worker",
            "--resource",
            handle.resource,
            "--plan",
            handle.plan_path,
            "--kubelet-socket",
            self.config.kubelet_socket,
            "--control",
            control_endpoint(self.run_dir),
            "--health",
            health_endpoint(self.run_dir),
            "--supervisor-pid",
            str(os.getpid()),
            "--log-format",
            self.config.log_format,
            "--log-level",
            self.config.log_level,
        ]
        return subprocess.Popen(argv, close_fds=True, stdin=subprocess.DEVNULL)


def open_nvml(config: Config) -> tuple[Any, Any]:
    """The pynvml module to use (the real one, or the simulator) and the simulator or None."""
    if config.simulate:
        from common.simulator import load_simulator

        sim = load_simulator(config.simulate)
        return sim, sim
    import pynvml

    return pynvml, None


class Supervisor:
    def __init__(self, config: Config, argv_flags: Any = None) -> None:
        self.config = config
        self.argv_flags = argv_flags
        self.run_dir = os.path.abspath(config.run_dir)
        self.plugin_dir = os.path.dirname(os.path.abspath(config.kubelet_socket))
        self.plans_dir = os.path.join(self.run_dir, "plans")
        self.epoch = uuid.uuid4().hex[:12]
        self.stopping = False
        self.reload_requested = False
        self.started_at = time.time()
        self.last_loop = time.monotonic()
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        for fd in (self._wake_r, self._wake_w):
            os.set_blocking(fd, False)
        self.nvml_module, self.simulator = open_nvml(config)
        self.node: Node | None = None
        self.plans: dict[str, ResourcePlan] = {}
        self.plan_json: dict[str, str] = {}
        self.health_policy = HealthPolicy.from_settings(
            disable_env=",".join(config.disable_healthchecks) or None,
            enable_env=",".join(config.enable_healthchecks) or None,
            xid_actions=config.health.xid_actions(),
            quiet_seconds=config.health.transient_quiet_seconds,
        )
        self.book: HealthBook | None = None
        self.monitor: HealthMonitor | None = None
        self.workers = WorkerSet(
            SubprocessSpawner(config, self.run_dir),
            Policy(heartbeat_timeout=config.heartbeat_timeout, start_retries=config.start_retries),
        )
        self.routes: dict[str, bytes] = {}  # resource -> ROUTER identity of its worker
        self.out_seq = SequenceCounter()
        self.health_changes = 0
        self._next_beacon = 0.0

    # ------------------------------------------------------------------ plumbing
    def post(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the main loop (callable from any thread)."""
        self._inbox.put(fn)
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"x")

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGHUP:
            self.reload_requested = True
        elif signum != signal.SIGCHLD:
            self.stopping = True

    # ------------------------------------------------------------------ start
    def prepare_dirs(self) -> None:
        os.makedirs(self.run_dir, mode=0o700, exist_ok=True)
        os.chmod(self.run_dir, 0o700)
        os.makedirs(self.plans_dir, mode=0o700, exist_ok=True)
        os.makedirs(self.plugin_dir, exist_ok=True)
        for name in ("control.sock", "health.sock"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.run_dir, name))
        self.remove_stale_sockets()

    def remove_stale_sockets(self) -> None:
        """Remove sockets an earlier life of gpuvisor left: ours by name, and nobody listening."""
        try:
            entries = list(os.scandir(self.plugin_dir))
        except FileNotFoundError:
            return
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
            log.info("removed stale socket %s", entry.path)

    def discover(self) -> Node:
        from common.nvml import Nvml

        nvml = Nvml(self.nvml_module)
        return nvml.discover()

    def init_nvml(self) -> None:
        """NVML init, with the two behaviours of --fail-on-init-error (NVIDIA #170)."""
        from common.nvml import Nvml

        delay = 1.0
        while True:
            try:
                Nvml(self.nvml_module).init()
                return
            except Exception as exc:  # any NVML failure at init: the message says what to check
                text = nvml_init_help(exc)
                if self.config.fail_on_init_error:
                    raise StartupError(text, EXIT_NVML_ERROR) from None
                log.error("%s; retrying in %.0fs (not ready)", text, delay)
            deadline = time.monotonic() + delay
            while time.monotonic() < deadline and not self.stopping:
                time.sleep(min(0.2, deadline - time.monotonic()))
            if self.stopping:
                raise StartupError("stopped before NVML came up", 0)
            delay = min(delay * 2, 60.0)

    def make_plans(self, node: Node, config: Config) -> dict[str, ResourcePlan]:
        try:
            return plan_resources(node, config)
        except PlanningError as exc:
            raise StartupError(f"config error: {exc}", EXIT_CONFIG_ERROR) from None

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
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        log.info("gpuvisor starting (pid %d): %s", os.getpid(), json.dumps(self.config.describe(), sort_keys=True))
        self.prepare_dirs()
        self.init_nvml()
        node = self.discover()
        self.node = node
        self.plans = self.make_plans(node, self.config)
        log.info(
            "discovered %d GPUs; resources: %s",
            len(node.gpus),
            ", ".join(f"{r} ({len(p.devices)})" for r, p in self.plans.items()) or "none",
        )
        self.book = HealthBook(self.plans, self.health_policy, time.time())
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
        self.monitor = HealthMonitor(self.nvml_module, node, self.health_policy, self.post, self._on_health_event)
        for batch in self.monitor.initial_probe(self.book):
            self._publish(batch)
        self.monitor.start()
        from supervisor.kubeletwatch import KubeletWatch

        self.watch = KubeletWatch(self.plugin_dir, self._kubelet_created, self._file_deleted)
        self.watch.start()
        for resource, plan in self.plans.items():
            self.workers.want(resource, self.write_plan(plan))
        try:
            self._loop()
        finally:
            self._shutdown()
        return 0

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        while not self.stopping:
            now = time.monotonic()
            self.last_loop = now
            self.workers.tick(now)
            if self.book is not None:
                self._publish(self.book.tick(time.time()))
            if now >= self._next_beacon:
                self._beacon()
                self._next_beacon = now + BEACON_S
            if self.reload_requested:
                self.reload_requested = False
                self.reload("SIGHUP")
            events = dict(poller.poll(int(TICK_S * 1000)))
            if self._wake_r in events:
                self._drain_wake()
            if self.router in events:
                self._drain_router()

    def _drain_wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_r, 4096):
                pass
        while True:
            try:
                fn = self._inbox.get_nowait()
            except queue.Empty:
                return
            fn()

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
            self._handle(route, envelope.message)

    def _send(self, route: list[bytes], message: Any) -> None:
        self.router.send_multipart([*route, *encode(message, seq=self.out_seq.next())])

    def _handle(self, route: list[bytes], message: Any) -> None:
        now = time.monotonic()
        if isinstance(message, Hello):
            self.routes[message.resource] = route[0]
        elif isinstance(message, Heartbeat):
            self.routes[message.resource] = route[0]
            self.workers.heartbeat(message.resource, message.pid, message.registered, message.socket_path, now)
            handle = self.workers.workers.get(message.resource)
            if handle is not None and handle.pid == message.pid:
                handle.stats = dict(message.stats)
        elif isinstance(message, SnapshotRequest):
            self.routes[message.resource] = route[0]
            self._send(route, SnapshotReply(self._snapshot(message.resource)))
        elif isinstance(message, StatusReport):
            log.debug("worker %s: %s (%s)", message.resource, message.event, message.detail)
            if message.event == "registered":
                handle = self.workers.workers.get(message.resource)
                if handle is not None and handle.proc is not None:
                    self.workers.heartbeat(message.resource, handle.pid, True, handle.socket_path, now)
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

    # ------------------------------------------------------------------ health
    def _on_health_event(self, apply: Apply) -> None:
        """From the health thread: apply one finding to the book on the main loop, publish."""

        def run() -> None:
            if self.book is not None:
                for batch in apply(self.book, time.time()):
                    self._publish(batch)

        self.post(run)

    def _publish(self, batch: ChangeBatch) -> None:
        """Log one change batch as one line and publish it to the workers."""
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
        self.post(lambda: self._reregister_all("kubelet.sock created"))

    def _file_deleted(self, name: str) -> None:
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

    def _tell(self, resource: str, message: Any) -> None:
        route = self.routes.get(resource)
        if route is not None:
            self._send([route], message)

    # ------------------------------------------------------------------ reload
    def reload(self, trigger: str) -> None:
        """Rebuild plans from a fresh config and device set; touch only what changed."""
        try:
            config = load_config(self.argv_flags, os.environ)
            node = self.discover()
            plans = plan_resources(node, config)
        except (ConfigError, PlanningError) as exc:
            log.error("reload (%s) refused, keeping the running config: %s", trigger, exc)
            return
        except Exception as exc:  # NVML trouble during rediscovery: keep what runs
            log.error("reload (%s) refused: discovery failed: %s", trigger, exc)
            return
        self.config = config
        self.node = node
        self.apply_plans(plans, trigger)

    def apply_plans(self, plans: dict[str, ResourcePlan], trigger: str) -> None:
        old = self.plans
        self.plans = plans
        if self.book is not None:
            self._publish(self.book.set_plans(plans, time.time()))
        now = time.monotonic()
        for resource in sorted(set(old) - set(plans)):
            log.info("reload (%s): resource %s removed", trigger, resource)
            self.workers.unwant(resource, now)
        for resource, plan in plans.items():
            text = plan.to_json()
            if resource not in old:
                log.info("reload (%s): resource %s added", trigger, resource)
                self.workers.want(resource, self.write_plan(plan))
            elif text != self.plan_json.get(resource):
                log.info("reload (%s): resource %s updated in place", trigger, resource)
                self.write_plan(plan)
                self._tell(resource, PlanUpdate(plan_json=text))

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
        return {
            "pid": os.getpid(),
            "simulated": self.simulator is not None,
            "started_at": self.started_at,
            "workers": workers,
            "resources": resources,
        }

    def ready(self) -> bool:
        return bool(self.plans) and all(
            h.state is WState.RUNNING for r, h in self.workers.workers.items() if r in self.plans
        )

    # ------------------------------------------------------------------ stop
    def _shutdown(self) -> None:
        log.info("stopping: %d workers", len(self.workers.workers))
        now = time.monotonic()
        self.workers.stop_all(now, "supervisor stopping")
        deadline = now + 4.0
        while not self.workers.all_stopped() and time.monotonic() < deadline:
            self.workers.tick(time.monotonic())
            time.sleep(0.02)
        for handle in self.workers.workers.values():
            if handle.proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    handle.proc.send_signal(signal.SIGKILL)
                self.workers.tick(time.monotonic())
        if self.monitor is not None:
            self.monitor.stop()
        with contextlib.suppress(Exception):
            self.watch.stop()
        with contextlib.suppress(Exception):
            self.router.close(0)
            self.pub.close(0)
        for name in ("control.sock", "health.sock"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.run_dir, name))
        log.info("stopped")


def nvml_init_help(exc: BaseException) -> str:
    return (
        f"NVML could not be initialised ({exc}). Check that the NVIDIA driver is loaded "
        "(nvidia-smi works on the host), that libnvidia-ml.so.1 is on the library path "
        "(LD_LIBRARY_PATH, --driver-root), and, in a container, that the NVIDIA container runtime "
        "is the runtime of this pod (runtimeClassName: nvidia) so the driver is mounted in"
    )

