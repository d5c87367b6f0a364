"""MPS control daemons of DRA claims: one per claim that NVIDIA's `MpsConfig` shares, supervised.

The DRA worker prepares an MPS claim by asking the supervisor (`MpsClaimRequest`, common/
mpsmessages.py) and answers the kubelet only once the daemon is up with its limits set; an
unprepare asks it to stop the daemon. NVIDIA's kubelet plugin (kubernetes-sigs/dra-driver-nvidia-gpu
v0.4.1, cmd/gpu-kubelet-plugin/sharing.go, `MpsControlDaemon`) runs the daemon as a Deployment
per claim from templates/mps-control-daemon.tmpl.yaml; gpuvisor runs it as a local process, as
it runs its device-plugin MPS daemons, a deliberate difference (no API objects, no image pull,
no pod in the claim's way; supervision by pid and probe instead of a startup probe).

Why the supervisor supervises and not the DRA worker: a claim's daemon must outlive the worker
(its clients are the claim's running containers), and the supervisor already is what that
takes: the subreaper that reaps a daemon `-d` forked away (supervisor/mps/layout.py), the
liveness loop with probe, hung-daemon kill, backoff and adoption (`MpsDaemons`, reused here by
key, not copied), NVML for the compute mode, and `gpuvisor status` and the metrics. A worker that
ran the daemons would have to supervise from a process that restarts more often than they do.
The worker's side is worker/dra/mps.py.

Layout, per daemon, under the claims root (`<mpsRoot>/dra` with --mps-root, else NVIDIA's
`<kubelet plugins dir>/gpu.nvidia.com/mps`): `<daemon id>/pipe`, `log`, `shm` (the containers'
/dev/shm; a directory, not a tmpfs of its own as NVIDIA mounts), `.started` once its limits are set,
and `claim.json`, the durable record (claim UID, GPUs, limits, when last asked for). The daemon ID
is NVIDIA's: `<claim UID>-<the first 5 hex digits of the SHA-256 of the GPU UUIDs joined by ",">`.
The daemon runs with CUDA_VISIBLE_DEVICES set to the claim's GPUs, and is told, in NVIDIA's
template's order, `set_default_active_thread_percentage <n>` (when set) and then
`set_default_device_pinned_mem_limit <GPU UUID> <MiB>M` for each GPU with a limit (by UUID, as Go's
template ranges over the map); its full GPUs are put in EXCLUSIVE_PROCESS compute mode first, as NVIDIA
does, and back in DEFAULT when the daemon stops (NVIDIA leaves them exclusive).

Who wants a daemon: its owner in the DRA checkpoint (`daemon_owners`: a claim, or for a GPU shared
by memory any claim with a share of it), or a record asked for less than `grace` seconds ago (a
prepare between its start and its checkpoint write). Any other daemon is stopped and its directory
removed: an unprepare's stop, a claim the checkpoint dropped, and what a crash between start and
checkpoint left (once its grace is over). A checkpoint that cannot be read stops nothing. After a
supervisor restart the records are read from disk and each live daemon adopted by its pid file
(its clients keep their server); the supervisor's shutdown leaves them running.

Requests: a start is answered once the daemon is up, or, at its first failure or after
`start_wait` seconds, with why, its daemon stopped and its directory removed (nothing left
behind); a start of a claim already up is answered at once (a repeated prepare). A stop is
answered once the claim's daemons are gone. A daemon that dies or hangs later is restarted with
its limits (the engine's backoff), loudly: a warning, its state in `gpuvisor status`
(`cluster.dra.mps_claims`), and the figures `mps_claim_daemons` / `mps_claim_daemons_down`.

Threads: one thread of its own ("gpuvisor-mps-claims") does all the work, `tick(now, wall)`, with
the clocks as parameters for the tests; requests reach it through a queue, answers leave through
`answer` (which posts them to the main loop).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import re
import shutil
import stat
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from common.atomicfile import write_atomic
from common.dracheckpoint import CheckpointError, daemon_owners
from common.mpsmessages import START, STOP, MpsClaimReply, MpsClaimRequest
from common.procutil import pid_alive
from supervisor.mps.daemons import DaemonStatus, MpsDaemons
from supervisor.mps.layout import MPS_CONTROL_BINARY, PID_FILE, MpsError, _read_pid, daemon_comm

log = logging.getLogger("gpuvisor.mps")

RECORD = "claim.json"
RECORD_VERSION = 1
MAX_RECORD_BYTES = 64 * 1024
MAX_CLAIM_DAEMONS = 128  # a node's MPS claims; one per GPU is the usual
MAX_GPUS = 32  # a claim's devices (AllocationResultsMaxSize)
GRACE_S = 90.0  # longer than the kubelet's 45 s prepare timeout and its retry
START_WAIT_S = 25.0  # a start is answered within this (plus a stop's quit): under the 45 s
CHECKPOINT_EVERY_S = 5.0
CLAIM_UID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")  # a Kubernetes UID is a UUID
GPU_UUID = re.compile(r"(GPU|MIG)-[A-Za-z0-9._/-]{1,96}")
THREAD_ENV = "CUDA_VISIBLE_DEVICES"


def check_claim_uid(uid: str) -> str:
    """The UID, checked before it becomes a path; raises MpsError."""
    if not CLAIM_UID.fullmatch(uid):
        raise MpsError(
            f"claim UID {uid[:120]!r} is not a UID gpuvisor makes a directory of "
            "(letters, digits, '.', '_', '-', at most 100)"
        )
    return uid


def daemon_id(claim_uid: str, gpu_uuids: tuple[str, ...]) -> str:
    """NVIDIA's ID of a claim's daemon (sharing.go, GetMpsControlDaemonID)."""
    import hashlib  # here: a node without MPS claims never loads it (nor OpenSSL with it)

    digest = hashlib.sha256(",".join(gpu_uuids).encode()).hexdigest()
    return f"{check_claim_uid(claim_uid)}-{digest[:5]}"


@dataclass(frozen=True)
class ClaimDaemonSettings:
    """One claim's daemon: a `DaemonSpec` (supervisor/mps/layout.py) for `MpsDaemons`."""

    claim_uid: str
    daemon_id: str
    claims_root: str
    gpu_uuids: tuple[str, ...]
    active_thread_percentage: int | None  # None: the daemon's default
    limits_mib: tuple[tuple[str, int], ...]  # (GPU UUID, MiB), by UUID

    @property
    def resource(self) -> str:
        return f"claim {self.daemon_id}"

    @property
    def mps_root(self) -> str:
        return self.claims_root

    @property
    def home(self) -> str:
        return os.path.join(self.claims_root, self.daemon_id)

    @property
    def pipe_dir(self) -> str:
        return os.path.join(self.home, "pipe")

    @property
    def log_dir(self) -> str:
        return os.path.join(self.home, "log")

    @property
    def shm_dir(self) -> str:
        return os.path.join(self.home, "shm")

    @property
    def started_file(self) -> str:
        return os.path.join(self.home, ".started")

    @property
    def thread_percentage(self) -> int:
        return 100 if self.active_thread_percentage is None else self.active_thread_percentage

    @property
    def pinned_limits(self) -> tuple[tuple[int | str, int], ...]:
        return self.limits_mib

    def commands(self) -> list[str]:
        out = []
        if self.active_thread_percentage is not None:
            out.append(f"set_default_active_thread_percentage {self.active_thread_percentage}")
        out.extend(f"set_default_device_pinned_mem_limit {uuid} {mib}M" for uuid, mib in self.limits_mib)
        return out

    def extra_env(self) -> dict[str, str]:
        return {THREAD_ENV: ",".join(self.gpu_uuids)}

    def to_json(self, requested_at: float) -> dict[str, Any]:
        return {
            "version": RECORD_VERSION,
            "claimUID": self.claim_uid,
            "gpuUUIDs": list(self.gpu_uuids),
            "activeThreadPercentage": self.active_thread_percentage,
            "pinnedMemoryLimitsMiB": dict(self.limits_mib),
            "requestedAt": requested_at,
        }


