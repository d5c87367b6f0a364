"""The layout and processes of NVIDIA's MPS control daemon, as gpuvisor drives it.

Where a resource's daemon keeps its pipe, log and marker files under the MPS root, the settings
one daemon gets from a plan (limits from replica counts), where its binary is found, and how its
processes are recognised and reaped: facts that `supervisor/mps/daemons.py` builds its supervision on.

How the daemon is driven, and what the fake in the tests must copy: `-d` forks the daemon into the
background and returns; the daemon writes its PID to `nvidia-cuda-mps-control.pid` in the pipe
directory; a command is one run of the binary with the command on stdin (`echo quit |
nvidia-cuda-mps-control`), which exits non-zero when no daemon answers on that pipe directory.

Limits: `set_default_device_pinned_mem_limit <index> <MiB>M` per GPU from that GPU's own replica
count (gpuvisor allows replica counts to differ per GPU), and one daemon-wide
`set_default_active_thread_percentage`, 100 / replicas; MPS has no per-device default thread
percentage, so with differing counts the largest count is used: no client can take more than its
share of the most-split GPU. The pinned-memory limit applies per CUDA client process, not per pod
(NVIDIA #720): a pod running two CUDA processes gets twice the limit.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from common.model import ResourcePlan
from common.procutil import pid_alive

MPS_CONTROL_BINARY = "nvidia-cuda-mps-control"
PID_FILE = "nvidia-cuda-mps-control.pid"
STARTED_MARKER = ".started"
READY_MARKER = ".ready"
START_LOG = "gpuvisor-control-start.log"
HEALTH_QUERY = "get_default_active_thread_percentage"
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
LOG_ENV = "CUDA_MPS_LOG_DIRECTORY"
# Where a driver root (a driver container's /run/nvidia/driver) keeps its binaries.
DRIVER_BIN_DIRS = ("usr/bin", "usr/local/bin", "bin", "usr/sbin")
PROBE_FAILURES_TO_RESTART = 2
COMM_LEN = 15  # TASK_COMM_LEN - 1: how much of an executable's name /proc/<pid>/comm keeps


class MpsError(Exception):
    """MPS cannot be run as configured (no binary, no MPS root, ...); the message says what to fix."""


class DState(StrEnum):
    DOWN = "down"  # not running; a start is due at `next_start`
    STARTING = "starting"  # `-d` ran (or a live daemon was found); waiting for it to take its limits
    UP = "up"  # running, limits set, ready marker written


# --- layout -----------------------------------------------------------------------------------


def pipe_dir(mps_root: str, resource: str) -> str:
    return os.path.join(mps_root, resource, "pipe")


def log_dir(mps_root: str, resource: str) -> str:
    return os.path.join(mps_root, resource, "log")


def shm_dir(mps_root: str) -> str:
    return os.path.join(mps_root, "shm")


def started_file(mps_root: str, resource: str) -> str:
    return os.path.join(mps_root, resource, STARTED_MARKER)


def ready_file(mps_root: str) -> str:
    return os.path.join(mps_root, READY_MARKER)


def find_control_binary(
    binary: str = MPS_CONTROL_BINARY, driver_root: str = "/", path: str | None = None
) -> str:
    """The control binary to run: `binary` itself when it names a path, else the first match on PATH
    (`path`, default $PATH), then under the driver root. Raises MpsError naming where it looked."""
    if "/" in binary:
        if os.path.isfile(binary) and os.access(binary, os.X_OK):
            return os.path.abspath(binary)
        raise MpsError(
            f"MPS sharing needs the CUDA MPS control binary, but {binary} does not exist or is not executable: "
            "fix --mps-control-binary (GPUVISOR_MPS_CONTROL)"
        )
    search = os.environ.get("PATH", os.defpath) if path is None else path
    import shutil  # here: a node without MPS never loads it (nor bz2 and lzma with it)

    found = shutil.which(binary, path=search)
    if found:
        return found
    tried = [os.path.join(driver_root, d, binary) for d in DRIVER_BIN_DIRS]
    for candidate in tried:
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    raise MpsError(
        f"MPS sharing needs the CUDA MPS control binary {binary}, but it is neither on PATH ({search}) nor "
        f"under the driver root ({', '.join(tried)}): install the driver's CUDA MPS utilities, mount the "
        "driver root (--driver-root), or point --mps-control-binary (GPUVISOR_MPS_CONTROL) at it"
    )


# --- what each daemon is told -----------------------------------------------------------------


class DaemonSpec(Protocol):
    """What the supervision (supervisor/mps/daemons.py) needs of one daemon: its key and
    directories, its GPUs, the commands that set its limits and the environment it starts with.
    A resource's daemon is a `DaemonSettings`; a DRA claim's is supervisor/mps/claims.py's."""

    @property
    def resource(self) -> str: ...  # the key: the resource name, or "claim <daemon id>"

    @property
    def mps_root(self) -> str: ...

    @property
    def pipe_dir(self) -> str: ...

    @property
    def log_dir(self) -> str: ...

    @property
    def shm_dir(self) -> str: ...

    @property
    def started_file(self) -> str: ...

    @property
    def gpu_uuids(self) -> tuple[str, ...]: ...

    @property
    def thread_percentage(self) -> int: ...

    @property
    def pinned_limits(self) -> tuple[tuple[int | str, int], ...]: ...  # (device, MiB)

    def commands(self) -> list[str]: ...

    def extra_env(self) -> dict[str, str]: ...


