"""Starting a worker process: forked by the zygote, or exec'd when the zygote cannot.

The worker's argv says what it serves and where to talk; its spawn secret (the proof that a
control message comes from the process spawned for that resource in that generation) never
goes on the command line or into the environment, which other users can read in /proc: the
zygote hands it to the forked child in memory, and an exec'd worker reads it from an inherited
pipe (`--secret-fd`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
from collections.abc import Callable

from supervisor.config import Config
from supervisor.host.rundir import RunDir
from supervisor.workers.lifecycle import Proc, WorkerHandle
from supervisor.workers.zygote import ForkedWorker, Zygote
from supervisor.workers.zygoteproc import worker_environ

log = logging.getLogger("gpuvisor.supervisor")


class WorkerSpawner:
    """A `Spawner` for `WorkerSet`: never a bare fork of the supervisor (it holds gRPC and
    ZeroMQ state)."""

    def __init__(self, *, config: Config, rundir: RunDir, record_tag: Callable[[str, str], None]) -> None:
        self.config = config
        self.rundir = rundir
        self.record_tag = record_tag  # the worker's socket tag is on record before it can bind
        self.zygote: Zygote | None = Zygote() if config.zygote else None

    def configure(self, config: Config) -> None:
        """A taken config: workers started from now on get its settings (`--zygote` keeps the
        value the supervisor started with: the zygote runs or it does not)."""
        self.config = config

    def adopt(self, zygote: Zygote) -> None:
        """Take the zygote `gpuvisor run` started before the supervisor's imports
        (supervisor/launch.py) as this spawner's own; stop it instead when workers start by exec
        (`--zygote=false` in the config)."""
        if self.zygote is None or self.zygote.proc is not None:
            zygote.stop()
            return
        self.zygote = zygote

    def start(self) -> None:
        """Start the zygote early (unless one was adopted): its imports overlap NVML start-up and discovery."""
        if self.zygote is not None and self.zygote.proc is not None:
            log.info(
                "worker zygote running (pid %d, started before the supervisor's imports)",
                self.zygote.proc.pid,
            )
        elif self.zygote is not None:
            try:
                self.zygote.start()
            except OSError as exc:
                log.warning("cannot start the worker zygote (%s): workers start by exec", exc)
                self.zygote = None

    def fileno(self) -> int:
        """The zygote's socket (its exit reports wake the main loop), or -1."""
        z = self.zygote
        return z.sock.fileno() if z is not None and z.sock is not None else -1

    def pump(self) -> None:
        if self.zygote is not None:
            self.zygote.pump()

    def worker_args(self, handle: WorkerHandle) -> list[str]:
        return [
            "--resource", handle.resource,
            "--plan", handle.plan_path,
            "--kubelet-socket", self.config.kubelet_socket,
            "--control", self.rundir.control_endpoint,
            "--health", self.rundir.health_endpoint,
            "--supervisor-pid", str(os.getpid()),
            "--log-format", self.config.log_format,
            "--log-level", self.config.log_level,
            "--heartbeat-interval", f"{handle.beat_interval:g}",
            "--socket-tag", handle.socket_tag,
        ]  # fmt: skip

    def __call__(self, handle: WorkerHandle) -> Proc:
        self.record_tag(handle.resource, handle.socket_tag)
        args = self.worker_args(handle)
        if self.zygote is not None:
            try:
                return ForkedWorker(self.zygote.spawn(args, handle.secret), self.zygote)
            except OSError as exc:
                log.warning("zygote spawn of %s failed (%s): starting it by exec", handle.resource, exc)
        return self._exec(args, handle.secret)

    @staticmethod
    def _exec(args: list[str], secret: str) -> Proc:
        read_end, write_end = os.pipe()
        try:
            os.write(write_end, secret.encode("ascii"))
        finally:
            os.close(write_end)
        try:
            return subprocess.Popen(
                [sys.executable, "-m", "worker", *args, "--secret-fd", str(read_end)],
                close_fds=True,
                pass_fds=(read_end,),
                stdin=subprocess.DEVNULL,
                env=worker_environ(os.environ),
            )
        finally:
            with contextlib.suppress(OSError):
                os.close(read_end)

    def stop(self) -> None:
        if self.zygote is not None:
            self.zygote.stop()