def claim_settings(
    claims_root: str,
    claim_uid: str,
    gpu_uuids: tuple[str, ...],
    thread_percentage: int | None,
    limits_mib: Mapping[str, float],
) -> ClaimDaemonSettings:
    """A claim's daemon settings, every value checked; raises MpsError naming what is wrong."""
    check_claim_uid(claim_uid)
    what = f"claim {claim_uid}"
    if not 1 <= len(gpu_uuids) <= MAX_GPUS:
        raise MpsError(f"{what}: an MPS daemon serves 1 to {MAX_GPUS} GPUs, not {len(gpu_uuids)}")
    for uuid in gpu_uuids:
        if not GPU_UUID.fullmatch(uuid):
            raise MpsError(f"{what}: {uuid[:120]!r} is not a GPU UUID")
    if len(set(gpu_uuids)) != len(gpu_uuids):
        raise MpsError(f"{what}: a GPU is named twice in {', '.join(gpu_uuids)}")
    if thread_percentage is not None and not 1 <= thread_percentage <= 100:
        raise MpsError(f"{what}: active thread percentage {thread_percentage} is not within 1-100")
    limits: list[tuple[str, int]] = []
    for uuid, mib in sorted(limits_mib.items()):
        if uuid not in gpu_uuids:
            raise MpsError(
                f"{what}: a pinned memory limit names {uuid[:120]!r}, which is not one of its GPUs"
            )
        if mib != int(mib) or not 1 <= mib <= 1 << 30:
            raise MpsError(
                f"{what}: pinned memory limit {mib:g} MiB for {uuid} is not a whole number of MiB >= 1"
            )
        limits.append((uuid, int(mib)))
    return ClaimDaemonSettings(
        claim_uid=claim_uid,
        daemon_id=daemon_id(claim_uid, gpu_uuids),
        claims_root=claims_root,
        gpu_uuids=gpu_uuids,
        active_thread_percentage=thread_percentage,
        limits_mib=tuple(limits),
    )