@dataclass(frozen=True)
class DaemonSettings:
    """One daemon's identity and defaults, derived from its resource plan."""

    resource: str
    mps_root: str
    thread_percentage: int
    pinned_limits: tuple[tuple[int, int], ...]  # (GPU index, MiB per client), by index
    gpu_uuids: tuple[str, ...]
    replicas: tuple[tuple[int, int], ...]  # (GPU index, replicas), for the ready marker and status

    @property
    def pipe_dir(self) -> str:
        return pipe_dir(self.mps_root, self.resource)

    @property
    def log_dir(self) -> str:
        return log_dir(self.mps_root, self.resource)

    @property
    def shm_dir(self) -> str:
        return shm_dir(self.mps_root)  # one for every resource under the root

    @property
    def started_file(self) -> str:
        return started_file(self.mps_root, self.resource)

    def extra_env(self) -> dict[str, str]:
        return {}

    def commands(self) -> list[str]:
        """The control commands, in NVIDIA's order: the pinned-memory limits, then the thread share."""
        out = [f"set_default_device_pinned_mem_limit {index} {mib}M" for index, mib in self.pinned_limits]
        out.append(f"set_default_active_thread_percentage {self.thread_percentage}")
        return out


def daemon_settings(plan: ResourcePlan) -> DaemonSettings:
    """The daemon settings for an MPS plan (see the module docstring for the rules)."""
    per_gpu: dict[int, tuple[int, int, str]] = {}  # index -> (replicas, memory MiB, uuid)
    for device in plan.devices:
        per_gpu[device.gpu_index] = (max(device.replicas, 1), device.memory_mib, device.gpu_uuid)
    most = max((r for r, _, _ in per_gpu.values()), default=1)
    limits = tuple(
        (index, memory // replicas) for index, (replicas, memory, _) in sorted(per_gpu.items()) if memory > 0
    )
    return DaemonSettings(
        resource=plan.resource,
        mps_root=plan.allocate.mps_root,
        thread_percentage=max(100 // most, 1),
        pinned_limits=limits,
        gpu_uuids=tuple(uuid for _, (_, _, uuid) in sorted(per_gpu.items())),
        replicas=tuple((index, replicas) for index, (replicas, _, _) in sorted(per_gpu.items())),
    )


def _read_pid(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as handle:
            text = handle.read().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() and int(text) > 0 else None


def daemon_comm(binary: str) -> str:
    """The name the kernel gives a process run from `binary` (/proc/<pid>/comm): its first 15 bytes."""
    return os.path.basename(binary)[:COMM_LEN]


def _alive(pid: int, daemon_comms: frozenset[str] = frozenset({daemon_comm(MPS_CONTROL_BINARY)})) -> bool:
    """Is `pid` a live process? A zombie counts as dead (and is reaped when it is our daemon)."""
    if not pid_alive(pid):
        return False
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            fields = handle.read().rpartition(")")[2].split()
    except OSError:
        return True  # no /proc (or a race): kill(0) said it exists
    if not fields or fields[0] not in ("Z", "X"):
        return True
    if len(fields) > 1 and fields[1] == str(os.getpid()):
        _reap_daemon(pid, daemon_comms)
    return False


def _reap_daemon(pid: int, daemon_comms: frozenset[str]) -> None:
    """Reap our zombie child `pid` if it is an MPS control daemon.

    A daemon that `-d` forked away is re-parented to the nearest child subreaper, which the
    supervisor makes itself (or to PID 1, which gpuvisor may be in its container): either way its
    zombie is ours to reap, and nobody else will. The name check comes first because the PID
    comes from a pid file that may be stale: a worker (also our child) that reused the PID must
    keep its exit status for the code that waits for it. A zombie cannot change identity before
    it is reaped, and only we reap our children, so the check still holds at the waitpid.
    """
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as handle:
            comm = handle.read().rstrip("\n")
    except OSError:
        return
    if comm not in daemon_comms:
        return
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)
