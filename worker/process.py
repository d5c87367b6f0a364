"""What every worker process does the same, whatever it serves: its spawn secret, the check that
its parent is still the supervisor (or the zygote that forked it), and no `ssl`. Its command line
is common.workerargs (the supervisor parses it too, for a worker the zygote forks).

`worker.main` (a device-plugin worker) and `worker.dra.main` (the DRA worker) both start here;
the supervisor's spawner gives both the same command line, and the plan says which one runs.
"""

from __future__ import annotations

import argparse
import os
import sys

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