def read_record(claims_root: str, name: str) -> tuple[ClaimDaemonSettings, float]:
    """The record in `<claims_root>/<name>/claim.json` and when it was last asked for; raises MpsError."""
    path = os.path.join(claims_root, name, RECORD)
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_RECORD_BYTES + 1)
        if len(data) > MAX_RECORD_BYTES:
            raise ValueError(f"over {MAX_RECORD_BYTES} bytes")
        raw = json.loads(data)
        if not isinstance(raw, dict) or raw.get("version") != RECORD_VERSION:
            raise ValueError(f"not a version {RECORD_VERSION} record")
        uuids = raw["gpuUUIDs"]
        limits = raw["pinnedMemoryLimitsMiB"]
        thread = raw["activeThreadPercentage"]
        at = raw["requestedAt"]
        if not isinstance(uuids, list) or not all(isinstance(u, str) for u in uuids):
            raise ValueError("gpuUUIDs is not a list of strings")
        if not isinstance(limits, dict) or not all(type(v) is int for v in limits.values()):
            raise ValueError("pinnedMemoryLimitsMiB is not a map of whole numbers")
        if thread is not None and type(thread) is not int:
            raise ValueError("activeThreadPercentage is not a whole number")
        if isinstance(at, bool) or not isinstance(at, int | float):
            raise ValueError("requestedAt is not a number")
        settings = claim_settings(claims_root, str(raw["claimUID"]), tuple(uuids), thread, limits)
    except (OSError, ValueError, KeyError, RecursionError) as exc:
        raise MpsError(f"{path}: {getattr(exc, 'strerror', None) or exc}") from None
    if settings.daemon_id != name:
        raise MpsError(f"{path}: its claim and GPUs make the daemon ID {settings.daemon_id}, not {name}")
    return settings, float(at)


@dataclass
class _Record:
    settings: ClaimDaemonSettings
    requested_at: float  # wall clock: a start's grace runs from here
    dropping: bool = False  # stop it (a stop, or a failed start)


@dataclass
class _PendingAnswer:
    request: MpsClaimRequest
    key: str  # the daemon (a start) or "" (a stop of the claim)
    deadline: float  # monotonic
    error: str = ""  # a failed start: answered once its daemon is gone


@dataclass
class _Inbox:
    requests: queue.Queue[MpsClaimRequest] = field(default_factory=lambda: queue.Queue(256))


