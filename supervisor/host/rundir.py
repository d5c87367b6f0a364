"""The run dir and the kubelet's plugin dir: layout, atomic writes, and which sockets go.

The run dir (`--run-dir`, default /run/gpuvisor) holds what the supervisor shares with its
workers and its CLI: `plans/<resource>.json` (read by a worker at start), `control.sock` (the
ROUTER) and `health.sock` (the PUB). Every file is written atomically: a temp file in the same
directory, flushed and fsync'd, then renamed over the target, so a reader sees the old content
or the new one and never half of either (`common.atomicfile`, the one helper for it).

Sockets in the plugin dir are the kubelet's and its plugins'; gpuvisor removes only the sockets
its own workers made, and only once nobody serves on them (a worker killed by SIGKILL leaves its
socket behind). `WorkerSockets` holds that one rule.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import stat
from collections.abc import Mapping
from typing import ClassVar

from common.atomicfile import remove_temp_files, stage_atomic, write_atomic
from common.procutil import unix_socket_listening
from common.socketnames import UNIX_PATH_MAX, is_tag, made_by

log = logging.getLogger("gpuvisor.supervisor")

RECORD_MAX_BYTES = 1 << 20  # the socket record of an earlier life: more is not ours
LABEL_RECORD_MAX_BYTES = 4096  # a label value is at most 63 characters: more is not ours


class RunDirError(Exception):
    """The run dir cannot be used; the text says which path and why."""

    config_error: ClassVar[bool] = False  # True: the settings must change (exit 78), not the host


class RunDirInUse(RunDirError):
    """Another live supervisor uses this run dir."""


class RunDirUntrusted(RunDirError):
    """The run dir is not gpuvisor's alone (a symlink, another owner, writable by others)."""

    config_error = True


class RunDirTooLong(RunDirError):
    """The run dir's socket paths do not fit a unix socket address."""

    config_error = True


class RunDir:
    """Paths of the run dir and its atomic file writes."""

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        self.plans_dir = os.path.join(self.path, "plans")
        self.control_path = os.path.join(self.path, "control.sock")
        self.health_path = os.path.join(self.path, "health.sock")
        self.sockets_record = os.path.join(self.path, "sockets.json")
        self.node_label_record = os.path.join(self.path, "node-label.json")

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
                raise RunDirTooLong(
                    f"--run-dir {self.path} is too long: {path} must fit a unix socket path "
                    f"(at most {UNIX_PATH_MAX} bytes, it has {size})"
                )

    def prepare(self) -> None:
        """Make the run dir (0700) and its plans dir, or check the ones there; refuse a run dir a
        live supervisor uses, or one another user could steer (see `trusted_dir`)."""
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            for path in (self.path, self.plans_dir):
                with contextlib.suppress(FileExistsError):
                    os.mkdir(path, 0o700)
                trusted_dir(path)
        except OSError as exc:
            raise RunDirError(f"cannot prepare {exc.filename or self.path}: {exc.strerror}") from None
        if unix_socket_listening(self.control_path):
            # Removing a live supervisor's sockets would cut it off from its workers.
            raise RunDirInUse(
                f"another gpuvisor is running with run dir {self.path} (its control socket answers): "
                "stop it first, or give this one another --run-dir"
            )
        try:
            self.remove_sockets()
            for directory in (self.path, self.plans_dir):  # what a killed supervisor was writing
                remove_temp_files(directory)
        except OSError as exc:
            raise RunDirError(f"cannot prepare {exc.filename or self.path}: {exc.strerror}") from None

    def remember_node_label(self, value: str) -> None:
        """Keep the node's config label for a restart in the same run dir (a container restart
        in the same pod): it starts with that label's config, as NVIDIA's plugin finds the file
        its config-manager last linked, instead of the default's until the label is read again."""
        write_atomic(self.node_label_record, json.dumps({"label": value}))

    def recall_node_label(self) -> str | None:
        """The label an earlier run kept, or None (none kept, or not a record of ours)."""
        try:
            with open(self.node_label_record, "rb") as fh:
                raw = fh.read(LABEL_RECORD_MAX_BYTES + 1)
            data = json.loads(raw) if len(raw) <= LABEL_RECORD_MAX_BYTES else None
        except (OSError, ValueError):
            return None
        value = data.get("label") if isinstance(data, dict) else None
        return value if isinstance(value, str) else None

    def plan_path(self, resource: str) -> str:
        return os.path.join(self.plans_dir, f"{resource.replace('/', '_')}.json")

    def write_plans(self, texts: Mapping[str, str]) -> None:
        """Write these plan files (resource -> plan JSON), all or none. Raises OSError.

        Every file is written to a temp file beside it and fsync'd first; only when all of them
        exist are they renamed into place (a rename needs no space). So a full or read-only run
        dir leaves every plan file as it was: a worker that restarts meanwhile reads the plan
        that is running, never half of a refused reload.
        """
        staged: list[tuple[str, str]] = []
        try:
            for resource, text in texts.items():
                path = self.plan_path(resource)
                staged.append((stage_atomic(path, text), path))
            for tmp, path in staged:
                os.replace(tmp, path)
        finally:
            for tmp, _path in staged:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)

    def secure_sockets(self) -> None:
        """Only the supervisor's user may talk to the control and health sockets."""
        for path in (self.control_path, self.health_path):
            os.chmod(path, 0o600)

    def remove_sockets(self) -> None:
        for path in (self.control_path, self.health_path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def trusted_dir(path: str) -> None:
    """Accept `path` as a directory only gpuvisor's user controls, tightened to 0700; else raise.

    Refused: a symlink (writes would land wherever it points), anything but a directory, a
    directory owned by another uid, or one that is group- or world-writable (another user could
    swap the plans the workers serve, or the sockets they talk to).
    """
    # Judged and tightened through one descriptor opened without following a symlink, so what is
    # checked is what gets chmod'ed, even if the path is swapped in between.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            raise RunDirUntrusted(
                f"run dir {path} is a symlink: refusing to write through it (give the real path)"
            ) from None
        if not stat.S_ISDIR(st.st_mode):
            raise RunDirUntrusted(f"run dir {path} is not a directory") from None
        raise
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise RunDirUntrusted(
                f"run dir {path} belongs to uid {st.st_uid}, not to this process's uid {os.geteuid()}"
            )
        if st.st_mode & 0o022:
            raise RunDirUntrusted(
                f"run dir {path} is writable by its group or by everyone (mode {stat.S_IMODE(st.st_mode):04o}): "
                "another user could steer what the workers serve; make it 0700 or remove it"
            )
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


