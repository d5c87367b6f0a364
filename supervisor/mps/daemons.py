"""MPS control daemons: one `nvidia-cuda-mps-control -d` per MPS-shared resource, supervised.

For each resource whose plan shares GPUs with MPS, the supervisor runs one control daemon with
`CUDA_MPS_PIPE_DIRECTORY=<mpsRoot>/<resource>/pipe` and `CUDA_MPS_LOG_DIRECTORY=<mpsRoot>/<resource>/log`
(the full resource name is the directory, as worker/allocate.py mounts it into containers), sets
its defaults from the replica counts, and marks it ready. The layout follows NVIDIA's MPS control
daemon: `<mpsRoot>/shm` (mounted as the containers' /dev/shm), `<mpsRoot>/<resource>/.started`
once a daemon's limits are set, and `<mpsRoot>/.ready` once every daemon is up.

How the daemon is driven (what the fake in the tests must copy) is in supervisor/mps/layout.py.

Liveness: the PID in the pid file must be alive (not a zombie) on every tick, and every
`probe_interval` seconds `get_default_active_thread_percentage` must be answered (the check
NVIDIA's plugin uses); two failed queries in a row count as a hung daemon, which is killed. A dead
or hung daemon is restarted with exponential backoff, and since `quit`/a crash loses the defaults
(the MPS docs say so), every start sends them again. A daemon found alive at start (gpuvisor
restarted, the daemon did not) is adopted, not restarted, so its running clients keep their server.
A daemon that `-d` forked away is re-parented to the supervisor (a child subreaper, or PID 1 in a
container), so its zombie is reaped here once /proc/<pid>/comm shows it is a control daemon: a
stale pid file naming a worker's PID never takes that worker's exit status.

Limits (from the replica counts) are explained where they are computed, in supervisor/mps/layout.py;
running the tool itself (start, commands, quit) is supervisor/mps/tool.py.

Threads: `tick(now)` does all the work (it runs the binary, so it can block for a few seconds) and
the clock is a parameter so tests drive it by hand. The supervisor runs it on a thread of its own
(`start_thread`), never on its main loop, and turns `on_change(resource, up, reason)` (called
from that thread) into health conditions and readiness with its own `post()`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from common.atomicfile import write_atomic
from common.backoff import Backoff
from common.model import ResourcePlan
from supervisor.mps.layout import (
    HEALTH_QUERY,
    MPS_CONTROL_BINARY,
    PID_FILE,
    PROBE_FAILURES_TO_RESTART,
    DaemonSettings,
    DaemonSpec,
    DState,
    MpsError,
    _read_pid,
    daemon_settings,
    find_control_binary,
    ready_file,
)
from supervisor.mps.tool import ControlTool

# What callers of the daemons use, kept importable from here.
__all__ = ["PID_FILE", "DaemonStatus", "MpsDaemons", "MpsError", "daemon_settings", "find_control_binary"]

log = logging.getLogger("gpuvisor.mps")


@dataclass
class _Daemon:
    settings: DaemonSpec
    backoff: Backoff  # the restart backoff, made with the daemon
    state: DState = DState.DOWN
    pid: int | None = None
    reason: str = "MPS control daemon not started yet"
    since: float = 0.0
    next_start: float = 0.0
    deadline: float = 0.0
    next_probe: float = 0.0
    probe_failures: int = 0
    restarts: int = 0
    applied: DaemonSpec | None = None
    killed_pid: int | None = None
    reported_up: bool | None = None


@dataclass(frozen=True)
class DaemonStatus:
    """A read-only view of one daemon, for `gpuvisor status` and readiness."""

    resource: str
    state: str
    up: bool
    pid: int | None
    reason: str
    restarts: int
    thread_percentage: int
    pinned_limits: tuple[tuple[int | str, int], ...]
    failures: int = 0  # failed starts and checks since it was last up


OnChange = Callable[[str, bool, str], None]


@dataclass
class _Event:
    resource: str
    up: bool
    reason: str


@dataclass
class _Pending:
    events: list[_Event] = field(default_factory=list)


class MpsDaemons:
    """Runs and supervises one MPS control daemon per MPS-shared resource.

    Call `set_plans(plans)` at start and on every reload (it raises MpsError for what cannot work),
    `tick(now)` periodically (or `start_thread()`), and `shutdown()` at the end, which quits every
    daemon. `on_change(resource, up, reason)` is called on every up/down flip, and once with
    up=False for each new resource (its daemon is not up yet), from the thread that ticks.
    """

    def __init__(
        self,
        on_change: OnChange,
        *,
        binary: str = MPS_CONTROL_BINARY,
        driver_root: str = "/",
        environ: Mapping[str, str] | None = None,
        nvml_module: Any = None,
        exclusive_process: bool = False,
        command_timeout: float = 5.0,
        start_timeout: float = 15.0,
        probe_interval: float = 10.0,
        backoff_initial: float = 1.0,
        backoff_max: float = 30.0,
        quit_timeout: float = 5.0,
    ) -> None:
        if exclusive_process and nvml_module is None:
            raise ValueError("exclusive_process needs the NVML module (nvml_module)")
        self._on_change = on_change
        self._tool = ControlTool(
            binary_name=binary,
            driver_root=driver_root,
            environ=dict(os.environ if environ is None else environ),
            nvml_module=nvml_module,
            command_timeout=command_timeout,
            quit_timeout=quit_timeout,
        )
        self._exclusive = exclusive_process
        self._start_timeout = start_timeout
        self._probe_interval = probe_interval
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max
        self._lock = threading.Lock()
        self._desired: dict[str, DaemonSpec] = {}
        self._public: dict[str, DaemonStatus] = {}
        self._daemons: dict[str, _Daemon] = {}  # touched only by the ticking thread
        self._ready_roots: dict[str, str] = {}  # root -> the .ready content written there
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._stopping = False

    # -- configuration (any thread) ------------------------------------------------------------

    @property
    def binary(self) -> str | None:
        """The control binary in use (None until a plan needed it)."""
        return self._tool.binary

    def validate(self, plans: Mapping[str, ResourcePlan]) -> None:
        """Check that the MPS plans among `plans` can run here; raises MpsError."""
        mps = [p for p in plans.values() if p.sharing == "mps"]
        if not mps:
            return
        for plan in mps:
            if not plan.allocate.mps_root:
                raise MpsError(
                    f"resource {plan.resource} is shared with MPS but has no MPS root: set --mps-root (MPS_ROOT)"
                )
        self._tool.find()

    def find_binary(self) -> str:
        """The control binary, found now (on PATH or under the driver root); raises MpsError."""
        return self._tool.find()

    def set_plans(self, plans: Mapping[str, ResourcePlan]) -> None:
        """The MPS plans to run daemons for (others are ignored). Raises MpsError, changing nothing."""
        self.validate(plans)
        self.set_desired({r: daemon_settings(p) for r, p in plans.items() if p.sharing == "mps"})

    def set_desired(self, specs: Mapping[str, DaemonSpec]) -> None:
        """The daemons to run, by key (`spec.resource`); the next tick starts and stops to match."""
        with self._lock:
            self._desired = dict(specs)
        self._wake.set()

    def is_up(self, resource: str) -> bool:
        """Is this resource's daemon up (limits set, ready marker written)?"""
        with self._lock:
            status = self._public.get(resource)
        return status is not None and status.up

    def all_up(self) -> bool:
        """Is every wanted daemon up? (True when no resource uses MPS.)"""
        with self._lock:
            return all(r in self._public and self._public[r].up for r in self._desired)

    def status(self) -> dict[str, DaemonStatus]:
        with self._lock:
            return dict(self._public)

    # -- the thread ----------------------------------------------------------------------------

    def start_thread(self, interval: float = 0.5) -> None:
        """Tick on a daemon thread of its own every `interval` seconds (and at once after set_plans)."""
        if self._thread is not None:
            return

        def run() -> None:
            while not self._stopping:
                try:
                    self.tick(time.monotonic())
                except Exception:  # never let one bad tick end supervision
                    log.exception("MPS supervision tick failed")
                self._wake.wait(interval)
                self._wake.clear()

        self._stopping = False
        self._thread = threading.Thread(target=run, name="gpuvisor-mps", daemon=True)
        self._thread.start()

    def stop_thread(self, timeout: float = 30.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    # -- the work (one thread) -----------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Reconcile: start wanted daemons, stop unwanted ones, check the running ones."""
        with self._lock:
            desired = dict(self._desired)
        pending = _Pending()
        for resource in sorted(set(self._daemons) - set(desired)):
            gone = self._daemons.pop(resource)
            log.info(
                "MPS daemon for %s no longer wanted: stopping it", resource, extra={"resource": resource}
            )
            self._stop(gone)
            if gone.reported_up is False:
                pending.events.append(_Event(resource, True, "resource no longer shared with MPS"))
        for resource, settings in sorted(desired.items()):
            daemon = self._daemons.get(resource)
            if daemon is None:
                daemon = _Daemon(
                    settings=settings,
                    since=now,
                    next_start=now,
                    backoff=Backoff(self._backoff_initial, self._backoff_max),
                )
                self._daemons[resource] = daemon
                self._report(daemon, False, daemon.reason, pending)
            elif daemon.settings != settings:
                if daemon.settings.pipe_dir != settings.pipe_dir:
                    # A new root is a new pipe directory: the old daemon cannot serve it.
                    self._stop(daemon)
                    self._fail(daemon, now, "MPS root changed: restarting the daemon", pending, count=False)
                daemon.settings = settings
            self._step(daemon, now, pending)
        self._update_markers()
        self._publish()
        for event in pending.events:
            try:
                self._on_change(event.resource, event.up, event.reason)
            except Exception:
                log.exception("MPS on_change callback failed for %s", event.resource)

    def _step(self, d: _Daemon, now: float, pending: _Pending) -> None:
        if d.state is DState.DOWN and now >= d.next_start:
            self._start(d, now, pending)
        if d.state is DState.STARTING:
            self._check_starting(d, now, pending)
        elif d.state is DState.UP:
            self._check_up(d, now, pending)

    def _start(self, d: _Daemon, now: float, pending: _Pending) -> None:
        s = d.settings
        try:
            for path, mode in ((s.pipe_dir, 0o755), (s.log_dir, 0o755), (s.shm_dir, 0o1777)):
                os.makedirs(path, mode=0o755, exist_ok=True)
                # The shared-memory dir is every client's /dev/shm: any user must be able to write it.
                os.chmod(path, mode)
        except OSError as exc:
            self._fail(
                d,
                now,
                f"cannot create the MPS directories under {s.mps_root}: {exc.strerror or exc}",
                pending,
            )
            return
        pid_path = os.path.join(s.pipe_dir, PID_FILE)
        existing = _read_pid(pid_path)
        if existing is not None and self._tool.alive(existing):
            if existing == d.killed_pid:
                # We killed it for not answering and it is still there: make sure it goes.
                with contextlib.suppress(OSError):
                    os.kill(existing, signal.SIGKILL)
                self._fail(
                    d, now, f"hung MPS control daemon (pid {existing}) did not exit; killed it", pending
                )
                return
            log.info(
                "MPS daemon for %s already running (pid %d): adopting it", s.resource, existing,
                extra={"resource": s.resource},
            )  # fmt: skip
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(pid_path)
            if self._exclusive:
                error = self._tool.set_compute_mode(s, exclusive=True)
                if error:
                    self._fail(d, now, error, pending)
                    return
            error = self._tool.launch(s)
            if error:
                self._fail(d, now, error, pending)
                return
        d.state = DState.STARTING
        d.deadline = now + self._start_timeout
        d.applied = None
        d.pid = None

    def _check_starting(self, d: _Daemon, now: float, pending: _Pending) -> None:
        s = d.settings
        pid = _read_pid(os.path.join(s.pipe_dir, PID_FILE))
        if pid is None or not self._tool.alive(pid):
            if now >= d.deadline:
                self._fail(
                    d, now,
                    f"MPS control daemon did not come up within {self._start_timeout:g}s "
                    f"(no live PID in {os.path.join(s.pipe_dir, PID_FILE)})",
                    pending,
                )  # fmt: skip
            return
        d.pid = pid
        error = self._apply(d)
        if error:
            if now >= d.deadline:
                self._fail(
                    d, now, f"MPS control daemon (pid {pid}) refused its limits: {error}", pending, kill=True
                )
            return
        d.state = DState.UP
        d.since = now
        d.backoff.reset()
        d.probe_failures = 0
        d.next_probe = now + self._probe_interval
        d.killed_pid = None
        self._touch(s.started_file)
        self._report(d, True, f"MPS control daemon up (pid {pid})", pending)

    def _check_up(self, d: _Daemon, now: float, pending: _Pending) -> None:
        pid = d.pid
        assert pid is not None
        if not self._tool.alive(pid):
            self._fail(d, now, f"MPS control daemon (pid {pid}) exited", pending)
            return
        if d.applied != d.settings:
            error = self._apply(d)
            if error:
                self._fail(
                    d, now, f"MPS control daemon (pid {pid}) refused new limits: {error}", pending, kill=True
                )
                return
            log.info(
                "MPS daemon for %s: limits updated",
                d.settings.resource,
                extra={"resource": d.settings.resource},
            )
        if now < d.next_probe:
            return
        ok, answer = self._tool.command(d.settings, HEALTH_QUERY)
        if ok:
            d.probe_failures = 0
            d.next_probe = now + self._probe_interval
            return
        d.probe_failures += 1
        d.next_probe = now + min(1.0, self._probe_interval)
        if d.probe_failures >= PROBE_FAILURES_TO_RESTART:
            self._fail(
                d, now, f"MPS control daemon (pid {pid}) is not answering: {answer}", pending, kill=True
            )

    def _apply(self, d: _Daemon) -> str:
        """Send the daemon its defaults; an error text, empty when all were taken."""
        for command in d.settings.commands():
            ok, answer = self._tool.command(d.settings, command)
            if not ok:
                return f"{command!r}: {answer}"
        d.applied = d.settings
        return ""

    def _fail(
        self,
        d: _Daemon,
        now: float,
        reason: str,
        pending: _Pending,
        *,
        kill: bool = False,
        count: bool = True,
    ) -> None:
        s = d.settings
        if kill and d.pid is not None and self._tool.alive(d.pid):
            with contextlib.suppress(OSError):
                os.kill(d.pid, signal.SIGTERM)
            d.killed_pid = d.pid
        with contextlib.suppress(FileNotFoundError):
            os.unlink(s.started_file)
        # A restart we caused (a new MPS root) is no failure: it waits as long as the last one did.
        delay = d.backoff.next() if count else d.backoff.step(max(d.backoff.attempts, 1))
        was_up = d.state is DState.UP
        d.state = DState.DOWN
        d.pid = None
        d.applied = None
        d.since = now
        d.next_start = now + delay
        if was_up:
            d.restarts += 1
        log.warning(
            "MPS daemon for %s down: %s; retrying in %.0fs", s.resource, reason, delay,
            extra={"resource": s.resource, "state": "down"},
        )  # fmt: skip
        self._report(d, False, reason, pending)

    def _report(self, d: _Daemon, up: bool, reason: str, pending: _Pending) -> None:
        d.reason = reason
        if d.reported_up is up:
            return
        d.reported_up = up
        if up:
            log.info(
                "MPS daemon for %s up: %s",
                d.settings.resource,
                reason,
                extra={"resource": d.settings.resource, "state": "up"},
            )
        pending.events.append(_Event(d.settings.resource, up, reason))

    def _publish(self) -> None:
        public = {
            r: DaemonStatus(
                resource=r,
                state=d.state.value,
                up=d.state is DState.UP,
                pid=d.pid,
                reason=d.reason,
                restarts=d.restarts,
                thread_percentage=d.settings.thread_percentage,
                pinned_limits=d.settings.pinned_limits,
                failures=d.backoff.attempts,
            )
            for r, d in self._daemons.items()
        }
        with self._lock:
            self._public = public

    def _update_markers(self) -> None:
        """`<mpsRoot>/.ready` exists exactly while every daemon under that root is up."""
        by_root: dict[str, list[tuple[_Daemon, DaemonSettings]]] = {}
        for d in self._daemons.values():
            if isinstance(d.settings, DaemonSettings):  # a DRA claim's daemon has no marker here
                by_root.setdefault(d.settings.mps_root, []).append((d, d.settings))
        for root in set(self._ready_roots) - set(by_root):
            self._unready(root)
        for root, daemons in by_root.items():
            if all(d.state is DState.UP for d, _ in daemons):
                content = {
                    "resources": {
                        s.resource: {
                            "replicas": {str(i): n for i, n in s.replicas},
                            "activeThreadPercentage": s.thread_percentage,
                            "pinnedMemoryLimitsMiB": {str(i): m for i, m in s.pinned_limits},
                        }
                        for _, s in sorted(daemons, key=lambda pair: pair[1].resource)
                    }
                }
                text = json.dumps(content, sort_keys=True) + "\n"
                if self._ready_roots.get(root) != text and self._write(ready_file(root), text):
                    self._ready_roots[root] = text
            elif root in self._ready_roots:
                self._unready(root)

    def _unready(self, root: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(ready_file(root))
        self._ready_roots.pop(root, None)

    # -- stopping ------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the ticking thread, quit every daemon, remove the ready markers."""
        self.stop_thread()
        for resource in sorted(self._daemons):
            self._stop(self._daemons[resource])
        self._daemons.clear()
        for root in list(self._ready_roots):
            self._unready(root)
        self._publish()

    def end(self, spec: DaemonSpec) -> None:
        """Stop a daemon this instance does not supervise (found on disk: its pid file)."""
        self._stop(_Daemon(settings=spec, backoff=Backoff(0.0, 0.0)))

    def _stop(self, d: _Daemon) -> None:
        s = d.settings
        with contextlib.suppress(FileNotFoundError):
            os.unlink(s.started_file)
        pid = _read_pid(os.path.join(s.pipe_dir, PID_FILE)) if d.pid is None else d.pid
        if pid is not None and self._tool.alive(pid):
            self._tool.end(s, pid)
            log.info(
                "MPS daemon for %s stopped", s.resource, extra={"resource": s.resource, "state": "stopped"}
            )
        if self._exclusive:
            error = self._tool.set_compute_mode(s, exclusive=False)
            if error:
                log.warning("%s", error, extra={"resource": s.resource})
        d.state = DState.DOWN
        d.pid = None

    # -- helpers -------------------------------------------------------------------------------

    @staticmethod
    def _touch(path: str) -> None:
        with contextlib.suppress(OSError), open(path, "a", encoding="utf-8"):
            pass

    @staticmethod
    def _write(path: str, text: str) -> bool:
        try:
            # Readable by the containers that look for it; never written through a planted symlink.
            write_atomic(path, text, mode=0o644)
        except OSError as exc:
            log.warning("cannot write MPS marker %s: %s", path, exc.strerror or exc)
            return False
        return True