class ClaimDaemons:
    """The MPS control daemons of DRA claims under one claims root (see the module docstring)."""

    def __init__(
        self,
        *,
        claims_root: str,
        checkpoint_path: str,
        engine: MpsDaemons,
        answer: Callable[[str, MpsClaimReply], None],
        grace: float = GRACE_S,
        start_wait: float = START_WAIT_S,
        checkpoint_every: float = CHECKPOINT_EVERY_S,
        on_counts: Callable[[int, int], None] = lambda up, down: None,
    ) -> None:
        self.claims_root = claims_root
        self.checkpoint_path = checkpoint_path
        self._engine = engine
        self._answer = answer  # (resource of the asking worker, reply), from the thread
        self._grace = grace
        self._start_wait = start_wait
        self._checkpoint_every = checkpoint_every
        self._on_counts = on_counts  # (up, down) whenever they change, from the thread
        self._inbox = _Inbox()
        self._records: dict[str, _Record] = {}  # daemon key -> record; the ticking thread's
        self._waiters: list[_PendingAnswer] = []
        self._prepared: frozenset[str] | None = None  # claim UIDs; None: not read yet
        self._next_read = 0.0
        self._lock = threading.Lock()
        self._public: dict[str, Any] = {}
        self._counts = (0, 0)
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False

    # -- any thread ----------------------------------------------------------------------------
    def request(self, request: MpsClaimRequest) -> None:
        """A worker's start or stop (from the main loop): queued for the thread, answered later."""
        try:
            self._inbox.requests.put_nowait(request)
        except queue.Full:
            self._answer(
                request.resource, MpsClaimReply(request.request_id, error="too many MPS requests queued")
            )
        self._wake.set()

    def checkpoint_changed(self) -> None:
        self._next_read = 0.0
        self._wake.set()

    def status(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._public)

    def counts(self) -> tuple[int, int]:
        """(daemons up, daemons not up): for the metrics."""
        with self._lock:
            return self._counts

    # -- the thread ----------------------------------------------------------------------------
    def start_thread(self, interval: float = 0.5) -> None:
        if self._thread is not None:
            return

        def run() -> None:
            while not self._stopping:
                try:
                    self.tick(time.monotonic(), time.time())
                except Exception:  # never let one bad tick end supervision
                    log.exception("MPS claim daemons: tick failed")
                # A start is watched closely: its prepare waits on it.
                self._wake.wait(0.05 if self._waiters else interval)
                self._wake.clear()

        self._stopping = False
        self._thread = threading.Thread(target=run, name="gpuvisor-mps-claims", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop supervising; the daemons keep running for their claims' containers."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    # -- the work (one thread) -----------------------------------------------------------------
    def load(self, wall: float) -> None:
        """Read the records on disk (a restart: their daemons are adopted or stopped by `tick`)."""
        try:
            names = sorted(os.listdir(self.claims_root))
        except FileNotFoundError:
            return
        except OSError as exc:
            log.error("cannot list the MPS claims root %s: %s", self.claims_root, exc.strerror or exc)
            return
        for name in names[: MAX_CLAIM_DAEMONS * 2]:
            if not CLAIM_UID.fullmatch(name) or not _is_dir(os.path.join(self.claims_root, name)):
                continue
            try:
                settings, at = read_record(self.claims_root, name)
            except MpsError as exc:
                log.error("MPS claim daemon record unusable (%s): stopping what runs there", exc)
                self._end_unknown(name)
                continue
            self._records[settings.resource] = _Record(settings, min(at, wall))
        if self._records:
            log.info(
                "MPS claim daemons found under %s: %s", self.claims_root, ", ".join(sorted(self._records))
            )

    def tick(self, now: float, wall: float) -> None:
        self._take_requests(now, wall)
        self._read_checkpoint(now)
        self._sync(now, wall)
        if self._check_starts(now):
            self._sync(now, wall)  # the failed starts' daemons go now, before their answer
        self._answer_done()
        self._publish()

    def _take_requests(self, now: float, wall: float) -> None:
        while True:
            try:
                request = self._inbox.requests.get_nowait()
            except queue.Empty:
                return
            try:
                if request.action == START:
                    self._start(request, now, wall)
                elif request.action == STOP:
                    check_claim_uid(request.claim_uid)
                    for record in self._records.values():
                        if record.settings.claim_uid == request.claim_uid:
                            record.dropping = True
                    self._waiters.append(_PendingAnswer(request, "", now + self._start_wait))
                else:
                    raise MpsError(f"unknown MPS request action {request.action[:40]!r}")
            except MpsError as exc:
                self._answer(request.resource, MpsClaimReply(request.request_id, error=str(exc)))

    def _start(self, request: MpsClaimRequest, now: float, wall: float) -> None:
        uuids = tuple(u for u in request.gpu_uuids.split(",") if u)
        thread = request.thread_percentage or None
        settings = claim_settings(self.claims_root, request.claim_uid, uuids, thread, request.pinned_limits)
        record = self._records.get(settings.resource)
        if record is None and len(self._records) >= MAX_CLAIM_DAEMONS:
            raise MpsError(
                f"claim {request.claim_uid}: this node runs {MAX_CLAIM_DAEMONS} MPS claim daemons already"
            )
        if record is None or record.dropping:
            self._engine.find_binary()  # raises MpsError naming where it looked
        self._write_record(settings, wall)  # before the daemon: a restart finds what it started
        if record is None:
            log.info("MPS daemon for claim %s: starting %s on %s", settings.claim_uid, settings.daemon_id,
                     ", ".join(uuids))  # fmt: skip
            self._records[settings.resource] = _Record(settings, wall)
        else:
            record.settings, record.requested_at, record.dropping = settings, wall, False
        self._waiters.append(_PendingAnswer(request, settings.resource, now + self._start_wait))

    def _write_record(self, settings: ClaimDaemonSettings, wall: float) -> None:
        try:
            os.makedirs(settings.home, mode=0o755, exist_ok=True)
            text = json.dumps(settings.to_json(wall), sort_keys=True) + "\n"
            write_atomic(os.path.join(settings.home, RECORD), text, mode=0o644)
        except OSError as exc:
            raise MpsError(
                f"claim {settings.claim_uid}: cannot write {settings.home}: {exc.strerror or exc}"
            ) from None

    def _read_checkpoint(self, now: float) -> None:
        if now < self._next_read:
            return
        self._next_read = now + self._checkpoint_every
        try:
            self._prepared = daemon_owners(self.checkpoint_path)
        except CheckpointError as exc:  # keep what was read last: a bad read stops nothing
            log.warning("MPS claim daemons: the DRA checkpoint cannot be read (%s): nothing stopped", exc)

    def _wanted(self, record: _Record, wall: float) -> bool:
        if record.dropping:
            return False
        if any(w.key == record.settings.resource for w in self._waiters):
            return True  # its prepare waits on it
        if self._prepared is None:
            return True  # the checkpoint was never read: stop nothing yet
        return record.settings.claim_uid in self._prepared or wall - record.requested_at < self._grace

    def _sync(self, now: float, wall: float) -> None:
        wanted = {key: r.settings for key, r in self._records.items() if self._wanted(r, wall)}
        ran = self._engine.status()
        if wanted and self._engine.binary is None:  # daemons adopted after a restart need it too
            try:
                self._engine.find_binary()
            except MpsError as exc:
                log.error("MPS claim daemons cannot be restarted: %s", exc)
        self._engine.set_desired(wanted)
        self._engine.tick(now)
        running = self._engine.status()
        for key in sorted(set(self._records) - set(wanted)):
            if key in running:
                continue  # the engine stops it on a later tick
            record = self._records.pop(key)
            if not record.dropping:
                log.warning(
                    "MPS daemon for claim %s stopped: the claim is not in the DRA checkpoint %s",
                    record.settings.claim_uid,
                    self.checkpoint_path,
                )
            if key in ran:  # the engine quit it just now: only its directory is left
                shutil.rmtree(record.settings.home, ignore_errors=True)
            else:  # found on disk and never run here: stopped by its pid file
                self._end(record.settings)
            log.info("MPS daemon for claim %s (%s) stopped", record.settings.claim_uid, key)

    def _check_starts(self, now: float) -> bool:
        """Answer the starts whose daemon is up; mark those that failed (answered once it is gone)."""
        running = self._engine.status()
        failed = False
        keep: list[_PendingAnswer] = []
        for waiter in self._waiters:
            record = self._records.get(waiter.key) if waiter.key else None
            if not waiter.key or waiter.error:
                keep.append(waiter)
                continue
            st = running.get(waiter.key)
            if record is None or record.dropping:
                waiter.error = "the claim was unprepared while its daemon started"
            elif st is not None and st.up:
                s = record.settings
                reply = MpsClaimReply(waiter.request.request_id, pipe_dir=s.pipe_dir, shm_dir=s.shm_dir)
                self._answer(waiter.request.resource, reply)
                continue
            elif st is not None and st.failures > 0:
                waiter.error = st.reason
            elif now >= waiter.deadline:
                waiter.error = f"not up within {self._start_wait:g}s" + (f" ({st.reason})" if st else "")
            if waiter.error:
                failed = True
                if record is not None:
                    record.dropping = True
                log.warning(
                    "MPS daemon for claim %s failed to start: %s", waiter.request.claim_uid, waiter.error
                )
            keep.append(waiter)
        self._waiters = keep
        return failed

    def _answer_done(self) -> None:
        """Answer the stops whose claim has no daemon left, and the failed starts whose daemon is gone."""
        keep: list[_PendingAnswer] = []
        for waiter in self._waiters:
            request = waiter.request
            if waiter.key and not waiter.error:
                keep.append(waiter)
                continue
            gone = (
                waiter.key not in self._records
                if waiter.key
                else not any(r.settings.claim_uid == request.claim_uid for r in self._records.values())
            )
            if not gone:
                keep.append(waiter)
                continue
            text = f"claim {request.claim_uid}: MPS control daemon: {waiter.error}" if waiter.error else ""
            self._answer(request.resource, MpsClaimReply(request.request_id, error=text))
        self._waiters = keep

    def _end_unknown(self, name: str) -> None:
        """Stop whatever daemon runs in `<root>/<name>` (its record unusable) and remove the directory."""
        self._end(ClaimDaemonSettings(name, name, self.claims_root, (), None, ()))

    def _end(self, settings: ClaimDaemonSettings) -> None:
        """Stop the daemon by its pid file (if still running: the engine stops those it runs) and
        give its GPUs back their compute mode; then remove its directory."""
        if not _is_dir(settings.home):
            return
        pid = _read_pid(os.path.join(settings.pipe_dir, PID_FILE))
        names = {daemon_comm(MPS_CONTROL_BINARY), daemon_comm(self._engine.binary or MPS_CONTROL_BINARY)}
        try:
            if pid is not None and pid_alive(pid) and _comm(pid) not in names:
                log.warning(
                    "MPS claim daemon in %s: pid %d is no control daemon now; not signalled",
                    settings.home,
                    pid,
                )
            else:
                self._engine.end(settings)
        except Exception:  # the directory goes anyway; the daemon's pipe with it
            log.exception("MPS claim daemon in %s: stopping it failed", settings.home)
        shutil.rmtree(settings.home, ignore_errors=True)

    def _publish(self) -> None:
        running = self._engine.status()
        daemons: dict[str, Any] = {}
        down = 0
        for key, record in sorted(self._records.items()):
            st: DaemonStatus | None = running.get(key)
            s = record.settings
            up = st is not None and st.up
            down += 0 if up else 1
            daemons[s.daemon_id] = {
                "claim_uid": s.claim_uid,
                "gpus": list(s.gpu_uuids),
                "active_thread_percentage": s.active_thread_percentage,
                "pinned_limits_mib": dict(s.limits_mib),
                "state": st.state if st is not None else "stopping",
                "up": up,
                "pid": st.pid if st is not None else None,
                "reason": st.reason if st is not None else "",
                "restarts": st.restarts if st is not None else 0,
            }
        counts = (len(daemons) - down, down)
        with self._lock:
            self._public = {"root": self.claims_root, "daemons": daemons}
            changed, self._counts = counts != self._counts, counts
        if changed:
            self._on_counts(*counts)


def _comm(pid: int) -> str:
    """/proc/<pid>/comm, "" when it cannot be read."""
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as handle:
            return handle.read().rstrip("\n")
    except OSError:
        return ""


def _is_dir(path: str) -> bool:
    """A real directory (never through a symlink planted in the root)."""
    with contextlib.suppress(OSError):
        return stat.S_ISDIR(os.lstat(path).st_mode)
    return False
