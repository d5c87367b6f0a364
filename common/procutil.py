"""Small process helpers shared by both roles: parent-death signal, socket checks, the loops' mailbox."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import queue
import signal
import socket
from collections.abc import Callable

PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """Ask Linux to send `sig` to this process when its parent dies (prctl PR_SET_PDEATHSIG)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def unix_socket_listening(path: str, timeout: float = 0.2) -> bool:
    """Does something accept connections on this unix socket path?"""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
        return True
    except OSError:
        return False
    finally:
        sock.close()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def set_cmdline(args: list[str]) -> bool:
    """Rewrite this process's command line as `ps` and /proc/<pid>/cmdline show it.

    A worker forked from the zygote would otherwise show the zygote's command line; with this it
    shows its own (`... -m worker --resource nvidia.com/gpu ...`). The kernel serves cmdline
    from the memory between arg_start and arg_end (fields 48 and 49 of /proc/self/stat), which
    lies in our own address space: the new arguments are written there, NUL-separated, and the
    rest is filled with NULs. It cannot grow the area, so the zygote is started with padding;
    what does not fit is cut. Returns False when the area cannot be found.
    """
    import ctypes

    try:
        with open("/proc/self/stat", encoding="ascii", errors="replace") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])
    except (OSError, IndexError, ValueError):
        return False
    size = end - start
    if size <= 1:
        return False
    data = "\0".join(args).encode("utf-8", "replace")[: size - 1]
    ctypes.memmove(start, data + b"\0" * (size - len(data)), size)
    return True


class Mailbox:
    """Work for a main loop from other threads and signal handlers: a queue plus a wake pipe.

    The loop polls `fileno()` (also the `signal.set_wakeup_fd` target, so a signal wakes it too)
    and calls `drain()`, which empties the pipe and runs every posted callable in order. A
    callable that raises is logged and dropped: one bad finding never ends the loop.
    """

    def __init__(self, log: logging.Logger, on_error: Callable[[], None] | None = None) -> None:
        self._log = log
        self._on_error = on_error  # told of each callable that raised (a metric), after the log line
        self._queue: queue.SimpleQueue[Callable[[], object]] = queue.SimpleQueue()
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)

    def fileno(self) -> int:
        return self._r

    @property
    def wakeup_fd(self) -> int:
        return self._w

    def post(self, fn: Callable[[], object]) -> None:
        """Run `fn` on the loop (callable from any thread); what it returns is dropped."""
        self._queue.put(fn)
        with contextlib.suppress(BlockingIOError):  # a full pipe already means "wake up"
            os.write(self._w, b"x")

    def close(self) -> None:
        for fd in (self._r, self._w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._r, 4096):
                pass
        while True:
            try:
                fn = self._queue.get_nowait()
            except queue.Empty:
                return
            try:
                fn()
            except Exception:
                self._log.exception("a queued main-loop call failed")
                if self._on_error is not None:
                    with contextlib.suppress(Exception):
                        self._on_error()
