"""Filesystem watches: the kubelet's plugin dir, and the directory of the config file (or of the
named configs, `--config-file-srcdir`).

Watchdog (inotify) observers call back from their own thread; `Watches` only posts the handlers'
calls to the supervisor's main loop (`post`), which acts on them, so nothing here touches
supervisor state.

The config file is watched through its *directory*, not the file: a Kubernetes ConfigMap volume
updates by writing a new timestamped dir, pointing a new `..data_tmp` symlink at it and renaming
that over `..data` (the file itself is a symlink `config.yaml -> ..data/config.yaml`), so the
file's inode never changes and an inotify watch on it would see nothing. Editors that save by
rename do much the same. Events on the file's name and on the ConfigMap's `..`-named entries are
reported; the supervisor debounces a burst and compares the file's content, so spurious events
cost one read. The named configs' directory reports every change: a config added or removed
can change which one the node's label chooses.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from functools import partial

from watchdog.events import (
    DirCreatedEvent,
    DirDeletedEvent,
    DirModifiedEvent,
    DirMovedEvent,
    FileClosedEvent,
    FileCreatedEvent,
    FileDeletedEvent,
    FileModifiedEvent,
    FileMovedEvent,
    FileSystemEvent,
    FileSystemEventHandler,
)
from watchdog.observers import Observer

from common.socketnames import KUBELET_SOCKET_NAME

log = logging.getLogger("gpuvisor.kubelet-watch")

# What each watch asks the kernel for (watchdog turns its event filter into the inotify mask).
# Neither asks for opens or reads: the kubelet listing its own directory, or anyone reading the
# config, must not wake the supervisor.
KUBELET_EVENTS: list[type[FileSystemEvent]] = [FileCreatedEvent, FileDeletedEvent, FileMovedEvent]
CONFIG_EVENTS: list[type[FileSystemEvent]] = [
    FileCreatedEvent, FileDeletedEvent, FileMovedEvent, FileModifiedEvent, FileClosedEvent,
    DirCreatedEvent, DirDeletedEvent, DirMovedEvent, DirModifiedEvent,
]  # fmt: skip


def _basename(path: str | bytes) -> str:
    return os.path.basename(path if isinstance(path, str) else path.decode())


class _KubeletHandler(FileSystemEventHandler):
    def __init__(self, on_kubelet: Callable[[], None], on_deleted: Callable[[str], None]) -> None:
        self._on_kubelet = on_kubelet
        self._on_deleted = on_deleted

    def on_created(self, event: FileSystemEvent) -> None:
        if _basename(event.src_path) == KUBELET_SOCKET_NAME:
            self._on_kubelet()

    def on_moved(self, event: FileSystemEvent) -> None:
        if _basename(event.dest_path) == KUBELET_SOCKET_NAME:
            self._on_kubelet()
        self._on_deleted(_basename(event.src_path))  # gone from under its name all the same

    def on_deleted(self, event: FileSystemEvent) -> None:
        self._on_deleted(_basename(event.src_path))


class KubeletWatch:
    """Calls `on_kubelet()` when kubelet.sock appears and `on_deleted(name)` when a file goes."""

    def __init__(
        self, plugin_dir: str, on_kubelet: Callable[[], None], on_deleted: Callable[[str], None]
    ) -> None:
        self.plugin_dir = plugin_dir
        self._observer = Observer()
        self._observer.daemon = True
        self._observer.schedule(
            _KubeletHandler(on_kubelet, on_deleted), plugin_dir, recursive=False, event_filter=KUBELET_EVENTS
        )

    def start(self) -> None:
        self._observer.start()

    def stop(self) -> None:
        self._observer.stop()
        self._observer.join(timeout=5)


class _ConfigEventHandler(FileSystemEventHandler):
    """Events that can change what the config file's path reads: the file itself (written, or
    renamed over by an editor) and a ConfigMap's `..data` machinery. Other files in the same
    directory (a log, an editor's swap file) are not the config's business: a steady stream of
    them must not keep a debounced check from ever running."""

    def __init__(self, name: str | None, on_event: Callable[[], None]) -> None:
        self._name = name  # None: every entry of the directory counts (the named configs)
        self._on_event = on_event

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.event_type in ("opened", "closed_no_write"):
            return  # reads (ours included) change nothing
        names = {_basename(event.src_path), _basename(getattr(event, "dest_path", "") or "")}
        if self._name is None or self._name in names or any(n.startswith("..") for n in names):
            self._on_event()


class ConfigWatch:
    """Calls `on_event()` for every change in the config file's directory (see the module doc),
    or, with `name` None, for every change in `directory` (the named configs).

    Raises OSError at `start()` when the directory cannot be watched (it does not exist).
    """

    def __init__(self, directory: str, name: str | None, on_event: Callable[[], None]) -> None:
        self.directory = os.path.abspath(directory)
        self._handler = _ConfigEventHandler(name, on_event)
        self._observer = Observer()
        self._observer.daemon = True

    def start(self) -> None:
        if not os.path.isdir(self.directory):
            raise OSError(f"no directory {self.directory}")
        self._observer.schedule(self._handler, self.directory, recursive=False, event_filter=CONFIG_EVENTS)
        self._observer.start()

    def stop(self) -> None:
        self._observer.stop()
        self._observer.join(timeout=5)


class Watches:
    """Both watches of a supervisor, started and stopped together.

    A watch that cannot start (the node's inotify limits, a config dir that does not exist) is
    logged with what still works without it; the supervisor runs on.
    """

    def __init__(
        self,
        *,
        plugin_dir: str,
        config_file: str,
        config_dir: str = "",
        post: Callable[[Callable[[], None]], None],
        on_kubelet: Callable[[], None],
        on_deleted: Callable[[str], None],
        on_config: Callable[[], None],
    ) -> None:
        self.plugin_dir = plugin_dir
        self.config_file = config_file
        self.config_dir = config_dir  # the named configs (--config-file-srcdir), watched whole
        self.post = post  # runs a call on the main loop (these watches call from their own thread)
        self.on_kubelet = on_kubelet
        self.on_deleted = on_deleted
        self.on_config = on_config
        self.kubelet: KubeletWatch | None = None
        self.config: ConfigWatch | None = None

    def start(self) -> None:
        try:
            self.kubelet = KubeletWatch(
                self.plugin_dir,
                lambda: self.post(self.on_kubelet),
                lambda name: self.post(partial(self.on_deleted, name)),
            )
            self.kubelet.start()
        except OSError as exc:  # e.g. the node's inotify instance limit (fs.inotify.max_user_instances)
            self.kubelet = None
            log.warning(
                "cannot watch %s (%s): workers notice a kubelet restart themselves, within 2 s",
                self.plugin_dir,
                exc,
            )
        if self.config_dir or self.config_file:
            where = self.config_dir or self.config_file
            directory = self.config_dir or os.path.dirname(os.path.abspath(self.config_file))
            name = None if self.config_dir else os.path.basename(self.config_file)
            try:
                self.config = ConfigWatch(directory, name, lambda: self.post(self.on_config))
                self.config.start()
            except OSError as exc:
                self.config = None
                log.warning("cannot watch the config file %s (%s): reload with SIGHUP", where, exc)

    def stop(self) -> None:
        for watch in (self.kubelet, self.config):
            if watch is not None:
                try:
                    watch.stop()
                except Exception:  # at exit: the other watch still stops
                    log.exception("stopping a file watch failed")
