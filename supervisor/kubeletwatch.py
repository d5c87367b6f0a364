"""Watch the kubelet's plugin dir: kubelet.sock created, our workers' sockets deleted.

A watchdog (inotify) observer calls back from its own thread; the callbacks only enqueue (the
supervisor's main loop acts on them), so nothing here touches worker state.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from common.kubeletapi import KUBELET_SOCKET_NAME

log = logging.getLogger("gpuvisor.kubelet-watch")


class _Handler(FileSystemEventHandler):
    def __init__(self, on_kubelet: Callable[[], None], on_deleted: Callable[[str], None]) -> None:
        self._on_kubelet = on_kubelet
        self._on_deleted = on_deleted

    @staticmethod
    def _name(event: FileSystemEvent) -> str:
        path = event.src_path
        return os.path.basename(path if isinstance(path, str) else path.decode())

    def on_created(self, event: FileSystemEvent) -> None:
        if self._name(event) == KUBELET_SOCKET_NAME:
            self._on_kubelet()

    def on_moved(self, event: FileSystemEvent) -> None:
        dest = event.dest_path
        if os.path.basename(dest if isinstance(dest, str) else dest.decode()) == KUBELET_SOCKET_NAME:
            self._on_kubelet()

    def on_deleted(self, event: FileSystemEvent) -> None:
        self._on_deleted(self._name(event))


class KubeletWatch:
    """Calls `on_kubelet()` when kubelet.sock appears and `on_deleted(name)` when a file goes."""

    def __init__(self, plugin_dir: str, on_kubelet: Callable[[], None], on_deleted: Callable[[str], None]) -> None:
        self.plugin_dir = plugin_dir
        self._observer = Observer()
        self._observer.daemon = True
        self._observer.schedule(_Handler(on_kubelet, on_deleted), plugin_dir, recursive=False)

    def start(self) -> None:
        self._observer.start()

    def stop(self) -> None:
        self._observer.stop()
        self._observer.join(timeout=5)
