"""The worker zygote: a process with the worker's modules imported, that forks new workers.

Starting a worker by exec costs a fresh interpreter plus the imports of grpc, protobuf and zmq;
a worker restart is on the critical path of "a resource is back".
The zygote pays that once: it imports everything a worker needs, creates **no** gRPC or ZeroMQ
object (gRPC's core does not survive a fork once it has threads; here there are none yet), and
then only forks on request. The supervisor starts it first thing (before its own imports), so
those imports overlap the supervisor's and the first worker is forked as soon as the first plan
is written.

Memory: every page a child writes is copied into it. The collector is off while the modules load
(no freed holes between long-lived objects) and `gc.freeze()` then moves everything into the
permanent generation, which no collection scans (it is not preceded by a collection: see
`preload`); a child never unfreezes, so its collections
walk only its own objects and leave the zygote's pages shared. The allocators' free blocks and
chunks are then filled and the ABC caches warmed (worker/pages.py), so a worker's new objects
and its first isinstance checks do not copy zygote pages either.

A forked child runs `worker.main.main` exactly as an exec'd worker would, with the arguments the
supervisor parsed (`common.workerargs.check_args`) and sent as fields, and rewrites its command
line in place (`common.procutil.set_cmdline`, into room the zygote was started with) so `ps`
shows `python -m worker --resource ...` as for any worker. Between two forks the zygote runs as
little Python as it can: every zygote page it writes then stays the private copy of each worker
forked before (so argparse runs in the supervisor, not here).

Protocol, over a socketpair inherited as fd `--fd` (one JSON object per line):
  supervisor -> zygote: {"op": "spawn", "id": N, "argv": [...], "args": {...}, "secret": "..."}
  zygote -> supervisor: {"op": "spawned", "id": N, "pid": P} | {"op": "error", "id": N, "error": "..."}
                        {"op": "exit", "pid": P, "status": S}   (S as subprocess returncode)
The secret is the worker's proof of identity on the control socket: it reaches the child in
memory, never on its command line or in its environment. The zygote dies with the supervisor
(parent-death signal, and EOF on the socket).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import logging
import os
import select
import signal
import socket
import sys
from collections.abc import Callable

from common import logs, methodcache
from common.procutil import set_cmdline, set_parent_death_signal
from common.workerargs import from_fields
from worker.pages import fill_allocator_holes, fill_malloc_holes, warm_abc_caches
from worker.process import leave_out_ssl

# What a worker imports, loaded once here (the zygote uses none of it itself). `worker.main`
# brings the rest; the others are imported by a worker only once it runs (ZeroMQ, gRPC's server
# and channel modules, the thread pool), and would otherwise be loaded after each fork, in each
# worker's own memory.
PRELOAD = (
    "worker.main",
    "worker.registrar",
    "worker.registration",
    "worker.service",
    "worker.server",
    "worker.devicebook",
    "worker.healthboard",
    "zmq",
    "grpc._server",
    "grpc._channel",
    "grpc._utilities",
    "concurrent.futures.thread",
)


def preload() -> None:
    """Import the worker's modules with the collector off, then freeze what they made and make
    the first writes a worker would make to shared pages here instead (worker/pages.py)."""
    gc.disable()
    methodcache.install()  # the code @dataclass compiles, from its cache
    for name in PRELOAD:
        importlib.import_module(name)
    methodcache.release()
    # Logging as a worker sets it up by default (text, info): a worker with those settings then
    # keeps the handler and level it inherits instead of making its own.
    logs.setup(role="zygote")
    _share(warm_abc_caches)
    # No collection first: the imports leave ~360 small objects of garbage (functions, classes,
    # dates of module-level temporaries; no file or socket, which a process test pins), and a
    # full collection of the ~41,000 objects made here cost 6-9 ms of the zygote's preload,
    # the last wait of a start (bench_startup). Frozen, that garbage stays, shared and
    # untouched; each further worker measured the same (bench_memory).
    gc.freeze()
    _share(fill_allocator_holes)  # then the pools' free blocks, the reports' own included
    _share(fill_malloc_holes)  # then malloc's: the reports' text and the pymalloc fill's lists freed chunks
    gc.enable()


def _share(step: Callable[[], object]) -> None:
    """Run one of worker/pages.py's steps: they only save workers memory, so one that fails
    is said in a line and skipped, never the zygote's end."""
    try:
        step()
    except Exception as exc:  # any failure of an optimisation is the same to us
        logging.getLogger("gpuvisor.zygote").warning(
            "skipped %s (%s: %s): workers share fewer of the zygote's pages",
            step.__name__,
            type(exc).__name__,
            exc,
        )


