"""Starting the worker zygote's process, with as few imports as can do it.

`gpuvisor run` starts the zygote first thing (supervisor/launch.py), before the supervisor's
imports, so that the zygote's own imports (gRPC, ZeroMQ, the worker's modules) run beside them;
every module loaded before that start delays it, and since the supervisor's imports take their
dataclass code from a cache (common/methodcache.py) the zygote is the wait of a start. So this
module needs only `os`, `sys` and `_socket`: the process is started with `os.posix_spawn`, not
`subprocess` (whose import, with `socket`'s, and `Popen` would delay the zygote's exec), and `ZygoteProcess` is the part of `Popen` the supervisor uses. The `Zygote` handle that later
takes the process over (supervisor/workers/zygote.py) brings logging, JSON and the rest.
`Zygote.start` uses it too, so there is one way to start the process.
"""

from __future__ import annotations

import _socket
import os
import sys
import time

TYPE_CHECKING = False  # typing itself is not imported before the zygote starts (mypy reads this)
if TYPE_CHECKING:
    from collections.abc import Mapping

# glibc gives each thread that allocates its own malloc arena, up to 8 per CPU. A worker runs
# ~24 threads on a node of 16 CPUs or more (gRPC's event engine alone starts clamp(CPUs, 4, 16)),
# and every arena holds pages of its own and keeps what it frees: two arenas for all of them cost
# a worker 0.1 MB less on an H100 node (docs/performance.md), and no allocation here is contended.
MALLOC_ARENAS = "2"
PAD = 1024  # blank room in the zygote's command line for each forked worker to show its own
STOP_WAIT_S = 2.0  # SIGTERM, then SIGKILL after this long


class ZygoteProcess:
    """Our child, the zygote process: `pid`, `returncode`, `poll`, `wait`, `send_signal`,
    `terminate` and `kill`, as `subprocess.Popen` has them (`wait` raises TimeoutError)."""

    def __init__(self, pid: int, args: list[str]) -> None:
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: gone all the same (Popen says 0 too)
                self.returncode = 0
            else:
                if pid == self.pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if timeout is None:
            if self.returncode is None:
                try:
                    _, status = os.waitpid(self.pid, 0)
                    self.returncode = os.waitstatus_to_exitcode(status)
                except ChildProcessError:
                    self.returncode = 0
            return self.returncode
        deadline = time.monotonic() + timeout
        delay = 0.0005
        while (code := self.poll()) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the worker zygote (pid {self.pid}) did not exit in {timeout} s")
            time.sleep(min(delay, left))
            delay = min(delay * 2, 0.05)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:  # noqa: SIM105 - contextlib (with collections, functools) is not otherwise loaded this early
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(15)  # SIGTERM (the signal module is not loaded for this)

    def kill(self) -> None:
        self.send_signal(9)  # SIGKILL


def worker_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment of a worker process (the zygote, and a worker started by exec): `environ`,
    with glibc's malloc arenas capped at MALLOC_ARENAS unless the operator chose a cap already
    (a non-empty MALLOC_ARENA_MAX, or glibc.malloc.arena_max in GLIBC_TUNABLES)."""
    env = dict(environ)
    if not env.get("MALLOC_ARENA_MAX") and "glibc.malloc.arena_max=" not in env.get("GLIBC_TUNABLES", ""):
        env["MALLOC_ARENA_MAX"] = MALLOC_ARENAS
    return env


def start_process(environ: Mapping[str, str]) -> tuple[ZygoteProcess, _socket.socket]:
    """Start `python -m worker.zygote` on one end of a new socketpair; its process and our end
    (non-blocking). The child gets the socket's end, stdin from /dev/null and our stdout and
    stderr, and no other descriptor (as `Popen(close_fds=True)` would). Raises OSError; the
    caller waits for the process (no `Popen` finalizer reaps it)."""
    if not sys.executable:  # posix_spawn would raise ValueError; callers fall back on OSError
        raise OSError("the Python interpreter's path is unknown (sys.executable is empty)")
    ours, theirs = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        fd = theirs.fileno()
        argv = [
            sys.executable, "-m", "worker.zygote",
            "--fd", str(fd),
            "--supervisor-pid", str(os.getpid()),
            "--pad", " " * PAD,
        ]  # fmt: skip
        env = worker_environ(environ)
        env["GRPC_ENABLE_FORK_SUPPORT"] = "0"  # no gRPC object exists in the zygote before a fork
        os.set_inheritable(fd, True)
        actions: list[tuple[object, ...]] = [(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0)]
        actions += [(os.POSIX_SPAWN_CLOSE, other) for other in _inherited(keep=(0, 1, 2, fd))]
        try:
            pid = os.posix_spawn(sys.executable, argv, env, file_actions=actions)
        except ValueError as exc:  # an argument posix_spawn refuses: to the callers, a start that failed
            raise OSError(f"cannot start the worker zygote: {exc}") from None
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    ours.setblocking(False)
    return ZygoteProcess(pid, argv), ours


def _inherited(keep: tuple[int, ...]) -> list[int]:
    """Our inheritable descriptors but `keep` (what a parent left us: a shell's, a service
    manager's), which the zygote, and every worker it forks, must not hold."""
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except (OSError, ValueError):  # no /proc: every descriptor the limit allows (a slow path)
        fds = list(range(3, min(os.sysconf("SC_OPEN_MAX"), 1 << 16)))
    found = []
    for fd in fds:
        if fd in keep:
            continue
        try:
            if os.get_inheritable(fd):
                found.append(fd)
        except OSError:  # the listing's own descriptor, closed since
            continue
    return found


def stop_process(proc: ZygoteProcess, sock: _socket.socket | None) -> None:
    """End a zygote process (SIGTERM, SIGKILL after 2 s) and close our end of its socket: for the
    `Zygote` handle, and for a process no handle took over (supervisor/launch.py's exit)."""
    if sock is not None:
        sock.close()
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(STOP_WAIT_S)
        except TimeoutError:
            proc.kill()
            proc.wait()


def wanted(words: list[str], environ: Mapping[str, str]) -> bool:
    """Will this command line run workers from a zygote? Not for help, the version or
    `--zygote=false` (flag or GPUVISOR_ZYGOTE); a config file that turns the zygote off has it
    stopped once the config is read (WorkerSpawner.adopt)."""
    if {"-h", "--help", "-v", "--version", "--zygote=false"} & set(words):
        return False
    return environ.get("GPUVISOR_ZYGOTE", "").strip().lower() not in ("0", "f", "false")
