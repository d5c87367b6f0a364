"""Small process helpers shared by both roles: parent-death signal, socket checks, the command line."""

from __future__ import annotations

import ctypes
import os
import signal
import socket

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