def _send(sock: socket.socket, message: dict[str, object]) -> None:
    sock.sendall((json.dumps(message) + "\n").encode())


def _child(
    sock: socket.socket, wake_r: int, wake_w: int, argv: list[str], args: argparse.Namespace, secret: str
) -> None:
    """In the forked child: drop the zygote's plumbing and become a worker."""
    code = 1
    try:
        sock.close()
        os.close(wake_r)
        os.close(wake_w)
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        # No gc.unfreeze(): the zygote's objects stay frozen, so the collections of this worker
        # never write to their pages (which would copy every imported module into it).
        set_cmdline([sys.executable, "-m", "worker", *argv])  # so `ps` names the resource
        from worker.main import main as worker_main  # loaded by preload(): a dict lookup

        code = worker_main(args=args, secret=secret)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # a worker bug must end this child, never return into the zygote loop
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve(fd: int, supervisor_pid: int) -> int:
    sock = socket.socket(fileno=fd)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in a terminal: the supervisor decides
    stop = False

    def on_term(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    zygote_pid = os.getpid()
    buffer = b""
    while not stop:
        if os.getppid() != supervisor_pid:
            break
        try:
            # The parent check is a backstop (the parent-death signal comes first): no need to
            # wake often for it.
            ready, _, _ = select.select([sock.fileno(), wake_r], [], [], 5.0)
        except InterruptedError:
            continue
        if wake_r in ready:
            os.read(wake_r, 4096)
        while True:  # reap and report every child that ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            _send(sock, {"op": "exit", "pid": pid, "status": os.waitstatus_to_exitcode(status)})
        if sock.fileno() not in ready:
            continue
        chunk = sock.recv(65536)
        if not chunk:
            break  # the supervisor closed its end
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            rid = None
            try:
                request = json.loads(line)
                rid = request["id"]
                argv = [str(a) for a in request["argv"]]
                secret = str(request.get("secret", ""))
                # Parsed by the supervisor, --zygote-pid included (see the module doc).
                args = from_fields(request["args"])
                if args.zygote_pid != zygote_pid:
                    raise ValueError(f"the fields' zygote_pid is not {zygote_pid}")
            except (ValueError, KeyError, TypeError) as exc:
                _send(sock, {"op": "error", "id": rid, "error": f"bad request: {exc}"})
                continue
            try:
                pid = os.fork()
            except OSError as exc:
                _send(sock, {"op": "error", "id": rid, "error": str(exc)})
                continue
            if pid == 0:
                _child(sock, wake_r, wake_w, argv, args, secret)
            _send(sock, {"op": "spawned", "id": rid, "pid": pid})
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpuvisor-zygote")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--supervisor-pid", type=int, required=True)
    parser.add_argument("--pad", default="", help="blank room for the workers' command lines")
    args = parser.parse_args(argv)
    set_cmdline(
        [
            sys.executable,
            "-m",
            "worker.zygote",
            "--fd",
            str(args.fd),
            "--supervisor-pid",
            str(args.supervisor_pid),
        ]
    )
    # Before the imports: a supervisor that dies meanwhile (a config error at start) takes the
    # zygote with it at once, not ~100 ms later.
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != args.supervisor_pid:
        return 0
    leave_out_ssl()  # before preload(): gRPC's asyncio would load OpenSSL for nothing
    preload()
    return serve(args.fd, args.supervisor_pid)


if __name__ == "__main__":
    sys.exit(main())
