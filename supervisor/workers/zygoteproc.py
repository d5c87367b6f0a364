"""Starting the worker zygote's process, with as few imports as can do it.

`gpuvisor run` starts the zygote first thing (supervisor/launch.py), before the supervisor's
imports, so that the zygote's own imports (gRPC, ZeroMQ, the worker's modules) run beside them;
every module loaded before that start delays it. This module needs only `os`, `socket`,
`subprocess` and `sys` (about 4 ms), where the `Zygote` handle that later takes the process over
(supervisor/workers/zygote.py) brings logging, JSON and the rest. `Zygote.start` uses it too, so
there is one way to start the process.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

TYPE_CHECKING = False  # typing itself is not imported before the zygote starts (mypy reads this)
if TYPE_CHECKING:
    from collections.abc import Mapping

PAD = 1024  # blank room in the zygote's command line for each forked worker to show its own


def start_process(environ: Mapping[str, str]) -> tuple[subprocess.Popen[bytes], socket.socket]:
    """Start `python -m worker.zygote` on one end of a new socketpair; its process and our end
    (non-blocking). Raises OSError."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        argv = [
            sys.executable, "-m", "worker.zygote",
            "--fd", str(theirs.fileno()),
            "--supervisor-pid", str(os.getpid()),
            "--pad", " " * PAD,
        ]  # fmt: skip
        env = dict(environ)
        env["GRPC_ENABLE_FORK_SUPPORT"] = "0"  # no gRPC object exists in the zygote before a fork
        proc = subprocess.Popen(argv, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env)
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    ours.setblocking(False)
    return proc, ours


def stop_process(proc: subprocess.Popen[bytes], sock: socket.socket | None) -> None:
    """End a zygote process (SIGTERM, SIGKILL after 2 s) and close our end of its socket: for the
    `Zygote` handle, and for a process no handle took over (the CLI failed before it could)."""
    if sock is not None:
        sock.close()
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(2)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wanted(words: list[str], environ: Mapping[str, str]) -> bool:
    """Will this command line run workers from a zygote? Not for help, the version or
    `--zygote=false` (flag or GPUVISOR_ZYGOTE); a config file that turns the zygote off has it
    stopped once the config is read (WorkerSpawner.adopt)."""
    if {"-h", "--help", "-v", "--version", "--zygote=false"} & set(words):
        return False
    return environ.get("GPUVISOR_ZYGOTE", "").strip().lower() not in ("0", "f", "false")
