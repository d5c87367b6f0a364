"""What every worker process does the same, whatever it serves: its command line, its spawn
secret, and the check that its parent is still the supervisor (or the zygote that forked it).

`worker.main` (a device-plugin worker) and `worker.dra.main` (the DRA worker) both start here;
the supervisor's spawner gives both the same command line, and the plan says which one runs.
"""

from __future__ import annotations

import argparse
import os
import sys

from common.socketnames import is_tag

HEARTBEAT_S = 1.0
SECRET_MAX_BYTES = 256  # the spawn secret read from --secret-fd: 32 hex characters, with room


def leave_out_ssl() -> None:
    """Make `import ssl` fail in this process, before a worker's modules are imported.

    A worker has no use for Python's ssl module: the device-plugin and DRA APIs are gRPC over unix
    sockets without TLS, the supervisor link is ZeroMQ over ipc://, and gRPC's own TLS lives in its
    C core, not in this module. asyncio (which gRPC's Cython layer imports) imports ssl only to
    offer TLS transports, and goes without them where ssl cannot be imported, as on a Python built
    without OpenSSL. Loaded, ssl brings OpenSSL: ~4 MB of private memory in the zygote, shared by
    every worker and used by none. A None in sys.modules is Python's own way to make an import
    fail (ModuleNotFoundError); a process that already has ssl keeps it.
    """
    sys.modules.setdefault("ssl", None)  # type: ignore[arg-type]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpuvisor-worker", description="gpuvisor worker: serves one resource")
    p.add_argument("--resource", required=True, help="the resource this worker serves (shown in ps)")
    p.add_argument("--plan", required=True, help="the resource plan (JSON) written by the supervisor")
    p.add_argument("--kubelet-socket", default="/var/lib/kubelet/device-plugins/kubelet.sock")
    p.add_argument("--control", default="", help="the supervisor's control socket (ZeroMQ endpoint)")
    p.add_argument("--health", default="", help="the supervisor's health publisher (ZeroMQ endpoint)")
    p.add_argument("--supervisor-pid", type=int, default=0)
    p.add_argument(
        "--zygote-pid", type=int, default=0, help="set by the zygote that forked this worker: a parent too"
    )
    p.add_argument("--log-format", default="text", choices=("text", "json"))
    p.add_argument("--log-level", default="info")
    p.add_argument("--heartbeat-interval", type=float, default=HEARTBEAT_S, help="seconds between heartbeats")
    p.add_argument(
        "--secret-fd",
        type=int,
        default=-1,
        help="an inherited pipe holding this spawn's secret (read once, closed)",
    )
    p.add_argument(
        "--socket-tag",
        type=socket_tag,
        default=None,
        help="6 hex digits in this process's socket names (the supervisor's record)",
    )
    return p.parse_args(argv)


def socket_tag(text: str) -> str:
    if not is_tag(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not 6 lower-case hex digits")
    return text


def read_secret(fd: int) -> str:
    """The spawn secret from an inherited pipe: read to its end (bounded) and close it."""
    chunks: list[bytes] = []
    size = 0
    try:
        while size <= SECRET_MAX_BYTES:
            chunk = os.read(fd, SECRET_MAX_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks)[:SECRET_MAX_BYTES].decode("ascii", "replace").strip()


def parent_ok(args: argparse.Namespace) -> bool:
    """Is our parent still the supervisor (or the zygote that forked us)?

    A worker forked by the zygote is the zygote's child; if the zygote dies, the supervisor (a
    child subreaper) adopts it and it keeps serving. If the supervisor dies, the zygote dies with
    it (its parent-death signal) and we are adopted by someone else: time to go.
    """
    if not args.supervisor_pid:
        return True
    return os.getppid() in (args.supervisor_pid, args.zygote_pid or args.supervisor_pid)
