"""The run dir and the kubelet's plugin dir: layout, atomic writes, and which sockets go.

The run dir (`--run-dir`, default /run/gpuvisor) holds what the supervisor shares with its
workers and its CLI: `plans/<resource>.json` (read by a worker at start), `control.sock` (the
ROUTER) and `health.sock` (the PUB). Every file is written atomically: a temp file in the same
directory, flushed and fsync'd, then renamed over the target, so a reader sees the old content
or the new one and never half of either.

Sockets in the plugin dir are the kubelet's and its plugins'; gpuvisor removes only the sockets
its own workers made, and only once nobody serves on them (a worker killed by SIGKILL leaves its
socket behind). `SocketSweeper` holds that one rule.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import stat

from common.model import ResourcePlan
from common.procutil import unix_socket_listening

log = logging.getLogger("gpuvisor.supervisor")

SOCKET_PREFIX = "gpuvisor-"
UNIX_PATH_MAX = 107  # bytes of a unix socket path, without the trailing NUL


class RunDirError(Exception):
    """The run dir cannot be used; the text says which path and why."""


class RunDirInUse(RunDirError):
    """Another live supervisor uses this run dir."""


class RunDir:
    """Paths of the run dir and its atomic file writes."""

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        self.plans_dir = os.path.join(self.path, "plans")
        self.control_path = os.path.join(self.path, "control.sock")
        self.health_path = os.path.join(self.path, "health.sock")

    @property
    def control_endpoint(self) -> str:
        return f"ipc://{self.control_path}"

    @property
    def health_endpoint(self) -> str:
        return f"ipc://{self.health_path}"

    def check_socket_paths(self) -> None:
        for path in (self.control_path, self.health_path):
            size = len(path.encode())
            if size > UNIX_PATH_MAX:
                raise RunDirError(
                    f"--run-dir {self.path} is too long: {path} must fit a unix socket path "
                    f"(at most {UNIX_PATH_MAX} bytes, it has {size})"
                )

    def prepare(self) -> None:
        """Make the run dir (0700) and its plans dir; refuse one a live supervisor uses."""
        if unix_socket_listening(self.control_path):
            # Removing a live supervisor's sockets would cut it off from its workers.
            raise RunDirInUse(
                f"another gpuvisor is running with run dir {self.path} (its control socket answers): "
                "stop it first, or give this one another --run-dir"
            )
        try:
            os.makedirs(self.path, mode=0o700, exist_ok=True)
            os.chmod(self.path, 0o700)
            os.makedirs(self.plans_dir, mode=0o700, exist_ok=True)
            for path in (self.control_path, self.health_path):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        except OSError as exc:
            raise RunDirError(f"cannot prepare {exc.filename or self.path}: {exc.strerror}") from None

    def plan_path(self, resource: str) -> str:
        return os.path.join(self.plans_dir, f"{resource.replace('/', '_')}.json")

    def write_plan(self, plan: ResourcePlan, text: str | None = None) -> str:
        """Write a worker's plan file atomically; returns its path. Raises OSError."""
        path = self.plan_path(plan.resource)
        write_atomic(path, plan.to_json() if text is None else text)
        return path

    def secure_sockets(self) -> None:
        """Only the supervisor's user may talk to the control and health sockets."""
        for path in (self.control_path, self.health_path):
            os.chmod(path, 0o600)

    def remove_sockets(self) -> None:
        for path in (self.control_path, self.health_path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def write_atomic(path: str, text: str, mode: int = 0o600) -> None:
    """Replace `path` with `text`: temp file beside it, fsync, rename. Raises OSError.

    The temp file is created exclusively and never through a symlink; the rename replaces a
    symlink at `path` itself rather than writing where it points.
    """
    directory = os.path.dirname(path) or "."
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # a leftover of a crash of this very pid number
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class SocketSweeper:
    """The one rule for which sockets in the plugin dir gpuvisor removes.

    A name `gpuvisor-<resource name>-<8 hex>.sock` (what a worker's server binds), a unix socket
    by `lstat` (never a directory, a regular file or a symlink, whatever its name), and nobody
    accepting on it.
    """

    def __init__(self, plugin_dir: str) -> None:
        self.plugin_dir = plugin_dir

    @staticmethod
    def pattern(resource: str | None) -> re.Pattern[str]:
        name = re.escape(resource.split("/", 1)[-1]) if resource is not None else r".+"
        return re.compile(rf"{re.escape(SOCKET_PREFIX)}{name}-[0-9a-f]{{8}}\.sock")

    def removable(self, name: str, pattern: re.Pattern[str]) -> bool:
        if not pattern.fullmatch(name):
            return False
        path = os.path.join(self.plugin_dir, name)
        try:
            if not stat.S_ISSOCK(os.lstat(path).st_mode):
                return False
        except OSError:
            return False
        return not unix_socket_listening(path)

    def sweep(self, resource: str | None = None) -> list[str]:
        """Remove the dead worker sockets of `resource` (None: of every resource); their names."""
        pattern = self.pattern(resource)
        try:
            names = sorted(os.listdir(self.plugin_dir))
        except OSError:
            return []
        removed = []
        for name in names:
            if self.removable(name, pattern):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.plugin_dir, name))
                    removed.append(name)
        return removed
