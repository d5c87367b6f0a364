"""Spawning workers through the zygote (worker/zygote.py), with exec as the fallback.

The supervisor keeps one zygote process: a Python with the worker's modules imported and no
gRPC object, which forks a worker on request instead of paying an exec and the worker's imports
at each start. The supervisor is the children's subreaper (PR_SET_CHILD_SUBREAPER), so if
the zygote dies its workers are re-parented to the supervisor and keep serving; the next spawn
starts a new zygote. Anything wrong with the zygote (it will not start, does not answer in
time) falls back to a plain exec of `python -m worker`: slower, never worse.

The supervisor parses a worker's arguments for the zygote (`common.workerargs.check_args`) and
sends the fields, so the zygote forks without running argparse: what it writes between two forks
stays the private copy of every worker forked before (worker/zygote.py). Arguments a worker would
refuse fail the spawn before anything is sent; the exec that follows says why.
"""

from __future__ import annotations

import _socket
import contextlib
import ctypes
import json
import logging
import os
import select
import signal
import time

from common.procutil import pid_alive
from common.workerargs import WorkerArgsError, check_args
from supervisor.workers.zygoteproc import ZygoteProcess, start_process, stop_process

log = logging.getLogger("gpuvisor.zygote")

PR_SET_CHILD_SUBREAPER = 36
SPAWN_TIMEOUT_S = 2.0


def become_subreaper() -> bool:
    """Adopt orphaned descendants (workers of a dead zygote) so they can be reaped here."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


class ForkedWorker:
    """A worker forked by the zygote: what WorkerSet needs of a process (pid, poll, signal)."""

    def __init__(self, pid: int, zygote: Zygote) -> None:
        self.pid = pid
        self._zygote = zygote
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._zygote.pump()
            self.returncode = self._zygote.exits.pop(self.pid, None)
        if self.returncode is None and not self._zygote.alive_for(self.pid):
            # Adopted after its zygote died: we are its parent now (subreaper), reap it here.
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self.returncode = -signal.SIGKILL if not pid_alive(self.pid) else None
            else:
                if pid == self.pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)


class Zygote:
    """The supervisor's handle on one zygote process."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.env = env
        self.proc: ZygoteProcess | None = None
        self.sock: _socket.socket | None = None
        self.exits: dict[int, int] = {}
        self._children: set[int] = set()
        self._buffer = b""
        self._next_id = 0
        self._replies: dict[int, dict[str, object]] = {}
        self._abandoned: set[int] = set()  # spawn requests we gave up on (fell back to exec)

    def start(self) -> None:
        self.proc, self.sock = start_process(os.environ if self.env is None else self.env)
        self._buffer = b""
        log.info("worker zygote started (pid %d)", self.proc.pid)

    @classmethod
    def taking(cls, proc: ZygoteProcess, sock: _socket.socket) -> Zygote:
        """The handle of a zygote process started already (`zygoteproc.start_process`, by
        supervisor/launch.py before the supervisor's imports)."""
        zygote = cls()
        zygote.proc, zygote.sock = proc, sock
        return zygote

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def alive_for(self, pid: int) -> bool:
        """Is the zygote that forked `pid` still its parent (and so the one reaping it)?"""
        return self.alive() and pid in self._children

    def pump(self) -> None:
        """Read whatever the zygote has said (exits, spawn replies), without blocking."""
        if self.sock is None:
            return
        while True:
            try:
                chunk = self.sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                chunk = b""
            if not chunk:
                self._lost()
                break
            self._buffer += chunk
        while b"\n" in self._buffer:
            line, self._buffer = self._buffer.split(b"\n", 1)
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if message.get("op") == "exit":
                pid = int(message["pid"])
                self.exits[pid] = int(message["status"])
                self._children.discard(pid)
            elif isinstance(message.get("id"), int):
                rid = int(message["id"])
                if rid in self._abandoned:
                    # Too late: the worker was started by exec meanwhile. A second worker for the
                    # same resource must not serve beside it.
                    self._abandoned.discard(rid)
                    if message.get("op") == "spawned":
                        with contextlib.suppress(ProcessLookupError, ValueError, TypeError):
                            os.kill(int(message["pid"]), signal.SIGKILL)
                        log.warning("killed a worker the zygote forked too late (pid %s)", message.get("pid"))
                else:
                    self._replies[rid] = message

    def _lost(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            self.proc.wait()
            log.warning("worker zygote (pid %d) is gone; its workers are adopted", self.proc.pid)
            self.proc = None
        self._children.clear()

    def spawn(self, argv: list[str], secret: str = "") -> int:
        """Fork a worker running `python -m worker <argv>`; returns its PID. Raises OSError.

        `secret` goes to the child over this private socket (see worker/zygote.py).
        """
        if not self.alive() or self.sock is None:
            self.pump()  # read the exit reports it sent before it died
            self._lost()
            self.start()
        assert self.sock is not None and self.proc is not None
        try:
            fields = check_args([*argv, "--zygote-pid", str(self.proc.pid)])
        except WorkerArgsError as exc:
            raise OSError(f"the worker's arguments are not valid ({exc})") from None
        self._next_id += 1
        rid = self._next_id
        request = {"op": "spawn", "id": rid, "argv": argv, "args": fields, "secret": secret}
        self.sock.sendall((json.dumps(request) + "\n").encode())
        deadline = time.monotonic() + SPAWN_TIMEOUT_S
        while rid not in self._replies:
            left = deadline - time.monotonic()
            if left <= 0 or self.sock is None:
                self._abandoned.add(rid)
                raise OSError("the worker zygote did not answer")
            select.select([self.sock], [], [], left)
            self.pump()
        reply = self._replies.pop(rid)
        if reply.get("op") != "spawned":
            raise OSError(f"the worker zygote did not start the worker: {reply.get('error')}")
        pid = int(str(reply["pid"]))
        self._children.add(pid)
        return pid

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, self.sock)
        elif self.sock is not None:
            self.sock.close()
        self.sock = None