class WorkerSockets:
    """The one rule for which sockets in the plugin dir gpuvisor removes.

    Each worker process gets a tag (6 hex digits, `WorkerHandle.socket_tag`) and names its
    sockets `gpuvisor-<resource name>-<tag><nn>.sock` (the name cut short if the path would not
    fit a socket address); the tag is recorded here (and in
    `<run dir>/sockets.json`, written atomically) before the process starts. A socket is removed
    only if its name carries a recorded tag of its resource, `lstat` says it is a unix socket
    (never a directory, a regular file or a symlink, whatever its name), and nobody accepts on
    it. A tag is forgotten once its worker is gone and none of its sockets is left. At start,
    the record of the supervisor's earlier life says which sockets its workers left behind.

    The record is bookkeeping for cleanup: a write that fails (a full run dir) is logged once,
    kept in memory and tried again with the next change; it never stops a worker from starting.
    """

    def __init__(self, plugin_dir: str, record_path: str) -> None:
        self.plugin_dir = plugin_dir
        self.record_path = record_path
        self.tags: dict[str, list[str]] = {}
        self.save_error = ""

    def load_earlier(self) -> None:
        """Take over the record an earlier supervisor left in the run dir (bad or missing: none)."""
        try:
            with open(self.record_path, "rb") as fh:
                raw = fh.read(RECORD_MAX_BYTES + 1)
        except FileNotFoundError:
            return
        except OSError as exc:
            log.warning("cannot read %s (%s): sockets of an earlier run stay", self.record_path, exc.strerror)
            return
        try:
            data = json.loads(raw) if len(raw) <= RECORD_MAX_BYTES else None
        except ValueError:
            data = None
        tags = data.get("tags") if isinstance(data, dict) else None
        if not isinstance(tags, dict) or not all(
            isinstance(r, str) and isinstance(ts, list) and all(isinstance(t, str) and is_tag(t) for t in ts)
            for r, ts in tags.items()
        ):
            log.warning(
                "ignoring %s: not a socket record of gpuvisor's; sockets of an earlier run stay",
                self.record_path,
            )
            return
        self.tags = {r: list(ts) for r, ts in tags.items()}

    def add(self, resource: str, tag: str) -> None:
        """A worker of `resource` is about to start with `tag`."""
        self.tags.setdefault(resource, []).append(tag)
        self._save()

    def sweep(self, resource: str, tag: str | None = None, names: list[str] | None = None) -> list[str]:
        """Remove the dead sockets of `tag` (None: every recorded tag) of `resource`; their names.

        Call it once the worker of `tag` is gone: its tag is forgotten when none of its sockets
        is left. `names`: the plugin dir's entries, when the caller has listed it already.
        """
        tags = self.tags.get(resource, [])
        chosen = [t for t in tags if tag is None or t == tag]
        if not chosen:
            return []
        if names is None:
            names = self._listing()
        before = len(tags)
        removed: list[str] = []
        for t in chosen:
            left = False
            for name in (n for n in names if made_by(n, resource, t)):
                path = os.path.join(self.plugin_dir, name)
                if self._removable(path):
                    try:
                        os.unlink(path)
                    except FileNotFoundError:
                        pass
                    except OSError as exc:  # a read-only or vanished dir: kept, tried at the next sweep
                        log.warning("could not remove dead socket %s: %s", path, exc)
                        left = True
                        continue
                    removed.append(name)
                elif _is_socket(path):
                    left = True  # someone serves on it: not ours to take away
            if not left:
                tags.remove(t)
        if not tags:
            self.tags.pop(resource, None)
        if len(tags) != before or self.save_error:  # the record changed, or is still unwritten
            self._save()
        return removed

    def worker_gone(self, resource: str, tag: str) -> None:
        """A worker of `resource` with `tag` is dead (SIGKILL leaves its sockets): sweep them."""
        removed = self.sweep(resource, tag)
        if removed:
            log.info("removed the socket(s) a dead worker of %s left: %s", resource, ", ".join(removed))

    def sweep_all(self) -> list[str]:
        names = self._listing()
        return [name for resource in sorted(self.tags) for name in self.sweep(resource, names=names)]

    def _listing(self) -> list[str]:
        try:
            return sorted(os.listdir(self.plugin_dir))
        except OSError:
            return []

    def take_over_earlier(self) -> None:
        """At start, before any worker of ours: the record of the earlier life, its workers that
        still run (ended), and the sockets they left (removed)."""
        self.load_earlier()
        self.end_stale_workers()
        removed = self.sweep_all()
        if removed:
            log.info("removed %d stale socket(s) of an earlier run: %s", len(removed), ", ".join(removed))

    def end_stale_workers(self) -> None:
        """Workers of an earlier life that never noticed their supervisor died (stopped, hung):
        SIGKILL them by PID (their recorded tag on their command line says they are ours) before
        new workers register, so their streams end first."""
        stale = self.stale_workers()
        if not stale:
            return
        import psutil  # loaded only when there is something to end: a first start has nothing

        procs = []
        for pid in stale:
            with contextlib.suppress(psutil.NoSuchProcess):
                procs.append(psutil.Process(pid))
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        log.warning("ended %d worker(s) an earlier run left behind: pids %s", len(stale), stale)
        psutil.wait_procs(procs, timeout=2)

    def stale_workers(self) -> list[int]:
        """PIDs of worker processes an earlier supervisor life left running: its recorded tags on
        their command lines (`--resource R ... --socket-tag T`). Their supervisor is gone, so a
        worker that was stopped or hung when it died never noticed and still holds its stream."""
        wanted = {(r, t) for r, ts in self.tags.items() for t in ts}
        if not wanted:
            return []
        import psutil  # only when an earlier life left workers on record (a first start does not)

        stale = []
        for proc in psutil.process_iter(["pid", "cmdline"]):
            argv = proc.info.get("cmdline") or []
            if "worker" not in argv or "--socket-tag" not in argv or "--resource" not in argv:
                continue
            try:
                key = (argv[argv.index("--resource") + 1], argv[argv.index("--socket-tag") + 1])
            except IndexError:
                continue
            if key in wanted and proc.info["pid"] != os.getpid():
                stale.append(int(proc.info["pid"]))
        return sorted(stale)

    @staticmethod
    def _removable(path: str) -> bool:
        return _is_socket(path) and not unix_socket_listening(path)

    def _save(self) -> None:
        try:
            write_atomic(self.record_path, json.dumps({"tags": self.tags}, sort_keys=True))
        except OSError as exc:
            text = f"cannot write {self.record_path}: {exc.strerror or exc}"
            if text != self.save_error:
                log.warning("%s; the socket record stays in memory and is written with the next change", text)
            self.save_error = text
            return
        self.save_error = ""


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except OSError:
        return False
